"""cuBLAS's workspace memsets, taken off a captured graph's critical path.

Before some GEMMs (the dynamically scheduled Hopper kernels, e.g. Granite's in_proj and every gate_up of a
2,048-token extend) cuBLAS zeroes a tile counter in its workspace with a memset. Captured, that memset is a graph
node between the kernel before the GEMM (an RMSNorm) and the GEMM: rms -> memset -> GEMM. On an H200 the two
extra hops cost about 5.5 us a GEMM (a 2,048-token Granite step: 76 memsets, 0.45 ms of 12.3).

The memset only has to follow the cuBLAS work before it on the stream (the previous GEMMs, which use the same
counter) and precede its GEMM; nothing else reads or writes the workspace, which torch allocates once per
(cuBLAS handle, stream) and never frees. So after capture each such memset is re-hung: its edge from the kernel
before it is replaced by one from the last cuBLAS kernel before it, and that kernel-before gets an edge straight
to the GEMM. And it becomes a kernel node that writes the same zeros (a memset node re-hung alone still delayed
its GEMM's start by about 4 us on an H200: the wait on a memset node is slow, not the memset). The GEMM then
waits on its input's producer and on a zeroing kernel that ran alongside it.

Which memsets: those writing the capture stream's workspace, found by capturing one GEMM that memsets (`probe`)
and reading its memset's destination. A memset of any other address (a zeroed tensor, whose memory the caching
allocator may have just taken from a tensor still being read) is never moved.

A graph with few such memsets (a decode step's one, before the LM head) keeps its shape instead: each memset is
swapped for the zeroing kernel where it stands (`moves_in_place`), since re-hung ones make the graph branch, and a
graph that branches starts its second node late.

`plan` is the rule over a plain node list (tested on the CPU); `CudaGraphEditor` reads and edits a cudaGraph_t
through the driver API (ctypes).
"""

import ctypes
import logging
import os
import re
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

# "1": by the graph's count of memsets (REHANG_MIN); "rehang" / "inplace": always that way (A/B runs); "0": off
MODE = os.environ.get("OSTINATO_MEMSET_HOIST", "1")
ENABLED = MODE != "0"
# A graph with fewer memsets to move has each swapped for the zeroing kernel where it stands (`plan`'s
# `in_place`), so a chain stays a chain. Re-hung, each memset leaves its GEMM's path (about 4 us an H200 hop),
# but the zeroing kernels become a second root, and a graph that branches starts its second node about 10 us
# late: a bs-1 decode graph (one memset, before the LM head's GEMM) ran its embedding 10 us after its first
# kernel re-hung and 0.9 us after it in place (H200, `profile_step_boundary.py`, memset-hoist-*-s28). A
# 2,048-token Granite extend has 76.
REHANG_MIN = 8
CUBLAS_KERNEL = re.compile(r"nvjet|gemm|gemv|cutlass|xmma|splitK", re.IGNORECASE)


@dataclass(frozen=True)
class Node:
    kind: str  # "kernel", "memset" or "other"
    name: str = ""  # a kernel's function name
    deps: tuple[int, ...] = ()  # indices of the nodes it depends on
    memset_range: tuple[int, int] | None = None  # a memset of zeros over one contiguous range: (address, bytes)


def plan(nodes: list[Node], workspace: tuple[int, int] | None, in_place: bool = False) -> list[tuple[str, int, int]]:
    """The edge edits, ("remove" | "add", from, to), that re-hang each memset of zeros over the `workspace` range
    (None: over any range, to ask whether a graph has candidates at all) whose only dependency R is not a cuBLAS
    kernel and whose only dependent G is one: R -> M becomes K -> M, with K the last cuBLAS kernel before M along
    the single-dependency chain through R (none: M becomes a root, as no cuBLAS work precedes it in the graph),
    and R -> G is added. A memset whose chain back branches before any cuBLAS kernel is left alone.
    `in_place`: each such memset is only swapped for the zeroing kernel, ("swap", M, M), its edges kept."""
    dependents: dict[int, list[int]] = {}
    for i, node in enumerate(nodes):
        for d in node.deps:
            dependents.setdefault(d, []).append(i)
    edits: list[tuple[str, int, int]] = []
    for m, node in enumerate(nodes):
        if not is_workspace_memset(node, workspace) or len(node.deps) != 1:
            continue
        after = dependents.get(m, [])
        if len(after) != 1 or not is_cublas(nodes[after[0]]):
            continue
        r, g = node.deps[0], after[0]
        if is_cublas(nodes[r]):
            continue  # already right after the cuBLAS work it must follow
        k: int | None = r
        while k is not None and not is_cublas(nodes[k]):
            if len(nodes[k].deps) > 1 or is_workspace_memset(nodes[k], workspace):
                k = -1  # a branch, or a workspace memset with no cuBLAS kernel after it: leave M alone
                break
            k = nodes[k].deps[0] if nodes[k].deps else None
        if k == -1:
            continue
        if in_place:
            edits.append(("swap", m, m))
            continue
        edits.append(("remove", r, m))
        if k is not None:
            edits.append(("add", k, m))
        edits.append(("add", r, g))
    return edits


def moves_in_place(count: int, mode: str | None = None) -> bool:
    """Whether a graph's `count` movable memsets are swapped where they stand (else re-hung), under `mode` (the
    OSTINATO_MEMSET_HOIST setting; None: the process's)."""
    mode = MODE if mode is None else mode
    return mode == "inplace" or (mode != "rehang" and count < REHANG_MIN)


def is_cublas(node: Node) -> bool:
    return node.kind == "kernel" and CUBLAS_KERNEL.search(node.name) is not None


def is_workspace_memset(node: Node, workspace: tuple[int, int] | None) -> bool:
    return node.memset_range is not None and workspace in (None, node.memset_range)


class _EdgeData(ctypes.Structure):
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


class _KernelParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem", ctypes.c_uint), ("params", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


class _MemsetParams(ctypes.Structure):  # CUDA_MEMSET_NODE_PARAMS
    _fields_ = [("dst", ctypes.c_uint64), ("pitch", ctypes.c_size_t), ("value", ctypes.c_uint),
                ("element_size", ctypes.c_uint), ("width", ctypes.c_size_t), ("height", ctypes.c_size_t)]


_NODE_KERNEL, _NODE_MEMSET = 0, 2  # CUgraphNodeType


class _CudaArray:
    """A raw device range as a uint8 tensor (torch.as_tensor reads __cuda_array_interface__; no copy)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 2, "strides": None}


class CudaGraphEditor:
    """Reads a cudaGraph_t's nodes into `Node`s and applies `plan`'s edits (driver API: CUgraph and
    cudaGraph_t are one handle)."""

    def __init__(self, graph: int) -> None:
        """Reads the graph (nothing is written before `apply`). Every driver function is looked up here, so a
        driver without one fails before the graph is touched."""
        cuda = ctypes.CDLL("libcuda.so.1")
        self.fn = {name: getattr(cuda, name) for name in (
            "cuGraphGetNodes", "cuGraphNodeGetType", "cuGraphMemsetNodeGetParams", "cuGraphKernelNodeGetParams_v2",
            "cuFuncGetName", "cuKernelGetName", "cuGraphNodeGetDependencies_v2", "cuGraphRemoveDependencies_v2",
            "cuGraphAddDependencies_v2", "cuGraphDestroyNode", "cuGraphAddKernelNode_v2")}
        self.graph = ctypes.c_void_p(graph)
        count = ctypes.c_size_t(0)
        self._call("cuGraphGetNodes", self.graph, None, ctypes.byref(count))
        handles = (ctypes.c_void_p * count.value)()
        self._call("cuGraphGetNodes", self.graph, handles, ctypes.byref(count))
        self.handles = list(handles)
        index = {h: i for i, h in enumerate(self.handles)}
        self.edges: dict[tuple[int, int], _EdgeData] = {}
        self.nodes = []
        for i, h in enumerate(self.handles):
            deps = []
            for d, data in self._dependencies(h):
                deps.append(index[d])
                self.edges[(index[d], i)] = data
            self.nodes.append(self._describe(h, tuple(deps)))

    def _call(self, name: str, *args) -> None:
        result = self.fn[name](*args)
        if result != 0:
            raise RuntimeError(f"{name} failed with CUresult {result}")

    def kernel_params(self, h: int) -> _KernelParams:
        p = _KernelParams()
        self._call("cuGraphKernelNodeGetParams_v2", ctypes.c_void_p(h), ctypes.byref(p))
        return p

    def _describe(self, h: int, deps: tuple[int, ...]) -> Node:
        kind = ctypes.c_int(-1)
        self._call("cuGraphNodeGetType", ctypes.c_void_p(h), ctypes.byref(kind))
        if kind.value == _NODE_MEMSET:
            p = _MemsetParams()
            self._call("cuGraphMemsetNodeGetParams", ctypes.c_void_p(h), ctypes.byref(p))
            contiguous = p.height <= 1 or p.pitch == p.width * p.element_size
            zeros = (p.dst, p.width * p.element_size * max(p.height, 1)) if p.value == 0 and contiguous else None
            return Node("memset", "", deps, zeros)
        if kind.value == _NODE_KERNEL:
            p = self.kernel_params(h)
            name = ctypes.c_char_p()
            if p.func:
                result = self.fn["cuFuncGetName"](ctypes.byref(name), ctypes.c_void_p(p.func))
            else:
                result = self.fn["cuKernelGetName"](ctypes.byref(name), ctypes.c_void_p(p.kern))
            return Node("kernel", (name.value or b"").decode() if result == 0 else "", deps)
        return Node("other", "", deps)

    def _dependencies(self, h: int) -> list[tuple[int, _EdgeData]]:
        count = ctypes.c_size_t(0)
        self._call("cuGraphNodeGetDependencies_v2", ctypes.c_void_p(h), None, None, ctypes.byref(count))
        if count.value == 0:
            return []
        deps, data = (ctypes.c_void_p * count.value)(), (_EdgeData * count.value)()
        self._call("cuGraphNodeGetDependencies_v2", ctypes.c_void_p(h), deps, data, ctypes.byref(count))
        return [(deps[i], data[i]) for i in range(count.value)]

    def _edge(self, op: str, src: int, dst: int, data: "_EdgeData | None" = None) -> None:
        one = ctypes.c_void_p * 1
        self._call(op, self.graph, one(src), one(dst), None if data is None else (_EdgeData * 1)(data),
                   ctypes.c_size_t(1))

    def apply(self, edits: list[tuple[str, int, int]], zero_kernel: _KernelParams) -> None:
        """The edge edits, then each memset moved is swapped for a kernel node of `zero_kernel`'s params, with
        the memset's dependencies and dependents."""
        for op, a, b in edits:
            if op == "swap":
                continue
            if op == "remove":
                self._edge("cuGraphRemoveDependencies_v2", self.handles[a], self.handles[b], self.edges.pop((a, b)))
            else:
                self._edge("cuGraphAddDependencies_v2", self.handles[a], self.handles[b])
                self.edges[(a, b)] = _EdgeData()
        for m in sorted({b for op, _, b in edits if op in ("remove", "swap")}):
            deps = [self.handles[a] for (a, b) in self.edges if b == m]
            after = [self.handles[b] for (a, b) in self.edges if a == m]
            self._call("cuGraphDestroyNode", ctypes.c_void_p(self.handles[m]))
            node = ctypes.c_void_p()
            self._call("cuGraphAddKernelNode_v2", ctypes.byref(node), self.graph,
                       (ctypes.c_void_p * max(len(deps), 1))(*deps), ctypes.c_size_t(len(deps)),
                       ctypes.byref(zero_kernel))
            for h in after:
                self._edge("cuGraphAddDependencies_v2", node.value, h)


