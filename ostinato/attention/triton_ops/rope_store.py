"""Rotary (with Qwen3's per-head q/k RMSNorm) fused with the K/V store: one launch where there were two.

Grid (T, q head blocks + kv head blocks). A q program rotates BLOCK_H query heads of one token into `q_out`;
a kv program rotates BLOCK_H key heads and writes them, with the same value heads, into the token's cache
slot (`loc`), quantized to fp8 as `kv_store.py` does for an fp8 cache. The inputs are read only: q, k and v
may be strided views into the qkv projection's output.

The rotation rounds as `layers/triton_ops/rotary.py` does and the store as `store_kv` does, so this kernel writes
the same bits as the rotary kernel followed by `store_kv` (tests/test_rope_store.py compares them). The cache is indexed
by slot, so the page size only shapes which slots `loc` holds. The CPU twin is the unfused path:
`layers.rotary.rotary_embedding_torch` then `KVCache.set_kv_buffer` (what `AttentionBackend.forward` does).
"""

import torch
import triton
import triton.language as tl

from ostinato.attention.triton_ops.kv_store import round_to_fp8
from ostinato.layers.triton_ops.pdl import enabled as pdl_enabled
from ostinato.layers.triton_ops.rotary import norm_rotate


@triton.jit
def _fp8_byte(x, Scale, KV_FP8: tl.constexpr):
    """fp32 x stored in an fp8 cache: x / scale rounded to nearest even, saturated, as its byte (`store_kv`'s)."""
    if KV_FP8 == 1:
        x = round_to_fp8(x / tl.load(Scale), 3, 2.0**-6, 2.0**14, 448.0)
        return x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        x = round_to_fp8(x / tl.load(Scale), 2, 2.0**-14, 2.0**7, 57344.0)
        return x.to(tl.float8e5).to(tl.uint8, bitcast=True)


@triton.jit
def load_halves(X, offs_h, stride_h, offs_d, mask, HEAD_DIM: tl.constexpr):
    """The halves [heads, half] of heads `offs_h` of one token's row X (before rotary), fp32."""
    src = X + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HEAD_DIM // 2, mask=mask, other=0.0).to(tl.float32)
    return x1, x2


@triton.jit
def inv_rms_of(x, n_cols, eps):
    """The inverse RMS of a row x loaded as [BLOCK] (lanes past n_cols 0), fp32 sums as silu_and_mul's deferred
    norm takes them: the deferred input norm's scale (`Rope.x_rms`)."""
    x = x.to(tl.float32)
    return tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)


@triton.jit
def scaled(x, inv_rms, dtype: tl.constexpr):
    """fp32 x (a model-dtype value) times the deferred norm's scale, rounded to the model dtype (`scale_by_inv_rms`)."""
    return (x * inv_rms).to(dtype).to(tl.float32)


@triton.jit
def rotate_store_kv(k1, k2, v1, v2, K_buf, V_buf, slot, offs_h, mask, offs_d, d_mask, cos, sin, KW, K_scale,
                    V_scale, stride_kbs, stride_kbh, stride_vbs, stride_vbh, eps, dtype: tl.constexpr,
                    HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr, KV_FP8: tl.constexpr):
    """One token's KV heads `offs_h`, given as their halves before rotary (`load_halves`; the model dtype
    `dtype`): K rotated (after Qwen3's norm) and rounded to the model dtype as the rotary kernel leaves it, then K
    and V written into cache slot `slot` (quantized for an fp8 cache, as `store_kv` does). `mask` [heads, half];
    offs_d the half's columns. The decode kernel's stage 1 calls it too (decode_attention's `new`)."""
    half: tl.constexpr = HEAD_DIM // 2
    k1, k2 = norm_rotate(k1, k2, KW, offs_d, d_mask, cos, sin, eps, dtype, HEAD_DIM, HAS_NORM)
    k1 = k1.to(dtype).to(tl.float32)
    k2 = k2.to(dtype).to(tl.float32)
    k_dst = K_buf + slot * stride_kbs + offs_h[:, None].to(tl.int64) * stride_kbh + offs_d[None, :]
    v_dst = V_buf + slot * stride_vbs + offs_h[:, None].to(tl.int64) * stride_vbh + offs_d[None, :]
    if KV_FP8 == 0:
        tl.store(k_dst, k1.to(K_buf.dtype.element_ty), mask=mask)
        tl.store(k_dst + half, k2.to(K_buf.dtype.element_ty), mask=mask)
        tl.store(v_dst, v1.to(V_buf.dtype.element_ty), mask=mask)
        tl.store(v_dst + half, v2.to(V_buf.dtype.element_ty), mask=mask)
    else:
        tl.store(k_dst, _fp8_byte(k1, K_scale, KV_FP8), mask=mask)
        tl.store(k_dst + half, _fp8_byte(k2, K_scale, KV_FP8), mask=mask)
        tl.store(v_dst, _fp8_byte(v1, V_scale, KV_FP8), mask=mask)
        tl.store(v_dst + half, _fp8_byte(v2, V_scale, KV_FP8), mask=mask)


