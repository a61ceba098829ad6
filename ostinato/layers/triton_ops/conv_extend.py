"""The Mamba2 causal conv of a whole extend batch (requests back to back) in two Triton launches:
1. every token's silu(conv) over the batch's rows as if they were one sequence: no tables, so the tile's loads
   issue at once (the rows before the batch read as zeros);
2. per request: its first K-1 outputs again, whose taps reach before the request's first new token, with the
   stored last K-1 inputs at the request's MambaPool slot in those places (overwriting what launch 1 wrote
   there), then the request's new stored inputs (its last K-1, old ones shifted in when it has fewer than K-1
   tokens), written after the old ones were read.
No [T, K, D] gather is materialized. The twin is `causal_conv_varlen` in `layers/mamba2.py`; here the sum
is float32 (the taps in order, then the bias), rounded once to the weight's dtype."""

import torch
import triton
import triton.language as tl

from ostinato.layers.triton_ops.pdl import enabled as pdl_enabled


@triton.jit
def _conv_extend_kernel(x_ptr, w_ptr, b_ptr, out_ptr, T, D, stride_x, stride_out, HAS_BIAS: tl.constexpr,
                        K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # layers/triton_ops/pdl.py: nothing read or written before the wait
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    mask = (offs_t < T)[:, None] & mask_d[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(K):
        rows = offs_t - (K - 1) + j
        v = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + offs_d[None, :],
                    mask=mask & (rows >= 0)[:, None], other=0.0).to(tl.float32)
        acc += v * tl.load(w_ptr + offs_d * K + j, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    out = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + offs_t.to(tl.int64)[:, None] * stride_out + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _conv_request_kernel(x_ptr, state_ptr, slot_ptr, cu_ptr, counts_ptr, w_ptr, b_ptr, out_ptr, D, stride_x,
                         stride_out, stride_s_slot, stride_s_d, HAS_BIAS: tl.constexpr, K: tl.constexpr,
                         BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, HAS_COUNTS: tl.constexpr,
                         PDL: tl.constexpr = False):
    # Under PDL everything is read and computed before the wait: xbc is in_proj's and the stored window the
    # last step's (both done when this grid starts: launch 1 triggers only after its own wait), and launch 1
    # writes neither. out's rows are launch 1's too: every store comes after the wait (for all of launch 1).
    r = tl.program_id(0)
    if HAS_COUNTS:  # a grid sized for the most requests (a captured step): the real count is on the device
        if r >= tl.load(counts_ptr):
            return
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    start = tl.load(cu_ptr + r)
    n = tl.load(cu_ptr + r + 1) - start
    slot = tl.load(slot_ptr + r).to(tl.int64)
    s_ptrs = state_ptr + slot * stride_s_slot + offs_d * stride_s_d  # [BLOCK_D]: the window's entry 0
    # the request's first K-1 outputs (those it has), as [BLOCK_D, BLOCK_K] (column i: output i)
    offs_k = tl.arange(0, BLOCK_K)
    rows_ok = mask_d[:, None] & ((offs_k < K - 1) & (offs_k < n))[None, :]
    acc = tl.zeros([BLOCK_D, BLOCK_K], dtype=tl.float32)
    for j in tl.static_range(K):
        q = offs_k - (K - 1) + j  # each tap's position in the request (<= i < n); < 0: a stored input, at K-1+q
        v = tl.load(x_ptr + (start + q).to(tl.int64)[None, :] * stride_x + offs_d[:, None],
                    mask=rows_ok & (q >= 0)[None, :], other=0.0).to(tl.float32)
        v += tl.load(s_ptrs[:, None] + (K - 1 + q)[None, :], mask=rows_ok & (q < 0)[None, :],
                     other=0.0).to(tl.float32)
        acc += v * tl.load(w_ptr + offs_d * K + j, mask=mask_d, other=0.0).to(tl.float32)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)[:, None]
    out = acc / (1.0 + tl.exp(-acc))
    mask = mask_d[:, None] & (offs_k < K - 1)[None, :]
    q = n - (K - 1) + offs_k  # the position each new stored entry comes from (< 0: an old stored one)
    new = (q >= 0)[None, :]
    v = tl.load(x_ptr + (start + q).to(tl.int64)[None, :] * stride_x + offs_d[:, None], mask=mask & new, other=0.0)
    old = tl.load(s_ptrs[:, None] + (K - 1 + q)[None, :], mask=mask & ~new, other=0.0)
    v = tl.where(new, v.to(state_ptr.dtype.element_ty), old)  # every read of the old window is above this store
    if PDL:  # layers/triton_ops/pdl.py
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(out_ptr + (start + offs_k).to(tl.int64)[None, :] * stride_out + offs_d[:, None],
             out.to(out_ptr.dtype.element_ty), mask=rows_ok)
    tl.store(s_ptrs[:, None] + offs_k[None, :], v, mask=mask)


def conv_extend(xbc: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor,
                weight: torch.Tensor, bias: torch.Tensor | None, block_t: int = 32, block_d: int = 64,
                num_warps: int = 2, counts: torch.Tensor | None = None) -> torch.Tensor:
    """xbc [T, D] (row-strided view fine; requests back to back as `cu_seqlens` [R+1] int32 splits them),
    conv_state [slots, D, K-1] read and updated in place at `slots` [R], weight [D, K] -> silu(conv) [T, D] in
    weight's dtype. block_t / block_d / num_warps: launch 1's tiling
    (benchmarks/bench_ssd_scan.py --conv-sweep: at granite-1b's shape and 2,048 tokens on an H200, 32 x 64
    with 2 warps took 15.4 us, with 4 warps 17.5). `counts` (int32 device, counts[0] the real request count):
    the tables are a captured step's (layers/mamba_tables.py), R is their bound, and requests past counts[0]
    are skipped; every one of the T tokens must still belong to a request."""
    T, D = xbc.shape
    K = weight.shape[1]
    assert xbc.stride(-1) == 1 and conv_state.stride(-1) == 1 and weight.is_contiguous() and K >= 2
    out = torch.empty(T, D, dtype=weight.dtype, device=xbc.device)
    R = cu_seqlens.shape[0] - 1
    pdl = pdl_enabled(xbc)
    b = weight if bias is None else bias
    if T:
        _conv_extend_kernel[(triton.cdiv(T, block_t), triton.cdiv(D, block_d))](
            xbc, weight, b, out, T, D, xbc.stride(0), out.stride(0), HAS_BIAS=bias is not None, K=K,
            BLOCK_T=block_t, BLOCK_D=block_d, num_warps=num_warps, PDL=pdl, launch_pdl=pdl,
        )
    block_d = 256
    _conv_request_kernel[(R, triton.cdiv(D, block_d))](
        xbc, conv_state, slots, cu_seqlens, cu_seqlens if counts is None else counts, weight, b, out, D,
        xbc.stride(0), out.stride(0), conv_state.stride(0), conv_state.stride(1), HAS_BIAS=bias is not None, K=K,
        BLOCK_K=triton.next_power_of_2(K - 1), BLOCK_D=block_d, HAS_COUNTS=counts is not None, PDL=pdl,
        launch_pdl=pdl,
    )
    return out
