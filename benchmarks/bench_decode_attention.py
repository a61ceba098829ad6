"""The split-KV decode attention kernel alone, bf16 KV vs fp8 (e4m3) KV, over its variants and launch settings
(Llama-3.2-1B heads: 32 query, 8 KV, dim 64, or --heads H:KV:D; a shuffled page order, as after churn).

For each case (batch:context) and KV dtype it times every setting of the grid below inside a CUDA graph (20
calls per replay), checks the output against a torch reference, and reports us per call and the KV bytes read
per second. fp8 variants (decode_attention.FP8_DECODE_VARIANTS, paged_softmax's module doc): fp16 (the current
default), fp16_vcvt (V widened before its layout change), bits (bit-moved fp8 -> fp16), qk8 (fp8 q.k dots), cast
(fp8 -> bf16), with and without whole_blocks (an unmasked loop over whole blocks), and kv_group (4 KV heads a
program; for bf16 too). Split counts come from the backend's two knobs: programs_per_sm (kv_splits_cap's 2)
and min_tokens_per_split. From 8 rows the splits are combined inside stage 1, as the backend does
(combine_min_bs). Settings whose error passes ERR_BOUND are never picked (qk8 usually).

Then the best settings per case are run again at page 16, and the JSON gets "table": an fp8 settings table
(the best fp8 setting of each case, keyed by its batch size).

--robust BS_LIST CTX_LIST runs bf16 and fp8 (fp16_vcvt) over whole blocks at every batch size x context and
picks, per KV dtype and batch size, the setting and split knobs with the least geometric-mean slowdown against
each context's best: TritonAttentionBackend.decode_tables entries, since one captured graph serves every context
of its batch size. It prints the pick and the backend's current entry side by side.

python benchmarks/bench_decode_attention.py        # ~3 min on an H200 (compiles in parallel first); no new
                                                   # timing starts after --budget-s (210), the JSON says what ran
python benchmarks/bench_decode_attention.py --smoke   # CPU, Triton's interpreter: tiny cases, checks the script
python benchmarks/bench_decode_attention.py --heads 16:8:128 --robust 1,4,32,128,256 128,1024,4096  # ~90 s, H100
"""

import argparse
import itertools
import json
import math
import os
import sys
import time

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from common import replay_us  # noqa: E402

from ostinato.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from ostinato.attention.triton_ops.decode_attention import (  # noqa: E402
    FP8_DECODE_VARIANTS,
    compute_num_kv_splits,
    decode_attention,
)

HEADS, KV_HEADS, DIM = 32, 8, 64  # Llama-3.2-1B; --heads sets them (Qwen3-0.6B: 16:8:128)
HBM_TBPS = 4.8  # H200
NUM_SMS = 132
MAX_SPLITS = 16  # the backend's max_kv_splits: the scratch has this depth, whatever the split count
FP8 = torch.float8_e4m3fn
# the settings before the tables (the full sweep's "default" rows): bf16 64-key blocks, 4 warps, 2 stages; fp8 below
BF16_DEFAULT = dict(variant="bf16", block_n=64, num_warps=4, num_stages=2, whole_blocks=False)
FP8_DEFAULT = dict(variant="fp16", block_n=128, num_warps=4, num_stages=3, whole_blocks=False)
ERR_BOUND = 0.02  # max |out - ref| / max |ref| a setting may have to be picked (bf16-level; qk8 is ~3-4%)
SPLIT_KNOBS = list(itertools.product((1, 2, 4, 8, 16), (32, 64, 128, 256)))  # (programs_per_sm, min_tokens_per_split)


