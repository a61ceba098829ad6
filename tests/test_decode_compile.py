"""--enable-torch-compile with more compiled decode sizes than dynamo's default recompile limit (8).

The decode graphs are built on CUDA only, so the DecodeGraphRunner is constructed on the CPU here, as the GPU
path builds it (its Graph stand-in calls the compiled step per size, as capture does on the GPU). Dynamo runs
with its "eager" backend: the recompile limit is dynamo's, before any backend, and Inductor's C++ builds would
take minutes on 2 cores."""

import json
import logging

import pytest
import torch
from test_decode_graph import TINY, decode_batch, release

from ostinato import LLM
from ostinato.graphs.decode import DecodeGraphRunner

SIZES = list(range(1, 13))  # 12 compiled sizes > the default limit of 8


@pytest.fixture
def eager_compile(monkeypatch):
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, **{**kw, "backend": "eager"}))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()  # the compiled variants hang off the model class's forward code object


def test_compile_more_sizes_than_the_recompile_limit(tmp_path, eager_compile, caplog):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    llm = LLM(str(path), load_format="dummy", device="cpu", max_total_tokens=1024, page_size=4,
              max_running_requests=len(SIZES), cuda_graph_bs=SIZES, enable_torch_compile=True,
              torch_compile_max_bs=len(SIZES))
    runner = llm.engine.runner
    assert runner.compiled_forward is not runner.model.forward
    with caplog.at_level(logging.INFO, logger="ostinato.graphs.decode"):
        graphs = DecodeGraphRunner(runner)  # raised FailOnRecompileLimitHit before the limit was raised
    assert sorted(graphs.graphs) == SIZES and graphs.compile_seconds > 0
    assert any("torch.compile of the decode step for 12 batch sizes" in r.getMessage() for r in caplog.records)
    import torch._dynamo.config as dynamo_config
    assert dynamo_config.recompile_limit == 8  # raised for the capture only

    # the compiled replays (past the 8th size included) match the eager forward
    gen = torch.Generator().manual_seed(1)
    lens = torch.randint(3, 40, (11,), generator=gen).tolist()
    seqs = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lens]
    sched, reqs = decode_batch(runner, seqs)
    batch = runner.prepare(sched)
    kv = [b.clone() for b in runner.kv_cache.get_kv_buffer(0)]
    eager = runner.forward(batch).clone()  # no graph runner attached to the runner on the CPU: eager
    for buf, orig in zip(runner.kv_cache.get_kv_buffer(0), kv, strict=True):
        buf.copy_(orig)
    with torch.inference_mode():  # as ModelRunner.forward replays (grad mode is part of dynamo's guards)
        replayed = graphs.replay(batch).clone()
    torch.testing.assert_close(replayed, eager, atol=1e-5, rtol=1e-5)
    release(runner, reqs)
