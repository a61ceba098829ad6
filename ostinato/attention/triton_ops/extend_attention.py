"""Causal attention of a batch's new tokens over each request's paged prefix plus themselves.

The new tokens' K/V are already in the cache, so every key is read through `req_to_token`: key j of
request b sits at slot req_to_token[req_pool_indices[b], j]. Query i of request b (row q_start[b] + i
of q) is at absolute position prefix_lens[b] + i and sees keys 0..prefix_lens[b] + i.

Grid (num_blocks, num_heads): one program per block of up to BLOCK_M queries of one request and one head.
A block table says which: block i covers queries block_m0[i] .. + BLOCK_M of request block_req[i] (built
by `extend_block_table`). Entries with block_req -1 are padding and exit at once, so a captured graph can
launch a fixed grid sized for its largest batch and run any smaller one.
"""

import torch
import triton
import triton.language as tl

from ostinato.attention.triton_ops.paged_softmax import LOG2E, attend_kv_block, fp8_code, page_arg


@triton.jit
def _extend_kernel(
    Q, Out, K_buf, V_buf, Req_to_token, Req_pool_indices, Q_start, Prefix_lens, Extend_lens, Block_req, Block_m0,
    K_scale, V_scale,
    qk_scale,  # softmax scale * log2(e)
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kbs, stride_kbh, stride_vbs, stride_vbh, stride_r2t,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
    PAGE: tl.constexpr, KV_FP8: tl.constexpr,
):
    block = tl.program_id(0)
    head = tl.program_id(1)
    b = tl.load(Block_req + block)
    if b < 0:
        return
    v_scale = 1.0
    if KV_FP8:  # dequantize by folding the layer's scales into the scores and the output
        qk_scale = qk_scale * tl.load(K_scale)
        v_scale = tl.load(V_scale)
    m0 = tl.load(Block_m0 + block)
    extend_len = tl.load(Extend_lens + b)
    prefix = tl.load(Prefix_lens + b)
    q_start = tl.load(Q_start + b).to(tl.int64)
    req = tl.load(Req_pool_indices + b).to(tl.int64)
    kv_head = head // GROUP

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < extend_len
    d_mask = offs_d < HEAD_DIM
    rows = q_start + offs_m
    q = tl.load(Q + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = prefix + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # the last query of this block sees keys up to kv_end - 1
    kv_end = prefix + tl.minimum(m0 + BLOCK_M, extend_len)
    for n0 in range(0, kv_end, BLOCK_N):
        acc, m_i, l_i = attend_kv_block(
            q, acc, m_i, l_i, n0, kv_end, q_pos, K_buf, V_buf, Req_to_token + req * stride_r2t, kv_head,
            stride_kbs, stride_kbh, stride_vbs, stride_vbh, offs_d, d_mask, qk_scale,
            BLOCK_N=BLOCK_N, CAUSAL=True, PRECISION=PRECISION, PAGE=PAGE, KV_FP8=KV_FP8,
        )

    out = acc * (v_scale / l_i)[:, None]
    tl.store(Out + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :], out.to(Out.dtype.element_ty),
             mask=m_mask[:, None] & d_mask[None, :])


def extend_block_table(extend_lens: list[int], block_m: int, pad_to: int | None = None) -> tuple[list[int], list[int]]:
    """(block_req, block_m0): one entry per block of `block_m` new tokens of each request, padded with
    (-1, 0) up to `pad_to` entries when given."""
    reqs = [b for b, n in enumerate(extend_lens) for _ in range(0, n, block_m)]
    m0s = [m0 for n in extend_lens for m0 in range(0, n, block_m)]
    if pad_to is not None:
        assert len(reqs) <= pad_to, f"{len(reqs)} blocks > {pad_to}"
        reqs += [-1] * (pad_to - len(reqs))
        m0s += [0] * (pad_to - len(m0s))
    return reqs, m0s


def max_extend_blocks(num_tokens: int, num_reqs: int, block_m: int) -> int:
    """Most blocks `num_reqs` requests with `num_tokens` new tokens in all can need (each adds at most one
    partial block)."""
    return -(-num_tokens // block_m) + min(num_reqs, num_tokens)


def extend_attention(
    q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, out: torch.Tensor,
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, q_start: torch.Tensor,
    prefix_lens: torch.Tensor, extend_lens: torch.Tensor, block_req: torch.Tensor, block_m0: torch.Tensor,
    scale: float, block_m: int = 64, block_n: int = 64, page_size: int = 1, kv_fp8: torch.dtype | None = None,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    """q/out [T, H, D] (requests' new tokens back to back); k_buf/v_buf [slots, Hkv, D];
    q_start/prefix_lens/extend_lens int32 [bs]; block_req/block_m0 int32 [num_blocks] from
    `extend_block_table(extend_lens, block_m)` (the launch grid's first dimension).
    `page_size`, `kv_fp8`, `k_scale`, `v_scale`: as for `decode_attention`."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_blocks = block_req.shape[0]
    group = num_heads // k_buf.shape[1]
    assert q.stride(2) == 1 and out.stride(2) == 1 and k_buf.stride(2) == 1 and v_buf.stride(2) == 1
    assert req_to_token.stride(1) == 1
    if num_blocks == 0:
        return
    fp8 = fp8_code(kv_fp8, k_buf)
    k_scale = q_start if k_scale is None else k_scale  # any pointer: read only for an fp8 cache
    v_scale = q_start if v_scale is None else v_scale
    _extend_kernel[(num_blocks, num_heads)](
        q, out, k_buf, v_buf, req_to_token, req_pool_indices, q_start, prefix_lens, extend_lens, block_req, block_m0,
        k_scale, v_scale, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1), req_to_token.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(head_dim), PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        PAGE=page_arg(page_size, block_n), KV_FP8=fp8, num_warps=4, num_stages=2,
    )
