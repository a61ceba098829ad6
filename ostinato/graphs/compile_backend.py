"""The torch.compile backend of piecewise graphs: split the traced forward at the split ops, compile each
piece between them, and hand each piece to a per-piece runtime (graphs/piecewise.py) that captures and
replays it per token count.

Dynamo traces the model once with the token dimension dynamic (`fullgraph=True`) and calls
`PiecewiseBackend(gm, example_inputs)`. The FX graph is cut at every call of a registered split op with
`torch.fx.passes.split_module(keep_original_order=True)`: piece 0, op, piece 1, op, ..., piece N. The
split ops stay plain calls in the top-level module and run eagerly on the real batch's metadata; the
pieces between them only see [tokens, ...] tensors whose rows are independent, so they can be captured
at padded token counts.
"""

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import fx
from torch.fx.passes.split_module import split_module

logger = logging.getLogger(__name__)

_SPLIT_OPS: set[object] = set()  # OpOverloadPackets / OpOverloads / functions that end a piece
_DIRECT: dict[object, Callable] = {}  # split op (and its overloads) -> the Python function behind it


def register_split_op(op: object, direct: Callable | None = None) -> None:
    """Make every call of `op` a piece boundary (the op runs eagerly between captured pieces). With `direct`,
    the function the custom op was made from, the split module calls that function instead of the op: the
    same work without a pass through the dispatcher, which costs the host tens of microseconds a call (on the
    GPU machines: the largest host cost of a piecewise step before this)."""
    overloads = op_overloads(op)
    _SPLIT_OPS.update(overloads)
    if direct is not None:
        _DIRECT.update(dict.fromkeys(overloads, direct))


def is_split_node(node: fx.Node, captured: frozenset = frozenset()) -> bool:
    """A call of a registered split op, unless the runner captures that op inside its pieces (`captured`)."""
    return node.op == "call_function" and node.target in _SPLIT_OPS and node.target not in captured


def op_overloads(op: object) -> frozenset:
    """An op packet and its overloads: what an FX node's target can be for a call of `op`."""
    if isinstance(op, torch._ops.OpOverloadPacket):
        return frozenset([op, *(getattr(op, name) for name in op.overloads())])
    return frozenset([op])


def _register_builtin_split_ops() -> None:
    from ostinato.attention.op import attention_impl  # defines ostinato::attention
    from ostinato.distributed.comm import all_gather_impl, all_reduce_impl  # ostinato::all_reduce, ::all_gather
    from ostinato.layers.mamba2 import MAMBA_OP_NAME, mamba_mixer_impl  # defines ostinato::mamba_mixer

    register_split_op(torch.ops.ostinato.attention, attention_impl)
    # tensor parallel: the collectives run eagerly between pieces, as seed 003 splits at the all-reduce
    register_split_op(torch.ops.ostinato.all_reduce, all_reduce_impl)
    register_split_op(torch.ops.ostinato.all_gather, all_gather_impl)
    # its state lives in the Mamba pool, outside the graph
    namespace, op = MAMBA_OP_NAME.split("::")
    register_split_op(getattr(getattr(torch.ops, namespace), op), mamba_mixer_impl)


_register_builtin_split_ops()

COMPILERS = ("eager", "inductor")


def compile_cache_dir() -> str:
    """Persistent cache of compiled pieces (inductor's FX graph and kernel caches), so a second start-up
    skips codegen: $OSTINATO_CACHE_DIR/torch_compile, default ~/.cache/ostinato/torch_compile."""
    root = os.environ.get("OSTINATO_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ostinato")
    return os.path.join(root, "torch_compile")


def use_compile_cache() -> str:
    """Point inductor's caches (FX graphs, AOTAutograd, Triton kernels, autotuning) at our persistent dir unless
    the user chose one, keep its FX graph cache on, and return the dir in use. Importing torch._dynamo sets
    TORCHINDUCTOR_CACHE_DIR to torch's default (/tmp/torchinductor_<user>), so that value counts as unset
    (a plain setdefault never took effect: warm and "cold" start-ups shared /tmp)."""
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        default = default_cache_dir()
    except ImportError:  # an older layout: only an unset variable is ours to set
        default = None
    if current is None or current == default:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = compile_cache_dir()
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    try:
        import torch._inductor.config as inductor_config

        inductor_config.fx_graph_cache = True
    except (ImportError, AttributeError):  # an inductor without the option: its default applies
        pass
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


