"""A question, not a kernel of the engine: does stage 1 of split-KV decode read the cache faster when a page's
K and V rows come in by TMA (one bulk copy per page, `TensorDescriptor`) than by the per-thread cp.async gathers of
`decode_attention`? Pages of 16-64 slots make a head's rows of a page one contiguous box (fp8 caches are
head-major: [kv_heads, slots, head_dim]; bf16 token-major: a box [page, head_dim] at the head's columns).

Times the engine's table entry (page 1 and the page size asked) against the TMA form at a few warps / stages,
stage 1 + stage 2 each, kernel alone in a replayed graph (20 calls), as `bench_decode_entries.py` does.

OSTINATO_PDL=0 python benchmarks/bench_tma_decode.py [--pages 16 64] [--out PATH]
python benchmarks/bench_tma_decode.py --smoke     # CPU, Triton's interpreter: the TMA form against torch
"""

import argparse
import json
import os
import sys
import time

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from common import RESULTS, device_tag, replay_us  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from ostinato.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from ostinato.attention.triton_ops.decode_attention import (  # noqa: E402
    _decode_stage2_kernel,
    compute_num_kv_splits,
    decode_attention,
    decode_kwargs,
    split_bounds,
    table_entry,
)
from ostinato.attention.triton_ops.paged_softmax import LOG2E  # noqa: E402
from ostinato.mem.kv_cache import MHATokenToKVPool  # noqa: E402

HEADS = {64: (32, 8), 128: (16, 8)}


