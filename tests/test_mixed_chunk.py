"""Mixed steps (--enable-mixed-chunk): decode tokens ride along with a prefill chunk. Greedy tokens must not
change, with retraction happening, on a tiny Llama with SmolLM2's tokenizer (fp32, CPU) and through the
piecewise graphs."""

import json

import torch
import torch._dynamo

from ostinato import LLM, SamplingParams
from ostinato.attention.forward_batch import ForwardMode

PROMPTS = [[{"role": "user", "content": f"Count to {i} slowly."}] for i in range(6)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def record_mixed_steps(runner):
    """Count extend steps that carry both a prefill chunk and decode tokens of requests in flight."""
    seen, step = {"mixed": 0}, runner.step

    def wrapped(sched):
        if sched.mode is ForwardMode.EXTEND and any(n > 1 for n in sched.extend_lens) and \
                any(r.num_pending for r in sched.reqs):
            seen["mixed"] += 1
        return step(sched)

    runner.step = wrapped
    return seen, step


def test_mixed_equals_unmixed_with_retraction(tiny_llama_path):
    """The tiny Llama (conftest) in fp32 with a KV pool too small for the six requests at once: unmixed, then
    mixed."""
    llm = LLM(tiny_llama_path, dtype="float32", device="cpu", max_total_tokens=224, chunked_prefill_size=48,
              page_size=4, max_running_requests=8,
              disable_radix_cache=True)  # shared prefixes would avoid the retraction
    scheduler, runner = llm.engine.scheduler, llm.engine.runner
    want = [o.outputs[0].token_ids for o in llm.chat(PROMPTS, GREEDY, use_tqdm=False)]
    before = scheduler.num_retractions
    seen, step = record_mixed_steps(runner)
    scheduler.enable_mixed_chunk = True
    try:
        got = [o.outputs[0].token_ids for o in llm.chat(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        scheduler.enable_mixed_chunk = False
        runner.step = step
    assert seen["mixed"] > 0  # decode tokens of in-flight requests (overlap scheduling) did ride along
    assert scheduler.num_retractions > before
    assert got == want


def test_piecewise_mixed_equals_eager(tmp_path):
    tiny = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 256, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(tiny))
    kw = dict(load_format="dummy", device="cpu", dtype="float32", attention_backend="torch", max_total_tokens=2048,
              page_size=4, max_running_requests=8, chunked_prefill_size=64, enable_mixed_chunk=True)
    gen = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(0, 256, (n,), generator=gen).tolist()} for n in (5, 70, 33, 90, 2)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(path), **kw).generate(prompts, params, use_tqdm=False)]
    torch._dynamo.reset()
    llm = LLM(str(path), **kw, enable_piecewise_cuda_graph=True, piecewise_cuda_graph_tokens=[16, 40, 64])
    runner, paths = llm.engine.runner, []
    pick = runner.extend_path
    runner.extend_path = lambda batch: paths.append(pick(batch)) or paths[-1]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert "piecewise" in paths and got == want
