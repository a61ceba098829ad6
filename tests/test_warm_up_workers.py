"""Start-up compiles of the sampler's kernels shared over child processes (runner/warm_up_workers.py): the parts
cover every warm-up case once, the children run and report, and (GPU) the engine's own warm-up afterwards finds
every kernel in Triton's cache."""

import logging
import os
import shutil
import subprocess
import sys
import textwrap
from collections import Counter

if shutil.which("nvidia-smi") is None:  # must be set before the kernels are decorated (children inherit it)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="the fused sampler is a Triton kernel")

from ostinato.runner.warm_up_workers import CHILD_BYTES, WarmUpWorkers, worker_count  # noqa: E402

GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if GPU else "cpu")


@pytest.mark.parametrize("vocab, max_batch, filters", [(700, 3, False), (151_936, 256, True), (49_152, 40, True)])
def test_parts_cover_every_case_once(vocab, max_batch, filters):
    from ostinato.runner.fused_sample import WARM_UP_FILTERS, warm_up_batches, warm_up_cases

    cases = warm_up_cases(max_batch, vocab, filters, row_strides=(vocab + 128,))
    # every batch class, both strides, each filter set and the eager draw
    sets = len(WARM_UP_FILTERS) if filters else 1
    assert len(cases) == len(warm_up_batches(max_batch, vocab)) * 2 * (sets + 1) == len(set(cases))
    for n in (2, 3, 8, len(cases) + 5):
        parts = [cases[i::n] for i in range(n)]
        assert Counter(c for p in parts for c in p) == Counter(cases)
        assert max(map(len, parts)) - min(map(len, parts)) <= 1  # even shares


def test_worker_count():
    gib = CHILD_BYTES
    assert worker_count(None, cores=16, free_bytes=100 * gib) == 8  # capped
    assert worker_count(None, cores=4, free_bytes=100 * gib) == 3  # a core left to the engine
    assert worker_count(None, cores=16, free_bytes=5 * gib) == 5  # GPU memory
    assert worker_count(12, cores=16, free_bytes=100 * gib) == 12  # as asked
    assert worker_count(12, cores=16, free_bytes=3 * gib) == 3
    for requested, cores, free in ((None, 2, 100 * gib), (1, 16, 100 * gib), (0, 16, 100 * gib), (None, 16, gib)):
        assert worker_count(requested, cores, free) == 0  # one child would only move the work


def test_workers_run_their_parts(caplog):
    """Two children warm up their halves (on the CPU through the interpreter); a child that fails is logged and
    counted, not raised."""
    assert WarmUpWorkers(2, 3, 700, DEVICE, filters=False).wait(timeout=600) == 2
    with caplog.at_level(logging.WARNING, logger="ostinato.runner.warm_up_workers"):
        assert WarmUpWorkers(2, 3, 700, torch.device("cuda:97"), filters=False).wait(timeout=600) == 0
    assert "worker 0/2 exited" in caplog.text and "worker 1/2 exited" in caplog.text


def test_workers_that_cannot_start_leave_the_engine_to_compile(tmp_path, monkeypatch, caplog):
    """No interpreter to start children with: a warning, and the engine's own warm-up runs (and marks the cache)."""
    from ostinato.runner import warm_up_workers

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))
    monkeypatch.setattr(warm_up_workers, "worker_count", lambda requested, cores, free: 2)
    with caplog.at_level(logging.WARNING, logger="ostinato.runner.warm_up_workers"):
        warm_up_workers.warm_up_sampler(None, 3, 700, DEVICE, filters=False)
    assert "could not start" in caplog.text
    assert len([p for p in (tmp_path / "ostinato-sampler-warm-up").iterdir() if p.suffix != ".lock"]) == 1


@pytest.mark.skipif(not GPU, reason="Triton's on-disk cache (the interpreter compiles nothing)")
def test_engine_warm_up_after_workers_compiles_nothing(tmp_path):
    """With an empty Triton cache, the children compile every sampler kernel; the engine process's own warm-up then
    adds no kernel to the cache (it loads them all)."""
    script = textwrap.dedent("""
        import os, sys, torch
        from ostinato.runner import fused_sample
        from ostinato.runner.warm_up_workers import WarmUpWorkers
        cache = sys.argv[1]
        def cubins():
            return sum(f.endswith(".cubin") for _, _, fs in os.walk(cache) for f in fs)
        args = (40, 5037, torch.device("cuda"), True, (5120,))
        assert WarmUpWorkers(4, *args).wait() == 4
        after_workers = cubins()
        fused_sample.warm_up(*args)
        torch.cuda.synchronize()
        print(after_workers, cubins())
    """)
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    after_workers, after_engine = map(int, out.stdout.split()[-2:])
    assert after_workers > 20 and after_engine == after_workers


def test_warm_up_sampler_starts_workers_until_the_cache_is_marked(tmp_path, monkeypatch):
    """The engine's entry: children for a warm-up the cache has not seen, none once this warm-up ran (the marker in
    Triton's cache directory), children again for another vocabulary or batch cap."""
    from ostinato.runner import warm_up_workers

    started = []

    class Recorder:
        def __init__(self, workers, *args):
            started.append((workers, *args[:2]))

        def wait(self):
            return len(started)

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(warm_up_workers, "WarmUpWorkers", Recorder)
    monkeypatch.setattr(warm_up_workers, "worker_count", lambda requested, cores, free: 3)
    for max_batch, vocab in ((3, 700), (3, 700), (4, 700), (3, 701), (3, 700)):
        warm_up_workers.warm_up_sampler(None, max_batch, vocab, DEVICE, filters=False)
    assert started == [(3, 3, 700), (3, 4, 700), (3, 3, 701)]
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")  # a Triton knob changes its cache keys: children again
    warm_up_workers.warm_up_sampler(None, 3, 700, DEVICE, filters=False)
    assert started[-1] == (3, 3, 700) and len(started) == 4
    assert len([p for p in (tmp_path / "ostinato-sampler-warm-up").iterdir() if p.suffix != ".lock"]) == 4


def test_concurrent_engines_take_turns(tmp_path, monkeypatch):
    """Two engines warming up alike at once (tensor-parallel ranks): one starts the children, the other waits on
    the lock, then finds the marker and only loads. Engines warming up for different models take turns too (the
    later one finds the kernels they share in the cache): their children never run at the same time."""
    import threading
    import time

    from ostinato.runner import warm_up_workers

    started, running = [], []

    class SlowRecorder:
        def __init__(self, workers, *args):
            started.append(args[1])  # the vocabulary
            running.append(1)
            assert len(running) == 1, "two engines' children at once"

        def wait(self):
            time.sleep(0.5)  # the other engine arrives meanwhile
            running.pop()
            return 2

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(warm_up_workers, "WarmUpWorkers", SlowRecorder)
    monkeypatch.setattr(warm_up_workers, "worker_count", lambda requested, cores, free: 2)
    errors = []

    def engine(vocab):
        try:
            warm_up_workers.warm_up_sampler(None, 3, vocab, DEVICE, False)
        except AssertionError as e:
            errors.append(e)

    engines = [threading.Thread(target=engine, args=(v,)) for v in (700, 700, 701)]
    for e in engines:
        e.start()
    for e in engines:
        e.join()
    assert not errors
    assert sorted(started) == [700, 701]
