"""Work in a captured CUDA graph that replays only where a device flag says so: a conditional IF node (CUDA 12.4+),
for `probe_graph_if_node.py` (fifty-first session: tried in the sampler and not kept, docs/gpu-notes.md).

The idea: some of a step's launches often have nothing to do. The sampler's cut search, in a step where every row's
unrestricted draw stood, replays its passes, resolves, finish and second draw as programs that read a count and exit,
about 1.4 us a launch on an H200, twelve launches in a top_p step. Captured under `run_if(flag)`, they go into the
body of an IF node whose condition a one-thread kernel sets from flag[0] > 0 as the graph replays, so a replay with
flag[0] == 0 skips them. On the H200 (driver for CUDA 13.0) the node cost about 5-7 us skipped and 9-13 us more than
the plain launches taken, so it pays only where it skips more than about six launches nearly every time.

torch 2.11 cannot capture one (`CUDAGraph.begin_capture_to_if_node` came later), so this does what it does through
the driver API (ctypes, as ostinato/graphs/memset_hoist.py): on the capturing stream, the set kernel (CUDA C,
compiled once by NVRTC: `cudaGraphSetConditional` is a device runtime function Triton cannot call), then the IF node
after it, which the stream's later work depends on; the block's launches are captured into the node's body from a
side stream.

The block's contract: it allocates nothing (the caching allocator does not route the side stream's allocations to
the graph's pool; `run_if` raises if it did), and what it computes is right whether or not it runs when
flag[0] <= 0. Outside a capture, and where the driver or NVRTC lacks what it needs, the block just runs.
"""

import contextlib
import ctypes
import logging
from collections.abc import Iterator

import torch

logger = logging.getLogger(__name__)

_SET_IF_SOURCE = r"""
extern "C" __device__ void cudaGraphSetConditional(unsigned long long handle, unsigned int value);
extern "C" __global__ void ostinato_set_if(unsigned long long handle, const int* flag) {
    cudaGraphSetConditional(handle, *flag > 0 ? 1u : 0u);
}
"""
_SET_IF_NAME = b"ostinato_set_if"

_CU_GRAPH_NODE_TYPE_CONDITIONAL = 13
_CU_GRAPH_COND_TYPE_IF = 0
_CU_GRAPH_COND_ASSIGN_DEFAULT = 1  # the condition is reset to its default (0) at each launch of the graph
_CU_STREAM_SET_CAPTURE_DEPENDENCIES = 1
_CU_STREAM_CAPTURE_MODE_GLOBAL = 0  # torch's default capture mode
_CU_STREAM_CAPTURE_STATUS_ACTIVE = 1


class _ConditionalParams(ctypes.Structure):  # CUDA_CONDITIONAL_NODE_PARAMS
    _fields_ = [("handle", ctypes.c_uint64), ("type", ctypes.c_int), ("size", ctypes.c_uint),
                ("graphs_out", ctypes.POINTER(ctypes.c_void_p)), ("ctx", ctypes.c_void_p)]


class _NodeParams(ctypes.Structure):  # CUgraphNodeParams: a type, then a 232-byte union, then 8 reserved bytes
    _fields_ = [("type", ctypes.c_int), ("reserved0", ctypes.c_int * 3), ("conditional", _ConditionalParams),
                ("padding", ctypes.c_byte * (232 - ctypes.sizeof(_ConditionalParams))), ("reserved2", ctypes.c_int64)]


class _Driver:
    """The driver functions `run_if` calls, and the set kernel loaded per device."""

    NAMES = ("cuStreamGetCaptureInfo_v3", "cuCtxGetCurrent", "cuGraphConditionalHandleCreate", "cuGraphAddNode_v2",
             "cuStreamUpdateCaptureDependencies_v2", "cuStreamBeginCaptureToGraph", "cuStreamEndCapture",
             "cuModuleLoadData", "cuModuleGetFunction", "cuLaunchKernel")

    def __init__(self) -> None:
        cuda = ctypes.CDLL("libcuda.so.1")
        self.fn = {name: getattr(cuda, name) for name in self.NAMES}
        self.kernels: dict[int, ctypes.c_void_p] = {}

    def call(self, name: str, *args) -> None:
        result = self.fn[name](*args)
        if result != 0:
            raise RuntimeError(f"{name} failed with CUresult {result}")

    def set_kernel(self, device: torch.device) -> ctypes.c_void_p:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self.kernels:
            major, minor = torch.cuda.get_device_capability(index)
            ptx = _nvrtc_ptx(_SET_IF_SOURCE, f"compute_{major}{minor}")
            with torch.cuda.device(index):
                torch.cuda.synchronize(index)  # the device's primary context made and current on this thread
                module, func = ctypes.c_void_p(), ctypes.c_void_p()
                self.call("cuModuleLoadData", ctypes.byref(module), ctypes.c_char_p(ptx))
                self.call("cuModuleGetFunction", ctypes.byref(func), module, _SET_IF_NAME)
            self.kernels[index] = func
        return self.kernels[index]

    def capture_tail(self, stream: int) -> tuple[ctypes.c_void_p, list[int]]:
        """The graph `stream` captures into and the nodes its next work will depend on."""
        status, graph = ctypes.c_int(), ctypes.c_void_p()
        deps, edges, count = ctypes.POINTER(ctypes.c_void_p)(), ctypes.c_void_p(), ctypes.c_size_t()
        self.call("cuStreamGetCaptureInfo_v3", ctypes.c_void_p(stream), ctypes.byref(status), None,
                  ctypes.byref(graph), ctypes.byref(deps), ctypes.byref(edges), ctypes.byref(count))
        if status.value != _CU_STREAM_CAPTURE_STATUS_ACTIVE:
            raise RuntimeError("the stream is not capturing")
        return graph, [deps[i] for i in range(count.value)]


