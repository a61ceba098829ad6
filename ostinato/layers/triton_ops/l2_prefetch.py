"""Asking L2 for rows a kernel will read, before its PDL wait (layers/triton_ops/pdl.py).

A kernel launched with PDL may start while the one before it finishes; until its wait returns it may read only
what no kernel still running writes (weights, the KV cache of earlier steps, the step's inputs). A prefetch of
those rows into L2 is fire-and-forget: no registers held, no value changed. So a program's first HBM round trip
overlaps the previous kernel's tail instead of following it. `prefetch.global.L2` is PTX: the callers issue it on
CUDA only (under PDL), never in Triton's interpreter.
"""

import triton
import triton.language as tl


@triton.jit
def prefetch_rows(P, rows, stride_row, row_len, LINES: tl.constexpr):
    """The first LINES 128-byte lines of rows `rows` of P (row r at P + r * stride_row, `row_len` elements;
    lines past a row's end are clamped to its last element) into L2."""
    per_line: tl.constexpr = 128 // (P.dtype.element_ty.primitive_bitwidth // 8)
    cols = tl.minimum(tl.arange(0, LINES) * per_line, row_len - 1)
    ptrs = P + rows[:, None] * stride_row + cols[None, :]
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


def lines_for(row_bytes: int) -> int:
    """128-byte lines covering `row_bytes`, rounded up to a power of two (at least one)."""
    return triton.next_power_of_2(max(1, -(-row_bytes // 128)))
