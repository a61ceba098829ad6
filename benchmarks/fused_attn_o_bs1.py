"""An experiment, not an engine path: one decode row's attention and o_proj as ONE kernel, o's input split by KV
head, each program's part of the projection summed into an fp32 accumulator with atomic adds.

At bs 1 a layer's attention is three kernel boundaries deep (stage 1, stage 2, o_proj), each costing its PDL
hand-off (about 2-3 us at bs 1: docs/gpu-notes.md's timelines). Here the grid is (KV heads, o row chunks): program
(g, c) loads its [BN, GROUP, D] slice of W_o (the rows c * BN .., the columns of KV head g's query heads) into
registers before its PDL wait, then does stage 1's work for head g over the whole context (rotary, the new
token's K/V store, the deferred input norm, the keys in one loop: no splits, no stage 2), multiplies its GROUP x D
outputs by the slice, and adds the [BN] partial into the accumulator. Every program of a head redoes that head's
attention (from L2 after the first); all of them store the new token's K/V, the same bytes. The sum's order is
not fixed (not bit-reproducible), and the MLP would have to read the accumulator; in a step (the wrapper below)
gate_up reads a bf16 row no kernel writes: timing only. The kernel's numerics are checked on the CPU against the
engine's decode_attention and a matmul (tests/test_fused_attn_o_bs1.py).

ATTN_O=BN:WARPS[:fold] python benchmarks/fused_attn_o_bs1.py <bench_decode.py's arguments>
(ATTN_O unset: the engine's path through the same wrapper, for A/B in turns.)
"""

import os
import runpy
import sys

import torch
import triton
import triton.language as tl

from ostinato.attention.triton_ops.decode_attention import (
    _attend_kv_block_folded,
    _load_new_token,
    _rope_q_store_kv,
    _unfold_rows,
    split_bounds,
)
from ostinato.attention.triton_ops.paged_softmax import LOG2E, attend_kv_block, block_slots
from ostinato.layers.triton_ops.l2_prefetch import lines_for, prefetch_rows


