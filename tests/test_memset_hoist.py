"""cuBLAS workspace memsets moved off a captured graph's critical path (graphs/memset_hoist.py): the edge rule on
node lists and the graph editor over a fake driver (CPU), and on the GPU a captured chain of norms and GEMMs that
replays the eager result with its memsets moved."""

import random

import pytest
import torch

from ostinato.graphs.memset_hoist import Node, is_cublas, plan

WS = (0x7000, 4)  # the workspace range: (address, bytes)


def chain(*specs: tuple) -> list[Node]:
    """A captured stream: each node depends on the one before. Spec: ("k", name) or ("m", dst)."""
    nodes = []
    for i, (kind, arg) in enumerate(specs):
        deps = (i - 1,) if i else ()
        nodes.append(Node("kernel", arg, deps) if kind == "k" else Node("memset", "", deps, arg))
    return nodes


def edited(nodes: list[Node], edits: list[tuple[str, int, int]]) -> list[set[int]]:
    deps = [set(n.deps) for n in nodes]
    for op, a, b in edits:
        if op == "remove":
            assert a in deps[b], f"removes a missing edge {a}->{b}"
            deps[b].discard(a)
        else:
            deps[b].add(a)
    return deps


def reaches(deps: list[set[int]]) -> list[set[int]]:
    """before[i]: every node that must finish before node i starts."""
    before: list[set[int]] = [set() for _ in deps]
    for i in range(len(deps)):  # chains are built in topological order
        for d in deps[i]:
            before[i] |= {d} | before[d]
    return before


def test_a_memset_between_a_norm_and_its_gemm_hangs_from_the_gemm_before():
    nodes = chain(("k", "nvjet_down"), ("k", "_rms_norm_kernel"), ("m", WS), ("k", "nvjet_gate_up"),
                  ("k", "_silu_and_mul_kernel"))
    assert plan(nodes, WS) == [("remove", 1, 2), ("add", 0, 2), ("add", 1, 3)]


def test_in_place_swaps_the_memset_and_keeps_every_edge():
    nodes = chain(("k", "nvjet_down"), ("k", "_rms_norm_kernel"), ("m", WS), ("k", "nvjet_gate_up"),
                  ("k", "_rms"), ("m", (WS[0] + 64, 4)), ("k", "nvjet_other"))
    assert plan(nodes, WS, in_place=True) == [("swap", 2, 2)]


def test_few_memsets_move_in_place_many_are_rehung():
    from ostinato.graphs.memset_hoist import REHANG_MIN, moves_in_place

    assert moves_in_place(1, "1") and not moves_in_place(REHANG_MIN, "1")
    assert moves_in_place(REHANG_MIN, "inplace") and not moves_in_place(1, "rehang")


def test_memsets_left_alone():
    other = chain(("k", "nvjet_a"), ("k", "_rms"), ("m", (WS[0] + 64, 4)), ("k", "nvjet_b"))  # not the workspace
    before_triton = chain(("k", "nvjet_a"), ("k", "_rms"), ("m", WS), ("k", "_silu"))  # not before a GEMM
    after_gemm = chain(("k", "_rms"), ("k", "nvjet_a"), ("m", WS), ("k", "nvjet_b"))  # nothing to gain
    branch = [Node("kernel", "_a"), Node("kernel", "_b"), Node("kernel", "_rms", (0, 1)),
              Node("memset", "", (2,), WS), Node("kernel", "nvjet_g", (3,))]  # joins before any GEMM
    for nodes in (other, before_triton, after_gemm, branch):
        assert plan(nodes, WS) == []
    assert plan(other, None) != []  # the candidates check: a memset of any address before a GEMM


def test_the_first_memset_becomes_a_root():
    nodes = chain(("k", "_embed"), ("k", "_rms_norm_kernel"), ("m", WS), ("k", "nvjet_in_proj"))
    assert plan(nodes, WS) == [("remove", 1, 2), ("add", 1, 3)]


