"""A captured step, with a CPU stand-in so graph-runner bookkeeping is tested without a GPU.

Contract for the captured callable: it reads only buffers allocated before capture and writes its
results into buffers allocated before capture. On CUDA `replay()` re-launches the recorded kernels over
those same addresses. The CPU form re-runs the callable, which reads the same static buffers: a runner
that forgets to copy an input into them, or reads a result from anywhere else, fails on the CPU too.
"""

from collections.abc import Callable

import torch

_pools: dict[int, object] = {}


def shared_graph_pool(device: torch.device) -> object | None:
    """One memory pool for every graph of the process (decode, piecewise, vision), per device."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _pools:
        _pools[index] = torch.cuda.graph_pool_handle()
    return _pools[index]


class Graph:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda_graph: torch.cuda.CUDAGraph | None = None
        self._fn: Callable[[], None] | None = None

    def capture(self, fn: Callable[[], None], stream: "torch.cuda.Stream | None" = None) -> None:
        if self.device.type == "cuda":
            self._cuda_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._cuda_graph, pool=shared_graph_pool(self.device), stream=stream):
                fn()
        else:
            fn()
            self._fn = fn

    def replay(self) -> None:
        if self._cuda_graph is not None:
            self._cuda_graph.replay()
        else:
            assert self._fn is not None, "replay() before capture()"
            self._fn()
