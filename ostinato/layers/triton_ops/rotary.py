"""Rotary embedding (HF "rotate half" layout) applied in place to q and k, optionally after Qwen3's
per-head RMSNorm, in one launch.

Grid (T, q head blocks + k head blocks): a program rotates BLOCK_H heads of one token. q and k may be
strided views into the fused qkv projection output; only their last dim must be contiguous.

Numerics: exactly HF's order of rounding, so that bf16 logits track HF's: the optional norm as HF's RMSNorm
(normalised row, then the weight product, each rounded to the model dtype), cos/sin rounded to the model
dtype, and q * cos, rotate_half(q) * sin and their sum each rounded to it. Products are taken in fp32 from
model-dtype values, which is what torch does for a bf16/fp16 multiply, so the kernel and the torch twin
agree to the bit but for fp32 rounding-mode details (FMA contraction in fp32 models). Rounding once from
fp32 would be closer to exact, but drifted further from HF's bf16 logits (llama-3.2-1b, dummy weights,
teacher-forced through the torch twins and torch attention: 3.1e-2 relative logit error against 2.2e-2).
"""

import torch
import triton
import triton.language as tl

from ostinato.layers.triton_ops.pdl import enabled as pdl_enabled


@triton.jit
def _round(x, dtype: tl.constexpr):
    """fp32 x rounded to `dtype`, back in fp32."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def norm_rotate(x1, x2, W, offs_d, d_mask, cos, sin, eps, dtype: tl.constexpr, HEAD_DIM: tl.constexpr,
                HAS_NORM: tl.constexpr):
    """Heads' halves x1, x2 ([heads, half], fp32) -> their rotated halves (fp32), every product and sum rounded
    to `dtype` as HF's code rounds, except the last rounding, which the caller's store does; with HAS_NORM,
    Qwen3's q/k RMS norm (weight W) first. The rotary kernel and the fused rotary + KV store share it."""
    if HAS_NORM:  # the weight's loads first: issued before the sums wait on x
        w1 = tl.load(W + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(W + HEAD_DIM // 2 + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        inv_rms = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)[:, None]
        x1 = _round(w1 * _round(x1 * inv_rms, dtype), dtype)
        x2 = _round(w2 * _round(x2 * inv_rms, dtype), dtype)
    out1 = _round(x1 * cos, dtype) - _round(x2 * sin, dtype)
    out2 = _round(x2 * cos, dtype) + _round(x1 * sin, dtype)
    return out1, out2


@triton.jit
def _rotate_heads(X, stride_h, head0, num_heads, W, cos, sin, eps,
                  HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, HAS_NORM: tl.constexpr):
    half: tl.constexpr = HEAD_DIM // 2
    offs_h = head0 + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < half
    mask = (offs_h < num_heads)[:, None] & d_mask[None, :]
    ptr = X + offs_h[:, None] * stride_h + offs_d[None, :]
    # every value is loaded before anything is stored: in place is safe
    x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + half, mask=mask, other=0.0).to(tl.float32)
    out1, out2 = norm_rotate(x1, x2, W, offs_d, d_mask, cos, sin, eps, X.dtype.element_ty, HEAD_DIM, HAS_NORM)
    tl.store(ptr, out1.to(X.dtype.element_ty), mask=mask)
    tl.store(ptr + half, out2.to(X.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    Positions, Q, K, Cos_sin, QW, KW,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs, eps,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, HAS_NORM: tl.constexpr, PDL: tl.constexpr = False,
):
    if PDL:  # layers/triton_ops/pdl.py: nothing read or written before the wait
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    q_blocks: tl.constexpr = (NUM_Q_HEADS + BLOCK_H - 1) // BLOCK_H
    half: tl.constexpr = HEAD_DIM // 2
    pos = tl.load(Positions + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < half
    dt = Q.dtype.element_ty
    cos = _round(tl.load(Cos_sin + pos * stride_cs + offs_d, mask=d_mask, other=0.0), dt)[None, :]
    sin = _round(tl.load(Cos_sin + pos * stride_cs + half + offs_d, mask=d_mask, other=0.0), dt)[None, :]
    if block < q_blocks:
        _rotate_heads(Q + t * stride_qt, stride_qh, block * BLOCK_H, NUM_Q_HEADS, QW, cos, sin, eps,
                      HEAD_DIM, BLOCK_H, BLOCK_HALF, HAS_NORM)
    else:
        _rotate_heads(K + t * stride_kt, stride_kh, (block - q_blocks) * BLOCK_H, NUM_KV_HEADS, KW, cos, sin, eps,
                      HEAD_DIM, BLOCK_H, BLOCK_HALF, HAS_NORM)


def _rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                      head_dim: int, q_norm_weight: torch.Tensor | None = None,
                      k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6) -> None:
    num_tokens, num_q_heads, _ = q.shape
    num_kv_heads = k.shape[1]
    has_norm = q_norm_weight is not None
    assert q.shape[2] == k.shape[2] == head_dim and head_dim % 2 == 0 and has_norm == (k_norm_weight is not None)
    assert q.dtype == k.dtype and q.stride(2) == 1 and k.stride(2) == 1 and cos_sin_cache.stride(1) == 1
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.shape[1] == head_dim
    if num_tokens == 0:
        return
    block_half = triton.next_power_of_2(head_dim // 2)
    block_h = min(triton.next_power_of_2(max(num_q_heads, num_kv_heads)), max(1, 512 // block_half))
    grid = (num_tokens, triton.cdiv(num_q_heads, block_h) + triton.cdiv(num_kv_heads, block_h))
    pdl = pdl_enabled(q)
    _rotary_kernel[grid](
        positions, q, k, cos_sin_cache,
        q_norm_weight if has_norm else q, k_norm_weight if has_norm else k,  # unread without the norm
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0), eps,
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=block_h, BLOCK_HALF=block_half, HAS_NORM=has_norm, num_warps=4 if block_h * block_half >= 256 else 1,
        PDL=pdl, launch_pdl=pdl,
    )


rotary_embedding_op = torch.library.custom_op("ostinato::rotary_embedding", _rotary_embedding,
                                              mutates_args=("q", "k"))


@rotary_embedding_op.register_fake
def _(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, head_dim: int,
      q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
      eps: float = 1e-6) -> None:
    return None


def rotary_embedding_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                      head_dim: int, q_norm_weight: torch.Tensor | None = None,
                      k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6) -> None:
    """In place: q [T, H, D], k [T, Hkv, D] (last dim contiguous, any other strides); positions [T];
    cos_sin_cache fp32 [max_pos, D] (cos in the first half, sin in the second).
    With norm weights [D], each head is RMS-normalised first (both or neither)."""
    # the custom op only where torch.compile needs an opaque node: its eager dispatch costs ~25 us a call
    op = rotary_embedding_op if torch.compiler.is_compiling() else _rotary_embedding
    op(positions, q, k, cos_sin_cache, head_dim, q_norm_weight, k_norm_weight, eps)
