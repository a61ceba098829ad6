"""y = x @ W^T at decode batch sizes (M <= 16), W an nn.Linear weight [N, K]: a weight-streaming kernel.

At M <= 16 the layer is a read of W, so what counts is keeping HBM busy. cuBLAS tiles for large M and at
M = 1 launches a few dozen CTAs (or splits K into a second reduce kernel). Here each program owns BLOCK_N
rows of W and walks all of K, so no program needs another's result: one launch, a grid fixed by the shapes,
no workspace, no atomics, the same bits on every call. BLOCK_N shrinks until the grid fills every SM at
least twice; M decides the inner product:

- M <= 4: CUDA-core FMAs into an fp32 [M_PAD, BLOCK_N, BLOCK_K] accumulator (a few registers per thread),
  summed over K once after the loop. Lets BLOCK_N go down to 4, so N = 2048 still gives 512 programs.
- M > 4: tl.dot of a [16, BLOCK_K] x tile with the [BLOCK_K, BLOCK_N] W tile on the tensor cores (FMAs
  would cost more than the load at M = 16); tl.dot needs BLOCK_N >= 16, hence the deeper pipeline when
  that leaves fewer programs than two per SM.

Split-K would give more programs at small N, but without atomics into a pre-zeroed buffer it needs a
persistent workspace and an arrival counter per tile (the last arrival sums the partials); not needed at
N >= 2048, where the grid already fills the SMs.
"""

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

