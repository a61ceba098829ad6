"""Pulling the next weight into L2 while a decode GEMV streams its own (#16).

At one decode row a weight GEMV of a few MB is about one round trip to HBM: its programs issue their loads, wait
for them, and finish, and HBM idles through the tail and through the attention and norm kernels between two GEMVs.
Here a skinny GEMV (`skinny_gemm.py`) first asks L2 for a slice of the weight the decode step reads next, before
its own PDL wait, and moves on: the prefetch is fire-and-forget (no registers, no shared memory), so HBM keeps
pulling bytes through those gaps and the next GEMV finds its first bytes on chip.

`prefetch_share` splits the next weight's 128-byte lines evenly over the grid in program order. Its modes:
- BULK: thread 0 of each program issues one `cp.async.bulk.prefetch.L2` (sm_90) for its whole slice;
- LINES: every thread issues `prefetch.global.L2` for lines of the slice.
The instructions are PTX, which Triton's interpreter cannot run; on the CPU the partition itself is what is
tested (`share`, `tests/test_l2_prefetch.py`), and a prefetch never changes a value.

Which weight is next is the decode step's own order: `record()` notes the weights the skinny kernels are given
during one eager step, and `link()` points each at the one after it.
"""

import contextlib
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

NONE, BULK, LINES = 0, 1, 2
LINE_BYTES = 128


@triton.jit
def share(lines, pid, num_programs):
    """(first line, line count) of program `pid`'s slice of `lines` lines: equal slices in program order, the
    last ones shorter or empty."""
    per = tl.cdiv(lines, num_programs)
    first = pid * per
    return first, tl.maximum(tl.minimum(per, lines - first), 0)


@triton.jit
def _bulk_prefetch(ptr, nbytes):
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0;"
        " @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptr, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _line_prefetch(ptrs):
    return tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def prefetch_share(P, numel, MODE: tl.constexpr):
    """This program's slice of P[:numel] into L2 (numel covers whole 128-byte lines: `link` rounds it down)."""
    per_line: tl.constexpr = 128 // (P.dtype.element_ty.primitive_bitwidth // 8)
    first, count = share(numel // per_line, tl.program_id(0), tl.num_programs(0))
    if count > 0:
        if MODE == 1:
            _bulk_prefetch(P + first.to(tl.int64) * per_line, (count * 128).to(tl.int32))
        else:
            offs = tl.arange(0, 512)
            for c in range(0, count, 512):
                line = first + c + tl.where(offs < count - c, offs, 0)
                _line_prefetch(P + line.to(tl.int64) * per_line)


# ------------------------------------------------------------------ the decode step's order of weights
_recording: list[torch.Tensor] | None = None
_next: dict[int, tuple[torch.Tensor, int]] = {}  # weight.data_ptr() -> (the next weight, elements to prefetch)
MODE = BULK
MAX_M = 16  # decode rows up to which a GEMV prefetches


def note(weight: torch.Tensor) -> None:
    """Called by the skinny kernels' launch with each weight it streams, while `record()` is on."""
    if _recording is not None and (not _recording or _recording[-1].data_ptr() != weight.data_ptr()):
        _recording.append(weight)


@contextlib.contextmanager
def record() -> Iterator[list[torch.Tensor]]:
    """The weights the skinny kernels stream inside the block, in launch order."""
    global _recording
    _recording = weights = []
    try:
        yield weights
    finally:
        _recording = None


@contextlib.contextmanager
def linked(weights: list[torch.Tensor], max_bytes: int) -> Iterator[int]:
    """Inside the block (a graph capture: the kernels' arguments are fixed there), each weight's GEMV prefetches
    the first min(max_bytes, its size) bytes, whole lines, of the weight after it; the last none. Yields the links
    made. Nothing stays linked after the block, so no weight is kept alive or prefetched by a later engine."""
    _next.clear()
    for cur, nxt in zip(weights[:-1], weights[1:], strict=True):
        nbytes = min(max_bytes, nxt.numel() * nxt.element_size()) // LINE_BYTES * LINE_BYTES
        if nbytes and nxt.data_ptr() % 16 == 0 and nxt.is_contiguous():
            _next[cur.data_ptr()] = (nxt, nbytes // nxt.element_size())
    try:
        yield len(_next)
    finally:
        _next.clear()


def next_for(weight: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """(the weight to prefetch, its elements) after `weight` while linked, or None."""
    return _next.get(weight.data_ptr()) if _next else None