@dataclass
class SplitResult:
    module: fx.GraphModule  # top level: calls submod_0, split op, submod_2, ...
    piece_names: list[str]  # the compiled (non-split) submodules, in execution order
    num_split_calls: int
    # per piece: indices of its arguments produced by a split op (fresh tensors each run, copied into
    # static buffers before a replay); every other argument is stable (a parameter, a static input
    # buffer, or an earlier piece's captured output)
    volatile_args: dict[str, list[int]] = field(default_factory=dict)


def split_at_ops(gm: fx.GraphModule, captured: frozenset = frozenset()) -> SplitResult:
    """Cut `gm` at the split ops (but those in `captured`): piece k gets id 2k, the k-th split op id 2k+1."""
    part, ids, num_split = 0, {}, 0
    for node in gm.graph.nodes:
        if is_split_node(node, captured):
            ids[node] = part + 1
            part += 2
            num_split += 1
        else:
            ids[node] = part
    split = split_module(gm, None, lambda node: ids[node], keep_original_order=True)
    split_subs, pieces = set(), []
    for node in split.graph.nodes:
        if node.op != "call_module":
            continue
        sub = getattr(split, node.target)
        if any(is_split_node(n, captured) for n in sub.graph.nodes):
            split_subs.add(node.target)
        else:
            pieces.append(node.target)

    def from_split(arg: object) -> bool:
        while isinstance(arg, fx.Node) and arg.op == "call_function" and arg.args:  # getitem of a tuple output
            arg = arg.args[0]
        return isinstance(arg, fx.Node) and arg.op == "call_module" and arg.target in split_subs

    volatile = {}
    for node in split.graph.nodes:
        if node.op == "call_module" and node.target in pieces:
            volatile[node.target] = [i for i, a in enumerate(node.args) if from_split(a)]
    return SplitResult(split, pieces, num_split, volatile)


def call_split_ops_directly(split: SplitResult) -> None:
    """Make the split module call the functions behind its split ops (those registered with `direct=`): they run
    eagerly anyway, and this skips the dispatcher. Only once the pieces are compiled: a fake run of the split
    module (compile_pieces) needs the ops' fake implementations."""
    for node in split.module.graph.nodes:
        if node.op != "call_module" or node.target in split.piece_names:
            continue
        sub = getattr(split.module, node.target)
        direct = [n for n in sub.graph.nodes if n.op == "call_function" and n.target in _DIRECT]
        for n in direct:
            n.target = _DIRECT[n.target]
        if direct:
            sub.recompile()


def piece_signature(piece: fx.GraphModule) -> str | None:
    """A key equal for pieces that compute the same function of their arguments: the node list with targets,
    constant arguments and each placeholder's dtype/shape, names left out (each layer's pieces name their
    weights differently). None for a piece that reads module state (get_attr / call_module): never shared."""
    index: dict[fx.Node, int] = {}
    lines = []
    for i, node in enumerate(piece.graph.nodes):
        if node.op in ("get_attr", "call_module"):
            return None
        index[node] = i
        args = fx.node.map_arg((node.args, node.kwargs), lambda n: f"%{index[n]}")
        meta = ""
        if node.op == "placeholder":
            val = node.meta.get("example_value", node.meta.get("val"))
            meta = f"{val.dtype}{tuple(val.shape)}" if isinstance(val, torch.Tensor) else type(val).__name__
        # the target object itself (a function of another closure is another function), by identity
        target = node.target if isinstance(node.target, str) else f"{node.target}@{id(node.target)}"
        lines.append(f"{node.op} {'' if node.op == 'placeholder' else target} {args} {meta}")
    return "\n".join(lines)


def _plain_copy(piece: fx.GraphModule) -> fx.GraphModule:
    """A plain GraphModule over a copy of the piece's graph: inductor may rewrite what it compiles, and
    split_module's modules may be lazy ones (torch 2.13) whose code is generated on first call."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(piece.graph, {}))
    return fx.GraphModule(piece, graph)


def compile_pieces(split: fx.GraphModule, gm: fx.GraphModule, example_inputs: list, names: list[str],
                   compiler: str) -> dict[str, Callable]:
    """The named pieces of `split` as traced (`eager`) or compiled by inductor (`inductor`), compiled here and now
    over the example arguments each piece gets in a fake run of the split module on dynamo's fake inputs (the
    token dimension symbolic, as dynamo traced it). A nested torch.compile of each piece does not work: called
    from the code dynamo compiled, it never compiles (the pieces ran eagerly)."""
    if compiler == "eager":
        return {name: getattr(split, name) for name in names}
    if compiler != "inductor":
        raise ValueError(f"piecewise_cuda_graph_compiler must be one of {COMPILERS}, got {compiler!r}")
    from torch._guards import detect_fake_mode
    from torch._inductor.compile_fx import compile_fx

    fake_mode = detect_fake_mode()  # dynamo's, of the compile in progress
    metas = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
    # tensors through the fake mode's memo (their shapes as dynamo made them); size inputs as dynamo's SymInts
    fakes = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else m for x, m in zip(example_inputs, metas,
                                                                                               strict=True)]
    wanted, out = set(names), {}

    class _CompileAtFirstCall(fx.Interpreter):
        def call_module(self, target, args, kwargs):
            if target in wanted and target not in out:
                out[target] = compile_fx(_plain_copy(getattr(split, target)), list(args))
            return super().call_module(target, args, kwargs)

    with fake_mode:
        _CompileAtFirstCall(split).run(*fakes)
    return out


class PiecewiseBackend:
    """A `torch.compile(backend=...)` callable. `make_runtime(name, index, num_pieces, runnable, volatile)`
    wraps each compiled piece (the per-token-count capture/replay runtime); the wrapped pieces replace the
    submodules in the split module, which is what dynamo then calls. `captured`: split ops this runner captures
    inside its pieces instead (their overloads, see op_overloads), because it made them capturable."""

    def __init__(self, compiler: str, make_runtime: Callable[..., Callable], captured: frozenset = frozenset()) -> None:
        if compiler not in COMPILERS:
            raise ValueError(f"piecewise_cuda_graph_compiler must be one of {COMPILERS}, got {compiler!r}")
        self.compiler = compiler
        self.make_runtime = make_runtime
        self.captured = captured
        self.splits: list[SplitResult] = []  # one per dynamo compile (a recompile adds one)
        self.compile_seconds = 0.0
        self.first_call_at: float | None = None  # perf_counter when dynamo first handed over a graph
        # one compiled callable per distinct piece: a model's middle layers give identical pieces (the weights
        # are arguments), compiled once instead of once per layer (inductor's cache would hit, but each
        # layer would still pay a dynamo trace and an AOTAutograd pass at every start-up)
        self.compiled: dict[str, Callable] = {}
        self.num_compiled = 0

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Callable:
        start = time.perf_counter()
        if self.first_call_at is None:
            self.first_call_at = start
        result = split_at_ops(gm, self.captured)
        names = result.piece_names
        keys = {name: piece_signature(getattr(result.module, name)) for name in names}
        first: dict[str, str] = {}  # signature -> the first piece that has it: the one compiled
        owner = {name: name if keys[name] is None else first.setdefault(keys[name], name) for name in names}
        todo = [name for name in names if owner[name] == name and keys[name] not in self.compiled]
        compiled = compile_pieces(result.module, gm, example_inputs, todo, self.compiler)
        call_split_ops_directly(result)
        self.num_compiled += len(compiled)
        for index, name in enumerate(names):
            key = keys[name]
            runnable = self.compiled[key] if key in self.compiled else compiled[owner[name]]
            if key is not None:
                self.compiled[key] = runnable
            # replace the submodule by its runtime: fx calls `self.<name>(*args)`
            result.module.__dict__[name] = self.make_runtime(name, index, len(names), runnable,
                                                             result.volatile_args[name])
        self.splits.append(result)
        self.compile_seconds += time.perf_counter() - start
        logger.info("piecewise backend: %d pieces around %d split-op calls, %d compiled (%s)", len(names),
                    result.num_split_calls, self.num_compiled, self.compiler)
        return result.module
