"""y = x @ W^T at one row, each program's whole slice of W requested before its PDL wait: the bs-1 GEMV of a
small model's decode step.

The skinny GEMV (skinny_gemm.py) streams W through a K loop after its wait, so a chain of GEMVs reads HBM in
bursts: each GEMV's weights are asked for only once the GEMV before it is done. Here a program issues the loads
of its entire [BLOCK_N, K] slice of W into registers first (W is no kernel's output), then lets the next kernel's
programs be placed (`gdc_launch_dependents`, before its own wait: the exception to pdl.py's rule), and only then
waits for x. The grid is a few programs an SM with small slices, so while one GEMV finishes, the programs of the
next one sit beside it with their weights on the way: GEMV g + 1's weights stream while GEMV g computes. Qwen3-0.6B's
112 GEMVs at one row, each a launch in a CUDA graph (`benchmarks/bench_persistent_gemv.py --resident`, H200): 325-340
us against the skinny kernel's 424 (2.6-2.7 TB/s against 2.1).

The slice must fit in registers, so this takes only shapes whose slice is at most RESIDENT_BYTES a thread at the
grid's bound: a 0.6B model's projections (4-13 MB), a 1B model's qkv and o, not its 34-67 MB gate_up and down.
Where it does not fit, skinny_gemm keeps the call. H200, `bench_decode.py --models llama-3.2-1b qwen3-0.6b --cases
1:128 1:1024 --modes graph --no-launches`, ms a step at bs 1 x 128 / 1024, skinny kernels only (run first and
last) -> every shape that fits resident -> all but qkv:
- Qwen3-0.6B: 0.731 / 0.790 and 0.737 / 0.795 -> 0.673 / 0.744 -> 0.672 / 0.725;
- Llama-3.2-1B (qkv and o fit): 0.856 / 0.879 and 0.859 / 0.884 -> 0.856 / 0.892 -> 0.837 / 0.863.
The ungated pre-norm projection (qkv, whose output decode attention reads) lets the next kernel in only at its end
(`trigger_at_end`): its own weights still stream while the GEMV before it (down) finishes, but attention's programs
are placed only once qkv is done, not beside its weight stream. qkv resident with the trigger before its wait,
after it, or at the end, against the skinny kernel, in turns (an experiment's switch, not kept; H200,
ms a step at bs 1 x 128 / 1024, `decode-rqkv-*-h200-20261127-s31.json`): Qwen3-0.6B skinny 0.671 / 0.721 and
0.672 / 0.722, before 0.669 / 0.737, after 0.665 / 0.736, at the end 0.637 / 0.687 and 0.639 / 0.689; Llama-3.2-1B
skinny 0.830 / 0.856 and 0.832 / 0.858, before 0.847 / 0.886, after 0.847 / 0.888, at the end 0.831 / 0.858 and
0.832 / 0.858.

Rows of x beyond the first reuse the slice held in registers (MAX_ROWS, 1 by default: at 2-4 rows the steps were
slower, Qwen3-0.6B bs 2 / 3 / 4 x 128 0.749 / 0.827 / 0.842 -> 0.782 / 0.977 / 1.089 ms and Llama-3.2-1B bs 3 / 4
0.952 / 0.959 -> 0.980 / 1.010, Llama-3.2-1B bs 2 0.869 -> 0.859; `decode-resident-rows*-h200-20261127-s29.json`).
It does what skinny_gemm's FMA kernel does, under the same constexprs: GATED (gate rows n, up rows I + n,
silu_and_mul's rounding), PRENORM (x <- rms_norm(x + R), the norm's weight folded into W, fp32 sums scaled by the
inverse RMS; program 0 writes x + R to R_out), HAS_ADD (the residual after the projection). x is loaded whole after
the wait. K need not be a power of two: the slice is two parts, K_A (the largest power of two <= K) and the rest
padded to a power of two K_B, masked.
"""

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ostinato.layers.triton_ops.pdl import enabled as pdl_enabled
from ostinato.layers.triton_ops.silu_and_mul import silu_mul_rounded


