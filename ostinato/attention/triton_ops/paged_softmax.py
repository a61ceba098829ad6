"""The step both attention kernels repeat: one block of keys read through `req_to_token`, folded into a
running (online) softmax. Inlined by Triton into each caller."""

import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # scores live in the log2 domain: callers scale q.k by softmax scale * LOG2E


@triton.jit
def attend_kv_block(
    q, acc, m_i, l_i, n0, kv_end, q_pos,
    K_buf, V_buf, req_row,  # req_row: pointer to the request's row of req_to_token
    kv_head, stride_kbs, stride_kbh, stride_vbs, stride_vbh, offs_d, d_mask, qk_scale,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
):
    """Keys n0 .. n0 + BLOCK_N (those < kv_end; with CAUSAL, also <= each row's q_pos) into (acc, m_i, l_i).

    Every row must see at least one key by its first block, so m_new stays finite from then on.
    """
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < kv_end
    slots = tl.load(req_row + offs_n, mask=n_mask, other=0).to(tl.int64)
    k = tl.load(K_buf + slots[None, :] * stride_kbs + kv_head * stride_kbh + offs_d[:, None],
                mask=d_mask[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_D, BLOCK_N]
    s = tl.dot(q, k.to(q.dtype), input_precision=PRECISION) * qk_scale  # [rows, BLOCK_N]
    visible = n_mask[None, :]
    if CAUSAL:
        visible = visible & (offs_n[None, :] <= q_pos[:, None])
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(V_buf + slots[:, None] * stride_vbs + kv_head * stride_vbh + offs_d[None, :],
                mask=n_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
    return acc, m_new, l_i
