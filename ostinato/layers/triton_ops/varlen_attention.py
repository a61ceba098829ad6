"""Bidirectional attention over packed segments given by a device `cu_seqlens` (vision towers).

q, k, v [N, H, D] hold segments back to back: segment s is rows cu_seqlens[s] .. cu_seqlens[s + 1], and a
query attends to every key of its own segment (no causal mask). cu_seqlens is an int32 device tensor whose
last entry is N; repeated entries are empty segments, so a buffer sized for the most segments can hold any
segmentation, with its tail filled by N.

Grid (cdiv(N, BLOCK_M), H): it depends on N only, never on the segment boundaries, so one CUDA graph replays
correctly for every segmentation of the same N once the new cu_seqlens is copied into its buffer. A program
takes BLOCK_M consecutive queries (which may straddle segments), finds each one's segment [lo, hi) by a binary
search over cu_seqlens, and walks the keys of the union of those segments, masking each query to its own.

Numerics: a masked score is -inf against a running max that starts at a finite -1e30, so a block whose keys
are all masked for a row adds exact zeros and leaves the row's sums untouched (no NaN from -inf - -inf). A
query's result then does not depend on keys outside its segment, nor on padding past them, bit for bit,
provided those values are finite.
"""

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["num_tokens", "num_cu", "search_steps"])  # one compile for every batch shape
def _varlen_kernel(
    Q, K, V, Out, Cu, num_tokens, num_cu, search_steps, qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    m0 = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1).to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < num_tokens
    d_mask = offs_d < HEAD_DIM
    rows = tl.minimum(offs_m, num_tokens - 1)  # rows past the end search like the last one

    # segment of each query: the largest s < num_cu - 1 with cu[s] <= row (cu[0] = 0 <= row always)
    s_lo = tl.zeros([BLOCK_M], dtype=tl.int32)
    s_hi = tl.zeros([BLOCK_M], dtype=tl.int32) + (num_cu - 1)
    for _ in range(search_steps):  # fixed step count; once s_hi - s_lo == 1 a step changes nothing
        mid = (s_lo + s_hi) // 2
        below = tl.load(Cu + mid) <= rows
        s_lo = tl.where(below, mid, s_lo)
        s_hi = tl.where(below, s_hi, mid)
    lo = tl.load(Cu + s_lo)
    hi = tl.load(Cu + s_lo + 1)
    kv_start = tl.min(tl.where(m_mask, lo, num_tokens), axis=0)
    kv_end = tl.max(tl.where(m_mask, hi, 0), axis=0)

    q = tl.load(Q + offs_m[:, None].to(tl.int64) * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n0 in range(kv_start, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        k = tl.load(K + offs_n[None, :].to(tl.int64) * stride_kt + head * stride_kh + offs_d[:, None],
                    mask=d_mask[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_D, BLOCK_N]
        qk = tl.dot(q, k, input_precision=PRECISION) * qk_scale
        mine = (offs_n[None, :] >= lo[:, None]) & (offs_n[None, :] < hi[:, None])
        qk = tl.where(mine, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(V + offs_n[:, None].to(tl.int64) * stride_vt + head * stride_vh + offs_d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + offs_m[:, None].to(tl.int64) * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     out: torch.Tensor | None = None, scale: float | None = None,
                     block_m: int | None = None, block_n: int | None = None) -> torch.Tensor:
    """Attention of q, k, v [N, H, D] (strided views allowed, last dim contiguous) within the segments of
    `cu_seqlens` (int32 [S + 1] on q's device, cu[0] = 0, cu[-1] = N, non-decreasing). Returns out [N, H, D]."""
    n, heads, head_dim = q.shape
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.device == q.device, "cu_seqlens: int32 on q's device"
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    if out is None:
        out = torch.empty(n, heads, head_dim, dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    num_cu = cu_seqlens.shape[0]
    block_d = max(16, triton.next_power_of_2(head_dim))
    if block_m is None:  # wide query blocks for long segments on a GPU; small ones keep the interpreter quick
        block_m = 128 if q.is_cuda and block_d <= 128 else 64 if q.is_cuda else 16
    block_n = block_n or (64 if q.is_cuda else 16)
    _varlen_kernel[(triton.cdiv(n, block_m), heads)](
        q, k, v, out, cu_seqlens, n, num_cu, max(1, (num_cu - 2).bit_length()), (scale or head_dim**-0.5) * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        PRECISION="ieee" if q.dtype in (torch.float32, torch.float64) else "tf32",
        num_warps=8 if block_m >= 128 else 4, num_stages=2,
    )
    return out