@triton.jit
def _tma_stage1(Q, K_desc, V_desc, Req_to_token, Seq_lens, Num_kv_splits, Mid_o, Mid_lse, qk_scale, head_rows,
                head_cols, stride_qb, stride_qh, stride_r2t, stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
                GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, PAGE: tl.constexpr,
                KV_FP8: tl.constexpr, STAGES: tl.constexpr):
    kv_head = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.load(Num_kv_splits + b)
    if split >= num_splits:
        return
    seq_len = tl.load(Seq_lens + b)
    start, end, per_split = split_bounds(seq_len, num_splits, split, PAGE)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + offs_h
    h_mask = offs_h < GROUP
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=h_mask[:, None], other=0.0)
    if KV_FP8:
        q = q.to(tl.float16)
    row0 = kv_head * head_rows
    col0 = kv_head * head_cols
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    req_row = Req_to_token + b * stride_r2t
    for n0 in tl.range(start, end, PAGE, num_stages=STAGES):
        first = tl.load(req_row + n0)
        k = K_desc.load([row0 + first, col0])  # [PAGE, HEAD_DIM]
        v = V_desc.load([row0 + first, col0])
        if KV_FP8:
            k = k.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            v = v.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where((n0 + tl.arange(0, PAGE) < end)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
        m_i = m_new
    nonempty = l_i > 0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    tl.store(Mid_o + b * stride_mob + heads[:, None] * stride_moh + split * stride_mos + offs_d[None, :], out,
             mask=h_mask[:, None])
    tl.store(Mid_lse + b * stride_mlb + heads * stride_mlh + split, lse, mask=h_mask)


def tma_decode(q, k, v, out, req_to_token, seq_lens, num_splits, mid_o, mid_lse, scale, page, head_major, fp8,
               warps, stages):
    """k / v: the pool's [slots, kv_heads, D] views; req_to_token holds each token's slot (pages contiguous)."""
    bs, heads, dim = q.shape
    kv_heads = k.shape[1]
    if head_major:  # [kv_heads, slots, D] underneath
        k2, v2 = (x.permute(1, 0, 2).reshape(-1, dim) for x in (k, v))
        head_rows, head_cols = k.shape[0], 0
    else:
        k2, v2 = (x.reshape(x.shape[0], -1) for x in (k, v))
        head_rows, head_cols = 0, dim
    kd, vd = (TensorDescriptor(x, list(x.shape), list(x.stride()), [page, dim]) for x in (k2, v2))
    splits = mid_o.shape[2]
    _tma_stage1[(kv_heads, bs, splits)](
        q, kd, vd, req_to_token, seq_lens, num_splits, mid_o, mid_lse, scale * LOG2E, head_rows, head_cols,
        q.stride(0), q.stride(1), req_to_token.stride(0), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), GROUP=heads // kv_heads, HEAD_DIM=dim,
        BLOCK_H=max(16, triton.next_power_of_2(heads // kv_heads)), PAGE=page, KV_FP8=fp8, STAGES=stages,
        num_warps=warps)
    _decode_stage2_kernel[(bs, heads)](
        mid_o, mid_lse, num_splits, out, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0),
        mid_lse.stride(1), out.stride(0), out.stride(1), HEAD_DIM=dim, BLOCK_S=max(2, triton.next_power_of_2(splits)),
        BLOCK_D=dim, num_warps=4, PDL=False)


def case(fp8: bool, dim: int, bs: int, ctx: int, pages: list[int], dev: torch.device, timed: bool,
         num_sms: int) -> list[dict]:
    heads, kv_heads = HEADS[dim]
    dtype = torch.bfloat16 if timed else torch.float16
    slots = bs * ctx + 64  # page 0 (the first 64 slots): the sink; each request's slots contiguous after it
    # slot_group 0: fp8 caches head-major over the whole pool, which the TMA descriptors here are laid over
    pool = MHATokenToKVPool(slots, torch.float8_e4m3fn if fp8 else dtype, kv_heads, dim, 1, dev, slot_group=0)
    k, v = pool.get_store_buffer(0)
    for buf in (k, v):  # never time on zeros
        x = torch.randn(buf.shape, device=dev, dtype=torch.float32)
        buf.copy_(x.to(torch.float8_e4m3fn).view(torch.uint8) if fp8 else x.to(dtype))
    q = torch.randn(bs, heads, dim, device=dev, dtype=dtype)
    req_to_token = torch.arange(64, slots, dtype=torch.int32, device=dev).view(bs, ctx)
    rows = torch.arange(bs, dtype=torch.int32, device=dev)
    seq_lens = torch.full((bs,), ctx, dtype=torch.int32, device=dev)
    scale = dim**-0.5
    entry = table_entry(TritonAttentionBackend.decode_table_for(dim, fp8), bs)
    fp8_args = dict(kv_fp8=torch.float8_e4m3fn, k_scale=torch.ones(1, device=dev),
                    v_scale=torch.ones(1, device=dev)) if fp8 else {}
    # the reference: the torch backend's math in float64
    kf = (k.view(torch.float8_e4m3fn) if fp8 else k).double()[req_to_token.long()]  # [bs, ctx, kv_heads, D]
    vf = (v.view(torch.float8_e4m3fn) if fp8 else v).double()[req_to_token.long()]
    qf = q.double().view(bs, kv_heads, heads // kv_heads, dim)
    w = torch.softmax(torch.einsum("bhgd,bthd->bhgt", qf, kf) * scale, -1)
    ref = torch.einsum("bhgt,bthd->bhgd", w, vf).reshape(bs, heads, dim)
    settings = [("entry_page1", "entry", 1, entry)]
    for page in pages:
        settings.append((f"entry_page{page}", "entry", page, entry))
        for warps in (1, 2, 4):
            for stages in (2, 3, 4):
                settings.append((f"tma_page{page}_w{warps}_s{stages}", "tma", page, dict(warps=warps, stages=stages)))
    if not timed:
        settings = [s for s in settings if s[1] == "entry" or s[0].endswith("w1_s2")]
    rows_out = []
    for name, kind, page, cfg in settings:
        per_sm = cfg.get("programs_per_sm", 2) if kind == "entry" else 2
        cap = TritonAttentionBackend.split_cap(bs, per_sm, kv_heads, num_sms, TritonAttentionBackend.max_kv_splits)
        min_tokens = max(page, cfg.get("min_tokens_per_split", TritonAttentionBackend.min_tokens_per_split))
        num_splits = torch.empty(bs, dtype=torch.int32, device=dev)
        compute_num_kv_splits(seq_lens, num_splits, min_tokens, cap)
        mid_o = torch.empty(bs, heads, cap, dim, device=dev)
        mid_lse = torch.empty(bs, heads, cap, device=dev)
        out = torch.empty(bs, heads, dim, device=dev, dtype=dtype)
        if kind == "entry":
            kw = dict(block_n=TritonAttentionBackend.decode_block_n) | decode_kwargs(cfg)

            def call(kw=kw, page=page, num_splits=num_splits, mid_o=mid_o, mid_lse=mid_lse, out=out) -> None:
                decode_attention(q, k, v, out, req_to_token, rows, seq_lens, num_splits, mid_o, mid_lse, scale,
                                 page_size=page, **fp8_args, **kw)
        else:
            def call(cfg=cfg, page=page, num_splits=num_splits, mid_o=mid_o, mid_lse=mid_lse, out=out) -> None:
                tma_decode(q, k, v, out, req_to_token, seq_lens, num_splits, mid_o, mid_lse, scale, page,
                           pool.head_major, fp8, cfg["warps"], cfg["stages"])
        try:
            call()
        except Exception as e:  # a setting that does not compile is a result too
            print(f"{name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            rows_out.append(dict(kv="fp8" if fp8 else "bf16", dim=dim, bs=bs, ctx=ctx, setting=name,
                                 error=str(e)[:500]))
            continue
        err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
        row = dict(kv="fp8" if fp8 else "bf16", dim=dim, bs=bs, ctx=ctx, setting=name, splits=cap, rel_err=err)
        if timed:
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(20):
                    call()
            row["us"] = replay_us(graph, 20)
            row["kv_tbps"] = bs * ctx * kv_heads * dim * 2 * k.element_size() / row["us"] / 1e6
        rows_out.append(row)
        print(f"{row['kv']:5} dim {dim:3} bs {bs:3} ctx {ctx:5} {name:22} {row.get('us', 0):8.2f} us "
              f"{row.get('kv_tbps', 0):5.2f} TB/s  err {err:.1e}", flush=True)
        if err > 3e-2:
            print(f"  {name}: WRONG (relative error {err:.1e})", flush=True)
    return rows_out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--kv", nargs="+", default=["fp8", "bf16"], choices=["fp8", "bf16"])
    ap.add_argument("--cases", nargs="+", default=["64:32:4096", "64:256:1024", "64:128:4096", "128:32:288",
                                                   "64:1:1024"], help="dim:bs:ctx")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--budget-s", type=float, default=420, help="no new case starts after this many seconds")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    timed = not args.smoke
    dev = torch.device("cuda" if timed else "cpu")
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count if timed else 8
    cases = [tuple(int(x) for x in c.split(":")) for c in args.cases] if timed else [(64, 3, 80)]
    start, rows = time.time(), []
    for kv in args.kv:
        for dim, bs, ctx in cases:
            if time.time() - start > args.budget_s:
                print("budget spent: stopping", flush=True)
                break
            rows += case(kv == "fp8", dim, bs, ctx, args.pages if timed else [16], dev, timed, num_sms)
    if timed:
        path = args.out or os.path.join(RESULTS, f"tma-decode-{device_tag(dev)}.json")
        with open(path, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(dev), seconds=time.time() - start, rows=rows), f,
                      indent=1)
        print("wrote", path)


if __name__ == "__main__":
    main()
