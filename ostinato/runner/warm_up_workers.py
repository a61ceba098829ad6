"""The sampler's Triton kernels compiled at start-up by child processes, in parallel.

`fused_sample.warm_up` with every filter compiles ~270 kernels, over half a second each on one core (167 s on an
H200 with an empty Triton cache); threads would share the GIL (two compiled eight kernels only 1.5x faster than
one on a 2-core CPU). Triton keeps what it compiles in its on-disk cache, which processes
share (entries land by rename). So n children each run every n-th warm-up case on the same GPU, and the engine's
own `warm_up` afterwards finds every kernel in the cache and only loads it: 31 s in all over 8 children, ~1.9 s
once the cache holds them (benchmarks/bench_sampler_warm_up.py). A child that fails costs only time: the engine
compiles whatever is missing itself. Once the engine's warm-up has run, a marker beside Triton's cache (keyed on the
warm-up's cases, the kernels' source, the toolchain and the TRITON_* environment) tells later starts that the cache
holds them all, so no children start then. Engines that start together (tensor-parallel ranks, parallel test
processes) take turns on a lock beside the markers, so each finds what the ones before it compiled.

Children start as `python -m ostinato.runner.warm_up_workers` rather than through multiprocessing, so a user's
script is never re-imported in them (spawn re-runs a `__main__` that lacks a main guard).
"""

import contextlib
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CHILD_BYTES = 1 << 30  # GPU memory a child may take (its CUDA context and the warm-up's logits), at most
MAX_AUTO_WORKERS = 8


def worker_count(requested: int | None, cores: int, free_bytes: int) -> int:
    """Children to start: `requested` (None: one a core, less the engine's, up to MAX_AUTO_WORKERS), never more
    than the free GPU memory holds (CHILD_BYTES each). Below 2 the engine compiles alone: one child would only
    move the work."""
    n = min(MAX_AUTO_WORKERS, cores - 1) if requested is None else requested
    n = min(n, free_bytes // CHILD_BYTES)
    return n if n >= 2 else 0


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class WarmUpWorkers:
    """n children running `fused_sample.warm_up(..., part=(i, n))`; `wait` for them before the engine's own."""

    def __init__(self, workers: int, max_batch: int, vocab_size: int, device: torch.device, filters: bool,
                 row_strides: tuple[int, ...] = ()) -> None:
        spec = _spec(max_batch, vocab_size, filters, row_strides)
        self.started = time.perf_counter()
        self.logs = [tempfile.TemporaryFile() for _ in range(workers)]  # stderr; a pipe could fill and block
        # the engine's import path, as multiprocessing's spawn passes it: ostinato imports wherever it did here
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.procs: list[subprocess.Popen] = []
        try:
            for i, log in enumerate(self.logs):
                self.procs.append(subprocess.Popen([sys.executable, "-m", __name__, spec, str(device), str(i),
                                                    str(workers)],
                                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                                                   env=env))
        except OSError:  # (no interpreter to run, no processes left): none of them then
            self._stop()
            raise

    def wait(self, timeout: float = 900.0) -> int:
        """Wait for every child (killing those still running after `timeout` seconds in all); how many finished
        cleanly. Failures are logged, never raised."""
        deadline = self.started + timeout
        ok = 0
        try:
            for i, (proc, log) in enumerate(zip(self.procs, self.logs, strict=True)):
                try:
                    rc = proc.wait(timeout=max(0.0, deadline - time.perf_counter()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    rc = proc.wait()
                if rc == 0:
                    ok += 1
                else:
                    log.seek(0)
                    tail = log.read().decode(errors="replace")[-2000:]
                    logger.warning("sampler warm-up worker %d/%d exited with %s; the engine compiles its kernels "
                                   "itself:\n%s", i, len(self.procs), rc, tail)
        finally:  # interrupted (Ctrl-C during start-up): no child outlives the wait
            self._stop()
        logger.info("sampler kernels compiled by %d worker processes in %.1f s", len(self.procs),
                    time.perf_counter() - self.started)
        return ok

    def _stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in self.logs:
            log.close()


def _spec(max_batch: int, vocab_size: int, filters: bool, row_strides: tuple[int, ...]) -> str:
    """A warm-up's arguments (but the device) as JSON: a child's command line, and the marker's key."""
    return json.dumps(dict(max_batch=max_batch, vocab_size=vocab_size, filters=filters, row_strides=list(row_strides)))


def _marker(spec: str, device: torch.device) -> Path:
    """The file that says a warm-up of `spec` ran on this kind of device with these kernels: in Triton's cache
    directory, so clearing the cache clears it too."""
    import triton

    from ostinato.layers.triton_ops import argmax
    from ostinato.runner import fused_sample

    h = hashlib.sha256(spec.encode())
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else device.type
    triton_env = sorted((k, v) for k, v in os.environ.items() if k.startswith("TRITON_"))  # knobs in the cache key
    for part in (triton.__version__, torch.version.cuda or "", str(capability), str(triton_env)):
        h.update(part.encode())
    for mod in (fused_sample, argmax):  # the kernels the warm-up compiles
        h.update(Path(mod.__file__).read_bytes())
    knobs = getattr(triton, "knobs", None)
    cache = getattr(getattr(knobs, "cache", None), "dir", None) or os.environ.get("TRITON_CACHE_DIR") or \
        os.path.join(os.path.expanduser("~"), ".triton", "cache")
    return Path(cache) / "ostinato-sampler-warm-up" / h.hexdigest()


def warm_up_sampler(requested_workers: int | None, max_batch: int, vocab_size: int, device: torch.device,
                    filters: bool, row_strides: tuple[int, ...] = ()) -> None:
    """`fused_sample.warm_up` in this process, after `worker_count` children have compiled its kernels into Triton's
    cache, unless the marker says a warm-up like it already filled the cache."""
    from ostinato.runner import fused_sample  # lazily: Triton

    args = (max_batch, vocab_size, device, filters, tuple(row_strides))
    marker = _marker(_spec(max_batch, vocab_size, filters, row_strides), device)
    # one engine's warm-up at a time on the cache: the next (a TP rank, a parallel test process) then finds the
    # marker, or at least the kernels the two share (Triton keys an integer argument such as the vocabulary size
    # only by its divisibility by 16), instead of compiling them at the same time
    with _exclusive(marker.parent / "warm-up.lock"):
        if not marker.exists():
            free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
            workers = worker_count(requested_workers, usable_cores(), free)
            if workers:
                try:
                    WarmUpWorkers(workers, *args).wait()
                except OSError as e:
                    logger.warning("sampler warm-up workers could not start (%s); the engine compiles alone", e)
        fused_sample.warm_up(*args)
        try:
            marker.touch()
        except OSError:  # a read-only cache: children start again next time
            pass


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` (POSIX advisory, released when its holder exits); none where it cannot be
    taken (a read-only cache directory, no fcntl)."""
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "a")  # noqa: SIM115 (held open for the lock's lifetime)
    except (ImportError, OSError):
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _main(argv: list[str]) -> None:
    from ostinato.proc_util import die_with_parent

    die_with_parent()
    spec, device, part = json.loads(argv[0]), torch.device(argv[1]), (int(argv[2]), int(argv[3]))
    if device.type == "cuda" and device.index is not None:  # (plain "cuda": the current device, as the engine's)
        torch.cuda.set_device(device)
    from ostinato.runner import fused_sample  # lazily, as the engine imports it: Triton

    fused_sample.warm_up(device=device, part=part, **{**spec, "row_strides": tuple(spec["row_strides"])})
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    _main(sys.argv[1:])
