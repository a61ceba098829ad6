"""Split-KV (flash-decoding) attention for one query token per request over the paged cache.

Stage 1, grid (num_kv_heads, bs, max_kv_splits): a program takes the GQA group of query heads that
share one KV head (padded to >= 16 rows so the scores are a tl.dot), walks its split of the request's
tokens through `req_to_token`, and writes the split's normalised partial output and log2-sum-exp.
Stage 2, grid (bs, num_heads): merges a request's splits.

The split count of a request lives on the device (`num_kv_splits[b]`, or counted by the kernels from its length),
so the grid is fixed and the launch can be captured in a CUDA graph: programs whose split index is past the count
exit at once.

With `new` (small decode batches: `TritonAttentionBackend.rope_attend`) stage 1 also does rope_store.py's work:
q comes before rotary and each program rotates its group's heads, and the program whose split holds the new token
rotates and stores that token's K/V before it walks its keys; with the layer's input norm deferred
(`NewTokens.x_rms`), q, k and v are first scaled by the inverse RMS of the request's residual-stream row.
"""

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ostinato.attention.triton_ops.paged_softmax import (
    LOG2E,
    attend_kv_block,
    bits_factor,
    block_slots,
    fp8_code,
    fp8_to_fp16_fixed,
    kv_to_dot,
    load_tile,
    page_arg,
)
from ostinato.attention.triton_ops.rope_store import inv_rms_of, rotate_store_kv
from ostinato.layers.triton_ops.l2_prefetch import lines_for, prefetch_rows
from ostinato.layers.triton_ops.pdl import enabled as pdl_enabled
from ostinato.layers.triton_ops.rotary import norm_rotate

# decode_attention's `early_kv` (OSTINATO_DECODE_EARLY_KV=0: never)
EARLY_KV = os.environ.get("OSTINATO_DECODE_EARLY_KV", "1") != "0"
# Stage 1 addresses K/V rows with int32 offsets where every element of the cache is within 2**31 of its start
# (OSTINATO_DECODE_OFFS32=0: always int64). The key loop's 64-bit products are a fifth of its SASS: per 128 keys,
# Qwen3-0.6B heads at bs 32's entry 2,276 -> 1,828 instructions, Llama-3.2-1B's 1,416 -> 1,192 (Triton 3.6, sm_90,
# `benchmarks/sass_decode_attention.py`), and at 32 rows the loop is bound by its warps' instruction issue. On the
# H200, a step: Qwen3-0.6B bs 1 0.645 -> 0.631 ms, bs 32 x 256 1.137 -> 1.119; Llama-3.2-1B bs 1 0.843 -> 0.835
# (docs/gpu-notes.md, fortieth session).
OFFS32 = os.environ.get("OSTINATO_DECODE_OFFS32", "1") != "0"


def int32_offsets(*bufs: torch.Tensor) -> bool:
    """Whether every element of each buffer lies within an int32 element offset of its first."""
    return all(_last_offset_fits(tuple(b.shape), b.stride()) for b in bufs)