@triton.jit
def _x_part(X, R, R_out, cols, mask, ss, store, PRENORM: tl.constexpr, HAS_RES: tl.constexpr):
    """One part of the row: x (plus the residual, rounded to x's dtype as HF adds it, stored to R_out where
    `store`) as fp32, and the sum of squares so far."""
    x = tl.load(X + cols, mask=mask, other=0.0)
    if PRENORM:
        if HAS_RES:
            x = (x.to(tl.float32) + tl.load(R + cols, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
            tl.store(R_out + cols, x, mask=mask & (cols * 0 + store != 0))  # a tensor mask for the interpreter
        ss += tl.sum(x.to(tl.float32) * x.to(tl.float32))
    return x.to(tl.float32), ss


@triton.jit
def _resident_gemv_kernel(
    X, W, Out, M, N, K, stride_xm, stride_wn, stride_om, Add, stride_am, R, R_out, stride_rm, stride_rom, eps,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, K_A: tl.constexpr, K_B: tl.constexpr, GATED: tl.constexpr,
    PRENORM: tl.constexpr, HAS_RES: tl.constexpr, HAS_ADD: tl.constexpr, PDL: tl.constexpr,
    TRIGGER_AT_END: tl.constexpr = False,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    # rows past N re-read row N - 1 and are never stored; GATED: N is the output width I, up rows I further on
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)[:, None]
    ka = tl.arange(0, K_A)[None, :]
    kb = K_A + tl.arange(0, K_B if K_B > 0 else 1)[None, :]
    kb_mask = kb < K
    w_a = tl.load(W + rows * stride_wn + ka)
    if GATED:
        u_a = tl.load(W + (rows + N) * stride_wn + ka)
    if K_B > 0:
        w_b = tl.load(W + rows * stride_wn + kb, mask=kb_mask, other=0.0)
        if GATED:
            u_b = tl.load(W + (rows + N) * stride_wn + kb, mask=kb_mask, other=0.0)
    if PDL:  # the loads above stay in flight; the next kernel's programs may be placed now (module doc)
        if not TRIGGER_AT_END:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    store = (pid == 0).to(tl.int32)
    mask = offs_n < N
    for m in tl.static_range(M_PAD):  # each row of x against the same slice of W, held in registers
        if m < M:
            x_m, r_m, ro_m = X + m * stride_xm, R + m * stride_rm, R_out + m * stride_rom
            ss = 0.0
            x_a, ss = _x_part(x_m, r_m, ro_m, ka, ka < K, ss, store, PRENORM, HAS_RES)
            y = tl.sum(w_a.to(tl.float32) * x_a, axis=1)
            if GATED:
                u = tl.sum(u_a.to(tl.float32) * x_a, axis=1)
            if K_B > 0:
                x_b, ss = _x_part(x_m, r_m, ro_m, kb, kb_mask, ss, store, PRENORM, HAS_RES)
                y += tl.sum(w_b.to(tl.float32) * x_b, axis=1)
                if GATED:
                    u += tl.sum(u_b.to(tl.float32) * x_b, axis=1)
            if PRENORM:
                inv_rms = tl.rsqrt(ss / K + eps)
                y *= inv_rms
                if GATED:
                    u *= inv_rms
            if GATED:
                y = silu_mul_rounded(y, u, Out.dtype.element_ty)
            if HAS_ADD:  # rounded as torch's `linear(x, W) + add` in the dtype
                a = tl.load(Add + m * stride_am + offs_n, mask=mask, other=0.0)
                y = y.to(Out.dtype.element_ty).to(tl.float32) + a.to(tl.float32)
            tl.store(Out + m * stride_om + offs_n, y.to(Out.dtype.element_ty), mask=mask)
    if PDL and TRIGGER_AT_END:
        tl.extra.cuda.gdc_launch_dependents()


class ResidentConfig(NamedTuple):
    block_n: int  # output columns a program (GATED: each reads 2 * block_n rows of W)
    k_a: int
    k_b: int
    num_warps: int


def _setting() -> tuple[int, int, int]:
    """(programs an SM the grid aims at, warps a program, most rows of x); OSTINATO_RESIDENT_GEMV=
    "per_sm,warps[,rows]", "0" off."""
    value = os.environ.get("OSTINATO_RESIDENT_GEMV", "4,4,1")
    if value == "0":
        return 0, 4, 1
    try:
        per_sm, warps, *rows = (int(v) for v in value.split(","))
    except ValueError:
        per_sm, warps, rows = 0, 0, []
    max_rows = rows[0] if rows else 1
    if per_sm < 1 or warps not in (1, 2, 4, 8, 16) or len(rows) > 1 or not 1 <= max_rows <= 4:
        raise ValueError(f"OSTINATO_RESIDENT_GEMV must be \"0\" or \"programs_per_sm,warps[,rows]\" (warps 1-16, "
                         f"a power of two; rows 1-4), got {value!r}")
    return per_sm, warps, max_rows


PER_SM, NUM_WARPS, MAX_ROWS = _setting()

RESIDENT_BYTES = 256  # of W a thread (64 registers): beside the previous kernel's programs, the next one's fit


def k_parts(k: int) -> tuple[int, int]:
    """(K_A, K_B): K_A the largest power of two <= k, K_B the rest padded to a power of two (0: none)."""
    k_a = 1 << (k.bit_length() - 1)
    return k_a, (triton.next_power_of_2(k - k_a) if k > k_a else 0)


def config_for(n: int, k: int, element_size: int, num_sms: int, gated: bool = False,
               per_sm: int = PER_SM, num_warps: int = NUM_WARPS) -> ResidentConfig | None:
    """The tiles for x [m, k] @ W^T (n output columns; gated: W [2n, k]), or None where the slice of a grid of at
    most per_sm * num_sms programs would not fit RESIDENT_BYTES a thread (or the kernel is switched off)."""
    if per_sm < 1 or n < 1 or k < 1:
        return None
    block_n = 1
    while triton.cdiv(n, block_n) > per_sm * num_sms:
        block_n *= 2
    k_a, k_b = k_parts(k)
    slice_bytes = block_n * (2 if gated else 1) * (k_a + k_b) * element_size
    if slice_bytes > RESIDENT_BYTES * 32 * num_warps:
        return None
    return ResidentConfig(block_n, k_a, k_b, num_warps)


def config_for_call(x: torch.Tensor, weight: torch.Tensor, num_sms: int,
                    gated: bool = False) -> ResidentConfig | None:
    """config_for at x's dtype where x has 1 to MAX_ROWS rows (None otherwise)."""
    if not 1 <= x.shape[0] <= MAX_ROWS:
        return None
    n = weight.shape[0] // (2 if gated else 1)
    return config_for(n, x.shape[1], x.element_size(), num_sms, gated)


def launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, cfg: ResidentConfig, gated: bool = False,
           add: torch.Tensor | None = None, eps: float | None = None, residual: torch.Tensor | None = None,
           residual_out: torch.Tensor | None = None, trigger_at_end: bool = False) -> None:
    """One launch into `out` [M, n]: x [M, K] (M <= 4), weight [N, K] contiguous (gated: [2n, K]), shapes checked
    by the caller (skinny_gemm's entry points). `eps` given: the pre-norm, with `residual` added first and x +
    residual written to `residual_out`. `trigger_at_end`: the next kernel's programs are placed only as this grid's
    programs finish, not before their wait (the module doc says where)."""
    (m, k), n = x.shape, out.shape[1]
    pdl = pdl_enabled(x)
    prenorm, has_res = eps is not None, residual is not None
    r, r_out = (residual, residual_out) if has_res else (x, x)  # unread without a residual
    _resident_gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0), out if add is None else add,
        0 if add is None else add.stride(0), r, r_out, r.stride(0), r_out.stride(0), eps if prenorm else 0.0,
        M_PAD=triton.next_power_of_2(m), BLOCK_N=cfg.block_n, K_A=cfg.k_a, K_B=cfg.k_b, GATED=gated,
        PRENORM=prenorm, HAS_RES=has_res, HAS_ADD=add is not None, PDL=pdl, launch_pdl=pdl, num_warps=cfg.num_warps,
        TRIGGER_AT_END=trigger_at_end)
