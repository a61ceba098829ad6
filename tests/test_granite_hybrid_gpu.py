"""Granite-4.0-H on the GPU (dummy granite-4.0-h-1b, bf16): decode-graph replay gives exactly the eager tokens
(padded rows write their Mamba state to the sink slot), and a prompt prefilled in chunks decodes as one
prefilled at once. Skipped without CUDA: `pytest tests/test_granite_hybrid_gpu.py`."""

import pytest
import torch

from ostinato import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def granite():
    llm = LLM("granite-4.0-h-1b", load_format="dummy", max_total_tokens=100_000, max_running_requests=32,
              cuda_graph_bs=[1, 2, 4, 8, 16, 32])
    yield llm
    del llm
    torch.cuda.empty_cache()


def _prompts(vocab: int, n: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(0, vocab, (int(k),), generator=gen).tolist()}
            for k in torch.randint(5, 400, (n,), generator=gen)]


@pytest.mark.parametrize("n", [1, 5, 24])  # 5 and 24 pad up to 8 and 32: padded rows hit the sink slot
def test_graph_replay_gives_the_eager_tokens(granite, n):
    runner = granite.engine.runner
    assert runner.graph_runner is not None and runner.mamba_pool is not None
    prompts = _prompts(runner.vocab_size, n, seed=n)
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    graphed = [o.outputs[0].token_ids for o in granite.generate(prompts, sp, use_tqdm=False)]
    graphs, runner.graph_runner = runner.graph_runner, None
    try:
        eager = [o.outputs[0].token_ids for o in granite.generate(prompts, sp, use_tqdm=False)]
    finally:
        runner.graph_runner = graphs
    assert graphed == eager
    granite.engine.check_memory_leak()


def test_chunked_prefill_continues_the_state(granite):
    """The same prompt, prefilled whole and cut into chunks (by a smaller chunk budget): same tokens."""
    runner = granite.engine.runner
    prompt = _prompts(runner.vocab_size, 1, seed=7)[0]
    prompt["prompt_token_ids"] = (prompt["prompt_token_ids"] * 8)[:1500]
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    whole = granite.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
    saved = granite.engine.scheduler.chunked_prefill_size
    granite.engine.scheduler.chunked_prefill_size = 333  # cuts mid-chunk of the 256-token SSD chunks
    try:
        cut = granite.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        granite.engine.scheduler.chunked_prefill_size = saved
    # bf16 activations: the two paths differ in rounding only; the first tokens must agree
    assert cut[:4] == whole[:4]