@triton.jit
def _attn_o_kernel(
    Q, K_buf, V_buf, Req_to_token, Req_pool_indices, Seq_lens, qk_scale,
    stride_qh, stride_kbs, stride_kbh, stride_vbs, stride_vbh, stride_r2t,
    Positions, Loc, K_new, V_new, Cos_sin, QW, KW, stride_knh, stride_vnh, stride_cs, eps,
    X, x_cols, eps_x, Wo, stride_wo, Y, Y_zero, n_out,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BN: tl.constexpr,
    HAS_NORM: tl.constexpr, X_NORM: tl.constexpr, BLOCK_X: tl.constexpr, FOLD: tl.constexpr, PRECISION: tl.constexpr,
    KV_LINES: tl.constexpr, KV_BLOCKS: tl.constexpr, PDL: tl.constexpr,
):
    kv_head = tl.program_id(0)
    chunk = tl.program_id(1)
    rows = chunk * BN + tl.arange(0, BN)
    offs_g = tl.arange(0, GROUP)
    offs_d = tl.arange(0, HEAD_DIM)
    # W_o's slice: rows `rows`, the columns of this KV head's GROUP query heads (W is no kernel's output)
    w_cols = (kv_head * GROUP + offs_g)[None, :, None] * HEAD_DIM + offs_d[None, None, :]
    w = tl.load(Wo + rows.to(tl.int64)[:, None, None] * stride_wo + w_cols, mask=(rows < n_out)[:, None, None],
                other=0.0)
    seq_len = tl.load(Seq_lens, volatile=True)
    req_row = Req_to_token + tl.load(Req_pool_indices, volatile=True).to(tl.int64) * stride_r2t  # the lone request
    if KV_LINES:  # the first key blocks' K and V rows to L2 (the KV cache of earlier steps: no kernel writes it)
        for blk in tl.static_range(KV_BLOCKS):
            if blk * BLOCK_N < seq_len:
                slots, _, _ = block_slots(req_row, blk * BLOCK_N, seq_len, BLOCK_N, 1)
                prefetch_rows(K_buf + kv_head.to(tl.int64) * stride_kbh, slots, stride_kbs, HEAD_DIM, KV_LINES)
                prefetch_rows(V_buf + kv_head.to(tl.int64) * stride_vbh, slots, stride_vbs, HEAD_DIM, KV_LINES)
    if PDL:  # resident_gemv's order: the next kernel's programs may be placed while W's loads fly
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    if kv_head == 0:  # the other layer parity's accumulator, read by no kernel any more
        tl.store(Y_zero + rows, tl.zeros([BN], tl.float32), mask=rows < n_out)
    offs_h = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + offs_h
    h_mask = offs_h < GROUP
    if FOLD:
        heads = kv_head * GROUP + offs_h % GROUP
        h_mask = offs_h >= 0
    pos, q_raw, k_new, v_new, slot, x_row = _load_new_token(
        Q, K_new, V_new, Positions, Loc, 0, kv_head, heads, h_mask, 0, stride_qh, 0, stride_knh, 0, stride_vnh, X,
        0, x_cols, HEAD_DIM, X_NORM, BLOCK_X)
    q = _rope_q_store_kv(pos, q_raw, k_new, v_new, slot, x_row, K_buf, V_buf, Cos_sin, QW, KW, Q, Q, kv_head,
                         h_mask, True, stride_kbs, stride_kbh, stride_vbs, stride_vbh, stride_cs, eps, x_cols, eps_x,
                         Q.dtype.element_ty, HEAD_DIM, BLOCK_H, HEAD_DIM, HAS_NORM, 0, X_NORM)
    d_mask = offs_d < HEAD_DIM
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    start, end, _ = split_bounds(seq_len, 1, 0, BLOCK_N)
    whole_end = start + (end - start) // BLOCK_N * BLOCK_N
    if FOLD:
        for n0 in range(start, whole_end, BLOCK_N):
            acc, m_i, l_i = _attend_kv_block_folded(
                q, acc, m_i, l_i, n0, end, K_buf, V_buf, req_row, kv_head, stride_kbs, stride_kbh, stride_vbs,
                stride_vbh, offs_d, d_mask, qk_scale, GROUP, BLOCK_N, PRECISION, 1, 0, False, MASK_N=False,
                MASK_D=False)
        if whole_end < end:
            acc, m_i, l_i = _attend_kv_block_folded(
                q, acc, m_i, l_i, whole_end, end, K_buf, V_buf, req_row, kv_head, stride_kbs, stride_kbh,
                stride_vbs, stride_vbh, offs_d, d_mask, qk_scale, GROUP, BLOCK_N, PRECISION, 1, 0, False,
                MASK_N=True, MASK_D=False)
        acc_h, _, l_h = _unfold_rows(acc, m_i, l_i, GROUP)
    else:
        for n0 in range(start, whole_end, BLOCK_N):
            acc, m_i, l_i = attend_kv_block(
                q, acc, m_i, l_i, n0, end, 0, K_buf, V_buf, req_row, kv_head, stride_kbs, stride_kbh, stride_vbs,
                stride_vbh, offs_d, d_mask, qk_scale, BLOCK_N=BLOCK_N, CAUSAL=False, PRECISION=PRECISION,
                MASK_N=False, MASK_D=False)
        if whole_end < end:
            acc, m_i, l_i = attend_kv_block(
                q, acc, m_i, l_i, whole_end, end, 0, K_buf, V_buf, req_row, kv_head, stride_kbs, stride_kbh,
                stride_vbs, stride_vbh, offs_d, d_mask, qk_scale, BLOCK_N=BLOCK_N, CAUSAL=False, PRECISION=PRECISION,
                MASK_D=False)
        # the GROUP real rows of the dot's BLOCK_H: rows 0 .. GROUP - 1 of [BLOCK_H // GROUP, GROUP, D]
        first = (tl.arange(0, BLOCK_H // GROUP) == 0)[:, None]
        acc_h = tl.sum(tl.where(first[:, :, None], tl.reshape(acc, [BLOCK_H // GROUP, GROUP, HEAD_DIM]), 0.0), 0)
        l_h = tl.sum(tl.where(first, tl.reshape(l_i, [BLOCK_H // GROUP, GROUP]), 0.0), 0)
    # the attention output as the engine's bf16 `out` holds it, then this program's rows of o_proj
    out = (acc_h / l_h[:, None]).to(Q.dtype.element_ty).to(tl.float32)
    y = tl.sum(tl.sum(w.to(tl.float32) * out[None, :, :], axis=2), axis=1)
    tl.atomic_add(Y + rows, y, mask=rows < n_out, sem="relaxed")


def attn_o(q: torch.Tensor, new, k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_token: torch.Tensor,
           req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, scale: float, wo: torch.Tensor, y: torch.Tensor,
           y_zero: torch.Tensor, bn: int = 64, num_warps: int = 4, fold: bool = False, block_n: int = 64,
           early_kv: int = 4) -> None:
    """y += attention(q) @ wo^T for one decode row: q [1, H, D] before rotary, `new` decode_attention's NewTokens
    (the new token's K/V are stored into k_buf / v_buf, page size 1, a bf16 / fp32 cache), y fp32 [n_out] (zeroed
    by the caller or the launch before); y_zero (fp32, at most n_out entries) is set to 0 on the way."""
    from ostinato.layers.triton_ops.pdl import enabled as pdl_enabled

    bs, num_heads, d = q.shape
    num_kv_heads = k_buf.shape[1]
    group = num_heads // num_kv_heads
    n_out = wo.shape[0]
    assert bs == 1 and d & (d - 1) == 0 and group & (group - 1) == 0 and k_buf.dtype == q.dtype
    assert wo.shape[1] == num_heads * d and wo.stride(1) == 1 and y.numel() == n_out and y_zero.numel() <= n_out
    pdl = pdl_enabled(q)
    has_norm = new.q_norm_weight is not None
    x = new.x_rms
    _attn_o_kernel[(num_kv_heads, triton.cdiv(n_out, bn))](
        q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, scale * LOG2E,
        q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1), req_to_token.stride(0),
        new.positions, new.loc, new.k, new.v, new.cos_sin, new.q_norm_weight if has_norm else new.cos_sin,
        new.k_norm_weight if has_norm else new.cos_sin, new.k.stride(1), new.v.stride(1), new.cos_sin.stride(0),
        new.eps, q if x is None else x, 1 if x is None else x.shape[1], new.x_rms_eps, wo, wo.stride(0), y, y_zero,
        n_out, GROUP=group, HEAD_DIM=d, BLOCK_H=max(16, group), BLOCK_N=block_n, BN=bn, HAS_NORM=has_norm,
        X_NORM=x is not None, BLOCK_X=1 if x is None else triton.next_power_of_2(x.shape[1]), FOLD=fold,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        KV_LINES=lines_for(d * k_buf.element_size()) if pdl and early_kv else 0, KV_BLOCKS=max(1, int(early_kv)),
        PDL=pdl, launch_pdl=pdl, num_warps=num_warps)


STATE: dict = {}


def _patch(bn: int, num_warps: int, fold: bool) -> None:
    """At one decode row: DecoderAttention.attend notes its layer's o_proj weight, the backend's decode_attention
    call becomes attn_o into one of two fp32 accumulators (each launch zeroes the other), and the layer's o_proj +
    gate_up step runs gate_up alone on a bf16 row no kernel writes (timing only)."""
    from ostinato.attention import triton_backend
    from ostinato.layers.linear import cuda_linear, try_wide
    from ostinato.layers.norm_linear import silu_and_mul
    from ostinato.models import llama

    engine_attend, engine_decode = llama.DecoderAttention.attend, triton_backend.decode_attention
    engine_tail = llama.attn_out_norm_gate_up_silu

    def attend(self, positions, qkv, x_rms=None):
        STATE["layer"] = (self.layer_id, self.o_proj.weight) if qkv.shape[0] == 1 and qkv.is_cuda else None
        return engine_attend(self, positions, qkv, x_rms)

    def decode(**kw):
        layer, q, new = STATE.get("layer"), kw["q"], kw.get("new")
        if layer is None or new is None or kw.get("page_size", 1) != 1 or kw.get("kv_fp8") is not None:
            return engine_decode(**kw)
        layer_id, wo = layer
        y = STATE.get("y")
        if y is None or y.shape[1] != wo.shape[0]:  # a model of another width in the same process
            y = STATE["y"] = torch.zeros(2, wo.shape[0], dtype=torch.float32, device=q.device)
        i = layer_id % 2
        attn_o(q, new, kw["k_buf"], kw["v_buf"], kw["req_to_token"], kw["req_pool_indices"], kw["seq_lens"],
               kw["scale"], wo, y[i], y[1 - i], bn, num_warps, fold,
               early_kv=int(kw.get("early_kv") or 0))
        STATE["fused"] = True

    def tail(o_proj, a, residual, norm, gate_up):
        if not STATE.pop("fused", False):
            return engine_tail(o_proj, a, residual, norm, gate_up)
        h = STATE.get("h")
        if h is None or h.shape[1] != o_proj.weight.shape[0]:
            h = STATE["h"] = torch.randn(1, o_proj.weight.shape[0], dtype=a.dtype, device=a.device) * 0.1
        act = try_wide(h, gate_up.weight, gated=True, norm_eps=norm.eps)
        return (silu_and_mul(cuda_linear(h, gate_up.weight), norm=(h, norm.eps)) if act is None else act), h

    llama.DecoderAttention.attend = attend
    triton_backend.decode_attention = decode
    llama.attn_out_norm_gate_up_silu = tail


if __name__ == "__main__":
    spec = os.environ.get("ATTN_O", "")
    if spec:
        fields = spec.split(":")
        if len(fields) < 2 or not all(f.isdigit() for f in fields[:2]) or set(fields[2:]) - {"fold"}:
            raise SystemExit(f"ATTN_O must be BN:WARPS[:fold], got {spec!r}")
        _patch(int(fields[0]), int(fields[1]), "fold" in fields)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    sys.argv = [os.path.join(here, "bench_decode.py")] + sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
