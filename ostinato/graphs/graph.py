"""A captured step, with a CPU stand-in so graph-runner bookkeeping is tested without a GPU.

Contract for the captured callable: it reads only buffers allocated before capture and writes its
results into buffers allocated before capture. On CUDA `replay()` re-launches the recorded kernels over
those same addresses. The CPU form re-runs the callable, which reads the same static buffers: a runner
that forgets to copy an input into them, or reads a result from anywhere else, fails on the CPU too.
"""

import contextlib
import gc
import time
from collections.abc import Callable, Hashable, Iterator

import torch
from tqdm import tqdm

from ostinato.graphs import memset_hoist

_pools: dict[int, object] = {}


def shared_graph_pool(device: torch.device) -> object | None:
    """One memory pool for every graph of the process (decode, piecewise, vision), per device."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _pools:
        _pools[index] = torch.cuda.graph_pool_handle()
    return _pools[index]


_capture_streams: dict[int, "torch.cuda.Stream"] = {}


def capture_stream(device: torch.device) -> "torch.cuda.Stream":
    """The device's one side stream for warm-up and capture, kept for the process: cuBLAS holds a workspace per
    stream it has run on until the process ends, so a new stream per engine would leak one each time (seen on an
    H200: 64 MiB more per engine built and dropped)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _capture_streams:
        _capture_streams[index] = torch.cuda.Stream(device)
    return _capture_streams[index]


def release_graph_pool(device: torch.device) -> None:
    """Forget the device's shared pool, so its memory goes back once the graphs captured into it are gone
    (each graph keeps the pool's memory alive while it lives); the next capture starts a fresh pool."""
    if device.type == "cuda":
        _pools.pop(device.index if device.index is not None else torch.cuda.current_device(), None)


class Graph:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda_graph: torch.cuda.CUDAGraph | None = None
        self._fn: Callable[[], None] | None = None

    def capture(self, fn: Callable[[], None], stream: "torch.cuda.Stream | None" = None,
                free_memory: bool = True) -> None:
        """`free_memory=False` (with a stream): capture as torch.cuda.graph does, less its emptying of the
        allocator's caches before each capture (releasing and re-allocating the cached device memory every
        time, for each of the hundreds of piecewise captures; their runner empties them once at the end)."""
        if self.device.type == "cuda":
            stream = stream or capture_stream(self.device)
            self._cuda_graph = torch.cuda.CUDAGraph(keep_graph=True)  # edited before it is instantiated
            if free_memory:
                with torch.cuda.graph(self._cuda_graph, pool=shared_graph_pool(self.device), stream=stream):
                    fn()
            else:
                torch.cuda.synchronize(self.device)
                with torch.cuda.stream(stream):
                    self._cuda_graph.capture_begin(pool=shared_graph_pool(self.device))
                    try:
                        fn()
                    finally:
                        self._cuda_graph.capture_end()
            memset_hoist.hoist_cublas_memsets(self._cuda_graph, self.device, stream)
            self._cuda_graph.instantiate()
        else:
            fn()
            self._fn = fn

    def replay(self) -> None:
        if self._cuda_graph is not None:
            self._cuda_graph.replay()
        else:
            assert self._fn is not None, "replay() before capture()"
            self._fn()


def warmed_capture(device: torch.device, step: Callable[[], None], free_memory: bool = True,
                   mid_serving: bool = False) -> Graph:
    """`step` run twice outside the capture (lazy init, autotuning and compilation stay out of it), then captured
    on the device's capture stream (`Graph.capture`'s `free_memory`); on the CPU the stand-in, run once.

    The warm-up runs on the capture stream at start-up and, with `mid_serving` (a graph captured lazily while the
    engine serves), on the current stream: see `warm_up_stream`."""
    graph = Graph(device)
    if device.type != "cuda":
        graph.capture(step)
        return graph
    stream = capture_stream(device)
    with warm_up_stream(device, mid_serving):
        step()
        step()
    graph.capture(step, stream, free_memory=free_memory)
    return graph


@contextlib.contextmanager
def warm_up_stream(device: torch.device, mid_serving: bool) -> Iterator[None]:
    """The stream a graph's warm-up runs on, synchronized after: the capture stream at start-up; mid-serving, the
    current stream. With the warm-up on the capture stream, a graph captured after start-up left every later
    decode-graph replay slower for the rest of the process (H200, bs 1: Qwen3-0.6B 0.770 -> 0.821 ms a token,
    Llama-3.2-1B 0.872 -> 0.905): the sampler graphs' lazy capture, a one-op graph warmed up on the capture stream
    or on a new one, and the sampler's step run twice on the capture stream with no capture all did; a one-op graph
    warmed up on the current stream, and the sampler graphs so, did not. Why is not known: a one-op step run twice
    on the capture stream with no capture did not slow it either, and neither a pool of its own nor emptying the
    allocator's cache helped (benchmarks/results/lazy-capture-stream-h200-20261127-s26.json)."""
    if mid_serving:
        yield
    else:
        current, stream = torch.cuda.current_stream(device), capture_stream(device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            yield
        current.wait_stream(stream)
    torch.cuda.synchronize(device)


def capture_graphs(device: torch.device, keys: list[Hashable], make_step: Callable[[Hashable], Callable[[], None]],
                   desc: str, keep_gc: bool = False) -> tuple[dict[Hashable, Graph], float, int]:
    """Capture `make_step(key)` for each key in the order given (largest first, so smaller graphs reuse the
    larger ones' memory in the shared pool). Each step runs twice on the capture stream first, so lazy init,
    autotuning and compilation stay outside the capture. The GC is frozen and off throughout unless
    `keep_gc`. Returns the graphs, the seconds taken and the device memory they hold."""
    start = time.perf_counter()
    cuda = device.type == "cuda"
    free_before = torch.cuda.mem_get_info(device)[0] if cuda else 0
    gc_was_enabled = gc.isenabled()
    if not keep_gc:
        gc.collect()
        gc.freeze()  # objects alive now are never scanned: no GC pause mid-capture
        gc.disable()
    graphs: dict[Hashable, Graph] = {}
    try:
        for key in tqdm(keys, desc=desc, leave=False, disable=not cuda):
            graphs[key] = warmed_capture(device, make_step(key))
    finally:
        if not keep_gc:
            gc.unfreeze()
            if gc_was_enabled:
                gc.enable()
    memory = 0
    if cuda:
        torch.cuda.synchronize(device)
        memory = max(0, free_before - torch.cuda.mem_get_info(device)[0])
    return graphs, time.perf_counter() - start, memory
