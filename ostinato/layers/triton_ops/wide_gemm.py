"""y = x @ W^T at 5-64 rows for wide weights (N > K: qkv, gate_up), W's rows on the MMA's M side.

skinny_gemm.py puts x's rows on the MMA's M side (16 or 32 of them, padded), which on Hopper means the
warp-level mma and W tiles of 16-32 rows, so every program re-reads x from L2 for as many bytes as it reads of
W. Here the product is computed transposed, y^T = W @ x^T: a program owns 64 rows of W (gated: 64 + 64, or
32 + 32 where config_for wants more programs), which fill the M side of the warpgroup MMA (wgmma, M = 64 a
warpgroup), and x^T [K, M_PAD] is the narrow N side. x is then re-read per program for M_PAD / 64 of its W bytes
(M_PAD / 128 gated). This is the tile shape cuBLAS picks for these calls (its 128 x 32 kernels); what the kernel
adds is what cuBLAS cannot do:

- GATED (gate_up): a program owns BLOCK_N gate rows and the BLOCK_N up rows I further on, and applies
  silu(gate) * up before its one store, rounded as silu_and_mul.py rounds (no [M, 2I] round trip, no launch);
- NORM (the deferred post-attention RMSNorm, layers/norm_linear.py): x is the residual row h, the norm's weight
  folded into W; the program sums the squares of x's tiles as it streams them (a second load of each: see the
  kernel) and scales gate and up by each row's inverse RMS, rounded as silu_and_mul(norm=) rounds them;
- PDL (layers/triton_ops/pdl.py): W's first lines go to L2 before the wait (W is no kernel's output), and the
  next kernel may start after the K loop; cuBLAS launches neither way.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ostinato.layers.triton_ops.l2_prefetch import lines_for, prefetch_rows
from ostinato.layers.triton_ops.pdl import enabled as pdl_enabled
from ostinato.layers.triton_ops.silu_and_mul import silu_mul_rounded
from ostinato.layers.triton_ops.skinny_gemm import DTYPES

MIN_M, MAX_M = 5, 64


@triton.jit
def _wide_kernel(
    X, W, Out, M, N, K, stride_xm, stride_wn, stride_om, eps,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    GATED: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr = False, PREFETCH_LINES: tl.constexpr = 0,
):
    # K is a multiple of BLOCK_K (the launcher's rule); W's rows past N are clamped (their outputs are masked),
    # x's rows past M are zero. GATED: the tile's first BLOCK_N rows are gate rows, the next BLOCK_N the up rows
    # N further on, one MMA chain for both
    ROWS: tl.constexpr = 2 * BLOCK_N if GATED else BLOCK_N
    r = tl.arange(0, ROWS)
    offs_n = tl.program_id(0) * BLOCK_N + r % BLOCK_N
    offs_m = tl.arange(0, M_PAD)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    w_rows = tl.minimum(offs_n, N - 1).to(tl.int64) + (r >= BLOCK_N).to(tl.int64) * N
    w_ptrs = W + w_rows[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros((ROWS, M_PAD), dtype=tl.float32)
    ss = tl.zeros((M_PAD,), dtype=tl.float32)
    if PREFETCH_LINES:  # before the wait: W is no kernel's output (l2_prefetch.py)
        prefetch_rows(W, w_rows, stride_wn, K, PREFETCH_LINES)
    if PDL:
        tl.extra.cuda.gdc_wait()
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        x = tl.load(x_ptrs + k, mask=m_mask[:, None], other=0.0)
        acc = tl.dot(tl.load(w_ptrs + k), tl.trans(x), acc)
        if NORM:
            # x's squares from a load of its own: summed from the tile the warpgroup MMA reads (Triton 3.6, sm_90),
            # some rows came out wrong (off by up to 1.4 in 10; H100, 2026-11-26), as from a stage overwritten
            xn = tl.load(x_ptrs + k, mask=m_mask[:, None], other=0.0, cache_modifier=".cg").to(tl.float32)
            ss += tl.sum(xn * xn, 1)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    dtype: tl.constexpr = Out.dtype.element_ty
    if GATED:
        y, up = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_N, M_PAD)), (1, 2, 0)))
        if NORM:  # each projection rounded to the dtype, then scaled and rounded again (silu_and_mul's norm)
            inv_rms = tl.rsqrt(ss / K + eps)[None, :]
            y = (y.to(dtype).to(tl.float32) * inv_rms).to(dtype).to(tl.float32)
            up = (up.to(dtype).to(tl.float32) * inv_rms).to(dtype).to(tl.float32)
        y = silu_mul_rounded(y, up, dtype)
    else:
        y = acc
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_n < N)[:, None] & m_mask[None, :]
    tl.store(Out + offs_m[None, :] * stride_om + offs_n[:, None], y.to(dtype), mask=mask)


class WideConfig(NamedTuple):
    m_pad: int  # x rows in a tile (the MMA's N side): 16, 32 or 64
    block_n: int  # W rows a program (gated: gate rows, as many up rows again)
    block_k: int
    num_warps: int
    num_stages: int


def config_for(m: int, n: int, k: int, gated: bool = False) -> WideConfig:
    """Tiles by shape (no autotuning: a capture must not benchmark) for M rows of x, N outputs (gated: N gate and
    N up rows of W) and K: 64 W rows a program (gated: 64 gate + 64 up), K tiles of 128, 6 stages plain and 4
    gated up to 32 rows of x (a stage is 24 or 48 KB of shared memory with x's second load for the norm: 144-192
    KB a program, one an SM), 4 and 3 at 33-64 rows (32 and 64 KB a stage). Up to 32 rows, the best of 18-19 tile
    settings for every shape and M timed (H100, M = 8 / 16 / 32, Llama-3.2-1B's and Qwen3-0.6B's qkv and gate_up,
    `bench_skinny_gemm.py --wide --sweep`, skinny-wide-sweep-h100-20261126-s18.json), except the gated K = 2048
    one, where 3 stages were 1% faster; at 64 rows the best of the settings that fit for Llama-3.2-1B's gate_up
    (H200). At 33-64 rows a gated W of fewer than 128 programs of 64 rows (Qwen3-0.6B's gate_up: 48, on 132 SMs)
    takes 32 + 32 rows a program and 4 stages: H200, M = 64, 9.90 -> 7.47 us (cuBLAS + silu_and_mul 8.25;
    skinny-wide-sweep-m64-h200-20261126-s18.json). So does it at 5-32 rows, timed in the decode step rather than
    alone (H200, Qwen3-0.6B, `bench_decode.py --models qwen3-0.6b --cases 8:128 16:128 32:256 --modes graph
    --no-launches --iters 100 --gemm-tiles rule "gated:block_n=32" ... rule`,
    decode-tiles-qwen3-h200-20261128-s39.json): ms a step 0.862 / 0.882 / 1.161 -> 0.847 / 0.874 / 1.132. Plain
    rows (qkv) were slower there at 32 a program (0.901 / 0.918 / 1.172; Llama-3.2-1B bs 32 x 256 1.013 -> 1.059)
    and at 128 (0.97x, decode-tiles128-qwen3-h200-20261128-s39.json)."""
    m_pad = max(16, triton.next_power_of_2(m))
    block_k = 128 if k % 128 == 0 else 64
    if gated and triton.cdiv(n, 64) < 128:
        return WideConfig(m_pad, 32, block_k, 4, 4)
    if m_pad > 32:
        return WideConfig(m_pad, 64, block_k, 4, 3 if gated else 4)
    return WideConfig(m_pad, 64, block_k, 4, 4 if gated else 6)


def supports(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> bool:
    """Whether the kernel takes (x, weight): CUDA, 5-64 rows, K a multiple of 64 (no K tail), contiguous rows."""
    n, k = weight.shape
    return (
        x.is_cuda and weight.is_cuda and x.device == weight.device and x.dim() == 2
        and MIN_M <= x.shape[0] <= MAX_M and x.shape[1] == k and k % 64 == 0 and n >= (2 if gated else 1)
        and (not gated or n % 2 == 0) and x.dtype in DTYPES and weight.dtype == x.dtype and x.stride(1) == 1
        and weight.is_contiguous()
    )


def wide_linear(x: torch.Tensor, weight: torch.Tensor, *, gated: bool = False, norm_eps: float | None = None,
                config: WideConfig | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N] in x's dtype (fp32 sums); `gated`: weight is gate_up's [2I, K] and the
    result silu(x @ W[:I]^T) * (x @ W[I:]^T), [M, I]; `norm_eps`: x is the bare residual row of a deferred RMSNorm
    (its weight folded into W) and the gated projections are scaled by each row's inverse RMS first. The caller
    checks `supports` (on the CPU, Triton's interpreter runs it). `config` overrides config_for (for tuning)."""
    if norm_eps is not None and not gated:
        raise ValueError("norm_eps needs gated=True (the deferred post-attention norm before gate_up)")
    (m, k), n = x.shape, weight.shape[0] // (2 if gated else 1)
    if not 1 <= m <= MAX_M:
        raise ValueError(f"x.shape[0] (M = {m}) must be 1-{MAX_M}")
    if k % 64:
        raise ValueError(f"x.shape[1] (K = {k}) must be a multiple of 64")
    if weight.shape[1] != k:
        raise ValueError(f"weight.shape[1] ({weight.shape[1]}) must equal x.shape[1] ({k})")
    if gated and weight.shape[0] % 2:
        raise ValueError(f"weight.shape[0] (2I = {weight.shape[0]}) must be even (gate rows, then as many up rows)")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    cfg = config or config_for(m, n, k, gated)
    if k % cfg.block_k or cfg.m_pad < m:
        raise ValueError(f"config {cfg} does not fit M = {m}, K = {k}")
    pdl = pdl_enabled(x)
    lines = lines_for(cfg.block_k * x.element_size()) if pdl else 0
    _wide_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0), norm_eps or 0.0,
        M_PAD=cfg.m_pad, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, NUM_STAGES=cfg.num_stages, GATED=gated,
        NORM=norm_eps is not None, PDL=pdl, PREFETCH_LINES=lines, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, launch_pdl=pdl,
    )
    return out
