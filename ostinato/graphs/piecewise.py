"""Piecewise CUDA graphs for extend (prefill) and mixed steps (seed 003).

The model forward is traced once by `torch.compile(fullgraph=True)` with the token dimension dynamic and
split at the split ops (attention; see graphs/compile_backend.py). Each piece between two split ops is
captured once per token count in `sizes` into the process's shared graph pool, largest first; the split
ops run eagerly between the pieces on the real batch's metadata, so any attention backend and any batch
layout (prefixes, many requests, decode tokens mixed with a prefill chunk) runs through the same graphs.

A batch of T tokens is padded to the next captured size P. Padded tokens are id 0 at position 0 writing
their K/V to the sink slot (slot 0) and belong to no request: attention only computes the real tokens'
rows, the pieces are row-wise, and the rows past T are never read (the logits are gathered at each
request's last real token).

Per piece and size a `SizeEntry` holds the captured graph, the static arguments it reads, and its output.
Arguments a split op produced are copied into a static buffer before each replay, unless the op wrote them
at a fixed address already: attention writes its output into the runner's `attn_out` buffer (handed over in
the forward context), which the next piece then reads in place. The other arguments (parameters, the
runner's static input buffers, earlier pieces' outputs) have fixed addresses already.

Rotary and the K/V store (`ostinato::rope_store`) run inside the pieces: they read the positions and the KV
slots from the runner's static buffers. Only the attention itself runs between them, called as the plain
function behind the op (compile_backend's `register_split_op(..., direct=)`).

Weak outputs (CUDA only): a piece's output lives in the graph pool. Holding it would keep that block
reserved forever; holding only a non-owning alias (a tensor over the same pointer built from a storage
without deleter) lets the allocator hand the block to later captures once the forward that captured it has
no more use for it, exactly as it would in eager mode. Replays then run in the same order as the capture,
so each block is written before it is read. The last piece's output (the hidden states the logits are
read from after the forward) is kept strongly. The CPU stand-in keeps every output strongly: its "replay"
re-runs the piece and copies the fresh result into the held output.
"""

import bisect
import dataclasses
import gc
import logging
import time
import types
from dataclasses import dataclass, field

import torch

from ostinato.attention.forward_batch import ForwardBatch, ForwardMode
from ostinato.attention.op import forward_context
from ostinato.graphs.compile_backend import PiecewiseBackend, op_overloads, use_compile_cache
from ostinato.graphs.decode import PAD_SLOT
from ostinato.graphs.graph import Graph, capture_stream
from ostinato.graphs.protocol import GraphHost
from ostinato.layers.mamba2 import SSD_CHUNK
from ostinato.layers.mamba_tables import GRAPH_MAX_REQS, MambaStepTables

logger = logging.getLogger(__name__)


def piecewise_token_sizes(max_tokens: int, sizes: list[int] | None = None) -> list[int]:
    """Ascending token counts to capture: given, or 4, 8, ..., 256 by powers of two then every 256, up to
    and including `max_tokens`."""
    if sizes:
        return sorted({s for s in sizes if 1 <= s <= max_tokens}) or [max_tokens]
    picked = {n for n in (4, 8, 16, 32, 64, 128, 256) if n < max_tokens} | set(range(512, max_tokens, 256))
    return sorted(picked | {max_tokens})


@dataclass
class _RunState:
    """What the piece runtimes do on the current forward: None (no piecewise run: call the piece),
    "warmup" (call the piece), "capture" (capture at `num_tokens`) or "replay"."""

    phase: str | None = None
    num_tokens: int = 0
    stream: "torch.cuda.Stream | None" = None
    # only the first capture of a start-up empties the allocator's caches (as torch.cuda.graph does before each
    # capture); the hundreds after it (pieces x sizes) skip that, and capture() empties them once at the end
    free_memory: bool = True
    graph_seconds: float = 0.0  # time inside Graph.capture (sync, begin, the piece, end and instantiate)
    fixed_storage: int = 0  # data pointer of the storage split ops write into in place (the runner's attn_out)


_state = _RunState()


def non_owning_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over `t`'s memory (same pointer, offset, sizes, strides) whose storage has no deleter: it does
    not keep the memory allocated. Valid only while something else does (here: the graph pool's captures)."""
    storage = torch._C._construct_storage_from_data_pointer(t.untyped_storage().data_ptr(), t.device,
                                                            t.untyped_storage().nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, t.storage_offset(), t.size(), t.stride())


def weak_ref(t: torch.Tensor) -> torch.Tensor:
    """A non-owning alias of a CUDA tensor; `t` itself elsewhere (the CPU stand-in holds outputs strongly)."""
    if t.device.type != "cuda":
        return t
    try:
        return non_owning_alias(t)
    except (AttributeError, RuntimeError, TypeError):  # no such constructor in this torch: hold it strongly
        return t


def _map_tensors(out, fn):
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, (tuple, list)):
        return type(out)(_map_tensors(o, fn) for o in out)
    return out