@pytest.mark.parametrize("seed", range(20))
def test_every_order_that_matters_is_kept(seed):
    """Random streams of Triton kernels, GEMMs and workspace-memset + GEMM pairs: after the edits every kernel
    still follows every kernel it followed, every workspace memset follows every GEMM before it and precedes its
    own GEMM, and each memset moved no longer waits on the kernel before it."""
    rng = random.Random(seed)
    specs = []
    for _ in range(rng.randrange(4, 40)):
        r = rng.random()
        if r < 0.5:
            specs.append(("k", f"_triton_{len(specs)}"))
        elif r < 0.75:
            specs.append(("k", f"nvjet_{len(specs)}"))
        else:
            specs += [("m", WS), ("k", f"nvjet_{len(specs)}")]
    nodes = chain(*specs)
    edits = plan(nodes, WS)
    before = reaches(edited(nodes, edits))
    for i, n in enumerate(nodes):
        for j in range(i):
            if n.kind == "kernel" and nodes[j].kind == "kernel":
                assert j in before[i], f"kernel {j} no longer precedes kernel {i}"
            if n.kind == "memset" and is_cublas(nodes[j]):
                assert j in before[i], f"workspace memset {i} may run before GEMM {j}"
        if n.kind == "memset":
            assert i in before[i + 1], f"memset {i} no longer precedes its GEMM"
    moved = {b for op, a, b in edits if op == "remove"}
    for m in moved:
        assert nodes[m].deps[0] not in before[m], f"memset {m} still waits on the kernel before it"
    pairs = sum(1 for i, n in enumerate(nodes) if n.kind == "memset" and i and not is_cublas(nodes[i - 1]))
    assert len(moved) == pairs


class FakeDriver:
    """The driver functions CudaGraphEditor calls, over an in-memory graph: node handle -> [type, name or memset
    range, set of dependency handles]. Each function reads and writes its ctypes arguments as libcuda does."""

    def __init__(self, nodes: list[Node]):
        self.nodes = {}
        for i, n in enumerate(nodes):
            kind = {"kernel": 0, "memset": 2}.get(n.kind, 5)
            self.nodes[100 + i] = [kind, n.name if n.kind == "kernel" else n.memset_range, {100 + d for d in n.deps}]
        self.names = {}  # fake CUfunction -> its name (bytes kept alive)
        self.added_params = []

    def __getattr__(self, name):
        return getattr(self, "_" + name)

    @staticmethod
    def _arg(x):
        return x._obj if hasattr(x, "_obj") else x

    def _cuGraphGetNodes(self, graph, out, count):
        count = self._arg(count)
        if out is not None:
            for i, h in enumerate(self.nodes):
                out[i] = h
        count.value = len(self.nodes)
        return 0

    def _cuGraphNodeGetType(self, h, out):
        self._arg(out).value = self.nodes[h.value][0]
        return 0

    def _cuGraphMemsetNodeGetParams(self, h, out):
        p = self._arg(out)
        p.dst, nbytes = self.nodes[h.value][1]
        p.value, p.element_size, p.width, p.height, p.pitch = 0, 1, nbytes, 1, nbytes
        return 0

    def _cuGraphKernelNodeGetParams_v2(self, h, out):
        p = self._arg(out)
        p.func = h.value + 10_000
        self.names[p.func] = self.nodes[h.value][1].encode()
        return 0

    def _cuFuncGetName(self, out, func):
        self._arg(out).value = self.names[func.value]
        return 0

    def _cuKernelGetName(self, out, kern):
        return 1

    def _cuGraphNodeGetDependencies_v2(self, h, deps, data, count):
        own = sorted(self.nodes[h.value][2])
        if deps is not None:
            for i, d in enumerate(own):
                deps[i] = d
        self._arg(count).value = len(own)
        return 0

    def _cuGraphRemoveDependencies_v2(self, graph, src, dst, data, n):
        self.nodes[dst[0]][2].remove(src[0])
        return 0

    def _cuGraphAddDependencies_v2(self, graph, src, dst, data, n):
        self.nodes[dst[0]][2].add(src[0])
        return 0

    def _cuGraphDestroyNode(self, h):
        del self.nodes[h.value]
        for node in self.nodes.values():
            node[2].discard(h.value)
        return 0

    def _cuGraphAddKernelNode_v2(self, out, graph, deps, n, params):
        h = max(self.nodes) + 1
        self.nodes[h] = [0, "zero", {deps[i] for i in range(n.value)}]
        self.added_params.append(self._arg(params))
        self._arg(out).value = h
        return 0


