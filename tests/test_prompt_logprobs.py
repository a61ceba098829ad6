"""SamplingParams.prompt_logprobs (vLLM's): every prompt token's logprob, rank and top alternatives, against
transformers' float32 log_softmax of the same model, whatever the chunking, batch, prefix cache or retraction."""

import random

import pytest
import torch

from ostinato import LLM, SamplingParams

K = 3
TOL = 1e-4  # float32 on both sides


@pytest.fixture(scope="module")
def hf(tiny_llama_path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(tiny_llama_path):
    """Small chunks (prompts are cut mid-way) and a pool small enough to retract; the prefix cache on."""
    return LLM(tiny_llama_path, dtype="float32", device="cpu", max_total_tokens=400, chunked_prefill_size=24,
               page_size=4, max_running_requests=12)


def reference(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # [len, vocab]: row i predicts i+1


def check(out, ids: list[int], ref: torch.Tensor, k: int = K) -> float:
    """The prompt logprobs against the reference; returns the largest logprob difference."""
    pl = out.prompt_logprobs
    assert len(pl) == len(ids) and pl[0] is None
    err = 0.0
    for i in range(1, len(ids)):
        entry, row = pl[i], ref[i - 1]
        tok = ids[i]
        assert tok in entry
        # the rank as the reference counts it, give or take the tokens within rounding of this one
        lo, hi = (int((row > row[tok] + d).sum()) + 1 for d in (TOL, -TOL))
        assert lo <= entry[tok].rank <= hi, (entry[tok].rank, lo, hi)
        err = max(err, abs(entry[tok].logprob - row[tok].item()))
        top = row.topk(k)
        ranked = sorted((lp.rank, t) for t, lp in entry.items() if lp.rank is not None and lp.rank <= k)
        assert torch.allclose(torch.tensor([entry[t].logprob for _, t in ranked]), top.values[: len(ranked)], atol=TOL)
        for t, lp in entry.items():
            err = max(err, abs(lp.logprob - row[t].item()))
    return err


def test_prompt_logprobs_match_transformers(llm, hf):
    rng = random.Random(0)
    shared = [rng.randrange(1000, 9000) for _ in range(20)]
    prompts = [shared + [rng.randrange(1000, 9000) for _ in range(rng.randint(3, 50))] for _ in range(6)]
    prompts += [[rng.randrange(1000, 9000) for _ in range(n)] for n in (2, 7, 61)]
    # the shared prefix is in the cache first: prompt logprobs must compute it anyway
    llm.generate({"prompt_token_ids": shared + [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=2),
                 use_tqdm=False)
    params = [SamplingParams(temperature=0.0, max_tokens=90, ignore_eos=True, prompt_logprobs=K) for _ in prompts]
    params[1] = SamplingParams(temperature=0.0, max_tokens=90, ignore_eos=True)  # beside one without them
    params[4] = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=90, ignore_eos=True, prompt_logprobs=0)
    before = llm.engine.scheduler.num_retractions
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.scheduler.num_retractions > before, "the pool was meant to force a retraction"
    errs = []
    for out, p, sp in zip(outs, prompts, params, strict=True):
        if sp.prompt_logprobs is None:
            assert out.prompt_logprobs is None
            continue
        errs.append(check(out, p, reference(hf, p), sp.prompt_logprobs))
        if sp.prompt_logprobs == 0:  # only the prompt token itself
            assert all(len(e) == 1 for e in out.prompt_logprobs[1:])
    assert max(errs) < TOL, errs


def test_prompt_logprobs_change_no_tokens(llm):
    """Asking for them leaves the generated tokens as they were."""
    p = {"prompt_token_ids": [1, 504, 3458, 282, 4649, 314, 1392, 9054, 30, 2050] * 3}
    sp = SamplingParams(temperature=0.7, seed=11, max_tokens=12, ignore_eos=True)
    plain = llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids
    sp.prompt_logprobs = 2
    assert llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids == plain


@pytest.mark.parametrize("value,fragment", [(-1, "prompt_logprobs must be"), (21, "prompt_logprobs: at most 20")])
def test_bad_prompt_logprobs(llm, value, fragment):
    with pytest.raises(ValueError, match=fragment):
        llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(prompt_logprobs=value), use_tqdm=False)
