"""Engines give their memory back: after LLM.shutdown(), at the end of a `with` block, and when the last
reference is dropped, the model and the KV pool are collected (weakrefs die); on a GPU, free memory
returns to where it was."""

import gc
import json
import weakref

import pytest
import torch
from test_decode_graph import TINY

from ostinato import LLM, SamplingParams


def small_llm(tmp_path, **kw) -> LLM:
    """A tiny random-weight Llama: what is checked is object lifetimes, not the model."""
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    return LLM(str(path), load_format="dummy", dtype="float32", device="cpu", max_total_tokens=256, max_model_len=128,
               **kw)


def refs(llm: LLM) -> list[weakref.ref]:
    r = llm.engine.runner
    return [weakref.ref(r.model), weakref.ref(r.kv_cache), weakref.ref(r.kv_cache.k_buffer[0]), weakref.ref(r)]


def run_one(llm: LLM) -> None:
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0.0, max_tokens=4),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("how", ["shutdown", "with", "del"])
def test_engine_objects_die(how, tmp_path):
    if how == "with":
        with small_llm(tmp_path) as llm:
            run_one(llm)
            alive = refs(llm)
    else:
        llm = small_llm(tmp_path)
        run_one(llm)
        alive = refs(llm)
        if how == "shutdown":
            llm.shutdown()
            llm.shutdown()  # idempotent
        del llm
    gc.collect()
    assert [r() is None for r in alive] == [True] * len(alive)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_memory_returns_after_engines():
    """Build, use and drop engines (graphs, fp8 and bf16 KV) in a loop: free memory comes back within 256 MiB of
    what it was after the first, and each new engine sizes its KV pool from what is really free. The first engine
    of a fresh process leaves the kernels CUDA loaded lazily for it (about 300 MiB on an H200, the same with the
    tree before the memset hoisting): bounded apart, at 512 MiB."""
    torch.cuda.empty_cache()
    free0 = start = torch.cuda.mem_get_info()[0]
    tokens = []
    for i, kv in enumerate(["auto", "fp8_e4m3", "auto", "fp8_e4m3"]):
        llm = LLM("llama-3.2-1b", load_format="dummy", kv_cache_dtype=kv, cuda_graph_max_bs=8,
                  extend_cuda_graph_max_tokens=256, sampler_warm_up="temperature")
        run_one(llm)
        tokens.append(llm.engine.runner.max_total_tokens)
        if i % 2:
            del llm
        else:
            llm.shutdown()
            del llm
        gc.collect()
        # what the collection just freed sits in torch's cache; the next engine's KV sizing empties it first
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info()[0]
        print(f"engine {i} ({kv}): KV {tokens[-1]} tokens; free memory back to {(free0 - free) / 2**20:.0f} MiB "
              f"below {'the start' if i == 0 else 'that after the first engine'}")
        if i == 0:
            assert start - free < 512 * 2**20, start - free  # the kernels loaded once for the process
            free0 = free
        else:
            assert free0 - free < 256 * 2**20, (i, free0 - free)
    assert tokens[1] >= 1.9 * tokens[0]  # fp8 KV: twice the tokens
    assert abs(tokens[2] - tokens[0]) <= 0.02 * tokens[0]  # the third engine saw what the first saw