def test_the_editor_swaps_a_memset_for_a_zeroing_kernel_through_the_driver_calls(monkeypatch):
    """CudaGraphEditor over a fake libcuda: the chain norm -> memset -> GEMM comes out as the GEMM waiting on the
    norm and on a zeroing kernel that hangs from the GEMM before; other memsets stay where they were."""
    from ostinato.graphs import memset_hoist

    nodes = chain(("k", "nvjet_down"), ("k", "_rms_norm_kernel"), ("m", WS), ("k", "nvjet_gate_up"),
                  ("k", "_rms"), ("m", (WS[0] + 64, 4)), ("k", "nvjet_other"))
    fake = FakeDriver(nodes)
    monkeypatch.setattr(memset_hoist.ctypes, "CDLL", lambda name: fake)
    editor = memset_hoist.CudaGraphEditor(1)
    assert editor.nodes == nodes  # read back as built
    zero = memset_hoist._KernelParams()
    editor.apply(memset_hoist.plan(editor.nodes, WS), zero)
    added = max(fake.nodes)
    assert 102 not in fake.nodes and fake.nodes[added][2] == {100}  # the memset became a kernel after the GEMM
    assert fake.nodes[103][2] == {101, added}  # the GEMM waits on the norm and the zeroing kernel
    assert fake.nodes[105][2] == {104} and fake.nodes[106][2] == {105}  # the other memset: untouched
    assert fake.added_params == [zero]


def test_the_editor_swaps_a_memset_in_place(monkeypatch):
    """In place: norm -> memset -> GEMM becomes norm -> zeroing kernel -> GEMM, a chain as before."""
    from ostinato.graphs import memset_hoist

    nodes = chain(("k", "_rms_norm_kernel"), ("m", WS), ("k", "nvjet_gate_up"), ("k", "_silu"))
    fake = FakeDriver(nodes)
    monkeypatch.setattr(memset_hoist.ctypes, "CDLL", lambda name: fake)
    editor = memset_hoist.CudaGraphEditor(1)
    zero = memset_hoist._KernelParams()
    editor.apply(memset_hoist.plan(editor.nodes, WS, in_place=True), zero)
    added = max(fake.nodes)
    assert 101 not in fake.nodes and fake.nodes[added][2] == {100}  # the kernel hangs where the memset hung
    assert fake.nodes[102][2] == {added} and fake.nodes[103][2] == {102}
    assert fake.added_params == [zero]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_norm_gemm_chain_replays_eagerly_with_its_memsets_moved():
    from ostinato.graphs import memset_hoist
    from ostinato.graphs.graph import Graph, capture_stream

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(2048, 1536, device=dev, dtype=torch.bfloat16, generator=g)
    ws = [torch.randn(8192, 1536, device=dev, dtype=torch.bfloat16, generator=g) * 0.03 for _ in range(2)]
    w_down = torch.randn(1536, 4096, device=dev, dtype=torch.bfloat16, generator=g) * 0.03
    out = torch.empty_like(x)

    def step():
        h = x
        for w in ws:  # norm -> gate_up (a memset before it on Hopper) -> silu-mul -> down
            h = torch.nn.functional.rms_norm(h, (h.shape[-1],))
            gate, up = torch.nn.functional.linear(h, w).chunk(2, dim=-1)
            h = h + torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w_down)
        out.copy_(h)

    step()
    expected = out.clone()
    stream = capture_stream(dev)
    with torch.cuda.stream(stream):
        step()  # warm on the capture stream, as capture_graphs does
    torch.cuda.synchronize()
    raw = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(raw, stream=stream):
        step()
    moved = memset_hoist.hoist_cublas_memsets(raw, dev, stream)
    raw.instantiate()
    workspace = memset_hoist.probe(dev, stream)
    graph = Graph(dev)  # the engine's path: hoisted inside capture()
    graph.capture(step, stream)
    for replay in (raw.replay, graph.replay) * 3:
        out.zero_()
        replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)
    if workspace is not None:  # the probe's GEMM memsets on this card, and so do the gate_up GEMMs here
        assert moved >= 1