def grid(smoke: bool) -> list[dict]:
    """Kernel settings (each a compiled variant): bf16, the fp8 main grid, the other fp8 variants at a few."""
    cfgs = []
    if smoke:
        for v, w in itertools.product(("bf16", "bf16_kv_group", *FP8_DECODE_VARIANTS), (False, True)):
            cfgs.append(dict(variant=v, block_n=16, num_warps=1, num_stages=1, whole_blocks=w))
        return cfgs
    # in the order they run (a time budget cuts the last): whole-block fp8, bf16, kv_group, masked fp8, the rest
    main = list(itertools.product(("fp16", "fp16_vcvt"), (32, 64, 128, 256), (1, 2, 4), (2, 3, 5)))
    for v, bn, nw, st in main:
        cfgs.append(dict(variant=v, block_n=bn, num_warps=nw, num_stages=st, whole_blocks=True))
    for w, bn, nw, st in itertools.product((False, True), (64, 128), (1, 2, 4), (2, 3, 5)):
        cfgs.append(dict(variant="bf16", block_n=bn, num_warps=nw, num_stages=st, whole_blocks=w))
    for v, bn, nw, st in itertools.product(("bf16_kv_group", "kv_group"), (16, 32, 64), (2, 4, 8), (2, 3)):
        cfgs.append(dict(variant=v, block_n=bn, num_warps=nw, num_stages=st, whole_blocks=True))
    for v, bn, nw, st in main:
        cfgs.append(dict(variant=v, block_n=bn, num_warps=nw, num_stages=st, whole_blocks=False))
    for v, bn, (nw, st) in itertools.product(("cast", "bits", "qk8", "qk8_vcvt"), (64, 128),
                                             ((1, 5), (4, 3))):
        cfgs.append(dict(variant=v, block_n=bn, num_warps=nw, num_stages=st, whole_blocks=True))
    for c in (BF16_DEFAULT, FP8_DEFAULT):
        if c not in cfgs:
            cfgs.append(dict(c))
    return cfgs


def set_heads(spec: str) -> None:
    """`H:KV:D` (query heads, KV heads, head dim) for every problem this process builds."""
    global HEADS, KV_HEADS, DIM
    HEADS, KV_HEADS, DIM = map(int, spec.split(":"))


CFG_KEYS = ("variant", "block_n", "num_warps", "num_stages", "whole_blocks")


def robust_grid(current: list[dict]) -> list[dict]:
    """--robust's settings: bf16 and fp8 (fp16 dots, V widened where loaded) over whole blocks, plus the backend's
    current entries. Register caps (entries' maxnreg) are not swept here: bench_decode_entries.py tries them."""
    cfgs = [dict(variant=v, block_n=bn, num_warps=nw, num_stages=st, whole_blocks=True)
            for v, bn, nw, st in itertools.product(("bf16", "fp16_vcvt"), (32, 64, 128), (1, 2, 4), (1, 2, 3, 5))]
    return cfgs + [c for c in current if c not in cfgs]


def current_entries(bs_list: list[int]) -> dict[tuple[str, int], dict]:
    """(kv, bs) -> the backend's table entry for a model of these heads: setting and split knobs."""
    from ostinato.attention.triton_ops.decode_attention import table_entry

    B = TritonAttentionBackend

    out = {}
    for kv, fp8 in (("bf16", False), ("fp8_e4m3", True)):
        table = B.decode_table_for(DIM, fp8)
        for bs in bs_list:
            e = table_entry(table, bs)
            out[(kv, bs)] = dict(variant=e.get("variant", "cast" if fp8 else "bf16"),
                                 block_n=e.get("block_n", B.decode_block_n),
                                 num_warps=e["num_warps"], num_stages=e["num_stages"],
                                 whole_blocks=e.get("whole_blocks", False),
                                 knobs=(e.get("programs_per_sm", 2), e.get("min_tokens_per_split",
                                                                           B.min_tokens_per_split)))
    return out


