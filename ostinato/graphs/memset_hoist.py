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

ENABLED = os.environ.get("OSTINATO_MEMSET_HOIST", "1") == "1"
CUBLAS_KERNEL = re.compile(r"nvjet|gemm|gemv|cutlass|xmma|splitK", re.IGNORECASE)


@dataclass(frozen=True)
class Node:
    kind: str  # "kernel", "memset" or "other"
    name: str = ""  # a kernel's function name
    deps: tuple[int, ...] = ()  # indices of the nodes it depends on
    memset_dst: int | None = None  # a memset's destination address


def plan(nodes: list[Node], workspace: int | None) -> list[tuple[str, int, int]]:
    """The edge edits, ("remove" | "add", from, to), that re-hang each memset of `workspace` (None: of any
    address, to ask whether a graph has candidates at all) whose only dependency R is not a cuBLAS kernel and whose
    only dependent G is one: R -> M becomes K -> M, with K the last cuBLAS kernel before M along the
    single-dependency chain through R (none: M becomes a root, as no cuBLAS work precedes it in the graph), and
    R -> G is added. A memset whose chain back branches before any cuBLAS kernel is left alone."""
    dependents: dict[int, list[int]] = {}
    for i, node in enumerate(nodes):
        for d in node.deps:
            dependents.setdefault(d, []).append(i)
    edits: list[tuple[str, int, int]] = []
    for m, node in enumerate(nodes):
        if node.kind != "memset" or workspace not in (None, node.memset_dst) or len(node.deps) != 1:
            continue
        after = dependents.get(m, [])
        if len(after) != 1 or not is_cublas(nodes[after[0]]):
            continue
        r, g = node.deps[0], after[0]
        if is_cublas(nodes[r]):
            continue  # already right after the cuBLAS work it must follow
        k: int | None = r
        while k is not None and not is_cublas(nodes[k]):
            if len(nodes[k].deps) > 1 or (nodes[k].kind == "memset" and workspace in (None, nodes[k].memset_dst)):
                k = -1  # a branch, or a workspace memset with no cuBLAS kernel after it: leave M alone
                break
            k = nodes[k].deps[0] if nodes[k].deps else None
        if k == -1:
            continue
        edits.append(("remove", r, m))
        if k is not None:
            edits.append(("add", k, m))
        edits.append(("add", r, g))
    return edits


def is_cublas(node: Node) -> bool:
    return node.kind == "kernel" and CUBLAS_KERNEL.search(node.name) is not None


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
        self.cuda = ctypes.CDLL("libcuda.so.1")
        self.graph = ctypes.c_void_p(graph)
        count = ctypes.c_size_t(0)
        self._check(self.cuda.cuGraphGetNodes(self.graph, None, ctypes.byref(count)), "cuGraphGetNodes")
        handles = (ctypes.c_void_p * count.value)()
        self._check(self.cuda.cuGraphGetNodes(self.graph, handles, ctypes.byref(count)), "cuGraphGetNodes")
        self.handles = list(handles)
        index = {h: i for i, h in enumerate(self.handles)}
        self.edges: dict[tuple[int, int], _EdgeData] = {}
        self.nodes = []
        for i, h in enumerate(self.handles):
            kind, name, dst = self._describe(h)
            deps = []
            for d, data in self._dependencies(h):
                deps.append(index[d])
                self.edges[(index[d], i)] = data
            self.nodes.append(Node(kind, name, tuple(deps), dst))

    @staticmethod
    def _check(result: int, what: str) -> None:
        if result != 0:
            raise RuntimeError(f"{what} failed with CUresult {result}")

    def memset_bytes(self, i: int) -> tuple[int, int] | None:
        """(dst, bytes) of memset node i when it writes zeros over one contiguous range, else None."""
        p = _MemsetParams()
        self._check(self.cuda.cuGraphMemsetNodeGetParams(ctypes.c_void_p(self.handles[i]), ctypes.byref(p)),
                    "cuGraphMemsetNodeGetParams")
        if p.value != 0 or (p.height > 1 and p.pitch != p.width * p.element_size):
            return None
        return p.dst, p.width * p.element_size * max(p.height, 1)

    def kernel_params(self, i: int) -> _KernelParams:
        p = _KernelParams()
        self._check(self.cuda.cuGraphKernelNodeGetParams_v2(ctypes.c_void_p(self.handles[i]), ctypes.byref(p)),
                    "cuGraphKernelNodeGetParams")
        return p

    def _describe(self, h: int) -> tuple[str, str, int | None]:
        kind = ctypes.c_int(-1)
        self._check(self.cuda.cuGraphNodeGetType(ctypes.c_void_p(h), ctypes.byref(kind)), "cuGraphNodeGetType")
        if kind.value == _NODE_MEMSET:
            p = _MemsetParams()
            self._check(self.cuda.cuGraphMemsetNodeGetParams(ctypes.c_void_p(h), ctypes.byref(p)),
                        "cuGraphMemsetNodeGetParams")
            return "memset", "", p.dst
        if kind.value == _NODE_KERNEL:
            p = _KernelParams()
            self._check(self.cuda.cuGraphKernelNodeGetParams_v2(ctypes.c_void_p(h), ctypes.byref(p)),
                        "cuGraphKernelNodeGetParams")
            name = ctypes.c_char_p()
            if p.func:
                result = self.cuda.cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(p.func))
            else:
                result = self.cuda.cuKernelGetName(ctypes.byref(name), ctypes.c_void_p(p.kern))
            return "kernel", (name.value or b"").decode() if result == 0 else "", None
        return "other", "", None

    def _dependencies(self, h: int) -> list[tuple[int, _EdgeData]]:
        count = ctypes.c_size_t(0)
        fn = self.cuda.cuGraphNodeGetDependencies_v2
        self._check(fn(ctypes.c_void_p(h), None, None, ctypes.byref(count)), "cuGraphNodeGetDependencies")
        if count.value == 0:
            return []
        deps, data = (ctypes.c_void_p * count.value)(), (_EdgeData * count.value)()
        self._check(fn(ctypes.c_void_p(h), deps, data, ctypes.byref(count)), "cuGraphNodeGetDependencies")
        return [(deps[i], data[i]) for i in range(count.value)]

    def apply(self, edits: list[tuple[str, int, int]], zero_kernel: "_KernelParams | None" = None) -> None:
        """The edge edits; with `zero_kernel`, each memset moved is then swapped for a kernel node of those
        params, with the memset's dependencies and dependents."""
        for op, a, b in edits:
            src, dst = (ctypes.c_void_p * 1)(self.handles[a]), (ctypes.c_void_p * 1)(self.handles[b])
            if op == "remove":
                data = (_EdgeData * 1)(self.edges.pop((a, b)))
                self._check(self.cuda.cuGraphRemoveDependencies_v2(self.graph, src, dst, data, ctypes.c_size_t(1)),
                            "cuGraphRemoveDependencies")
            else:
                self._check(self.cuda.cuGraphAddDependencies_v2(self.graph, src, dst, None, ctypes.c_size_t(1)),
                            "cuGraphAddDependencies")
                self.edges[(a, b)] = _EdgeData()
        if zero_kernel is None:
            return
        for m in sorted({b for op, _, b in edits if op == "remove"}):
            deps = [a for (a, b) in self.edges if b == m]
            after = [b for (a, b) in self.edges if a == m]
            self._check(self.cuda.cuGraphDestroyNode(ctypes.c_void_p(self.handles[m])), "cuGraphDestroyNode")
            node = ctypes.c_void_p()
            dep_handles = (ctypes.c_void_p * max(len(deps), 1))(*[self.handles[d] for d in deps])
            self._check(self.cuda.cuGraphAddKernelNode_v2(ctypes.byref(node), self.graph, dep_handles,
                                                          ctypes.c_size_t(len(deps)), ctypes.byref(zero_kernel)),
                        "cuGraphAddKernelNode")
            for b in after:
                dst = (ctypes.c_void_p * 1)(self.handles[b])
                self._check(self.cuda.cuGraphAddDependencies_v2(self.graph, (ctypes.c_void_p * 1)(node), dst, None,
                                                                ctypes.c_size_t(1)), "cuGraphAddDependencies")


@dataclass
class Workspace:
    """The range cuBLAS zeroes in its workspace on one stream, and a kernel node's params that zero it."""

    dst: int
    nbytes: int
    zero_kernel: _KernelParams
    _keep: object  # the graph those params were read from (its argument storage)


_workspaces: dict[int, Workspace | None] = {}


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
        editor = CudaGraphEditor(g.raw_cuda_graph())
        ranges = {editor.memset_bytes(i) for i, n in enumerate(editor.nodes) if n.kind == "memset"}
        _workspaces[key] = None
        if len(ranges) == 1 and None not in ranges:
            dst, nbytes = ranges.pop()
            view = torch.as_tensor(_CudaArray(dst, nbytes), device=device)
            zero = torch.cuda.CUDAGraph(keep_graph=True)
            with torch.cuda.graph(zero, stream=stream):
                view.mul_(0)  # a kernel (zero_() would be a memset node again)
            zeroer = CudaGraphEditor(zero.raw_cuda_graph())
            kernels = [i for i, n in enumerate(zeroer.nodes) if n.kind == "kernel"]
            if len(kernels) == 1 and len(zeroer.nodes) == 1:
                _workspaces[key] = Workspace(dst, nbytes, zeroer.kernel_params(kernels[0]), zero)
        del g
    return _workspaces[key]


def hoist_cublas_memsets(graph: int, device: torch.device, stream: "torch.cuda.Stream") -> int:
    """Applies `plan` to a cudaGraph_t captured on `stream` (not yet instantiated), swapping each memset moved
    for the zeroing kernel; returns the memsets moved. Only memsets of exactly the probe's range are touched, and
    the probe runs only once a graph has a memset before a cuBLAS kernel (most graphs have none: their GEMMs are
    small)."""
    editor = CudaGraphEditor(graph)
    if not plan(editor.nodes, None):
        return 0
    workspace = probe(device, stream)
    if workspace is None:
        return 0
    nodes = [n if n.kind != "memset" or editor.memset_bytes(i) == (workspace.dst, workspace.nbytes)
             else Node("memset", "", n.deps, None) for i, n in enumerate(editor.nodes)]
    edits = plan(nodes, workspace.dst)
    editor.apply(edits, workspace.zero_kernel)
    return sum(op == "remove" for op, _, _ in edits)