@dataclass
class Workspace:
    """The range cuBLAS zeroes in its workspace on one stream, and a kernel node's params that zero it."""

    range: tuple[int, int]  # (address, bytes)
    zero_kernel: _KernelParams
    _keep: object  # the graph those params were read from (its argument storage)


_workspaces: dict[int, Workspace | None] = {}
_enabled = ENABLED


def probe(device: torch.device, stream: "torch.cuda.Stream") -> Workspace | None:
    """What cuBLAS memsets in its workspace on `stream` (None if the probe GEMM issues no memset): one GEMM of a
    2,048-token extend's gate_up shape, captured on that stream; then a zeroing kernel over that range, captured
    for its node params."""
    key = stream.cuda_stream
    if key not in _workspaces:
        x = torch.randn(2048, 1536, device=device, dtype=torch.bfloat16)
        w = torch.randn(8192, 1536, device=device, dtype=torch.bfloat16)
        with torch.cuda.stream(stream):
            torch.nn.functional.linear(x, w)  # the handle and its workspace exist before capture
        torch.cuda.synchronize(device)
        g = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(g, stream=stream):
            torch.nn.functional.linear(x, w)
        ranges = {n.memset_range for n in CudaGraphEditor(g.raw_cuda_graph()).nodes if n.kind == "memset"}
        _workspaces[key] = None
        if len(ranges) == 1 and None not in ranges:
            (dst, nbytes), = ranges
            view = torch.as_tensor(_CudaArray(dst, nbytes), device=device)
            zero = torch.cuda.CUDAGraph(keep_graph=True)
            with torch.cuda.graph(zero, stream=stream):
                view.mul_(0)  # a kernel (zero_() would be a memset node again)
            zeroer = CudaGraphEditor(zero.raw_cuda_graph())
            if [n.kind for n in zeroer.nodes] == ["kernel"]:
                _workspaces[key] = Workspace((dst, nbytes), zeroer.kernel_params(zeroer.handles[0]), zero)
        del g
    return _workspaces[key]


def hoist_cublas_memsets(graph: "torch.cuda.CUDAGraph", device: torch.device, stream: "torch.cuda.Stream") -> int:
    """Applies `plan` to a graph captured on `stream` with keep_graph=True (not yet instantiated), swapping each
    memset moved for the zeroing kernel; returns the memsets moved. Only memsets of exactly the probe's range are
    touched, and the probe runs only once a graph has a memset before a cuBLAS kernel (most graphs have none:
    their GEMMs are small). Where reading fails (no libcuda, an older driver) the graph is left as captured and
    hoisting is off for the process; a failure while editing raises, as the graph is then half edited."""
    global _enabled
    if not _enabled:
        return 0
    try:
        editor = CudaGraphEditor(graph.raw_cuda_graph())
        if not plan(editor.nodes, None):
            return 0
        workspace = probe(device, stream)
    except (AttributeError, OSError, RuntimeError) as e:
        logger.warning("cuBLAS memsets stay on the graphs' critical path: %s", e)
        _enabled = False
        return 0
    if workspace is None:
        return 0
    edits = plan(editor.nodes, workspace.range, in_place=True)
    if not moves_in_place(len(edits)):
        edits = plan(editor.nodes, workspace.range)
    editor.apply(edits, workspace.zero_kernel)
    return sum(op in ("remove", "swap") for op, _, _ in edits)