def _copy_into(dst, src) -> None:
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src, strict=True):
            _copy_into(d, s)


@dataclass
class SizeEntry:
    num_tokens: int
    graph: Graph
    static: dict[int, torch.Tensor]  # the static buffers the graph reads its split-op-produced arguments from
    output: object = None  # weak on CUDA except for the last piece (see the module docstring)


@dataclass
class PieceRuntime:
    """One compiled piece, captured and replayed per token count (the seed's ConcreteSizeEntry)."""

    name: str
    index: int
    num_pieces: int
    runnable: object
    volatile: list[int]  # argument positions produced by split ops, copied into static buffers
    device: torch.device
    entries: dict[int, SizeEntry] = field(default_factory=dict)
    static_bufs: dict[int, torch.Tensor] = field(default_factory=dict)  # per volatile arg, at the largest size

    @property
    def is_last(self) -> bool:
        return self.index == self.num_pieces - 1

    def __call__(self, *args):
        phase = _state.phase
        if phase is None or phase == "warmup":
            return self.runnable(*args)
        entry = self.entries.get(_state.num_tokens)
        if phase == "capture" and entry is None:
            return self._capture(_state.num_tokens, list(args))
        assert entry is not None, f"{self.name}: no graph captured at {_state.num_tokens} tokens"
        for i, static in entry.static.items():
            # an argument at the captured address (same token count, so the same shape) is read in place
            if args[i] is not static and args[i].data_ptr() != static.data_ptr():
                static.copy_(args[i])
        entry.graph.replay()
        return entry.output

    def _static_arg(self, i: int, arg: torch.Tensor, num_tokens: int) -> torch.Tensor:
        buf = self.static_bufs.get(i)
        if (buf is not None and arg.dim() >= 1 and arg.shape[0] == num_tokens and buf.shape[0] >= num_tokens
                and buf.shape[1:] == arg.shape[1:] and buf.dtype == arg.dtype):
            return buf[:num_tokens]
        buf = torch.empty_like(arg, memory_format=torch.contiguous_format)
        if i not in self.static_bufs:
            self.static_bufs[i] = buf  # sizes are captured largest first: smaller ones slice this one
        return buf

    def _capture(self, num_tokens: int, args: list):
        for i in self.volatile:
            if _state.fixed_storage and args[i].untyped_storage().data_ptr() == _state.fixed_storage:
                continue  # written at a fixed address by its split op: the static argument is the tensor itself
            static = self._static_arg(i, args[i], num_tokens)
            static.copy_(args[i])
            args[i] = static
        # only the static buffers (and views of the fixed buffer) are kept: the other arguments are parameters, the
        # runner's inputs, or earlier pieces' outputs, which must stay weak (on CUDA the graph itself keeps nothing
        # of `run`)
        entry = SizeEntry(num_tokens, Graph(self.device), {i: args[i] for i in self.volatile})

        def run() -> None:
            out = self.runnable(*args)
            if entry.output is None:
                entry.output = out
            else:  # CPU stand-in replay: a fresh result, into the tensors handed out at capture
                _copy_into(entry.output, out)

        t = time.perf_counter()
        entry.graph.capture(run, _state.stream, free_memory=_state.free_memory)
        _state.graph_seconds += time.perf_counter() - t
        _state.free_memory = False
        out = entry.output
        if not self.is_last:  # the forward being captured still holds `out` strongly until its last use
            entry.output = _map_tensors(out, weak_ref)
        self.entries[num_tokens] = entry
        return out


