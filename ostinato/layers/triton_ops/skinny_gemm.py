"""y = x @ W^T at decode batch sizes (M <= 32), W an nn.Linear weight [N, K]: a weight-streaming kernel.

At M <= 32 the layer is a read of W, so what counts is keeping HBM busy. cuBLAS tiles for large M: at M = 1
it launches a few dozen CTAs, or splits K into a second reduce kernel. Here each program owns BLOCK_N rows
of W across all of K, so no program needs another's result: one launch, a grid fixed by the shapes, no
workspace, no atomics, the same bits on every call. K tiles stream through a cp.async ring in shared memory,
so a program keeps num_stages - 1 tiles of W in flight. M picks the inner product:

- M <= 4: CUDA-core FMAs into an fp32 [M_PAD, BLOCK_N, BLOCK_K] accumulator (32-64 registers a thread),
  summed over K once after the loop. BLOCK_N can go down to 4, so N = 2048 still gives 512 programs.
- M > 4: tl.dot on the tensor cores (at M = 16 the FMAs would take about as long as the load), x padded to
  16 rows (32 past 16). Its tiles are >= 16 a side, so N = 2048 gives 128 programs.

Split-K would give more programs at small N (Qwen3-0.6B's o / down, N = 1024, get 64 at M > 4). Built once
(af4f44c: a persistent workspace, an arrival count per N tile, the last program summing the partials in split
order) and slower at every o / down shape of Llama-3.2-1B and Qwen3-0.6B at M = 8, 16 and 32, by 6-26% at the
best of 70 split / tile / stage settings (H100, `bench_skinny_gemm.py --split-sweep` at that commit,
benchmarks/results/skinny-split-sweep-h100-20261126-s17.json): a program's time here is mostly latency, and the
arrival count and the partials' round trip add to it.

skinny_gate_up_silu is the MLP's gate_up projection with its activation: W the fused [2I, K] weight, out
silu(x @ W[:I]^T) * (x @ W[I:]^T), [M, I]. Both kernels take it under the constexpr GATED: a program owns
BLOCK_N gate rows and the BLOCK_N up rows I further on, accumulates both from the same x tile, and applies
silu_and_mul's rounding (gate and up rounded to the dtype, silu rounded, product rounded) before its one
store: the bits of silu_and_mul(skinny_linear(x, W)) without the [M, 2I] round trip or the second launch.

skinny_norm_linear puts the RMSNorm before the layer (and the residual add before that) into the FMA kernel,
under the constexpr PRENORM, for M <= 2: each program adds the residual to its x tiles, sums their squares as
they stream (it walks all of K anyway) and scales its fp32 sums by the inverse RMS after the loop; program 0
writes x + residual out. The norm's weight is folded into W beforehand (layers/norm_linear.py).
"""

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ostinato.layers.triton_ops import resident_gemv
from ostinato.layers.triton_ops.l2_prefetch import lines_for, prefetch_rows
from ostinato.layers.triton_ops.pdl import enabled as pdl_enabled
from ostinato.layers.triton_ops.silu_and_mul import silu_mul_rounded

MAX_M = 32
DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _add_after(y, Add, stride_am, offs_m, offs_n, mask, dtype: tl.constexpr, HAS_ADD: tl.constexpr):
    """With HAS_ADD, y (fp32 sums) rounded to the dtype, plus Add's [M, N] tile, in fp32 (the caller rounds the
    sum): torch's `linear(x, W) + add` in the dtype, the residual add after a projection as HF rounds it."""
    if HAS_ADD:
        a = tl.load(Add + offs_m[:, None] * stride_am + offs_n[None, :], mask=mask, other=0.0)
        y = y.to(dtype).to(tl.float32) + a.to(tl.float32)
    return y


@triton.jit
def _prenorm_tile(x, r_ptrs, ro_ptrs, mask, ss, store, HAS_RES: tl.constexpr):
    """One K tile of the pre-norm: x (plus the residual, rounded to x's dtype as HF adds residuals, and stored
    where `store`) -> (the fp32 row, the sums of squares so far)."""
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(ro_ptrs, x, mask=mask & store)
    x = x.to(tl.float32)
    return x, ss + x * x


