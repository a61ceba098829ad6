"""Mixed steps (--enable-mixed-chunk): decode tokens ride along with a prefill chunk. Greedy tokens must not
change, with retraction happening, on SmolLM2 (fp32, CPU) and through the piecewise graphs."""

import json

import torch
import torch._dynamo

from ostinato import LLM, SamplingParams
from ostinato.attention.forward_batch import ForwardMode

PROMPTS = [[{"role": "user", "content": f"Count to {i} slowly and explain why."}] for i in range(10)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
SMALL = dict(dtype="float32", device="cpu", max_total_tokens=640, chunked_prefill_size=48, page_size=4,
             max_running_requests=16)


def record_mixed_steps(llm):
    """Count extend steps that carry both a prefill chunk and decode tokens of requests in flight."""
    runner, seen = llm.engine.runner, {"mixed": 0}
    step = runner.step

    def wrapped(sched):
        if sched.mode is ForwardMode.EXTEND and any(n > 1 for n in sched.extend_lens) and \
                any(r.num_pending for r in sched.reqs):
            seen["mixed"] += 1
        return step(sched)

    runner.step = wrapped
    return seen


def test_mixed_equals_unmixed_with_retraction():
    plain = LLM(**SMALL)
    want = [o.outputs[0].token_ids for o in plain.chat(PROMPTS, GREEDY, use_tqdm=False)]
    assert plain.engine.scheduler.num_retractions > 0
    del plain
    mixed = LLM(**SMALL, enable_mixed_chunk=True)
    seen = record_mixed_steps(mixed)
    got = [o.outputs[0].token_ids for o in mixed.chat(PROMPTS, GREEDY, use_tqdm=False)]
    assert seen["mixed"] > 0  # decode tokens of in-flight requests (overlap scheduling) did ride along
    assert mixed.engine.scheduler.num_retractions > 0
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