class PiecewiseGraphRunner:
    def __init__(self, runner: GraphHost, max_tokens: int, sizes: list[int] | None = None,
                 compiler: str = "eager", capture_mixer: bool | None = None) -> None:
        """`capture_mixer` (hybrid models): the Mamba mixer inside the pieces (default with eager pieces) or a
        split op between them."""
        self.runner = runner
        self.device = runner.device
        self.sizes = piecewise_token_sizes(max_tokens, sizes)
        self.max_tokens = self.sizes[-1]
        self.compiler = compiler
        n, dev = self.max_tokens, self.device
        self.tokens = torch.zeros(3, n, dtype=torch.int64, device=dev)  # input ids, positions, KV slots
        self.input_ids, self.positions, self.out_cache_loc = self.tokens
        self.token_pad = torch.tensor([0, 0, PAD_SLOT], dtype=torch.int64, device=dev)[:, None]
        self.pieces: list[PieceRuntime] = []
        self.cache_dir = use_compile_cache() if compiler == "inductor" else None
        # hybrid models: with eager pieces the Mamba mixer is captured inside them, reading the step's layout
        # from tables at fixed addresses (one piece per attention layer, not per layer); inductor pieces keep it
        # a split op between them (functionalizing its in-place state updates would copy the pool's state)
        self.mamba_tables: MambaStepTables | None = None
        captured = frozenset()
        if runner.mamba_pool is not None and (compiler == "eager" if capture_mixer is None else capture_mixer):
            max_reqs = min(runner.max_running_requests, GRAPH_MAX_REQS) + 1  # + the padding request
            self.mamba_tables = MambaStepTables(self.max_tokens, max_reqs, SSD_CHUNK, dev)
            captured = op_overloads(torch.ops.ostinato.mamba_mixer)
        self.backend = PiecewiseBackend(compiler, self._make_runtime, captured)
        model = runner.model

        def piecewise_forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return model(input_ids, positions)

        # a code object of its own: dynamo caches compiled code per code object, so this runner's entries
        # neither collide with another runner's nor count towards their recompile limit
        fn = types.FunctionType(piecewise_forward.__code__.replace(), piecewise_forward.__globals__,
                                closure=piecewise_forward.__closure__)
        self.forward_fn = torch.compile(fn, backend=self.backend, fullgraph=True)
        self.trace_seconds = 0.0  # the first forward until dynamo hands its graph over (the dynamo trace)
        self.compile_seconds = 0.0  # in our backend: the split and the compile of every distinct piece
        self.capture_seconds = 0.0  # the rest: warm-ups (the first run included) and captures at every size
        self.num_graphs = 0
        self.graph_memory_bytes = 0
        # every attention layer writes its [T, H*D] output here (when all have the same width); see _RunState
        widths = {spec.num_heads * spec.head_dim for spec in model.attention_specs.values()}
        self.attn_out = torch.empty(n, widths.pop(), dtype=runner.dtype, device=dev) if len(widths) == 1 else None
        self.capture()

    def _make_runtime(self, name: str, index: int, num_pieces: int, runnable, volatile: list[int]) -> PieceRuntime:
        piece = PieceRuntime(name, index, num_pieces, runnable, volatile, self.device)
        self.pieces.append(piece)
        return piece

    @property
    def num_pieces(self) -> int:
        return len(self.backend.splits[0].piece_names) if self.backend.splits else 0

    def _static_batch(self, batch: ForwardBatch, padded: int) -> ForwardBatch:
        return dataclasses.replace(batch, input_ids=self.input_ids[:padded], positions=self.positions[:padded],
                                   out_cache_loc=self.out_cache_loc[:padded], decode_ints=None)

    def _dummy_batch(self, num_tokens: int) -> ForwardBatch:
        """Capture input: padding tokens in requests of at most a request row's width, all on row 0."""
        width = self.runner.req_to_token_pool.req_to_token.shape[1] - 1
        lens = [min(width, num_tokens - s) for s in range(0, num_tokens, width)]
        bs, dev = len(lens), self.device
        seq = torch.tensor(lens, dtype=torch.int64, device=dev)
        hybrid = self.runner.mamba_pool is not None  # the padding's Mamba state: the sink slot (0, as PAD_SLOT)
        return ForwardBatch(ForwardMode.EXTEND, bs, self.input_ids[:num_tokens], self.positions[:num_tokens],
                            torch.zeros(bs, dtype=torch.int64, device=dev), seq, self.out_cache_loc[:num_tokens],
                            torch.cumsum(seq, 0) - 1, lens, [0] * bs, lens,
                            mamba_slots=torch.full((bs,), PAD_SLOT, device=dev) if hybrid else None)

    def _run(self, batch: ForwardBatch, phase: str | None, num_tokens: int) -> torch.Tensor:
        backend = self.runner.backend
        if self.mamba_tables is not None:  # outside any capture: the step's layout, before its kernels run
            self.mamba_tables.fill(batch.extend_seq_lens_cpu, batch.mamba_slots, num_tokens)
            batch = dataclasses.replace(batch, mamba_tables=self.mamba_tables)
        _state.phase, _state.num_tokens = phase, num_tokens
        out = self.attn_out
        _state.fixed_storage = 0 if out is None else out.untyped_storage().data_ptr()
        try:
            with forward_context(backend, batch, self.runner.model.attention_specs, out):
                backend.init_forward_metadata(batch)
                return self.forward_fn(batch.input_ids, batch.positions)
        finally:
            _state.phase, _state.num_tokens, _state.fixed_storage = None, 0, 0

    @torch.inference_mode()
    def capture(self) -> None:
        cuda = self.device.type == "cuda"
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0] if cuda else 0
        keep_gc = self.runner.args.enable_cudagraph_gc
        gc_was_enabled = gc.isenabled()
        if not keep_gc:
            gc.collect()
            gc.freeze()
            gc.disable()
        _state.stream = capture_stream(self.device) if cuda else None
        _state.free_memory = True
        _state.graph_seconds = 0.0
        first_run = True
        warmup_seconds = first_seconds = 0.0
        try:
            self.tokens[:] = self.token_pad
            for size in reversed(self.sizes):
                batch = self._dummy_batch(size)
                torch._dynamo.mark_dynamic(batch.input_ids, 0)
                torch._dynamo.mark_dynamic(batch.positions, 0)
                # the first (largest) size twice: the compile, lazy inits and the allocator's first blocks; every
                # later size once, which is all a capture needs (its kernels are built, their workspaces exist)
                for _ in range(2 if cuda and first_run else 1):
                    t = time.perf_counter()
                    self._run(batch, "warmup", size)
                    if cuda:
                        torch.cuda.synchronize(self.device)
                    if first_run:  # the dynamo trace, up to the call of our backend (split, compile)
                        self.trace_seconds, first_run = (self.backend.first_call_at or t) - t, False
                        first_seconds = time.perf_counter() - t
                    else:
                        warmup_seconds += time.perf_counter() - t
                self._run(batch, "capture", size)
        finally:
            _state.stream, _state.free_memory = None, True
            if not keep_gc:
                gc.unfreeze()
                if gc_was_enabled:
                    gc.enable()
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # the warm-ups' cached blocks (captures after the first no longer free them)
            self.graph_memory_bytes = max(0, free_before - torch.cuda.mem_get_info(self.device)[0])
        self.compile_seconds = self.backend.compile_seconds
        self.capture_seconds = time.perf_counter() - start - self.trace_seconds - self.compile_seconds
        # where capture_seconds goes: the first run past the compile (lazy inits, kernel JIT), the other
        # warm-up runs, and the graph captures themselves (the rest: the capture passes' eager attention)
        self.capture_split = {"first_run_s": max(0.0, first_seconds - self.trace_seconds - self.compile_seconds),
                              "warmup_s": warmup_seconds, "graphs_s": _state.graph_seconds}
        self.num_graphs = sum(len(p.entries) for p in self.pieces)
        if len(self.backend.splits) > 1:
            logger.warning("piecewise graphs: dynamo traced the forward %d times (something branches on the token "
                           "count); each trace costs start-up time", len(self.backend.splits))
        logger.info("piecewise graphs (%s pieces): %d pieces (%d compiled) at %s tokens; dynamo trace %.1f s, "
                    "compile %.1f s, capture %.1f s (%d graphs: first run %.1f s, warm-ups %.1f s, graph capture "
                    "%.1f s), graph memory %.2f GiB%s", self.compiler, self.num_pieces, self.backend.num_compiled,
                    self.sizes, self.trace_seconds, self.compile_seconds, self.capture_seconds, self.num_graphs,
                    self.capture_split["first_run_s"], self.capture_split["warmup_s"],
                    self.capture_split["graphs_s"], self.graph_memory_bytes / 2**30,
                    f"; compile cache {self.cache_dir}" if self.cache_dir else "")

    def can_run(self, batch: ForwardBatch) -> bool:
        """Extend steps (mixed ones included: decode tokens are 1-token extends) within the captured range (and,
        with the Mamba mixer captured, with room for the padding request in its tables)."""
        fits = self.mamba_tables is None or batch.batch_size < self.mamba_tables.max_reqs
        return batch.mode is ForwardMode.EXTEND and batch.num_tokens <= self.max_tokens and fits

    def padded_size(self, num_tokens: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, num_tokens)]

    def forward_hidden(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [T, hidden] of the batch's tokens, a view of the last piece's static output."""
        t = batch.num_tokens
        padded = self.padded_size(t)
        self.input_ids[:t] = batch.input_ids
        self.positions[:t] = batch.positions
        self.out_cache_loc[:t] = batch.out_cache_loc
        self.tokens[:, t:padded] = self.token_pad
        return self._run(self._static_batch(batch, padded), "replay", padded)[:t]

    @torch.inference_mode()
    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [bs, vocab] (float32) at each request's last token."""
        hidden = self.forward_hidden(batch)
        return self.runner.model.compute_logits(hidden[batch.logits_indices])