# The rotation is the rotary kernel's own `norm_rotate`, rounding for rounding (`layers/triton_ops/rotary.py`; the
# tests compare bits); the K/V branch is `rotate_store_kv`, which decode stage 1 calls too.
@triton.jit
def _rope_store_kernel(
    Positions, Loc, Q, K, V, Q_out, K_buf, V_buf, Cos_sin, QW, KW, K_scale, V_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh, stride_cs, eps,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, HAS_NORM: tl.constexpr, KV_FP8: tl.constexpr,
    PDL: tl.constexpr = False, X=None, stride_x=0, x_cols=1, eps_x=0.0, X_NORM: tl.constexpr = False,
    BLOCK_X: tl.constexpr = 1,
):
    if PDL:  # layers/triton_ops/pdl.py: nothing read or written before the wait; the trigger is at the end
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    q_blocks: tl.constexpr = (NUM_Q_HEADS + BLOCK_H - 1) // BLOCK_H
    half: tl.constexpr = HEAD_DIM // 2
    dt = Q.dtype.element_ty  # the model dtype: every step below is rounded to it, as HF rounds
    pos = tl.load(Positions + t).to(tl.int64)
    if X_NORM:  # the deferred input norm (Rope.x_rms): the token's residual-stream row, for its scale
        offs_x = tl.arange(0, BLOCK_X)
        x_row = tl.load(X + t * stride_x + offs_x, mask=offs_x < x_cols, other=0.0)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < half
    cos = tl.load(Cos_sin + pos * stride_cs + offs_d, mask=d_mask, other=0.0).to(dt).to(tl.float32)[None, :]
    sin = tl.load(Cos_sin + pos * stride_cs + half + offs_d, mask=d_mask, other=0.0).to(dt).to(tl.float32)[None, :]
    if block < q_blocks:
        offs_h = block * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = (offs_h < NUM_Q_HEADS)[:, None] & d_mask[None, :]
        x1, x2 = load_halves(Q + t * stride_qt, offs_h, stride_qh, offs_d, mask, HEAD_DIM)
        if X_NORM:
            inv_rms = inv_rms_of(x_row, x_cols, eps_x)
            x1, x2 = scaled(x1, inv_rms, dt), scaled(x2, inv_rms, dt)
        out1, out2 = norm_rotate(x1, x2, QW, offs_d, d_mask, cos, sin, eps, dt, HEAD_DIM, HAS_NORM)
        dst = Q_out + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
        tl.store(dst, out1.to(dt), mask=mask)
        tl.store(dst + half, out2.to(dt), mask=mask)
    else:
        offs_h = (block - q_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = (offs_h < NUM_KV_HEADS)[:, None] & d_mask[None, :]
        k1, k2 = load_halves(K + t * stride_kt, offs_h, stride_kh, offs_d, mask, HEAD_DIM)
        v1, v2 = load_halves(V + t * stride_vt, offs_h, stride_vh, offs_d, mask, HEAD_DIM)
        if X_NORM:
            inv_rms = inv_rms_of(x_row, x_cols, eps_x)
            k1, k2 = scaled(k1, inv_rms, dt), scaled(k2, inv_rms, dt)
            v1, v2 = scaled(v1, inv_rms, dt), scaled(v2, inv_rms, dt)
        rotate_store_kv(k1, k2, v1, v2, K_buf, V_buf, tl.load(Loc + t).to(tl.int64), offs_h, mask, offs_d, d_mask,
                        cos, sin, KW, K_scale, V_scale, stride_kbs, stride_kbh, stride_vbs, stride_vbh, eps, dt,
                        HEAD_DIM, HAS_NORM, KV_FP8)
    if PDL:  # the decode kernel's programs come in as this grid's last programs finish (pdl.py)
        tl.extra.cuda.gdc_launch_dependents()


def rope_store_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  cos_sin_cache: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor,
                  q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
                  eps: float = 1e-6, kv_fp8: torch.dtype | None = None, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None, x_rms: torch.Tensor | None = None,
                  x_rms_eps: float = 1e-6) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] before rotary (last dim contiguous, any other strides; not written);
    positions and loc [T]; cos_sin_cache fp32 [max_pos, D] (cos | sin); k_buf/v_buf [slots, Hkv, D] as stored.
    Writes rotated k and v at `loc` and returns rotated q as a new [T, H, D] tensor in q's dtype.

    With norm weights [D] (both or neither) each q/k head is RMS-normalised first. `kv_fp8`: the fp8 dtype of
    a cache stored as uint8, values stored as x / scale (`k_scale` / `v_scale`: float32 device tensors).
    Rows sharing a slot (padded rows of a captured batch all write the sink) race, harmlessly.

    `x_rms` [T, hidden] (last dim contiguous): q, k and v are the projection of these rows bare, the layer's input
    RMSNorm deferred; each is first scaled by its row's inverse RMS (eps `x_rms_eps`), rounded to the model dtype
    (`layers.norm.scale_by_inv_rms`).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    has_norm = q_norm_weight is not None
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim) and head_dim % 2 == 0
    assert has_norm == (k_norm_weight is not None) and q.dtype == k.dtype
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1 and k_buf.stride(2) == 1
    assert v_buf.stride(2) == 1 and cos_sin_cache.stride(1) == 1
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.shape[1] == head_dim
    fp8 = 0
    if kv_fp8 is not None:
        assert k_buf.dtype == torch.uint8 and k_scale is not None and v_scale is not None
        fp8 = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}[kv_fp8]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    block_half = triton.next_power_of_2(head_dim // 2)
    block_h = min(triton.next_power_of_2(max(num_q_heads, num_kv_heads)), max(1, 512 // block_half))
    grid = (num_tokens, triton.cdiv(num_q_heads, block_h) + triton.cdiv(num_kv_heads, block_h))
    pdl = pdl_enabled(q)
    x_args = {}
    if x_rms is not None:
        assert x_rms.shape[0] == num_tokens and x_rms.stride(1) == 1 and x_rms.dtype == q.dtype
        x_args = dict(X=x_rms, stride_x=x_rms.stride(0), x_cols=x_rms.shape[1], eps_x=x_rms_eps, X_NORM=True,
                      BLOCK_X=triton.next_power_of_2(x_rms.shape[1]))
    _rope_store_kernel[grid](
        positions, loc, q, k, v, q_out, k_buf, v_buf, cos_sin_cache,
        q_norm_weight if has_norm else q, k_norm_weight if has_norm else k,  # unread without the norm
        loc if k_scale is None else k_scale, loc if v_scale is None else v_scale,  # unread without fp8
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), q_out.stride(0),
        q_out.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        cos_sin_cache.stride(0), eps,
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_H=block_h,
        BLOCK_HALF=block_half, HAS_NORM=has_norm, KV_FP8=fp8, PDL=pdl, launch_pdl=pdl,
        num_warps=4 if block_h * block_half >= 256 or x_rms is not None else 1, **x_args,
    )
    return q_out