def robust_tables(rows: list[dict], current: dict) -> tuple[dict, list[dict]]:
    """Per KV dtype and batch size, the setting and split knobs with the least geometric-mean slowdown against
    each context's best time: a captured graph serves every context of its batch size with one setting. Also
    the current entry's slowdowns beside the pick's."""
    tables, report = {"bf16": {}, "fp8_e4m3": {}}, []
    for kv in tables:
        for bs in sorted({r["bs"] for r in rows}):
            g = [r for r in rows if r["kv"] == kv and r["bs"] == bs and r["rel_err"] <= ERR_BOUND]
            ctxs = sorted({r["ctx"] for r in g})
            if not g:
                continue
            best = {c: min(r["us"] for r in g if r["ctx"] == c) for c in ctxs}
            times: dict[tuple, dict[int, float]] = {}
            for r in g:
                for knobs in r["split_knobs"]:
                    times.setdefault((tuple(r[k] for k in CFG_KEYS), tuple(knobs)), {})[r["ctx"]] = r["us"]

            def slowdown(t: dict[int, float], best: dict[int, float] = best) -> float:
                return math.exp(sum(math.log(t[c] / best[c]) for c in best) / len(best))

            full = {key: t for key, t in times.items() if len(t) == len(ctxs)}
            (cfg, knobs), t = min(full.items(), key=lambda kt: (slowdown(kt[1]), kt[0][1] != (2, 64)))
            entry = dict(zip(CFG_KEYS, cfg, strict=True), programs_per_sm=knobs[0], min_tokens_per_split=knobs[1])
            tables[kv][bs] = entry
            cur = current.get((kv, bs))
            cur_t = full.get((tuple(cur[k] for k in CFG_KEYS), tuple(cur["knobs"]))) if cur else None
            report.append(dict(kv=kv, bs=bs, pick=entry, pick_us=t, best_us=best, pick_slowdown=slowdown(t),
                               current=cur, current_us=cur_t,
                               current_slowdown=slowdown(cur_t) if cur_t else None))
    return tables, report


def kv_splits_cap(bs: int, programs_per_sm: int) -> int:
    """TritonAttentionBackend.kv_splits_cap with programs_per_sm in place of its 2."""
    return TritonAttentionBackend.split_cap(bs, programs_per_sm, KV_HEADS, NUM_SMS, MAX_SPLITS)