@functools.cache
def _last_offset_fits(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    # cached: decode_attention asks once a layer and step, always about the same few KV buffers
    return sum((n - 1) * st for n, st in zip(shape, stride, strict=True) if n > 0) < 2**31


@triton.jit
def _combine_if_last(Counter, counter_idx, num_splits, b, heads, h_mask, offs_d, d_mask, Mid_o, Mid_lse, Out,
                     stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh,
                     BLOCK_S: tl.constexpr):
    """After a split program stored its partials: count it, and if it is the request's (and head group's) last
    split to finish, combine every split into Out (stage 2's math, all splits of all the program's heads loaded
    at once) and reset the count to 0 for the next launch. The barrier puts every thread's partial stores before
    the release; the reads bypass L1 (other SMs wrote them, and this SM may hold an older line)."""
    tl.debug_barrier()
    done = tl.atomic_add(Counter + counter_idx, 1, sem="acq_rel", scope="gpu")
    if done == num_splits - 1:
        tl.debug_barrier()
        tl.store(Counter + counter_idx, 0)
        H: tl.constexpr = heads.shape[0]
        D: tl.constexpr = offs_d.shape[0]
        offs_s = tl.arange(0, BLOCK_S)
        hs_mask = h_mask[:, None] & (offs_s < num_splits)[None, :]
        lse = tl.load(Mid_lse + b * stride_mlb + heads[:, None] * stride_mlh + offs_s[None, :], mask=hs_mask,
                      other=float("-inf"), cache_modifier=".cg")  # [H, S]; split 0 is never empty
        w = tl.exp2(lse - tl.max(lse, 1)[:, None])
        rows = (heads[:, None] * stride_moh + offs_s[None, :] * stride_mos).reshape(H * BLOCK_S)
        part = tl.load(Mid_o + b * stride_mob + rows[:, None] + offs_d[None, :],
                       mask=hs_mask.reshape(H * BLOCK_S)[:, None] & d_mask[None, :], other=0.0,
                       cache_modifier=".cg").reshape(H, BLOCK_S, D)
        acc = tl.sum(part * w[:, :, None], 1)
        tl.store(Out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 (acc / tl.sum(w, 1)[:, None]).to(Out.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])


@triton.jit
def splits_for(seq_len, min_tokens, max_splits):
    """compute_num_kv_splits' rule for one request: ceil(seq_len / min_tokens) in [1, max_splits]."""
    return tl.minimum(tl.maximum((seq_len + min_tokens - 1) // min_tokens, 1), max_splits)


@triton.jit
def _num_splits(Num_kv_splits, Seq_lens, b, min_tokens, max_splits, SPLITS_FROM_LEN: tl.constexpr):
    """Request b's split count: Num_kv_splits[b], or with SPLITS_FROM_LEN counted here from its length (a
    captured step then needs no launches to fill the tensor, and no kernel ahead of stage 1 writes what it reads)."""
    if SPLITS_FROM_LEN:
        return splits_for(tl.load(Seq_lens + b), min_tokens, max_splits)
    return tl.load(Num_kv_splits + b)


@triton.jit
def split_bounds(seq_len, num_splits, split, BLOCK: tl.constexpr):
    """Tokens [start, end) of split `split` of a request's seq_len in num_splits, and the splits' length: whole
    BLOCKs long, so the last splits may be short or empty."""
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK) * BLOCK
    start = split * per_split
    return start, tl.minimum(start + per_split, seq_len), per_split


@triton.jit
def _halves(x, HEAD_DIM: tl.constexpr):
    """Rows [n, HEAD_DIM] (HEAD_DIM a power of two) -> their two halves [n, HEAD_DIM / 2], fp32."""
    x1, x2 = tl.split(tl.permute(tl.reshape(x.to(tl.float32), [x.shape[0], 2, HEAD_DIM // 2]), (0, 2, 1)))
    return x1, x2


@triton.jit
def _load_new_token(Q, K_new, V_new, Positions, Loc, b, kv_head, heads, h_mask,
                    stride_qb, stride_qh, stride_knt, stride_knh, stride_vnt, stride_vnh, X, stride_x, x_cols,
                    HEAD_DIM: tl.constexpr, X_NORM: tl.constexpr, BLOCK_X: tl.constexpr):
    """rope_attend's loads for one request and KV head, all before rotary, raw (stage 1 issues them with its other
    first loads, and uses none before rotary's cos / sin rows are asked for): the position, the group's q rows,
    the new token's slot and K / V rows of this KV head (every program loads those; only the one whose split
    holds the token stores them), and with X_NORM the request's residual-stream row (the deferred input norm)."""
    offs = tl.arange(0, HEAD_DIM)[None, :]
    pos = tl.load(Positions + b, volatile=True).to(tl.int64)  # volatile: see _decode_stage1_kernel
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs, mask=h_mask[:, None], other=0.0)
    one_head = kv_head + tl.arange(0, 1)
    k = tl.load(K_new + b * stride_knt + one_head[:, None] * stride_knh + offs)
    v = tl.load(V_new + b * stride_vnt + one_head[:, None] * stride_vnh + offs)
    slot = tl.load(Loc + b).to(tl.int64)
    x_row = pos  # unread without X_NORM
    if X_NORM:
        offs_x = tl.arange(0, BLOCK_X)
        x_row = tl.load(X + b * stride_x + offs_x, mask=offs_x < x_cols, other=0.0)
    return pos, q, k, v, slot, x_row


@triton.jit
def _rope_q_store_kv(pos, q, k, v, slot, x_row, K_buf, V_buf, Cos_sin, QW, KW, K_scale, V_scale,
                     kv_head, h_mask, stores, stride_kbs, stride_kbh, stride_vbs, stride_vbh, stride_cs, eps,
                     x_cols, eps_x, dtype: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_D: tl.constexpr, HAS_NORM: tl.constexpr, KV_FP8: tl.constexpr, X_NORM: tl.constexpr):
    """rope_store.py's work for one request and KV head, inside stage 1, on `_load_new_token`'s values: the group's
    query heads rotated (returned as [BLOCK_H, BLOCK_D] in the model dtype `dtype`, the padding rows 0) and, where
    `stores` (the program whose split holds the new token), the new token's K rotated and V written into its slot,
    with rope_store's roundings, so the bits are the unfused path's. HEAD_DIM a power of two (the halves joined
    side by side make the row). With X_NORM, q, k and v are first scaled by the inverse RMS of x_row (the deferred
    input norm), as rope_store does."""
    half: tl.constexpr = HEAD_DIM // 2
    if X_NORM:
        inv_rms = inv_rms_of(x_row, x_cols, eps_x)
        q = (q.to(tl.float32) * inv_rms).to(dtype)
        k = (k.to(tl.float32) * inv_rms).to(dtype)
        v = (v.to(tl.float32) * inv_rms).to(dtype)
    offs_d = tl.arange(0, half)
    d_mask = offs_d < half
    # [1, half] rows (not [half] vectors broadcast): in the heads' layout, no shared-memory shuffle after the loads
    row = Cos_sin + pos * stride_cs + offs_d[None, :]
    cos = tl.load(row).to(dtype).to(tl.float32)
    sin = tl.load(row + half).to(dtype).to(tl.float32)
    x1, x2 = _halves(q, HEAD_DIM)
    q1, q2 = norm_rotate(x1, x2, QW, offs_d, d_mask, cos, sin, eps, dtype, HEAD_DIM, HAS_NORM)
    q1 = tl.where(h_mask[:, None], q1, 0.0).to(dtype)  # padding rows: 0, as a masked load gives (the norm's eps
    q2 = tl.where(h_mask[:, None], q2, 0.0).to(dtype)  # leaves them 0 too; kept explicit)
    q = tl.reshape(tl.permute(tl.join(q1, q2), (0, 2, 1)), (BLOCK_H, BLOCK_D))
    if stores:  # this KV head of the new token, as one [1, half] row
        one_head = kv_head + tl.arange(0, 1)
        k1, k2 = _halves(k, HEAD_DIM)
        v1, v2 = _halves(v, HEAD_DIM)
        rotate_store_kv(k1, k2, v1, v2, K_buf, V_buf, slot, one_head, (one_head >= 0)[:, None] & d_mask[None, :],
                        offs_d, d_mask, cos, sin, KW, K_scale, V_scale, stride_kbs, stride_kbh, stride_vbs,
                        stride_vbh, eps, dtype, HEAD_DIM, HAS_NORM, KV_FP8)
        tl.debug_barrier()  # the stores before any of this program's threads loads the slot back
    return q


@triton.jit
def _attend_kv_block_folded(
    q, acc, m_i, l_i, n0, kv_end, K_buf, V_buf, req_row, kv_head, stride_kbs, stride_kbh, stride_vbs, stride_vbh,
    offs_d, d_mask, qk_scale, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    PAGE: tl.constexpr, KV_FP8: tl.constexpr, V_CVT: tl.constexpr, MASK_N: tl.constexpr, MASK_D: tl.constexpr,
):
    """attend_kv_block with the dot's rows folded over the keys (stage 1's FOLD): q holds the GROUP query heads
    CHUNKS = BLOCK_H / GROUP times (row r: head r % GROUP, chunk r // GROUP), and row r keeps the online softmax of
    its chunk of the block, keys n0 + chunk * W .. + W. One q.K^T over all BLOCK_N keys (the same tensor-core work
    as BLOCK_N / W padded dots) gives every row every score; each row keeps its chunk's by an in-register select,
    so the softmax runs on [BLOCK_H, W], none of it on padding rows. p goes back block-diagonally ([BLOCK_H,
    BLOCK_N], 0 outside a row's chunk) into p.V. A row may see no key of a block (its chunk past kv_end): its
    running max then stays -inf, and the shift below keeps its terms 0, not NaN."""
    BLOCK_H: tl.constexpr = q.shape[0]
    CHUNKS: tl.constexpr = BLOCK_H // GROUP
    W: tl.constexpr = BLOCK_N // CHUNKS
    slots, offs_n, n_mask = block_slots(req_row, n0, kv_end, BLOCK_N, PAGE, MASK_N)
    k = load_tile(K_buf + slots[None, :] * stride_kbs + kv_head.to(tl.int64) * stride_kbh + offs_d[:, None],
                  d_mask, n_mask, MASK_D, MASK_N)  # [BLOCK_D, BLOCK_N]
    s_all = tl.dot(q, kv_to_dot(k, KV_FP8, False, q.dtype), input_precision=PRECISION)  # [BLOCK_H, BLOCK_N]
    chunk = tl.arange(0, BLOCK_H) // GROUP
    own = chunk[:, None] == tl.arange(0, CHUNKS)[None, :]  # [BLOCK_H, CHUNKS]: a row's chunk
    s = tl.sum(tl.where(own[:, :, None], tl.reshape(s_all, [BLOCK_H, CHUNKS, W]), 0.0), 1) * qk_scale
    if MASK_N:
        s = tl.where(n0 + chunk[:, None] * W + tl.arange(0, W)[None, :] < kv_end, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - shift)
    p = tl.exp2(s - shift[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = load_tile(V_buf + slots[:, None] * stride_vbs + kv_head.to(tl.int64) * stride_vbh + offs_d[None, :],
                  n_mask, d_mask, MASK_N, MASK_D)  # [BLOCK_N, BLOCK_D]
    if V_CVT:
        v = fp8_to_fp16_fixed(v, KV_FP8)
    else:
        v = kv_to_dot(v, KV_FP8, False, q.dtype)
    p_bd = tl.reshape(tl.where(own[:, :, None], p[:, None, :], 0.0), [BLOCK_H, BLOCK_N])
    acc = acc * alpha[:, None] + tl.dot(p_bd.to(q.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _unfold_rows(acc, m_i, l_i, GROUP: tl.constexpr):
    """FOLD's rows back to one per query head: the CHUNKS rows of a head merged as split-KV's partials are
    (weights 2^(m - max)); a head none of whose chunks saw a key keeps m -inf and l 0."""
    BLOCK_H: tl.constexpr = acc.shape[0]
    BLOCK_D: tl.constexpr = acc.shape[1]
    CHUNKS: tl.constexpr = BLOCK_H // GROUP
    m3 = tl.reshape(m_i, [CHUNKS, GROUP])
    m_h = tl.max(m3, 0)
    w = tl.exp2(m3 - tl.where(m_h == float("-inf"), 0.0, m_h)[None, :])
    l_h = tl.sum(tl.reshape(l_i, [CHUNKS, GROUP]) * w, 0)
    acc_h = tl.sum(tl.reshape(acc, [CHUNKS, GROUP, BLOCK_D]) * w[:, :, None], 0)
    return acc_h, m_h, l_h


@triton.jit
def _decode_stage1_kernel(
    Q, K_buf, V_buf, Req_to_token, Req_pool_indices, Seq_lens, Num_kv_splits, Mid_o, Mid_lse, K_scale, V_scale,
    qk_scale,  # softmax scale * log2(e): scores live in the log2 domain
    stride_qb, stride_qh, stride_kbs, stride_kbh, stride_vbs, stride_vbh, stride_r2t,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    PAGE: tl.constexpr, KV_FP8: tl.constexpr, FP16_DOT: tl.constexpr,
    V_CVT: tl.constexpr = False, CVT_BITS: tl.constexpr = False, QK_FP8: tl.constexpr = False,
    BITS_FACTOR: tl.constexpr = 1.0, WHOLE_BLOCKS: tl.constexpr = False,
    Counter=None, Out=None, stride_ob=0, stride_oh=0, COMBINE: tl.constexpr = False, BLOCK_S: tl.constexpr = 1,
    GROUP_P2: tl.constexpr = 1, PDL: tl.constexpr = False,
    Positions=None, Loc=None, K_new=None, V_new=None, Cos_sin=None, QW=None, KW=None,
    stride_knt=0, stride_knh=0, stride_vnt=0, stride_vnh=0, stride_cs=0, eps=0.0,
    ROPE: tl.constexpr = False, HAS_NORM: tl.constexpr = False, FOLD: tl.constexpr = False,
    X=None, stride_x=0, x_cols=1, eps_x=0.0, X_NORM: tl.constexpr = False, BLOCK_X: tl.constexpr = 1,
    KV_LINES: tl.constexpr = 0, KV_BLOCKS: tl.constexpr = 1, min_tokens=1, SPLITS_FROM_LEN: tl.constexpr = False,
    OFFS32: tl.constexpr = False,
):
    kv_head = tl.program_id(0)  # a request's KV heads are neighbours in launch order (see decode_attention)
    b = tl.program_id(1)
    split = tl.program_id(2)
    # The loads that need only the program's ids go out before the first wait on any (the exit of a program past
    # the request's splits), so their round trips overlap; volatile ones, because the compiler would sink plain
    # loads past the exit. Loaded where first used, the rotary path had waited on five round trips in turn before
    # it asked for the first key block's slots; now on two (sm_90 SASS: the splits with the position, then cos /
    # sin with q). KV_LINES: before the PDL wait (none of them is the kernel ahead's output: decode_attention's
    # `early_kv`), and then the split's first KV_BLOCKS key blocks go to L2 (their K and V rows' first KV_LINES
    # lines)
    if PDL and KV_LINES == 0:  # layers/triton_ops/pdl.py: nothing read or written before the wait
        tl.extra.cuda.gdc_wait()
    if SPLITS_FROM_LEN:
        seq_len = tl.load(Seq_lens + b, volatile=True)
        num_splits = splits_for(seq_len, min_tokens, tl.num_programs(2))
    else:
        num_splits = tl.load(Num_kv_splits + b)
        seq_len = tl.load(Seq_lens + b, volatile=True)
    req = tl.load(Req_pool_indices + b, volatile=True).to(tl.int64)
    if KV_LINES:
        if split < num_splits:
            first, last, per = split_bounds(seq_len, num_splits, split, BLOCK_N)
            for blk in tl.static_range(KV_BLOCKS):
                if first + blk * BLOCK_N < last:
                    slots, _, _ = block_slots(Req_to_token + req * stride_r2t, first + blk * BLOCK_N, last,
                                              BLOCK_N, PAGE)
                    prefetch_rows(K_buf + kv_head.to(tl.int64) * stride_kbh, slots, stride_kbs, HEAD_DIM, KV_LINES)
                    prefetch_rows(V_buf + kv_head.to(tl.int64) * stride_vbh, slots, stride_vbs, HEAD_DIM, KV_LINES)
        if PDL:
            tl.extra.cuda.gdc_wait()
    v_scale = 1.0
    if KV_FP8:  # dequantize by folding the layer's scales into the scores and the output
        qk_scale = qk_scale * tl.load(K_scale)
        v_scale = tl.load(V_scale)
        if CVT_BITS:  # bit-moved fp8 comes out BITS_FACTOR too small
            qk_scale = qk_scale * BITS_FACTOR
            v_scale = v_scale * BITS_FACTOR
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h
    if FOLD:  # every row a query head: the group's heads once per chunk of the key blocks
        heads = kv_head * GROUP + offs_h % GROUP
        h_mask = offs_h >= 0
    if ROPE:  # Q, K_new, V_new before rotary: rotated below, and the new token's split stores its K/V first
        new_token = _load_new_token(Q, K_new, V_new, Positions, Loc, b, kv_head, heads, h_mask, stride_qb,
                                    stride_qh, stride_knt, stride_knh, stride_vnt, stride_vnh, X, stride_x, x_cols,
                                    HEAD_DIM, X_NORM, BLOCK_X)
    else:
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    if split >= num_splits:
        return
    # splits are whole blocks long; the last ones may be empty (they then write lse = -inf)
    start, end, per_split = split_bounds(seq_len, num_splits, split, BLOCK_N)
    if ROPE:
        pos, q_raw, k_new, v_new, slot, x_row = new_token
        q = _rope_q_store_kv(pos, q_raw, k_new, v_new, slot, x_row, K_buf, V_buf, Cos_sin, QW, KW, K_scale,
                             V_scale, kv_head, h_mask, split == (seq_len - 1) // per_split, stride_kbs, stride_kbh,
                             stride_vbs, stride_vbh, stride_cs, eps, x_cols, eps_x, Q.dtype.element_ty, HEAD_DIM,
                             BLOCK_H, BLOCK_D, HAS_NORM, KV_FP8, X_NORM)
    if QK_FP8:  # q per row to e4m3 (max 448), its row scale folded into the score scale
        q = q.to(tl.float32)
        amax = tl.max(tl.abs(q), 1)
        q_scale = tl.where(amax > 0, amax / 448.0, 1.0)
        q = (q / q_scale[:, None]).to(tl.float8e4nv)
        qk_scale = qk_scale * q_scale[:, None]  # [BLOCK_H, 1]: scales each row's scores
    elif FP16_DOT:  # fp8 -> fp16 is one conversion instruction on Hopper; fp8 -> bf16 goes through fp32
        q = q.to(tl.float16)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    req_row = Req_to_token + req * stride_r2t
    if FOLD:
        whole_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
        for n0 in range(start, whole_end, BLOCK_N):
            acc, m_i, l_i = _attend_kv_block_folded(
                q, acc, m_i, l_i, n0, end, K_buf, V_buf, req_row, kv_head, stride_kbs, stride_kbh, stride_vbs,
                stride_vbh, offs_d, d_mask, qk_scale, GROUP, BLOCK_N, PRECISION, PAGE, KV_FP8, V_CVT,
                MASK_N=False, MASK_D=HEAD_DIM != BLOCK_D)
        if whole_end < end:
            acc, m_i, l_i = _attend_kv_block_folded(
                q, acc, m_i, l_i, whole_end, end, K_buf, V_buf, req_row, kv_head, stride_kbs, stride_kbh,
                stride_vbs, stride_vbh, offs_d, d_mask, qk_scale, GROUP, BLOCK_N, PRECISION, PAGE, KV_FP8, V_CVT,
                MASK_N=True, MASK_D=HEAD_DIM != BLOCK_D)
        acc, m_i, l_i = _unfold_rows(acc, m_i, l_i, GROUP)
        heads = kv_head * GROUP + tl.arange(0, GROUP)
        h_mask = heads >= 0
    elif WHOLE_BLOCKS:  # the whole blocks without key masks, then the request's last partial block with them
        whole_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
        for n0 in range(start, whole_end, BLOCK_N):
            acc, m_i, l_i = attend_kv_block(
                q, acc, m_i, l_i, n0, end, 0, K_buf, V_buf, req_row, kv_head,
                stride_kbs, stride_kbh, stride_vbs, stride_vbh, offs_d, d_mask, qk_scale,
                BLOCK_N=BLOCK_N, CAUSAL=False, PRECISION=PRECISION, PAGE=PAGE, KV_FP8=KV_FP8,
                V_CVT=V_CVT, CVT_BITS=CVT_BITS, QK_FP8=QK_FP8, MASK_N=False, MASK_D=HEAD_DIM != BLOCK_D,
                OFFS32=OFFS32,
            )
        if whole_end < end:
            acc, m_i, l_i = attend_kv_block(
                q, acc, m_i, l_i, whole_end, end, 0, K_buf, V_buf, req_row, kv_head,
                stride_kbs, stride_kbh, stride_vbs, stride_vbh, offs_d, d_mask, qk_scale,
                BLOCK_N=BLOCK_N, CAUSAL=False, PRECISION=PRECISION, PAGE=PAGE, KV_FP8=KV_FP8,
                V_CVT=V_CVT, CVT_BITS=CVT_BITS, QK_FP8=QK_FP8, MASK_D=HEAD_DIM != BLOCK_D, OFFS32=OFFS32,
            )
    else:
        for n0 in range(start, end, BLOCK_N):
            acc, m_i, l_i = attend_kv_block(
                q, acc, m_i, l_i, n0, end, 0, K_buf, V_buf, req_row, kv_head,
                stride_kbs, stride_kbh, stride_vbs, stride_vbh, offs_d, d_mask, qk_scale,
                BLOCK_N=BLOCK_N, CAUSAL=False, PRECISION=PRECISION, PAGE=PAGE, KV_FP8=KV_FP8,
                V_CVT=V_CVT, CVT_BITS=CVT_BITS, QK_FP8=QK_FP8, OFFS32=OFFS32,
            )

    nonempty = l_i > 0
    out = acc * (v_scale / tl.where(nonempty, l_i, 1.0))[:, None]
    if COMBINE and num_splits == 1:  # the request's only split: its output is final (the combine's bits: weight 1)
        tl.store(Out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :], out.to(Out.dtype.element_ty),
                 mask=h_mask[:, None] & d_mask[None, :])
    else:
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        tl.store(Mid_o + b * stride_mob + heads[:, None] * stride_moh + split * stride_mos + offs_d[None, :], out,
                 mask=h_mask[:, None] & d_mask[None, :])
        tl.store(Mid_lse + b * stride_mlb + heads * stride_mlh + split, lse, mask=h_mask)
        if COMBINE:  # over the group's heads only (BLOCK_H pads them to a dot's 16 rows)
            offs_g = tl.arange(0, GROUP_P2)
            _combine_if_last(Counter, b * tl.num_programs(0) + kv_head, num_splits, b, kv_head * GROUP + offs_g,
                             offs_g < GROUP, offs_d, d_mask, Mid_o, Mid_lse, Out, stride_mob, stride_moh,
                             stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh, BLOCK_S)
    if PDL:  # the next kernel's programs come in as this grid's last programs finish (layers/triton_ops/pdl.py)
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _attend_kv_group_block(
    q, acc, m_i, l_i, n0, kv_end, K_buf, V_buf, req_row, head0, stride_kbs, stride_vbs, offs_c, onehot, qk_scale,
    ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, KV_PER_PROG: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, KV_FP8: tl.constexpr, PRECISION: tl.constexpr, MASK_N: tl.constexpr,
):
    """One block of keys for all KV_PER_PROG heads of a program (see _decode_stage1_kv_group_kernel)."""
    slots, offs_n, n_mask = block_slots(req_row, n0, kv_end, BLOCK_N, PAGE, MASK_N)
    k_ptrs = K_buf + slots[None, :] * stride_kbs + head0 + offs_c[:, None]  # [WIDTH, BLOCK_N]
    v_ptrs = V_buf + slots[:, None] * stride_vbs + head0 + offs_c[None, :]  # [BLOCK_N, WIDTH]
    if MASK_N:
        k = tl.load(k_ptrs, mask=n_mask[None, :], other=0)
        v = tl.load(v_ptrs, mask=n_mask[:, None], other=0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    s = tl.dot(q, kv_to_dot(k, KV_FP8, False, q.dtype), input_precision=PRECISION) * qk_scale  # [ROWS, BLOCK_N]
    if MASK_N:
        s = tl.where(n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # widened before the reshape, so V reaches the dot's operand layout as 16-bit values
    v = tl.reshape(kv_to_dot(v, KV_FP8, False, q.dtype), [BLOCK_N * KV_PER_PROG, HEAD_DIM])
    p_all = tl.reshape(tl.where(onehot[:, None, :], p[:, :, None], 0.0), [ROWS, BLOCK_N * KV_PER_PROG])
    acc = acc * alpha[:, None] + tl.dot(p_all.to(q.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _decode_stage1_kv_group_kernel(
    Q, K_buf, V_buf, Req_to_token, Req_pool_indices, Seq_lens, Num_kv_splits, Mid_o, Mid_lse, K_scale, V_scale,
    qk_scale, stride_qb, stride_qh, stride_kbs, stride_vbs, stride_r2t,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, KV_PER_PROG: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, KV_FP8: tl.constexpr, FP16_DOT: tl.constexpr, WHOLE_BLOCKS: tl.constexpr,
    PRECISION: tl.constexpr,
    Counter=None, Out=None, stride_ob=0, stride_oh=0, COMBINE: tl.constexpr = False, BLOCK_S: tl.constexpr = 1,
    PDL: tl.constexpr = False, min_tokens=1, SPLITS_FROM_LEN: tl.constexpr = False,
):
    """Stage 1 for KV_PER_PROG consecutive KV heads per program, so all GROUP * KV_PER_PROG rows of the dots are
    real query heads (one KV head fills only GROUP of the 16 rows a dot needs). The heads of a slot are
    contiguous (a 4 x 64-byte fp8 row), read through one table entry. q.K^T for every head at once: q is block
    diagonal [rows, KV_PER_PROG * HEAD_DIM] (a row holds its query in its KV head's columns, zeros elsewhere)
    against the slots' K rows of all the heads; p.V likewise, p spread block-diagonally over [rows, keys x heads]
    against V as [keys x heads, HEAD_DIM]. The zeros cost tensor-core work, which is not the limit here; the
    softmax's work is no longer on padding rows. V is widened before it is reshaped, so it reaches the dot's
    layout as 16-bit values."""
    kv_group = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)
    if PDL:  # layers/triton_ops/pdl.py: nothing read or written before the wait
        tl.extra.cuda.gdc_wait()
    num_splits = _num_splits(Num_kv_splits, Seq_lens, b, min_tokens, tl.num_programs(2), SPLITS_FROM_LEN)
    if split >= num_splits:
        return
    ROWS: tl.constexpr = GROUP * KV_PER_PROG
    WIDTH: tl.constexpr = KV_PER_PROG * HEAD_DIM
    v_scale = 1.0
    if KV_FP8:
        qk_scale = qk_scale * tl.load(K_scale)
        v_scale = tl.load(V_scale)
    seq_len = tl.load(Seq_lens + b)
    req = tl.load(Req_pool_indices + b).to(tl.int64)
    start, end, per_split = split_bounds(seq_len, num_splits, split, BLOCK_N)

    offs_r = tl.arange(0, ROWS)
    offs_c = tl.arange(0, WIDTH)
    heads = kv_group * ROWS + offs_r
    own = (offs_c // HEAD_DIM)[None, :] == (offs_r // GROUP)[:, None]  # a row's KV head's columns
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + (offs_c % HEAD_DIM)[None, :], mask=own, other=0.0)
    if FP16_DOT:
        q = q.to(tl.float16)
    onehot = (offs_r // GROUP)[:, None] == tl.arange(0, KV_PER_PROG)[None, :]  # [ROWS, KV_PER_PROG]
    head0 = kv_group * KV_PER_PROG * HEAD_DIM  # heads are contiguous within a slot: stride_kbh == HEAD_DIM
    req_row = Req_to_token + req * stride_r2t

    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    if WHOLE_BLOCKS:  # the whole blocks unmasked, then the request's last partial block
        whole_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
        for n0 in range(start, whole_end, BLOCK_N):
            acc, m_i, l_i = _attend_kv_group_block(
                q, acc, m_i, l_i, n0, end, K_buf, V_buf, req_row, head0, stride_kbs, stride_vbs, offs_c, onehot,
                qk_scale, ROWS, HEAD_DIM, KV_PER_PROG, BLOCK_N, PAGE, KV_FP8, PRECISION, MASK_N=False)
        if whole_end < end:
            acc, m_i, l_i = _attend_kv_group_block(
                q, acc, m_i, l_i, whole_end, end, K_buf, V_buf, req_row, head0, stride_kbs, stride_vbs, offs_c,
                onehot, qk_scale, ROWS, HEAD_DIM, KV_PER_PROG, BLOCK_N, PAGE, KV_FP8, PRECISION, MASK_N=True)
    else:
        for n0 in range(start, end, BLOCK_N):
            acc, m_i, l_i = _attend_kv_group_block(
                q, acc, m_i, l_i, n0, end, K_buf, V_buf, req_row, head0, stride_kbs, stride_vbs, offs_c, onehot,
                qk_scale, ROWS, HEAD_DIM, KV_PER_PROG, BLOCK_N, PAGE, KV_FP8, PRECISION, MASK_N=True)

    nonempty = l_i > 0
    out = acc * (v_scale / tl.where(nonempty, l_i, 1.0))[:, None]
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    offs_d = tl.arange(0, HEAD_DIM)
    tl.store(Mid_o + b * stride_mob + heads[:, None] * stride_moh + split * stride_mos + offs_d[None, :], out)
    tl.store(Mid_lse + b * stride_mlb + heads * stride_mlh + split, lse)
    if COMBINE:
        _combine_if_last(Counter, b * tl.num_programs(0) + kv_group, num_splits, b, heads, offs_r < ROWS, offs_d,
                         offs_d < HEAD_DIM, Mid_o, Mid_lse, Out, stride_mob, stride_moh, stride_mos, stride_mlb,
                         stride_mlh, stride_ob, stride_oh, BLOCK_S)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


def fold_applies(group: int, block_n: int) -> bool:
    """Whether stage 1's FOLD fits: a power-of-two GQA group of at most 8 (two or more chunks in the dot's 16 rows),
    and key blocks of at least 8 keys a chunk."""
    return group & (group - 1) == 0 and group <= 8 and block_n % (16 // group) == 0 and block_n // (16 // group) >= 8


def kv_group_size(num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """KV heads per program for the kv_group variant: enough that the query heads fill 16 rows, when the head
    count divides and the shapes are powers of two; else 1 (the variant does not apply)."""
    group = num_heads // num_kv_heads
    n = 16 // group if group < 16 and 16 % group == 0 else 1
    pow2 = head_dim & (head_dim - 1) == 0
    return n if n > 1 and num_kv_heads % n == 0 and pow2 else 1


@triton.jit
def _decode_stage2_kernel(
    Mid_o, Mid_lse, Num_kv_splits, Out,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
    Seq_lens=None, min_tokens=1, max_splits=1, SPLITS_FROM_LEN: tl.constexpr = False,
):
    if PDL:  # layers/triton_ops/pdl.py: nothing read or written before the wait
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    h = tl.program_id(1)
    num_splits = _num_splits(Num_kv_splits, Seq_lens, b, min_tokens, max_splits, SPLITS_FROM_LEN)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(Mid_lse + b * stride_mlb + h * stride_mlh + offs_s, mask=s_mask, other=float("-inf"))
    # split 0 is never empty (seq_len >= 1), so the max is finite
    w = tl.exp2(lse - tl.max(lse, 0))
    part = tl.load(Mid_o + b * stride_mob + h * stride_moh + offs_s[:, None] * stride_mos + offs_d[None, :],
                   mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=d_mask)


# Ways of reading an fp8 cache (decode_attention's keyword arguments; paged_softmax's module doc says what
# each does). benchmarks/bench_decode_attention.py sweeps them; the backend's settings table picks one per
# batch size.
FP8_DECODE_VARIANTS: dict[str, dict] = {
    "cast": dict(),  # fp8 -> q's dtype (bf16 goes through fp32)
    "fp16": dict(fp16_dot=True),  # fp8 -> fp16, one instruction per pair on Hopper
    "fp16_vcvt": dict(fp16_dot=True, v_cvt=True),  # V widened in its loaded layout (CUDA; else "fp16")
    "bits": dict(cvt_bits=True),
    "qk8": dict(qk_fp8=True),
    "qk8_vcvt": dict(qk_fp8=True, v_cvt=True),
    "kv_group": dict(fp16_dot=True, kv_group=True),  # several KV heads per program (see its kernel)
    "fp16_fold": dict(fp16_dot=True, fold=True),  # the dot's rows folded over the keys (see decode_attention)
    "fp16_vcvt_fold": dict(fp16_dot=True, v_cvt=True, fold=True),
}


def table_entry(table: dict[int, dict], bs: int) -> dict:
    """The entry of a settings table keyed by batch size for a batch of `bs`: the largest key <= the next power of
    two of bs (the smallest key when none is), so a batch padded to a captured power-of-two size and the same
    batch run eagerly get the same settings."""
    bucket = 1 << (max(bs, 1) - 1).bit_length()
    keys = sorted(table)
    return table[max([k for k in keys if k <= bucket], default=keys[0])]


def decode_kwargs(entry: dict) -> dict:
    """A settings-table entry as decode_attention's keyword arguments (variant expanded; the split settings and
    `combine`, which the caller applies, dropped)."""
    kw = {k: v for k, v in entry.items()
          if k not in ("variant", "programs_per_sm", "min_tokens_per_split", "combine", "balance")}
    return kw | FP8_DECODE_VARIANTS[entry.get("variant", "cast")]


def compute_num_kv_splits(seq_lens: torch.Tensor, out: torch.Tensor, min_tokens_per_split: int,
                          max_kv_splits: int, balance: bool = False) -> None:
    """out[b] = clamp(ceil(seq_lens[b] / min_tokens_per_split), 1, max_kv_splits), on the device, no sync.

    `balance`: a split holds at least the batch's mean length (rounded up) as well, so a batch of one length
    keeps one split a request and only the requests longer than the mean split, where one long request's
    programs would otherwise run on alone after the rest (the offline shape's contexts run 100-2,048 tokens). The
    mean is over the rows longer than 1: a decoding request holds its prompt and the new token, while a graph's
    padded rows hold 1, so a padded replay splits as the eager pass of its real rows does."""
    if balance:  # one launch, where the torch ops took eight (each a node of a captured step)
        bs = seq_lens.shape[0]
        assert seq_lens.is_contiguous() and out.is_contiguous() and out.shape[0] >= bs
        _balanced_splits_kernel[(1,)](seq_lens, out, bs, min_tokens_per_split, max_kv_splits,
                                      BLOCK=max(2, triton.next_power_of_2(bs)))
        return
    n = torch.div(seq_lens + (min_tokens_per_split - 1), min_tokens_per_split, rounding_mode="floor")
    out.copy_(n.clamp_(1, max_kv_splits))


@triton.jit
def _balanced_splits_kernel(Seq_lens, Out, bs, min_tokens, max_splits, BLOCK: tl.constexpr):
    """compute_num_kv_splits with `balance`, the whole batch in one program (bs <= BLOCK)."""
    offs = tl.arange(0, BLOCK)
    lens = tl.load(Seq_lens + offs, mask=offs < bs, other=0).to(tl.int64)
    real = lens > 1
    count = tl.maximum(tl.sum(real.to(tl.int64), 0), 1)
    per_split = tl.maximum((tl.sum(tl.where(real, lens, 0), 0) + count - 1) // count, min_tokens)
    splits = tl.minimum(tl.maximum((lens + per_split - 1) // per_split, 1), max_splits)
    tl.store(Out + offs, splits.to(Out.dtype.element_ty), mask=offs < bs)


class NewTokens(NamedTuple):
    """What stage 1 needs to do rope_store.py's work itself (decode_attention's `new`): q is then passed before
    rotary, and each request's new K/V, before rotary too, are written into their slots by the program whose split
    holds them."""
    positions: torch.Tensor  # [bs]
    loc: torch.Tensor  # [bs] the new tokens' slots
    k: torch.Tensor  # [bs, Hkv, D], last dim contiguous
    v: torch.Tensor
    cos_sin: torch.Tensor  # fp32 [max_pos, D]: cos | sin
    q_norm_weight: torch.Tensor | None = None  # [D], both or neither (Qwen3)
    k_norm_weight: torch.Tensor | None = None
    eps: float = 1e-6
    x_rms: torch.Tensor | None = None  # [bs, hidden]: the deferred input norm's rows (attention.base.Rope.x_rms)
    x_rms_eps: float = 1e-6


def decode_attention(
    q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, out: torch.Tensor,
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
    num_kv_splits: torch.Tensor | None, mid_o: torch.Tensor, mid_lse: torch.Tensor, scale: float,
    block_n: int = 64, page_size: int = 1, kv_fp8: torch.dtype | None = None,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    num_warps: int = 4, num_stages: int = 2, fp16_dot: bool = False,
    v_cvt: bool = False, cvt_bits: bool = False, qk_fp8: bool = False, whole_blocks: bool = False,
    kv_group: bool = False, counters: torch.Tensor | None = None, maxnreg: int | None = None,
    new: NewTokens | None = None, fold: bool = False, early_kv: bool | int = False,
    min_tokens_per_split: int | None = None,
) -> None:
    """q/out [bs, H, D]; k_buf/v_buf [slots, Hkv, D]; seq_lens int32/int64 and num_kv_splits int32 [bs], seq_lens >= 1.

    `page_size`: the pool's page size (slots of a page are contiguous), read a page per table entry.
    `kv_fp8`: the fp8 dtype of a cache stored as uint8 in k_buf/v_buf, dequantized by `k_scale` / `v_scale`
    (float32 device tensors, the first element read). `fp16_dot`: with an fp8 cache, the dots take q and the
    probabilities in fp16 (fp8 widens to fp16 exactly) instead of q's dtype. With an fp8 cache only, the
    variants of `paged_softmax` (its module doc): `v_cvt` widens V before its layout change (fp16 dots; CUDA
    with a 16-bit q only, elsewhere ignored), `cvt_bits` widens by moving bits (implies fp16 dots), `qk_fp8`
    quantizes q per row to e4m3 for an fp8 q.k^T dot (p.v in fp16). They are ignored for a bf16/fp32 cache.
    `whole_blocks` (any cache): the key loop runs unmasked over a split's whole blocks and masks only the
    request's last, partial block. `kv_group` (any cache): several KV heads per program
    (_decode_stage1_kv_group_kernel) where kv_group_size allows, else ignored. `maxnreg`: a register cap for
    ptxas (stage 1; ignored by Triton's interpreter).

    mid_o [bs, H, S, D] / mid_lse [bs, H, S] fp32 scratch (views of larger buffers are fine); S is the
    grid's split dimension and must be >= max(num_kv_splits).
    `num_kv_splits` None: the kernels count each request's splits from its length, as compute_num_kv_splits does with
    `min_tokens_per_split` and S (a captured decode step so needs no launches to fill the tensor).

    `counters` (int32, contiguous, at least bs * Hkv entries, all 0; left all 0): the splits are combined by each
    request's last split program to finish (`_combine_if_last`), and no stage-2 launch follows. Without it a
    second launch combines them.

    `fold` (any cache): the 16 dot rows hold the GQA group's query heads once per chunk of each key block, and
    each row keeps the softmax of its chunk only (`_attend_kv_block_folded`); where the group is a power of two
    up to 8 and block_n holds 16 / group chunks of >= 8 keys, else ignored. Not with `qk_fp8` or `cvt_bits`.

    `new`: q comes before rotary, and stage 1 rotates it and stores the new tokens' K/V (`NewTokens`) as
    rope_store_kv would have, the same bits, without its launch; with `new.x_rms`, after the deferred input
    norm's scale, as rope_store_kv applies it. Head dims that are powers of two; `kv_group` is then ignored.

    `early_kv` (CUDA, under PDL): stage 1 reads its split's bounds (num_kv_splits, seq_lens, req_pool_indices,
    req_to_token) before its PDL wait and asks L2 for its first key block's K and V rows (an int: that many
    blocks). Only where the caller knows that none of those was written by the kernel just ahead of this one: a
    kernel that wrote one and then triggered (or ended) may not have flushed its writes yet.
    OSTINATO_DECODE_EARLY_KV=0 turns it off.

    With OFFS32 (the default; OSTINATO_DECODE_OFFS32=0 turns it off) stage 1 computes K/V row offsets in int32
    where `int32_offsets(k_buf, v_buf)` (the fold and kv_group forms in int64 always).
    """
    bs, num_heads, head_dim = q.shape
    num_kv_heads = k_buf.shape[1]
    group = num_heads // num_kv_heads
    max_kv_splits = mid_o.shape[2]
    assert q.stride(2) == 1 and out.stride(2) == 1 and k_buf.stride(2) == 1 and v_buf.stride(2) == 1
    assert mid_o.stride(3) == 1 and mid_lse.stride(2) == 1 and req_to_token.stride(1) == 1
    if bs == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    fp8 = fp8_code(kv_fp8, k_buf)
    k_scale = mid_lse if k_scale is None else k_scale  # any pointer: read only for an fp8 cache
    v_scale = mid_lse if v_scale is None else v_scale
    fold = bool(fold and fold_applies(group, block_n))
    assert not (fold and fp8 and (qk_fp8 or cvt_bits)), "fold runs the plain fp8 read or v_cvt"
    per_prog = kv_group_size(num_heads, num_kv_heads, head_dim) if kv_group and not fold else 1
    # V widened by inline asm (paged_softmax's V_CVT): CUDA and 16-bit q only; elsewhere the plain conversion
    assert not (v_cvt and cvt_bits), "v_cvt widens exactly; cvt_bits' scale factor would be applied to V too"
    v_cvt_on = bool(v_cvt and fp8 and q.is_cuda and q.dtype != torch.float32)
    # both stages launch with PDL; stage 1's programs come in only as the KV store's last programs finish
    # (layers/triton_ops/pdl.py)
    pdl = pdl_enabled(q)
    combine = counters is not None
    if combine:
        assert counters.dtype == torch.int32 and counters.is_contiguous() and counters.numel() >= bs * num_kv_heads
    from_len = num_kv_splits is None
    if from_len:
        assert min_tokens_per_split is not None and min_tokens_per_split >= 1, "num_kv_splits or min_tokens_per_split"
        num_kv_splits = seq_lens  # unread: the kernels count the splits from seq_lens
    counting = dict(min_tokens=min_tokens_per_split or 1, SPLITS_FROM_LEN=from_len)
    tail = dict(Counter=counters, Out=out, stride_ob=out.stride(0), stride_oh=out.stride(1), COMBINE=combine,
                BLOCK_S=max(2, triton.next_power_of_2(max_kv_splits)), PDL=pdl, launch_pdl=pdl, **counting,
                **({"maxnreg": maxnreg} if maxnreg else {}))
    if new is not None:
        assert head_dim & (head_dim - 1) == 0, f"stage 1 rotates whole-row halves: head_dim {head_dim}"
        assert new.k.shape == new.v.shape == (bs, num_kv_heads, head_dim) and new.k.stride(2) == new.v.stride(2) == 1
        assert new.cos_sin.dtype == torch.float32 and new.cos_sin.stride(1) == 1
        has_norm = new.q_norm_weight is not None
        assert has_norm == (new.k_norm_weight is not None)
        per_prog = 1
        tail |= dict(Positions=new.positions, Loc=new.loc, K_new=new.k, V_new=new.v, Cos_sin=new.cos_sin,
                     QW=new.q_norm_weight if has_norm else new.cos_sin,  # unread without the norm
                     KW=new.k_norm_weight if has_norm else new.cos_sin,
                     stride_knt=new.k.stride(0), stride_knh=new.k.stride(1), stride_vnt=new.v.stride(0),
                     stride_vnh=new.v.stride(1), stride_cs=new.cos_sin.stride(0), eps=new.eps, ROPE=True,
                     HAS_NORM=has_norm)
        if new.x_rms is not None:
            x = new.x_rms
            assert x.shape[0] == bs and x.stride(1) == 1 and x.dtype == q.dtype
            tail |= dict(X=x, stride_x=x.stride(0), x_cols=x.shape[1], eps_x=new.x_rms_eps, X_NORM=True,
                         BLOCK_X=triton.next_power_of_2(x.shape[1]))
    # KV heads in the grid's first dimension: the programs of one request's heads launch side by side and read
    # the same slots' rows (a slot holds every head) at about the same time (H200, 1-3% faster kernels at
    # contexts 1,024-4,096, about 1% faster steps; docs/gpu-notes.md)
    if per_prog > 1 and k_buf.stride(1) == head_dim and v_buf.stride(1) == head_dim:  # a slot's heads contiguous
        _decode_stage1_kv_group_kernel[(num_kv_heads // per_prog, bs, max_kv_splits)](
            q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, num_kv_splits, mid_o, mid_lse, k_scale,
            v_scale, scale * LOG2E, q.stride(0), q.stride(1), k_buf.stride(0), v_buf.stride(0),
            req_to_token.stride(0), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0),
            mid_lse.stride(1), GROUP=group, HEAD_DIM=head_dim, KV_PER_PROG=per_prog, BLOCK_N=block_n,
            PAGE=page_arg(page_size, block_n), KV_FP8=fp8,
            FP16_DOT=bool(fp16_dot and fp8 and q.dtype != torch.float32), WHOLE_BLOCKS=bool(whole_blocks),
            PRECISION=precision, **tail,
            num_warps=num_warps, num_stages=num_stages,
        )
    else:
        _decode_stage1_kernel[(num_kv_heads, bs, max_kv_splits)](
            q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, num_kv_splits, mid_o, mid_lse, k_scale, v_scale,
            scale * LOG2E,
            q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
            req_to_token.stride(0),
            mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
            GROUP=group, HEAD_DIM=head_dim, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d,
            BLOCK_N=block_n, PRECISION=precision, PAGE=page_arg(page_size, block_n), KV_FP8=fp8,
            FP16_DOT=bool((fp16_dot or cvt_bits or v_cvt_on) and fp8 and q.dtype != torch.float32),
            V_CVT=v_cvt_on, CVT_BITS=bool(cvt_bits and fp8), QK_FP8=bool(qk_fp8 and fp8),
            BITS_FACTOR=bits_factor(fp8), WHOLE_BLOCKS=bool(whole_blocks), **tail,
            GROUP_P2=triton.next_power_of_2(group), FOLD=fold, num_warps=num_warps,
            num_stages=num_stages, OFFS32=OFFS32 and int32_offsets(k_buf, v_buf),
            KV_LINES=lines_for(head_dim * k_buf.element_size()) if pdl and early_kv and EARLY_KV else 0,
            KV_BLOCKS=int(early_kv) or 1,
        )
    if combine:
        return
    _decode_stage2_kernel[(bs, num_heads)](
        mid_o, mid_lse, num_kv_splits, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_S=max(2, triton.next_power_of_2(max_kv_splits)), BLOCK_D=block_d, num_warps=4,
        PDL=pdl, launch_pdl=pdl, Seq_lens=seq_lens, max_splits=max_kv_splits, **counting,
    )