def _nvrtc_ptx(source: str, arch: str) -> bytes:
    """PTX of `source` for `arch` by NVRTC (the one torch loaded: libnvrtc.so.<CUDA major>)."""
    nvrtc = ctypes.CDLL(f"libnvrtc.so.{torch.version.cuda.split('.')[0]}")
    prog = ctypes.c_void_p()
    if nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"set_if.cu", 0, None, None) != 0:
        raise RuntimeError("nvrtcCreateProgram failed")
    try:
        opts = (ctypes.c_char_p * 1)(f"--gpu-architecture={arch}".encode())
        if nvrtc.nvrtcCompileProgram(prog, 1, opts) != 0:
            size = ctypes.c_size_t()
            nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC failed: {log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetPTX(prog, ptx)
        return ptx.value
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))


_driver: _Driver | None = None
_unavailable: str | None = None  # why IF nodes are off for the process, once something failed
_side_streams: dict[int, "torch.cuda.Stream"] = {}


def _ready(device: torch.device) -> _Driver | None:
    """The driver with the set kernel loaded for `device` (compiled here, outside any capture: `run_if` calls it in
    the warm-up runs), or None where IF nodes are unavailable (logged once)."""
    global _driver, _unavailable
    if _unavailable is not None:
        return None
    try:
        if _driver is None:
            _driver = _Driver()
        _driver.set_kernel(device)
        return _driver
    except (OSError, AttributeError, RuntimeError) as e:
        _unavailable = str(e)
        logger.warning("captured graphs replay every launch (no conditional IF nodes): %s", e)
        return None


def available(device: torch.device) -> bool:
    """Whether `run_if` puts its block under an IF node in captures on `device`."""
    return device.type == "cuda" and _ready(device) is not None


@contextlib.contextmanager
def run_if(flag: torch.Tensor) -> Iterator[None]:
    """The block's launches, captured into a graph, replay only where flag[0] > 0 (an int32 on the device, final
    by the time the block would start). Outside a capture, or without IF nodes, the block runs as is."""
    device = flag.device
    driver = _ready(device) if device.type == "cuda" else None
    if driver is None or not torch.cuda.is_current_stream_capturing():
        yield
        return
    assert flag.dtype == torch.int32, "run_if reads flag[0] as an int32"
    stream = torch.cuda.current_stream(device).cuda_stream
    graph, _ = driver.capture_tail(stream)
    ctx, handle = ctypes.c_void_p(), ctypes.c_uint64()
    driver.call("cuCtxGetCurrent", ctypes.byref(ctx))
    driver.call("cuGraphConditionalHandleCreate", ctypes.byref(handle), graph, ctx, 0, _CU_GRAPH_COND_ASSIGN_DEFAULT)
    args = (ctypes.c_uint64(handle.value), ctypes.c_uint64(flag.data_ptr()))
    arg_ptrs = (ctypes.c_void_p * 2)(*(ctypes.addressof(a) for a in args))
    driver.call("cuLaunchKernel", driver.set_kernel(device), 1, 1, 1, 1, 1, 1, 0, ctypes.c_void_p(stream), arg_ptrs,
                None)
    graph, deps = driver.capture_tail(stream)  # the set kernel's node
    params = _NodeParams(type=_CU_GRAPH_NODE_TYPE_CONDITIONAL)
    params.conditional = _ConditionalParams(handle=handle.value, type=_CU_GRAPH_COND_TYPE_IF, size=1, ctx=ctx)
    node = ctypes.c_void_p()
    driver.call("cuGraphAddNode_v2", ctypes.byref(node), graph, (ctypes.c_void_p * len(deps))(*deps), None,
                ctypes.c_size_t(len(deps)), ctypes.byref(params))
    body = ctypes.c_void_p(params.conditional.graphs_out[0])
    driver.call("cuStreamUpdateCaptureDependencies_v2", ctypes.c_void_p(stream), (ctypes.c_void_p * 1)(node), None,
                ctypes.c_size_t(1), _CU_STREAM_SET_CAPTURE_DEPENDENCIES)
    side = _side_stream(device)
    driver.call("cuStreamBeginCaptureToGraph", ctypes.c_void_p(side.cuda_stream), body, None, None,
                ctypes.c_size_t(0), _CU_STREAM_CAPTURE_MODE_GLOBAL)
    allocations = _allocations(device)
    try:
        with torch.cuda.stream(side):
            yield
    finally:
        ended = ctypes.c_void_p()
        driver.call("cuStreamEndCapture", ctypes.c_void_p(side.cuda_stream), ctypes.byref(ended))
    if _allocations(device) != allocations:
        raise RuntimeError("a run_if block allocated device memory: allocate its buffers before the block")


def _allocations(device: torch.device) -> int:
    """The caching allocator's count of allocations made on `device` so far."""
    return torch.cuda.memory_stats(device).get("allocation.all.allocated", 0)


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    """The stream an IF node's body is captured from (one per device, kept for the process)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _side_streams:
        _side_streams[index] = torch.cuda.Stream(device)
    return _side_streams[index]