MAX_M = 16
DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _skinny_fma_kernel(
    X, W, Out, M, N, K, stride_xm, stride_wn, stride_om,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_m = tl.arange(0, M_PAD)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)[None, None, :]
    # rows past M / N re-read the last valid row instead of masking the loads; their sums are never stored
    x_ptrs = X + tl.minimum(offs_m, M - 1)[:, None, None] * stride_xm + offs_k
    w_ptrs = W + tl.minimum(offs_n, N - 1).to(tl.int64)[None, :, None] * stride_wn + offs_k
    acc = tl.zeros((M_PAD, BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_full = K - K % BLOCK_K
    for k in range(0, k_full, BLOCK_K):
        acc += tl.load(x_ptrs + k).to(tl.float32) * tl.load(w_ptrs + k).to(tl.float32)
    if k_full < K:
        mask = offs_k < K - k_full
        x = tl.load(x_ptrs + k_full, mask=mask, other=0.0).to(tl.float32)
        acc += x * tl.load(w_ptrs + k_full, mask=mask, other=0.0).to(tl.float32)
    y = tl.sum(acc, axis=2)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(Out + offs_m[:, None] * stride_om + offs_n[None, :], y.to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _skinny_dot_kernel(
    X, W, Out, M, N, K, stride_xm, stride_wn, stride_om,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_m = tl.arange(0, M_PAD)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)[None, :]
    # as in the FMA kernel: clamped rows, never stored
    x_ptrs = X + tl.minimum(offs_m, M - 1)[:, None] * stride_xm + offs_k
    w_ptrs = W + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * stride_wn + offs_k
    acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    k_full = K - K % BLOCK_K
    for k in range(0, k_full, BLOCK_K):
        acc = tl.dot(tl.load(x_ptrs + k), tl.trans(tl.load(w_ptrs + k)), acc)
    if k_full < K:
        mask = offs_k < K - k_full
        x = tl.load(x_ptrs + k_full, mask=mask, other=0.0)
        acc = tl.dot(x, tl.trans(tl.load(w_ptrs + k_full, mask=mask, other=0.0)), acc)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(Out + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(Out.dtype.element_ty), mask=mask)


class SkinnyConfig(NamedTuple):
    m_pad: int
    block_n: int
    block_k: int
    use_dot: bool
    num_warps: int
    num_stages: int


def config_for(m: int, n: int, k: int, num_sms: int = 132) -> SkinnyConfig:
    """Tile sizes for x [m, k] @ W [n, k]^T: a rule of the shapes only (no autotuning: capture must not
    benchmark), tuned for H100 (132 SMs) with bf16/fp16 weights."""
    num_warps, threads = 4, 128
    k_cap = max(16, triton.next_power_of_2(k))
    if m > 4:
        # tl.dot's smallest tile is 16; fewer programs than two per SM each keep a deeper pipeline in flight
        block_n = 16 if triton.cdiv(n, 32) < 4 * num_sms else 32
        few = triton.cdiv(n, block_n) < 2 * num_sms
        return SkinnyConfig(16, block_n, min(512 if few else 256, k_cap), True, num_warps, 4 if few else 3)
    m_pad = triton.next_power_of_2(m)
    block_n = 16
    while block_n > 4 and triton.cdiv(n, block_n) < 2 * num_sms:
        block_n //= 2
    # 32 W elements a thread per tile (four 16-byte loads), 16 at m_pad = 4: <= 64 fp32 accumulators
    per_thread = 32 if m_pad <= 2 else 16
    return SkinnyConfig(m_pad, block_n, min(per_thread * threads // block_n, k_cap), False, num_warps, 1)


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


def _check(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x must be [M, K] and weight [N, K], got x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    (m, k), (n, wk) = x.shape, weight.shape
    if wk != k:
        raise ValueError(f"weight.shape[1] ({wk}) must equal x.shape[1] ({k})")
    if m > MAX_M:
        raise ValueError(f"x.shape[0] (M = {m}) must be at most {MAX_M}")
    if x.dtype not in DTYPES:
        raise ValueError(f"x.dtype must be bfloat16 or float16, got {x.dtype}")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight.dtype ({weight.dtype}) must equal x.dtype ({x.dtype})")
    if weight.device != x.device:
        raise ValueError(f"weight.device ({weight.device}) must equal x.device ({x.device})")
    if x.stride(1) != 1:
        raise ValueError(f"x must have a contiguous last dim, got strides {x.stride()}")
    if not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous, got strides {weight.stride()}")
    if out is not None:
        if out.shape != (m, n):
            raise ValueError(f"out.shape must be {(m, n)}, got {tuple(out.shape)}")
        if out.dtype != x.dtype:
            raise ValueError(f"out.dtype ({out.dtype}) must equal x.dtype ({x.dtype})")
        if out.device != x.device:
            raise ValueError(f"out.device ({out.device}) must equal x.device ({x.device})")
        if out.stride(1) != 1 and n > 1:
            raise ValueError(f"out must have a contiguous last dim, got strides {out.stride()}")


def _launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, config: SkinnyConfig | None) -> None:
    (m, k), n = x.shape, weight.shape[0]
    if m == 0 or n == 0:
        return
    if k == 0:
        out.zero_()
        return
    cfg = config or config_for(m, n, k, _num_sms(x.device))
    assert cfg.m_pad >= m and (not cfg.use_dot or min(cfg.m_pad, cfg.block_n, cfg.block_k) >= 16)
    kernel = _skinny_dot_kernel if cfg.use_dot else _skinny_fma_kernel
    kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        M_PAD=cfg.m_pad, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _skinny_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    _launch(x, weight, out, None)
    return out


skinny_linear_op = torch.library.custom_op("ostinato::skinny_linear", _skinny_linear, mutates_args=())


@skinny_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None, *,
                  config: SkinnyConfig | None = None) -> torch.Tensor:
    """x [M, K] (M <= 16, last dim contiguous) @ weight [N, K]^T -> [M, N] in x's dtype, fp32 accumulation.
    `out`: [M, N] to write into (last dim contiguous); `config` overrides config_for (for tuning)."""
    _check(x, weight, out)
    if torch.compiler.is_compiling():  # opaque node for torch.compile; eager skips the op's ~25 us dispatch
        y = skinny_linear_op(x, weight)
        return y if out is None else out.copy_(y)
    if out is None:
        out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    _launch(x, weight, out, config)
    return out