@triton.jit
def _prefetch_w(W, w_rows, stride_wn, N, K, LINES: tl.constexpr, GATED: tl.constexpr):
    """Before the PDL wait (W is no kernel's output): the first LINES lines of the program's W rows (and GATED's up
    rows N further on) into L2 (l2_prefetch.py); nothing where LINES is 0."""
    if LINES:
        prefetch_rows(W, w_rows, stride_wn, K, LINES)
        if GATED:
            prefetch_rows(W, w_rows + N, stride_wn, K, LINES)


@triton.jit
def _skinny_fma_kernel(
    X, W, Out, M, N, K, stride_xm, stride_wn, stride_om,
    R, R_out, stride_rm, stride_rom, eps,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    GATED: tl.constexpr, PRENORM: tl.constexpr = False, HAS_RES: tl.constexpr = False, PDL: tl.constexpr = False,
    Add=None, stride_am=0, HAS_ADD: tl.constexpr = False, PREFETCH_LINES: tl.constexpr = 0,
):
    offs_m = tl.arange(0, M_PAD)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)[None, None, :]
    # x rows past M are masked (not fetched); W rows past N re-read row N - 1 (unpredicated loads) and are
    # never stored. GATED: N is the output width I, W rows n (gate) and I + n (up) make output column n
    m_mask = (offs_m < M)[:, None, None]
    x_ptrs = X + offs_m[:, None, None] * stride_xm + offs_k
    w_rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    rows = w_rows[None, :, None]
    w_ptrs = W + rows * stride_wn + offs_k
    u_ptrs = W + (rows + N) * stride_wn + offs_k
    acc = tl.zeros((M_PAD, BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((M_PAD, BLOCK_N, BLOCK_K), dtype=tl.float32)
    # PRENORM: x is rms_norm(x + R), applied on the fly (the norm's weight is folded into W). Every program walks
    # all of K, so each sums the row's squares itself and scales its sums by the inverse RMS after the loop (fp32
    # throughout: no rounding of the normalised row); program 0 alone writes x + R to R_out
    r_ptrs = R + offs_m[:, None, None] * stride_rm + offs_k
    ro_ptrs = R_out + offs_m[:, None, None] * stride_rom + offs_k
    ss = tl.zeros((M_PAD, 1, BLOCK_K), dtype=tl.float32)
    store = (offs_m * 0 + tl.program_id(0) == 0)[:, None, None]  # a tensor: the interpreter masks with no scalar
    k_full = K - K % BLOCK_K
    _prefetch_w(W, w_rows, stride_wn, N, K, PREFETCH_LINES, GATED)
    if PDL:  # layers/triton_ops/pdl.py: x is the previous kernel's output
        tl.extra.cuda.gdc_wait()
    for k in tl.range(0, k_full, BLOCK_K, num_stages=NUM_STAGES):
        x = tl.load(x_ptrs + k, mask=m_mask, other=0.0)
        if PRENORM:
            x, ss = _prenorm_tile(x, r_ptrs + k, ro_ptrs + k, m_mask, ss, store, HAS_RES)
        else:
            x = x.to(tl.float32)
        acc += x * tl.load(w_ptrs + k).to(tl.float32)
        if GATED:
            acc_u += x * tl.load(u_ptrs + k).to(tl.float32)
    if k_full < K:
        k_mask = offs_k < K - k_full
        x = tl.load(x_ptrs + k_full, mask=m_mask & k_mask, other=0.0)
        if PRENORM:
            x, ss = _prenorm_tile(x, r_ptrs + k_full, ro_ptrs + k_full, m_mask & k_mask, ss, store, HAS_RES)
        else:
            x = x.to(tl.float32)
        acc += x * tl.load(w_ptrs + k_full, mask=k_mask, other=0.0).to(tl.float32)
        if GATED:
            acc_u += x * tl.load(u_ptrs + k_full, mask=k_mask, other=0.0).to(tl.float32)
    if PDL:  # the next kernel's programs only once this one's loads are done (pdl.py: the GEMV exception)
        tl.extra.cuda.gdc_launch_dependents()
    y = tl.sum(acc, axis=2)
    if PRENORM:
        inv_rms = tl.rsqrt(tl.sum(ss, axis=2) / K + eps)  # [M_PAD, 1]
        y *= inv_rms
    if GATED:
        u = tl.sum(acc_u, axis=2)
        if PRENORM:
            u *= inv_rms
        y = silu_mul_rounded(y, u, Out.dtype.element_ty)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    y = _add_after(y, Add, stride_am, offs_m, offs_n, mask, Out.dtype.element_ty, HAS_ADD)
    tl.store(Out + offs_m[:, None] * stride_om + offs_n[None, :], y.to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _skinny_dot_kernel(
    X, W, Out, M, N, K, stride_xm, stride_wn, stride_om,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    K_SPLIT: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr = False,
    Add=None, stride_am=0, HAS_ADD: tl.constexpr = False, PREFETCH_LINES: tl.constexpr = 0,
):
    # a K tile is K_SPLIT batches of a batched tl.dot, one a warp: independent accumulator chains instead of
    # one chain of BLOCK_K / 16 dependent MMAs, summed after the loop
    SUB_K: tl.constexpr = BLOCK_K // K_SPLIT
    offs_m = tl.arange(0, M_PAD)[None, :, None]
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = (tl.arange(0, K_SPLIT) * SUB_K)[:, None, None] + tl.arange(0, SUB_K)[None, None, :]
    # rows as in the FMA kernel: x's past M masked, W's past N clamped, GATED's up rows N further on
    m_mask = offs_m < M
    x_ptrs = X + offs_m * stride_xm + offs_k  # [K_SPLIT, M_PAD, SUB_K]
    w_rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    rows = w_rows[None, :, None]
    w_ptrs = W + rows * stride_wn + offs_k  # [.., BLOCK_N, ..]
    u_ptrs = W + (rows + N) * stride_wn + offs_k
    acc = tl.zeros((K_SPLIT, M_PAD, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((K_SPLIT, M_PAD, BLOCK_N), dtype=tl.float32)
    k_full = K - K % BLOCK_K
    _prefetch_w(W, w_rows, stride_wn, N, K, PREFETCH_LINES, GATED)
    if PDL:
        tl.extra.cuda.gdc_wait()
    for k in tl.range(0, k_full, BLOCK_K, num_stages=NUM_STAGES):
        x = tl.load(x_ptrs + k, mask=m_mask, other=0.0)
        acc = tl.dot(x, tl.trans(tl.load(w_ptrs + k), (0, 2, 1)), acc)
        if GATED:
            acc_u = tl.dot(x, tl.trans(tl.load(u_ptrs + k), (0, 2, 1)), acc_u)
    if k_full < K:
        k_mask = offs_k < K - k_full
        x = tl.load(x_ptrs + k_full, mask=m_mask & k_mask, other=0.0)
        acc = tl.dot(x, tl.trans(tl.load(w_ptrs + k_full, mask=k_mask, other=0.0), (0, 2, 1)), acc)
        if GATED:
            acc_u = tl.dot(x, tl.trans(tl.load(u_ptrs + k_full, mask=k_mask, other=0.0), (0, 2, 1)), acc_u)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    y = tl.sum(acc, axis=0)
    if GATED:
        y = silu_mul_rounded(y, tl.sum(acc_u, axis=0), Out.dtype.element_ty)
    offs_m = tl.arange(0, M_PAD)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    y = _add_after(y, Add, stride_am, offs_m, offs_n, mask, Out.dtype.element_ty, HAS_ADD)
    tl.store(Out + offs_m[:, None] * stride_om + offs_n[None, :], y.to(Out.dtype.element_ty), mask=mask)


class SkinnyConfig(NamedTuple):
    m_pad: int  # x rows in a tile: next power of 2 >= M, 16 or 32 for tl.dot
    block_n: int
    block_k: int
    use_dot: bool
    num_warps: int
    num_stages: int  # K tiles in flight per program: num_stages - 1 (cp.async ring in shared memory)


def config_for(m: int, n: int, k: int, num_sms: int = 132, gated: bool = False) -> SkinnyConfig:
    """Tiles for x [m, k] @ W [n, k]^T, a rule of the shapes (no autotuning: a capture must not benchmark).
    Set for H100 and 2-byte dtypes from bytes in flight and occupancy, not from timings of these tiles.

    The grid aims at one wave: every program resident from the start (so all of them have loads in flight)
    and none left for a tail with the SMs half idle. x is re-read from L2 by every program, m / block_n of
    the W bytes, so block_n >= 2 * m_pad.

    gated: tiles for skinny_gate_up_silu, n the output width I (W [2n, k]). A program reads 2 * block_n rows
    of W into two accumulators of block_n, which costs what one of 2 * block_n costs: the rule is the one
    for W's rows (tile = W rows a program), and the grid, cdiv(n, tile / 2), is that of x @ W^T. So an FMA
    config is that of skinny_linear on W with block_n halved, and the fp32 sums are summed in the same order
    (same block_k)."""
    num_warps, threads = 4, 128
    rows = 2 if gated else 1  # W rows a program reads per output column
    k_cap = max(16, triton.next_power_of_2(k))
    if m > 4:
        # tl.dot tiles are >= 16 a side; a grid under two programs per SM gets bigger, deeper K tiles
        # (3 x 16 KB of W in flight per program, 96 KB of shared memory: two programs an SM). Gated: always
        # 16 + 16 rows, the wide plain tile, and 3 stages (deep tiles of W and x are 48 KB a stage)
        block_n = 32 if not gated and triton.cdiv(n, 32) >= 2 * num_sms else 16
        few = triton.cdiv(n, block_n) < 2 * num_sms
        stages = 4 if few and not gated else 3
        # 17-32 rows: x padded to 32, the same W tiles (H200 sweep at M = 32, skinny-gemm-m32-h200-20261126.json:
        # K tiles of 512 beat 256 by 10-28% on the o / down shapes, though a stage is then 48 KB)
        return SkinnyConfig(16 if m <= 16 else 32, block_n, min(512 if few else 256, k_cap), True, num_warps, stages)
    m_pad = triton.next_power_of_2(m)
    # programs resident an SM, by registers: ~72 a thread at m_pad = 1 (32 W elements a thread), ~125 with
    # 64 accumulators (Triton 3.9, sm_90)
    resident = (7 if m_pad == 1 else 4) * num_sms
    tile = max(4, 2 * m_pad)
    while tile < 32 and triton.cdiv(rows * n, tile) > resident:
        tile *= 2
    # W elements a thread per K tile: 32 (four 16-byte loads), 16 at m_pad = 4: 64 fp32 accumulators at most
    per_thread = 32 if m_pad <= 2 else 16
    if m_pad * per_thread * threads // tile < 256:
        # an x tile of 128 elements has Triton 3.9 read W back from shared memory 2 bytes at a time
        per_thread *= 2
    block_k = min(per_thread * threads // tile, k_cap)
    if m_pad == 1 and k <= 4096:  # H200 sweep at K = 2048: K tiles of 512 beat 1024 by 5%
        block_k = min(block_k, 512)
    # >= 16 KB of W in flight per program, and at least two tiles
    num_stages = min(5, max(3, 1 + triton.cdiv(16384, tile * block_k * 2)))
    return SkinnyConfig(m_pad, tile // rows, block_k, False, num_warps, num_stages)


def _prefetch_tiles() -> tuple[int, int]:
    """K tiles of W a program asks L2 for before its PDL wait, (FMA form, tensor-core form);
    OSTINATO_GEMV_PREFETCH_TILES="fma,dot" sets them (0: none). H100, GPU forward ms a step at bs 1 / 4 / 8 / 32 x
    128, none -> 1 tile -> 2 tiles (`bench_decode.py --models llama-3.2-1b qwen3-0.6b --cases 1:128 4:128 8:128
    32:128 --modes graph --no-launches --iters 100`, decode-gemv-l2first-{none,1tile,2tiles}-h100-20261126-s17*.json;
    "none" ran first and last, with the same figures):
    - Llama-3.2-1B: 1.085 / 1.186 / 1.215 / 1.287 -> 1.081 / 1.183 / 1.204 / 1.278 -> 1.080 / 1.171 / 1.207 / 1.282;
    - Qwen3-0.6B: 0.838 / 0.955 / 1.053 / 1.252 -> 0.842 / 0.935 / 1.033 / 1.234 -> 0.826 / 0.923 / 1.046 / 1.247.
    bs 1-4 run the FMA form, bs 8-32 the tensor-core one. A second call, none / (2, 1) twice each and (4, 1) once
    (decode-pf-*-h100-20261126-s17*.json): Llama-3.2-1B 1.085 / 1.183 / 1.214 / 1.282 -> 1.080 / 1.170 / 1.204 /
    1.273, Qwen3-0.6B 0.834 / 0.948 / 1.050 / 1.246 -> 0.822 / 0.919 / 1.030 / 1.228; (4, 1) no better at bs 4."""
    value = os.environ.get("OSTINATO_GEMV_PREFETCH_TILES", "2,1")
    try:
        tiles = [int(v) for v in value.split(",")]
    except ValueError:
        tiles = []
    if not 1 <= len(tiles) <= 2 or min(tiles) < 0:
        raise ValueError(f"OSTINATO_GEMV_PREFETCH_TILES must be one or two tile counts >= 0 (\"fma,dot\"), "
                         f"got {value!r}")
    return tiles[0], tiles[-1]


PREFETCH_TILES = _prefetch_tiles()


def prefetch_lines(cfg: SkinnyConfig, element_size: int) -> int:
    """128-byte lines of each W row a program asks L2 for before its PDL wait: its first K tiles (PREFETCH_TILES,
    by form), rounded up to a power of two; 0: none."""
    tiles = PREFETCH_TILES[cfg.use_dot]
    return lines_for(tiles * cfg.block_k * element_size) if tiles > 0 else 0


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether skinny_linear takes (x, weight) on the GPU; otherwise fall back to torch."""
    return (
        x.is_cuda and weight.is_cuda and x.device == weight.device and x.dim() == 2 and weight.dim() == 2
        and 1 <= x.shape[0] <= MAX_M and x.shape[1] == weight.shape[1] and weight.shape[0] >= 1
        and x.dtype in DTYPES and weight.dtype == x.dtype and x.stride(1) == 1 and weight.is_contiguous()
    )


def supports_gate_up(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether skinny_gate_up_silu takes (x, weight [2I, K]) on the GPU; otherwise fall back to
    skinny_linear / F.linear and silu_and_mul."""
    return supports(x, weight) and weight.shape[0] % 2 == 0


def _check_like_x(name: str, t: torch.Tensor, x: torch.Tensor) -> None:
    for attr in ("dtype", "device"):
        if getattr(t, attr) != getattr(x, attr):
            raise ValueError(f"{name}.{attr} ({getattr(t, attr)}) must equal x.{attr} ({getattr(x, attr)})")


def _check(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None, gated: bool = False) -> None:
    """ValueError naming the first field that skinny_linear (gated: skinny_gate_up_silu) cannot take."""
    if x.dim() != 2:
        raise ValueError(f"x.dim() must be 2 ([M, K]), got shape {tuple(x.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"weight.dim() must be 2 ([N, K]), got shape {tuple(weight.shape)}")
    (m, k), (n, wk) = x.shape, weight.shape
    if wk != k:
        raise ValueError(f"weight.shape[1] ({wk}) must equal x.shape[1] ({k})")
    if m > MAX_M:
        raise ValueError(f"x.shape[0] (M = {m}) must be at most {MAX_M}")
    if x.dtype not in DTYPES:
        raise ValueError(f"x.dtype must be torch.bfloat16 or torch.float16, got {x.dtype}")
    _check_like_x("weight", weight, x)
    if x.stride(1) != 1 and k > 1:
        raise ValueError(f"x.stride(1) must be 1 (rows contiguous), got strides {x.stride()}")
    if not weight.is_contiguous():
        raise ValueError(f"weight.stride() must be contiguous ({(k, 1)}), got {weight.stride()}")
    if gated:
        if n % 2:
            raise ValueError(f"weight.shape[0] (2I = {n}) must be even (gate rows, then as many up rows)")
        n //= 2
    if out is None:
        return
    if out.shape != (m, n):
        raise ValueError(f"out.shape must be {(m, n)}, got {tuple(out.shape)}")
    _check_like_x("out", out, x)
    if out.stride(1) != 1 and n > 1:
        raise ValueError(f"out.stride(1) must be 1 (rows contiguous), got strides {out.stride()}")


class PreNorm(NamedTuple):
    """The RMSNorm a skinny call applies to x first, its weight folded into W: x <- rms_norm(x + residual), and
    x + residual written to residual_out (both None: no residual add)."""
    eps: float
    residual: torch.Tensor | None = None
    residual_out: torch.Tensor | None = None


def _launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, config: SkinnyConfig | None,
            gated: bool = False, prenorm: PreNorm | None = None, add: torch.Tensor | None = None) -> None:
    (m, k), n = x.shape, out.shape[1]  # gated: n = I, half of weight's rows
    if m == 0 or n == 0:
        return
    if k == 0:
        out.zero_()  # gated too: silu(0) * 0
        if add is not None:
            out.add_(add)
        return
    # up to resident_gemv.MAX_ROWS rows (one unless set), a slice that fits in registers: requested whole before the
    # PDL wait (resident_gemv.py). The ungated pre-norm projection (qkv, Granite's in_proj) lets the next kernel in
    # only at its end
    if config is None:
        sms = _num_sms(x.device)
        resident = resident_gemv.config_for_call(x, weight, sms, gated)
        if resident is not None:
            pre = dict(eps=prenorm.eps, residual=prenorm.residual, residual_out=prenorm.residual_out) if prenorm else {}
            resident_gemv.launch(x, weight, out, resident, gated, add, **pre,
                                 trigger_at_end=prenorm is not None and not gated)
            return
        config = (prenorm_config if prenorm else config_for)(m, n, k, sms, gated)
    cfg = config
    grid = (triton.cdiv(n, cfg.block_n),)
    args = (x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0))
    pdl = pdl_enabled(x)
    meta = dict(M_PAD=cfg.m_pad, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, NUM_STAGES=cfg.num_stages,
                GATED=gated, PDL=pdl, launch_pdl=pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                Add=out if add is None else add, stride_am=0 if add is None else add.stride(0),
                HAS_ADD=add is not None, PREFETCH_LINES=prefetch_lines(cfg, x.element_size()) if pdl else 0)
    assert cfg.m_pad >= m
    if cfg.use_dot:
        assert min(cfg.m_pad, cfg.block_n, cfg.block_k) >= 16 and prenorm is None
        # one K slice a warp, each >= 16 (the MMA's K)
        _skinny_dot_kernel[grid](*args, **meta, K_SPLIT=min(cfg.num_warps, cfg.block_k // 16))
        return
    if prenorm is None:
        norm_args = (x, x, 0, 0, 0.0)  # unread
    else:
        r = x if prenorm.residual is None else prenorm.residual
        r_out = x if prenorm.residual_out is None else prenorm.residual_out
        norm_args = (r, r_out, r.stride(0), r_out.stride(0), prenorm.eps)
    _skinny_fma_kernel[grid](*args, *norm_args, **meta, PRENORM=prenorm is not None,
                             HAS_RES=prenorm is not None and prenorm.residual is not None)


def _skinny_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    _launch(x, weight, out, None)
    return out


skinny_linear_op = torch.library.custom_op("ostinato::skinny_linear", _skinny_linear, mutates_args=())


@skinny_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None, *,
                  config: SkinnyConfig | None = None, add: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_M, last dim contiguous) @ weight [N, K]^T -> [M, N] in x's dtype, fp32 accumulation.
    `out`: [M, N] to write into (last dim contiguous); `config` overrides config_for (for tuning; ignored
    under torch.compile). `add` [M, N] in x's dtype (last dim contiguous): added after the projection in the
    kernel's epilogue, rounded as `skinny_linear(x, weight) + add` is (a residual add without its launch)."""
    _check(x, weight, out)
    if add is not None:
        _check_add(add, x, weight.shape[0])
    if torch.compiler.is_compiling():  # opaque node for torch.compile; eager skips the op's ~25 us dispatch
        y = skinny_linear_op(x, weight)
        y = y if add is None else y + add
        return y if out is None else out.copy_(y)
    if out is None:
        out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    _launch(x, weight, out, config, add=add)
    return out


def _check_add(add: torch.Tensor, x: torch.Tensor, n: int) -> None:
    if add.shape != (x.shape[0], n):
        raise ValueError(f"add.shape must be {(x.shape[0], n)}, got {tuple(add.shape)}")
    _check_like_x("add", add, x)
    if add.stride(1) != 1 and n > 1:
        raise ValueError(f"add.stride(1) must be 1 (rows contiguous), got strides {add.stride()}")


def _skinny_gate_up_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape[0], weight.shape[0] // 2, dtype=x.dtype, device=x.device)
    _launch(x, weight, out, None, gated=True)
    return out


skinny_gate_up_silu_op = torch.library.custom_op("ostinato::skinny_gate_up_silu", _skinny_gate_up_silu,
                                                 mutates_args=())


@skinny_gate_up_silu_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0] // 2)


def skinny_gate_up_silu(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None, *,
                        config: SkinnyConfig | None = None) -> torch.Tensor:
    """silu_and_mul(skinny_linear(x, weight)) in one launch, without the [M, 2I] intermediate: x [M, K]
    (M <= MAX_M, last dim contiguous), weight the fused gate_up weight [2I, K] (gate rows, then up rows) ->
    silu(x @ weight[:I]^T) * (x @ weight[I:]^T), [M, I] in x's dtype. `out`: [M, I] to write into (last
    dim contiguous); `config` overrides config_for(m, I, k, gated=True) (ignored under torch.compile)."""
    _check(x, weight, out, gated=True)
    if torch.compiler.is_compiling():
        y = skinny_gate_up_silu_op(x, weight)
        return y if out is None else out.copy_(y)
    if out is None:
        out = torch.empty(x.shape[0], weight.shape[0] // 2, dtype=x.dtype, device=x.device)
    _launch(x, weight, out, config, gated=True)
    return out


PRENORM_MAX_M = 2  # the FMA kernel's (the tl.dot one feeds x to the MMA unscaled); at M = 4 the fused GEMVs were
# slower than the norm and the GEMV apart (H100, bench_decode.py: Llama-3.2-1B bs 4, GPU forward 1.50 against 1.29 ms)


def prenorm_config(m: int, n: int, k: int, num_sms: int = 132, gated: bool = False) -> SkinnyConfig:
    """config_for's tiles, widened where the pre-norm's extra reads would weigh: every program reads x and the
    residual from L2 for each of its K tiles, so a program of few W rows is taken wider (block_n doubled,
    block_k halved: the same W bytes a tile) until those reads are at most a quarter of its W reads. H100,
    `bench_skinny_gemm.py --prenorm --sweep`: Llama-3.2-1B's qkv at M = 1 8.29 -> 6.09 us (4 -> 8 rows), Qwen3-0.6B's
    at M = 2 5.82 -> 4.94 us (8 -> 16); Llama's at M = 2 6.58 -> 6.95 us, the one measured loss."""
    cfg = config_for(m, n, k, num_sms, gated)
    rows = 2 if gated else 1
    while 4 * 2 * cfg.m_pad > rows * cfg.block_n and cfg.block_k > 16:
        cfg = cfg._replace(block_n=cfg.block_n * 2, block_k=cfg.block_k // 2)
    if gated and cfg.m_pad == 1:
        # twice the rows, the same K tile: half the programs, each reading x and the residual once for twice the W.
        # H200, M = 1 (`--prenorm --sweep`, skinny-prenorm-sweep-m1-h200-20261126.json): Qwen3-0.6B's gate_up
        # 5.93 -> 5.40 us, Llama-3.2-1B's 19.18 -> 18.40 (at M = 2 the doubled fp32 accumulators would not fit)
        cfg = cfg._replace(block_n=cfg.block_n * 2)
    return cfg


def skinny_norm_linear(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *,
                       gated: bool = False, config: SkinnyConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The RMSNorm before a linear layer, folded into it: h = rms_norm(x + residual), then (h @ weight^T, or
    silu_and_mul of it when `gated`) -> (out, x + residual), or (out, x) with no residual. `weight` holds the
    norm's weight already (W * norm_weight, column by column: layers/norm_linear.fold_norm_weight). One launch
    instead of the norm's and the GEMV's. The normalised row is never rounded to the dtype (the unfused pair
    rounds it), so results agree with rms_norm + skinny_linear to the dtype's rounding, not bit for bit.
    x [M, K] with M <= PRENORM_MAX_M, residual [M, K] in x's dtype."""
    _check(x, weight, None, gated=gated)
    m, k = x.shape
    if m > PRENORM_MAX_M:
        raise ValueError(f"x.shape[0] (M = {m}) must be at most {PRENORM_MAX_M} with a pre-norm")
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual.shape must equal x.shape {tuple(x.shape)}, got {tuple(residual.shape)}")
        _check_like_x("residual", residual, x)
        if residual.stride(1) != 1 and k > 1:
            raise ValueError(f"residual.stride(1) must be 1 (rows contiguous), got strides {residual.stride()}")
    if config is not None and config.use_dot:
        raise ValueError("config.use_dot must be False with a pre-norm (the FMA kernel applies it)")
    out = torch.empty(m, weight.shape[0] // (2 if gated else 1), dtype=x.dtype, device=x.device)
    residual_out = x if residual is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch(x, weight, out, config, gated, PreNorm(eps, residual, None if residual is None else residual_out))
    return out, residual_out
