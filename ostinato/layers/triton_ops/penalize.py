"""A step's penalties applied to its logits in one Triton launch (`layers/sampling_ops.penalize`, whose torch ops
are the CPU twin): per (row, block of columns) the logits, the row's output counts and prompt marks read straight
from the penalty state by request slot, one fp32 write. The torch form gathered the state's rows first and ran
about ten elementwise passes over [B, V]."""

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _penalize_kernel(logits_ptr, stride_l, out_ptr, counts_ptr, marks_ptr, rows_ptr, freq_ptr, pres_ptr, rep_ptr,
                     vocab, HAS_REP: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < vocab
    row = tl.load(rows_ptr + b).to(tl.int64)
    x = tl.load(logits_ptr + b * stride_l + offs, mask=inside, other=0.0).to(tl.float32)
    count = tl.load(counts_ptr + row * vocab + offs, mask=inside, other=0).to(tl.float32)
    if HAS_REP:
        rep = tl.load(rep_ptr + b)
        seen = (count > 0) | (tl.load(marks_ptr + row * vocab + offs, mask=inside, other=0) != 0)
        x = tl.where(seen, tl.where(x > 0, x / rep, x * rep), x)
    x = x - tl.load(freq_ptr + b) * count
    x = x - tl.load(pres_ptr + b) * tl.where(count > 0, 1.0, 0.0)
    tl.store(out_ptr + b * vocab + offs, x, mask=inside)


def penalize_rows(logits: torch.Tensor, counts: torch.Tensor, rows: torch.Tensor, frequency: torch.Tensor,
                  presence: torch.Tensor, repetition: torch.Tensor | None,
                  in_prompt: torch.Tensor | None) -> torch.Tensor:
    """`sampling_ops.penalize` in one launch (any device Triton runs on, its CPU interpreter too)."""
    b, vocab = logits.shape
    assert counts.shape[1] == vocab and counts.is_contiguous() and logits.stride(1) == 1
    out = torch.empty(b, vocab, dtype=torch.float32, device=logits.device)
    if b == 0:
        return out
    has_rep = repetition is not None
    _penalize_kernel[(b, triton.cdiv(vocab, BLOCK))](
        logits, logits.stride(0), out, counts, in_prompt if has_rep else counts, rows, frequency, presence,
        repetition if has_rep else frequency, vocab, HAS_REP=has_rep, BLOCK=BLOCK, num_warps=8)
    return out


def warm_up(vocab_size: int, row_strides: list[int], device: torch.device) -> None:
    """Compile the variants an engine launches (fp32 logits rows `row_strides` apart: a decode graph's padded buffer,
    a contiguous [B, V]; with and without a repetition penalty), so that the first penalized request does not hold
    up the running ones for a compile."""
    counts = torch.zeros(1, vocab_size, dtype=torch.int32, device=device)
    marks = torch.zeros(1, vocab_size, dtype=torch.bool, device=device)
    rows = torch.zeros(1, dtype=torch.int64, device=device)
    zero = torch.zeros(1, device=device)
    for stride in sorted(set(row_strides)):
        logits = torch.zeros(1, stride, device=device)[:, :vocab_size]
        penalize_rows(logits, counts, rows, zero, zero, None, None)
        penalize_rows(logits, counts, rows, zero, zero, zero + 1, marks)
