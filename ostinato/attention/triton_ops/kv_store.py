"""Write the new tokens' K and V into one layer's paged buffers in a single launch (quantizing to fp8
when the cache is fp8)."""

import torch
import triton
import triton.language as tl

from ostinato.layers.triton_ops.pdl import enabled as pdl_enabled


@triton.jit
def round_to_fp8(x, MANT: tl.constexpr, MIN_NORMAL: tl.constexpr, SUB_MAGIC: tl.constexpr, MAX: tl.constexpr):
    """fp32 x rounded to the nearest (ties to even) value of an fp8 format with MANT mantissa bits, saturated
    to +-MAX, still as fp32: the cast that follows is then exact. Done by hand because Triton's interpreter
    rounds fp32 -> fp8 wrongly (124 -> 64 in e4m3); on the GPU this costs a few integer ops per element."""
    x_bits = x.to(tl.int32, bitcast=True)
    drop: tl.constexpr = 23 - MANT
    bits = x_bits + ((1 << (drop - 1)) - 1) + ((x_bits >> drop) & 1)
    normal = (bits & -(1 << drop)).to(tl.float32, bitcast=True)
    ax = tl.abs(x)
    sub = (ax + SUB_MAGIC) - SUB_MAGIC  # subnormal range: multiples of the smallest step, ties to even
    r = tl.where(ax < MIN_NORMAL, tl.where(x_bits < 0, -sub, sub), normal)  # the sign bit keeps -0.0
    return tl.clamp(r, -MAX, MAX)


@triton.jit
def _store_kv_kernel(
    K, V, K_buf, V_buf, Loc, K_scale, V_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    KV_FP8: tl.constexpr, PDL: tl.constexpr = False,
):
    if PDL:  # layers/triton_ops/pdl.py: nothing read or written before the wait; the trigger is at the end
        tl.extra.cuda.gdc_wait()
    # one program per token: all its heads at once
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Loc + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    if KV_FP8 == 1:  # x / scale, rounded to nearest even, saturated to the e4m3 range, stored as its byte
        k = round_to_fp8(k.to(tl.float32) / tl.load(K_scale), 3, 2.0**-6, 2.0**14, 448.0)
        v = round_to_fp8(v.to(tl.float32) / tl.load(V_scale), 3, 2.0**-6, 2.0**14, 448.0)
        k = k.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        v = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    elif KV_FP8 == 2:  # the same for e5m2
        k = round_to_fp8(k.to(tl.float32) / tl.load(K_scale), 2, 2.0**-14, 2.0**7, 57344.0)
        v = round_to_fp8(v.to(tl.float32) / tl.load(V_scale), 2, 2.0**-14, 2.0**7, 57344.0)
        k = k.to(tl.float8e5).to(tl.uint8, bitcast=True)
        v = v.to(tl.float8e5).to(tl.uint8, bitcast=True)
    tl.store(K_buf + slot * stride_kbs + offs_h[:, None].to(tl.int64) * stride_kbh + offs_d[None, :],
             k.to(K_buf.dtype.element_ty), mask=mask)
    tl.store(V_buf + slot * stride_vbs + offs_h[:, None].to(tl.int64) * stride_vbh + offs_d[None, :],
             v.to(V_buf.dtype.element_ty), mask=mask)
    if PDL:  # the decode kernel's programs come in as this grid's last programs finish (pdl.py)
        tl.extra.cuda.gdc_launch_dependents()


def store_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             kv_fp8: torch.dtype | None = None, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """k_buf/v_buf [slots, Hkv, D] (any float dtype: values are cast); loc [T]; k/v [T, Hkv, D].

    `kv_fp8`: the fp8 dtype of a cache stored as uint8 in k_buf/v_buf; values are stored as x / scale
    (`k_scale` / `v_scale`: float32 device tensors, the first element read).
    Rows sharing a slot (padded rows of a captured batch all write slot 0) race: the slot ends up
    holding one of them, which is fine for the sink.
    """
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_buf.stride(2) == 1 and v_buf.stride(2) == 1
    fp8 = 0
    if kv_fp8 is not None:
        assert k_buf.dtype == torch.uint8 and k_scale is not None and v_scale is not None
        fp8 = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}[kv_fp8]
    pdl = pdl_enabled(k)
    _store_kv_kernel[(num_tokens,)](
        k, v, k_buf, v_buf, loc, loc if k_scale is None else k_scale, loc if v_scale is None else v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim), KV_FP8=fp8,
        PDL=pdl, launch_pdl=pdl,
    )
