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


def register_split_op(op: object) -> None:
    """Make every call of `op` a piece boundary (the op runs eagerly between captured pieces). Attention
    registers itself below; a tensor-parallel all-reduce or a Mamba mixer op does the same when it lands."""
    _SPLIT_OPS.add(op)
    if isinstance(op, torch._ops.OpOverloadPacket):
        for name in op.overloads():
            _SPLIT_OPS.add(getattr(op, name))


def is_split_node(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in _SPLIT_OPS


def _register_builtin_split_ops() -> None:
    import ostinato.attention.op  # noqa: F401  (defines ostinato::attention)
    import ostinato.distributed.comm  # noqa: F401  (defines ostinato::all_reduce, ostinato::all_gather)
    from ostinato.layers.mamba2 import MAMBA_SPLIT_OPS  # defines ostinato::mamba_mixer

    register_split_op(torch.ops.ostinato.attention)
    # tensor parallel: the collectives run eagerly between pieces, as seed 003 splits at the all-reduce
    register_split_op(torch.ops.ostinato.all_reduce)
    register_split_op(torch.ops.ostinato.all_gather)
    for name in MAMBA_SPLIT_OPS:  # "ostinato::mamba_mixer": its state lives in the Mamba pool, outside the graph
        namespace, op = name.split("::")
        register_split_op(getattr(getattr(torch.ops, namespace), op))


_register_builtin_split_ops()

COMPILERS = ("eager", "inductor")


def compile_cache_dir() -> str:
    """Persistent cache of compiled pieces (inductor's FX graph and kernel caches), so a second start-up
    skips codegen: $OSTINATO_CACHE_DIR/torch_compile, default ~/.cache/ostinato/torch_compile."""
    root = os.environ.get("OSTINATO_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ostinato")
    return os.path.join(root, "torch_compile")


def use_compile_cache() -> None:
    """Point inductor at our persistent cache dir (unless the user set one) and keep its FX graph cache on."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", compile_cache_dir())
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    try:
        import torch._inductor.config as inductor_config

        inductor_config.fx_graph_cache = True
    except (ImportError, AttributeError):  # an inductor without the option: its default applies
        pass


@dataclass
class SplitResult:
    module: fx.GraphModule  # top level: calls submod_0, split op, submod_2, ...
    piece_names: list[str]  # the compiled (non-split) submodules, in execution order
    num_split_calls: int
    # per piece: indices of its arguments produced by a split op (fresh tensors each run, copied into
    # static buffers before a replay); every other argument is stable (a parameter, a static input
    # buffer, or an earlier piece's captured output)
    volatile_args: dict[str, list[int]] = field(default_factory=dict)


def split_at_ops(gm: fx.GraphModule) -> SplitResult:
    """Cut `gm` at the split ops: piece k gets id 2k, the k-th split op id 2k+1."""
    part, ids, num_split = 0, {}, 0
    for node in gm.graph.nodes:
        if is_split_node(node):
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
        if any(is_split_node(n) for n in sub.graph.nodes):
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


def compile_piece(piece: fx.GraphModule, example_inputs: list, compiler: str) -> Callable:
    """The piece as traced (`eager`) or compiled by inductor over dynamic token counts (`inductor`)."""
    if compiler == "eager":
        return piece
    if compiler == "inductor":
        # one dynamic-shape compile per piece; identical layers hit inductor's FX graph cache
        return torch.compile(piece, backend="inductor", fullgraph=True, dynamic=True)
    raise ValueError(f"piecewise_cuda_graph_compiler must be one of {COMPILERS}, got {compiler!r}")


class PiecewiseBackend:
    """A `torch.compile(backend=...)` callable. `make_runtime(name, index, num_pieces, runnable, volatile)`
    wraps each compiled piece (the per-token-count capture/replay runtime); the wrapped pieces replace the
    submodules in the split module, which is what dynamo then calls."""

    def __init__(self, compiler: str, make_runtime: Callable[..., Callable]) -> None:
        if compiler not in COMPILERS:
            raise ValueError(f"piecewise_cuda_graph_compiler must be one of {COMPILERS}, got {compiler!r}")
        self.compiler = compiler
        self.make_runtime = make_runtime
        self.splits: list[SplitResult] = []  # one per dynamo compile (a recompile adds one)
        self.compile_seconds = 0.0

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Callable:
        start = time.perf_counter()
        result = split_at_ops(gm)
        n = len(result.piece_names)
        for index, name in enumerate(result.piece_names):
            runnable = compile_piece(getattr(result.module, name), example_inputs, self.compiler)
            # replace the submodule by its runtime: fx calls `self.<name>(*args)`
            result.module.__dict__[name] = self.make_runtime(name, index, n, runnable, result.volatile_args[name])
        self.splits.append(result)
        self.compile_seconds += time.perf_counter() - start
        logger.info("piecewise backend: %d pieces around %d split-op calls (%s)", n, result.num_split_calls,
                    self.compiler)
        return result.module