def split_options(bs: int, ctx: int) -> dict[int, list[tuple[int, int]]]:
    """Split count -> the (programs_per_sm, min_tokens_per_split) pairs that give it for this case."""
    out: dict[int, list[tuple[int, int]]] = {}
    for pps, mt in SPLIT_KNOBS:
        n = max(1, min(kv_splits_cap(bs, pps), -(-ctx // mt)))
        out.setdefault(n, []).append((pps, mt))
    return out


def setup(bs: int, ctx: int, fp8: bool, page: int, dev: str, gen: torch.Generator) -> dict:
    pages = bs * ctx // page
    slots = pages * page + page  # page 0: the sink
    k = torch.randn(slots, KV_HEADS, DIM, device=dev)
    v = torch.randn(slots, KV_HEADS, DIM, device=dev)
    if fp8:
        k, v = k.to(FP8).view(torch.uint8), v.to(FP8).view(torch.uint8)
    else:
        k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
    order = (torch.randperm(pages, generator=gen) + 1).to(dev)  # shuffled pages
    req_to_token = (order.view(bs, ctx // page, 1) * page + torch.arange(page, device=dev)).view(bs, ctx)
    q_dtype = torch.bfloat16 if dev == "cuda" else torch.float16  # the interpreter's bf16 dots are wrong
    return dict(q=torch.randn(bs, HEADS, DIM, device=dev, dtype=q_dtype), k=k, v=v, page=page, fp8=fp8,
                out=torch.empty(bs, HEADS, DIM, device=dev, dtype=q_dtype),
                req_to_token=req_to_token.to(torch.int32).contiguous(), rows=torch.arange(bs, device=dev),
                seq_lens=torch.full((bs,), ctx, device=dev, dtype=torch.int32),
                k_scale=torch.tensor([0.5], device=dev), v_scale=torch.tensor([0.25], device=dev),
                mid_o=torch.empty(bs, HEADS, MAX_SPLITS, DIM, device=dev),
                mid_lse=torch.empty(bs, HEADS, MAX_SPLITS, device=dev),
                nsplit=torch.empty(bs, device=dev, dtype=torch.int32),
                # as the backend from its combine_min_bs rows: the last split program combines (no stage 2)
                counters=torch.zeros(bs * KV_HEADS, device=dev, dtype=torch.int32)
                if bs >= TritonAttentionBackend.combine_min_bs else None)


def reference(t: dict) -> torch.Tensor:
    """float32 attention over the (dequantized) cache, a few requests at a time."""
    bs, ctx = t["req_to_token"].shape
    ks, vs = (t["k_scale"].item(), t["v_scale"].item()) if t["fp8"] else (1.0, 1.0)

    def rows(buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:  # gathered as stored, then read as fp8
        x = buf[slots]
        return (x.view(FP8) if t["fp8"] else x).float().repeat_interleave(HEADS // KV_HEADS, 2)

    out = torch.empty(bs, HEADS, DIM, device=t["q"].device)
    for b0 in range(0, bs, 16):
        slots = t["req_to_token"][b0 : b0 + 16].long()
        k, v = rows(t["k"], slots) * ks, rows(t["v"], slots) * vs  # [b, n, H, D]
        w = torch.softmax(torch.einsum("bhd,bnhd->bhn", t["q"][b0 : b0 + 16].float(), k) * DIM**-0.5, -1)
        out[b0 : b0 + 16] = torch.einsum("bhn,bnhd->bhd", w, v)
    return out


BF16_VARIANTS = {"bf16": {}, "bf16_kv_group": dict(kv_group=True)}


def is_bf16(cfg: dict) -> bool:
    return cfg["variant"] in BF16_VARIANTS


def call(t: dict, cfg: dict, splits: int) -> None:
    kw = dict(FP8_DECODE_VARIANTS[cfg["variant"]] if t["fp8"] else BF16_VARIANTS[cfg["variant"]])
    decode_attention(t["q"], t["k"], t["v"], t["out"], t["req_to_token"], t["rows"], t["seq_lens"], t["nsplit"],
                     t["mid_o"][:, :, :splits], t["mid_lse"][:, :, :splits], DIM**-0.5, block_n=cfg["block_n"],
                     page_size=t["page"], kv_fp8=FP8 if t["fp8"] else None,
                     k_scale=t["k_scale"] if t["fp8"] else None, v_scale=t["v_scale"] if t["fp8"] else None,
                     num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                     whole_blocks=cfg["whole_blocks"], counters=t["counters"], **kw)


def time_us(t: dict, cfg: dict, splits: int, iters: int, graphs: bool) -> float:
    compute_num_kv_splits(t["seq_lens"], t["nsplit"], 1, splits)  # every request gets `splits` (ctx >= splits)
    call(t, cfg, splits)
    if not graphs:  # the CPU smoke run: no timing
        return 1.0
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        call(t, cfg, splits)  # warm on the capture stream
        stream.synchronize()
        with torch.cuda.graph(g, stream=stream):
            for _ in range(iters):
                call(t, cfg, splits)
    return replay_us(g, iters)


def _warm_worker(cfgs: list[dict], page: int, heads: str, tasks, status, current, slot: int) -> None:
    """A compile process: takes setting indices from `tasks` (None: stop), compiles and runs each once on a tiny
    problem with the real ones' specialization (pointers and strides multiples of 16), so Triton's on-disk
    cache serves the main process. status[i]: 3 while it works on i, then 1 (ok) or 2 (an error: skipped)."""
    set_heads(heads)  # a spawned process: the module's defaults again
    gen = torch.Generator().manual_seed(0)
    probs = {fp8: setup(2, 64, fp8, page, "cuda", gen) for fp8 in (False, True)}
    while (i := tasks.get()) is not None:
        current[slot] = i
        status[i] = 3
        t = probs[not is_bf16(cfgs[i])]
        try:
            compute_num_kv_splits(t["seq_lens"], t["nsplit"], 1, 2)
            call(t, cfgs[i], 2)
            torch.cuda.synchronize()
            status[i] = 1
        except Exception as e:  # out of shared memory etc.
            print(f"warm-up failed: {cfgs[i]}: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr, flush=True)
            status[i] = 2


def warm_all(cfgs: list[dict], page: int, jobs: int, timeout_s: float = 420) -> list[dict]:
    """Compile the settings in `jobs` processes; the ones that compiled and ran. A setting whose compile kills its
    process (a compiler abort) is dropped, so the main process never compiles it, and the process replaced."""
    t0 = time.time()
    ctx = torch.multiprocessing.get_context("spawn")
    tasks, status, current = ctx.Queue(), ctx.Array("b", len(cfgs), lock=False), ctx.Array("i", jobs, lock=False)
    for i in range(len(cfgs)):
        tasks.put(i)

    def start(slot: int):
        current[slot] = -1
        p = ctx.Process(target=_warm_worker, args=(cfgs, page, f"{HEADS}:{KV_HEADS}:{DIM}", tasks, status, current,
                                                   slot), daemon=True)
        p.start()
        return p

    procs = [start(slot) for slot in range(jobs)]
    while any(s in (0, 3) for s in status[:]) and time.time() - t0 < timeout_s:
        time.sleep(0.2)
        for slot, p in enumerate(procs):
            if p.exitcode is not None and p.exitcode != 0:  # died: drop what it was compiling, replace it
                i = current[slot]
                if i >= 0 and status[i] == 3:
                    status[i] = 4
                    print(f"dropped (its compile killed the process): {cfgs[i]}", file=sys.stderr, flush=True)
                procs[slot] = start(slot)
    for _ in procs:
        tasks.put(None)
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    ok = [c for c, st in zip(cfgs, status[:], strict=True) if st == 1]
    print(f"compiled {len(ok)} of {len(cfgs)} settings at page {page} in {time.time() - t0:.0f} s with {jobs} "
          "processes", flush=True)
    return ok


def sweep(cases, cfgs, page, iters, graphs, dev, deadline: float, only=None) -> list[dict]:
    """Every (setting, case, split count) of the grid (or the `only` list per case and kv dtype): rows. Settings
    run in order, each over all cases (all problems stay on the GPU), until `deadline` (time.time())."""
    gen = torch.Generator().manual_seed(0)
    probs = {}
    for bs, ctx in cases:
        for fp8 in (False, True):
            t = setup(bs, ctx, fp8, page, dev, gen)
            probs[(bs, ctx, fp8)] = (t, reference(t), 2 * bs * ctx * KV_HEADS * DIM * (1 if fp8 else 2))
    rows, skipped = [], 0
    for cfg in cfgs:
        fp8 = not is_bf16(cfg)
        for bs, ctx in cases:
            t, ref, kv_bytes = probs[(bs, ctx, fp8)]
            todo = list(split_options(bs, ctx)) if only is None else [s for c, s in only.get((bs, ctx, fp8), [])
                                                                       if c == cfg]
            for splits in todo:
                if time.time() > deadline:
                    skipped += 1
                    continue
                try:
                    us = time_us(t, cfg, splits, iters, graphs)
                except Exception as e:  # out of shared memory etc.: skip the setting
                    print(f"skip {bs}:{ctx} {cfg} splits {splits}: {type(e).__name__} {str(e)[:100]}", file=sys.stderr)
                    continue
                err = (t["out"].float() - ref).abs().max().item()
                rows.append(dict(bs=bs, ctx=ctx, page=page, kv="fp8_e4m3" if fp8 else "bf16", **cfg, splits=splits,
                                 split_knobs=split_options(bs, ctx)[splits], us=round(us, 2),
                                 tbps=round(kv_bytes / us / 1e6, 3), max_err=err,
                                 rel_err=err / ref.abs().max().item()))
    if skipped:
        print(f"time budget: {skipped} timings skipped (raise --budget-s)", file=sys.stderr)
    del probs
    if dev == "cuda":
        torch.cuda.empty_cache()
    return rows


def is_default(r: dict) -> bool:
    d = FP8_DEFAULT if r["kv"] != "bf16" else BF16_DEFAULT
    return all(r[k] == v for k, v in d.items()) and [2, 64] in [list(x) for x in r["split_knobs"]]


def summarize(rows: list[dict]) -> tuple[list[dict], dict]:
    """Per (case, page): bf16 and fp8 default and best; fp8 best per variant; the suggested settings table."""
    out, table = [], {}
    key = lambda r: (r["bs"], r["ctx"], r["page"])  # noqa: E731
    for (bs, ctx, page), group in itertools.groupby(sorted(rows, key=key), key=key):
        group = list(group)
        s = dict(bs=bs, ctx=ctx, page=page)
        for kv in ("bf16", "fp8_e4m3"):
            g = [r for r in group if r["kv"] == kv and r["rel_err"] <= ERR_BOUND]  # qk8 is never picked
            if not g:
                continue
            best = min(g, key=lambda r: r["us"])
            dflt = [r for r in g if is_default(r)]
            s[kv] = dict(best=best, default=min(dflt, key=lambda r: r["us"]) if dflt else None)
            if kv == "fp8_e4m3":
                s["fp8_by_variant"] = {
                    f"{v}{'+whole' if w else ''}": min(gv, key=lambda r: r["us"])
                    for (v, w) in {(r["variant"], r["whole_blocks"]) for r in g}
                    for gv in [[r for r in g if r["variant"] == v and r["whole_blocks"] == w]]}
                knobs = [tuple(x) for x in best["split_knobs"]]  # prefer the backend's knobs for the same count
                pps, mt = (2, 64) if (2, 64) in knobs else next((x for x in knobs if x[0] == 2), knobs[0])
                if page == 1 or bs not in table:
                    table[bs] = dict(variant=best["variant"], block_n=best["block_n"], num_warps=best["num_warps"],
                                     num_stages=best["num_stages"], whole_blocks=best["whole_blocks"],
                                     programs_per_sm=pps, min_tokens_per_split=mt)
        if "bf16" in s and "fp8_e4m3" in s:
            s["fp8_best_speedup_vs_bf16_best"] = round(s["bf16"]["best"]["us"] / s["fp8_e4m3"]["best"]["us"], 3)
        out.append(s)
    return out, table


def print_summary(summary: list[dict]) -> None:
    def fmt(r):
        if r is None:
            return "-"
        return (f"{r['us']:8.1f} us {r['tbps']:5.2f} TB/s  {r['variant']} bn{r['block_n']} w{r['num_warps']} "
                f"st{r['num_stages']}{' whole' if r['whole_blocks'] else ''} splits {r['splits']} "
                f"err {r['rel_err']:.1e}")
    for s in summary:
        floor = 2 * s["bs"] * s["ctx"] * KV_HEADS * DIM / (HBM_TBPS * 1e6)
        print(f"\n== bs {s['bs']} ctx {s['ctx']} page {s['page']}  (HBM floor: fp8 {floor:.1f} us, bf16 "
              f"{2 * floor:.1f} us)  fp8 best / bf16 best speedup {s.get('fp8_best_speedup_vs_bf16_best')}")
        for kv in ("bf16", "fp8_e4m3"):
            if kv in s:
                print(f"  {kv:9} default {fmt(s[kv]['default'])}")
                print(f"  {kv:9} best    {fmt(s[kv]['best'])}")
        for name, r in sorted(s.get("fp8_by_variant", {}).items(), key=lambda x: x[1]["us"]):
            print(f"    fp8 {name:18} {fmt(r)}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=["32:4096", "128:4096", "256:1024", "1:128"])
    ap.add_argument("--page", type=int, default=1, help="page size of the full sweep (the engine's default 1)")
    ap.add_argument("--recheck-page", type=int, default=16, help="page size the best settings run again at (0: no)")
    ap.add_argument("--top", type=int, default=4, help="settings per (case, kv dtype) run again at --recheck-page")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=210, help="no new timing starts after this many seconds")
    ap.add_argument("--jobs", type=int, default=min(15, max(1, (os.cpu_count() or 2) - 1)))
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton's interpreter, tiny cases")
    ap.add_argument("--heads", default="32:8:64", help="query heads:KV heads:head dim (Qwen3-0.6B: 16:8:128)")
    ap.add_argument("--robust", nargs=2, metavar=("BS_LIST", "CTX_LIST"), default=None,
                    help="e.g. 1,4,32,128,256 128,1024,4096: one setting per batch size over all the contexts "
                         "(a graph serves them all), for the backend's tables")
    ap.add_argument("--out", default=None, help="JSON (default results/decode-attention-fp8-<gpu>.json)")
    a = ap.parse_args()
    set_heads(a.heads)
    t0 = time.time()
    dev = "cpu" if a.smoke else "cuda"
    if a.robust:
        return robust_main(a, dev, t0)
    cases = [tuple(map(int, c.split(":"))) for c in (["2:48", "3:16"] if a.smoke else a.cases)]
    cfgs = grid(a.smoke)
    cfgs = [c for c in cfgs if c in (BF16_DEFAULT, FP8_DEFAULT)] + [c for c in cfgs if c not in (BF16_DEFAULT,
                                                                                                FP8_DEFAULT)]
    deadline = t0 + (1e9 if a.smoke else a.budget_s)
    if not a.smoke:
        cfgs = warm_all(cfgs, a.page, a.jobs)
    rows = sweep(cases, cfgs, a.page, a.iters, not a.smoke, dev, deadline - 30 if a.recheck_page else deadline)
    if a.recheck_page:
        only = {}
        key = lambda r: (r["bs"], r["ctx"], r["kv"] != "bf16")  # noqa: E731
        for k, g in itertools.groupby(sorted(rows, key=key), key=key):
            g = sorted(g, key=lambda r: r["us"])
            keep = [r for r in g[: a.top]] + [r for r in g if is_default(r)][:1]
            only[k] = [({c: r[c] for c in FP8_DEFAULT}, r["splits"]) for r in keep]
        if not a.smoke:
            again = [c for c in cfgs if any(c == x for todo in only.values() for x, _ in todo)]
            ok = warm_all(again, a.recheck_page, min(a.jobs, len(again)))
            only = {k: [(c, s) for c, s in todo if c in ok] for k, todo in only.items()}
        rows += sweep(cases, cfgs, a.recheck_page, a.iters, not a.smoke, dev, deadline, only=only)
    summary, table = summarize(rows)
    print_summary(summary)
    print("\nsuggested fp8 entries of TritonAttentionBackend.decode_tables (page", a.page, "figures):")
    for bs, e in sorted(table.items()):
        print(f"    {bs}: dict({', '.join(f'{k}={v!r}' for k, v in e.items())}),")
    bad = [r for r in rows if r["rel_err"] > ERR_BOUND]
    print(f"\n{len(rows)} timings, {len(bad)} over the error bound ({ERR_BOUND:.0%} of max |ref|; such settings "
          "are never picked, qk8 usually is one), "
          f"{time.time() - t0:.0f} s")
    for r in bad[:10]:
        print("  over:", {k: r[k] for k in ("bs", "ctx", "kv", "variant", "block_n", "rel_err")})
    name = torch.cuda.get_device_name().replace(" ", "-").lower() if dev == "cuda" else "cpu-smoke"
    path = a.out or os.path.join(os.path.dirname(__file__), "results", f"decode-attention-fp8-{name}.json")
    with open(path, "w") as f:
        json.dump(dict(device=name, cases=cases, page=a.page, summary=summary, table=table, all=rows), f, indent=1)
    print("wrote", path)


def robust_main(a, dev: str, t0: float) -> None:
    bs_list, ctx_list = ([int(x) for x in v.split(",")] for v in a.robust)
    cases = [(bs, ctx) for bs in bs_list for ctx in ctx_list]
    current = current_entries(bs_list)
    cfgs = robust_grid([{k: c[k] for k in CFG_KEYS} for c in current.values()])
    if a.smoke:
        cfgs = [c for c in cfgs if c["block_n"] == 32 and c["num_stages"] == 1 and c["num_warps"] == 1]
    else:
        cfgs = warm_all(cfgs, a.page, a.jobs)
    rows = sweep(cases, cfgs, a.page, a.iters, not a.smoke, dev, t0 + (1e9 if a.smoke else a.budget_s))
    tables, report = robust_tables(rows, current)
    for r in report:
        ctxs = sorted(r["best_us"])
        fmt = lambda t, ctxs=ctxs: " ".join(f"{t[c]:7.1f}" for c in ctxs) if t else "-"  # noqa: E731
        print(f"{r['kv']:9} bs {r['bs']:4}  ctx {ctxs}  best {fmt(r['best_us'])}  pick {fmt(r['pick_us'])} "
              f"({r['pick_slowdown']:.3f}x)  current {fmt(r['current_us'])} "
              f"({r['current_slowdown'] or float('nan'):.3f}x)  pick: {r['pick']}")
    name = torch.cuda.get_device_name().replace(" ", "-").lower() if dev == "cuda" else "cpu-smoke"
    path = a.out or os.path.join(os.path.dirname(__file__), "results", f"decode-attention-robust-{DIM}-{name}.json")
    with open(path, "w") as f:
        json.dump(dict(device=name, heads=a.heads, cases=cases, page=a.page, tables=tables, report=report,
                       all=rows, seconds=round(time.time() - t0)), f, indent=1)
    print(f"{len(rows)} timings in {time.time() - t0:.0f} s; wrote", path)


if __name__ == "__main__":
    main()
