"""Greedy decoding's argmax over a logits row, in two Triton launches with fixed grids: per (row, chunk of
BLOCK columns) the chunk's maximum and its first index, then per row the first chunk holding the row's maximum.
`draw_rows` is the same two launches with each sampled row's Gumbel noise added in the first (the fused sampler's
plain draw, bit for bit), so a decode graph draws a temperature-only step where it took the argmax.
torch's reduction ran one thread block per row (33 us for one 128k row on an H200), and its chunked form
(`layers/sampling_ops.chunked_argmax` on the CPU, the twin) took three kernels and 14 us of a decode step.
Ties go to the lowest index, as torch.argmax's do."""

import torch
import triton
import triton.language as tl

from ostinato.layers.triton_ops.gumbel import gumbel_perturbed, row_key


@triton.jit
def _chunk_best_kernel(x_ptr, stride_x, n_cols, vals_ptr, idx_ptr, n_chunks, temps_ptr, seeds_ptr, steps_ptr,
                       greedy_eps, BLOCK: tl.constexpr, DRAW: tl.constexpr):
    """Per (row, chunk): the chunk's maximum and its first index. DRAW: of x / temperature + Gumbel noise for a row
    whose temperature is >= greedy_eps (a greedy row's program skips the noise, and the seed and step loads)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + offs, mask=offs < n_cols, other=float("-inf")).to(tl.float32)
    if DRAW:
        temp = tl.load(temps_ptr + row)
        if temp >= greedy_eps:
            x = gumbel_perturbed(x / temp, offs, row_key(seeds_ptr, steps_ptr, row))
    m, i = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(vals_ptr + row * n_chunks + c, m)
    tl.store(idx_ptr + row * n_chunks + c, c * BLOCK + i)


@triton.jit
def _rows_argmax_kernel(vals_ptr, idx_ptr, n_chunks, out_ptr, dest_ptr, index_ptr, BLOCK_C: tl.constexpr,
                        SCATTER: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    v = tl.load(vals_ptr + row * n_chunks + offs, mask=offs < n_chunks, other=float("-inf"))
    _, j = tl.max(v, axis=0, return_indices=True, return_indices_tie_break_left=True)
    best = tl.load(idx_ptr + row * n_chunks + j).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row, best)
    if SCATTER:
        tl.store(dest_ptr + tl.load(index_ptr + row), best)


def argmax_rows(x: torch.Tensor, out: torch.Tensor | None = None, block: int = 2048,
                scatter: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """argmax over the last dim of x [B, V] (float, unit column stride; rows may be strided) -> int64 [B], into
    `out` when given; with `scatter` = (dest, index) also dest[index[b]] = the argmax of row b."""
    out = torch.empty(x.shape[0], dtype=torch.int64, device=x.device) if out is None else out
    return _best_rows(x, None, out, block, scatter)


def draw_rows(x: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
              greedy_eps: float, out: torch.Tensor, block: int = 2048,
              scatter: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Row b's token into out[b] (int64 [B]): the argmax of x[b] where temperatures[b] < greedy_eps, else the
    Gumbel-max draw from x[b] / temperatures[b] with the noise of (seeds[b], steps[b]); x float32 [B, V] with unit
    column stride (columns of -inf are never drawn). With `scatter` = (dest, index) also dest[index[b]] = out[b]."""
    assert x.dtype == torch.float32
    return _best_rows(x, (temperatures, seeds, steps, greedy_eps), out, block, scatter)


def _best_rows(x: torch.Tensor, draw: tuple | None, out: torch.Tensor, block: int,
               scatter: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """The two launches: per (row, chunk) the best (drawn with `draw` = (temperatures, seeds, steps, greedy_eps),
    else the maximum), then per row the first chunk holding the row's best."""
    b, n = x.shape
    assert x.stride(-1) == 1
    chunks = triton.cdiv(n, block)
    vals = torch.empty(b, chunks, dtype=torch.float32, device=x.device)
    idx = torch.empty(b, chunks, dtype=torch.int32, device=x.device)
    if b:
        temps, seeds, steps, eps = draw if draw is not None else (x, x, x, 0.0)  # (unread without DRAW)
        _chunk_best_kernel[(b, chunks)](x, x.stride(0), n, vals, idx, chunks, temps, seeds, steps, eps, BLOCK=block,
                                        DRAW=draw is not None, num_warps=4)
    return pick_rows(vals, idx, out, scatter)


def pick_rows(vals: torch.Tensor, idx: torch.Tensor, out: torch.Tensor,
              scatter: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """out[b] = idx[b, j] at the first j holding the maximum of vals[b] (vals [B, S] float32 and idx [B, S],
    contiguous), in one launch; with `scatter` = (dest, index) also dest[index[b]] = out[b]."""
    b, s = vals.shape
    assert vals.is_contiguous() and idx.is_contiguous() and idx.shape == vals.shape
    dest, index = scatter if scatter is not None else (out, out)
    if b:
        _rows_argmax_kernel[(b,)](vals, idx, s, out, dest, index, BLOCK_C=triton.next_power_of_2(s),
                                  SCATTER=scatter is not None, num_warps=1)
    return out
