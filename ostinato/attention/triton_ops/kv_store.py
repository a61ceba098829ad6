"""Write the new tokens' K and V into one layer's paged buffers in a single launch."""

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    K, V, K_buf, V_buf, Loc,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # one program per token: all its heads at once
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Loc + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(K_buf + slot * stride_kbs + offs_h[:, None] * stride_kbh + offs_d[None, :],
             k.to(K_buf.dtype.element_ty), mask=mask)
    tl.store(V_buf + slot * stride_vbs + offs_h[:, None] * stride_vbh + offs_d[None, :],
             v.to(V_buf.dtype.element_ty), mask=mask)


def store_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """k_buf/v_buf [slots, Hkv, D] (any float dtype: values are cast); loc [T]; k/v [T, Hkv, D].

    Rows sharing a slot (padded rows of a captured batch all write slot 0) race: the slot ends up
    holding one of them, which is fine for the sink.
    """
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_buf.stride(2) == 1 and v_buf.stride(2) == 1
    _store_kv_kernel[(num_tokens,)](
        k, v, k_buf, v_buf, loc,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )
