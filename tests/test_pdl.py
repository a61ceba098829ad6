"""Programmatic Dependent Launch (layers/triton_ops/pdl.py): whether it is on, and, on a Hopper GPU, that a
model's decode with PDL gives the bits it gives without (a kernel reading before its wait would read a stale
activation or the previous step's, and the logprobs would differ). Under PDL a kernel only waits first: the
CPU tests run the same kernels, without the wait, in Triton's interpreter."""

import pytest
import torch

from ostinato import LLM, SamplingParams
from ostinato.layers.triton_ops import pdl

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def test_off_for_cpu_tensors_and_when_switched_off(monkeypatch):
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert not pdl.enabled(torch.empty(1))
    if HOPPER:
        assert pdl.enabled(torch.empty(1, device="cuda"))
        monkeypatch.setattr(pdl, "ENABLED", False)
        assert not pdl.enabled(torch.empty(1, device="cuda"))


def generate(model: str, prompts: list[dict], one_at_a_time: bool = False) -> list:
    """Greedy, then sampled with seeds: each output's tokens and logprobs. `one_at_a_time`: each prompt alone (a
    one-row decode), else all in one batch."""
    llm = LLM(model, load_format="dummy", max_total_tokens=40_000, max_running_requests=16,
              cuda_graph_bs=[1, 2, 4, 8, 16], disable_radix_cache=True, sampler_warm_up="temperature")
    batches = [[p] for p in prompts] if one_at_a_time else [prompts]
    outs = []
    try:
        for batch in batches:
            outs += llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2),
                                 use_tqdm=False)
        for batch in batches:
            outs += llm.generate(batch, [SamplingParams(temperature=0.6, top_p=0.9, max_tokens=24, ignore_eos=True,
                                                        seed=i, logprobs=2) for i in range(len(batch))],
                                 use_tqdm=False)
    finally:
        llm.shutdown()
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def check_bits_without_pdl(model: str, lens: tuple[int, ...], seed: int, monkeypatch,
                           one_at_a_time: bool = False) -> None:
    """Random prompts of `lens` tokens decoded with PDL and without: the same tokens and logprobs, bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [{"prompt_token_ids": torch.randint(0, 30_000, (n,), generator=gen).tolist()} for n in lens]
    runs = {}
    for on in (False, True):
        monkeypatch.setattr(pdl, "ENABLED", on)
        runs[on] = generate(model, prompts, one_at_a_time)
    for i, (off, on) in enumerate(zip(runs[False], runs[True], strict=True)):
        assert off[0] == on[0], f"output {i}: tokens differ with PDL"
        assert off[1] == on[1], f"output {i}: logprobs differ with PDL"


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper (or later) GPU")
@pytest.mark.parametrize("model", ["llama-3.2-1b", "qwen3-0.6b", "granite-4.0-h-1b"])
def test_decode_with_pdl_gives_the_bits_without(model, monkeypatch):
    check_bits_without_pdl(model, (5, 130, 47, 600, 9, 260), 3, monkeypatch)


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper (or later) GPU")
@pytest.mark.parametrize("model", ["llama-3.2-1b", "qwen3-0.6b"])
def test_one_row_decode_with_pdl_gives_the_bits_without(model, monkeypatch):
    """Requests decoded one at a time: the one-row chain, where the resident GEMVs trigger before their waits and
    decode stage 1 reads the step's inputs and asks L2 for its first key blocks before its wait (its table entry's
    early_kv)."""
    check_bits_without_pdl(model, (3, 140, 700), 11, monkeypatch, one_at_a_time=True)
