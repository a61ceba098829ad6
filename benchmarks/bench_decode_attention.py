"""The split-KV decode attention kernel alone, bf16 vs fp8 KV, over its launch settings (Llama-3.2-1B heads:
32 query, 8 KV, dim 64; pages of 16 in a shuffled order). Prints us per call, the KV bytes read per second
against the HBM peak, and the best setting per (kv dtype, batch, context); JSON with --out.

python benchmarks/bench_decode_attention.py          # ~2 min on an H200
"""

import argparse
import itertools
import json
import sys

import torch

from ostinato.attention.triton_ops.decode_attention import compute_num_kv_splits, decode_attention

HEADS, KV_HEADS, DIM, PAGE = 32, 8, 64, 16
HBM_TBPS = 4.8  # H200


def setup(bs: int, ctx: int, fp8: bool, gen: torch.Generator) -> dict:
    dev = torch.device("cuda")
    pages = bs * ctx // PAGE
    slots = pages * PAGE + PAGE  # page 0: the sink
    store = torch.uint8 if fp8 else torch.bfloat16
    k = torch.randn(slots, KV_HEADS, DIM, device=dev).to(torch.float8_e4m3fn if fp8 else store)
    v = torch.randn(slots, KV_HEADS, DIM, device=dev).to(torch.float8_e4m3fn if fp8 else store)
    if fp8:
        k, v = k.view(torch.uint8), v.view(torch.uint8)
    order = (torch.randperm(pages, generator=gen) + 1).to(dev)  # shuffled pages, as after churn
    req_to_token = (order.view(bs, ctx // PAGE, 1) * PAGE + torch.arange(PAGE, device=dev)).view(bs, ctx)
    return dict(q=torch.randn(bs, HEADS, DIM, device=dev, dtype=torch.bfloat16), k=k, v=v,
                out=torch.empty(bs, HEADS, DIM, device=dev, dtype=torch.bfloat16),
                req_to_token=req_to_token.to(torch.int32), rows=torch.arange(bs, device=dev),
                seq_lens=torch.full((bs,), ctx, device=dev, dtype=torch.int32),
                scale_k=torch.tensor([0.5], device=dev), scale_v=torch.tensor([0.25], device=dev))


def run(t: dict, fp8: bool, splits: int, block_n: int, warps: int, stages: int, fp16_dot: bool, iters: int):
    bs = t["q"].shape[0]
    nsplit = torch.empty(bs, device="cuda", dtype=torch.int32)
    compute_num_kv_splits(t["seq_lens"], nsplit, block_n, splits)
    mid_o = torch.empty(bs, HEADS, splits, DIM, device="cuda", dtype=torch.float32)
    mid_lse = torch.empty(bs, HEADS, splits, device="cuda", dtype=torch.float32)

    def call():
        decode_attention(t["q"], t["k"], t["v"], t["out"], t["req_to_token"], t["rows"], t["seq_lens"], nsplit,
                         mid_o, mid_lse, DIM**-0.5, block_n=block_n, page_size=PAGE,
                         kv_fp8=torch.float8_e4m3fn if fp8 else None, k_scale=t["scale_k"] if fp8 else None,
                         v_scale=t["scale_v"] if fp8 else None, num_warps=warps, num_stages=stages,
                         fp16_dot=fp16_dot)

    call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3, t["out"].float().clone()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=["32:4096", "128:4096", "256:2048", "128:1024"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for case in a.cases:
        bs, ctx = map(int, case.split(":"))
        for fp8 in (False, True):
            t = setup(bs, ctx, fp8, gen)
            kv_bytes = 2 * bs * ctx * KV_HEADS * DIM * (1 if fp8 else 2)
            ref = None
            grid = itertools.product((1, 2, 4), (32, 64, 128), (4, 8), (2, 3), (False, True) if fp8 else (False,))
            for splits, block_n, warps, stages, fp16_dot in grid:
                try:
                    us, out = run(t, fp8, splits, block_n, warps, stages, fp16_dot, a.iters)
                except Exception as e:  # out of shared memory etc.: skip the setting
                    print(f"skip {case} fp8={fp8} {splits}/{block_n}/{warps}/{stages}/{fp16_dot}: "
                          f"{type(e).__name__}", file=sys.stderr)
                    continue
                ref = out if ref is None else ref
                err = (out - ref).abs().max().item()
                rows.append(dict(bs=bs, ctx=ctx, kv="fp8_e4m3" if fp8 else "bf16", splits=splits, block_n=block_n,
                                 warps=warps, stages=stages, fp16_dot=fp16_dot, us=round(us, 1),
                                 tbps=round(kv_bytes / us / 1e6, 2), max_diff_vs_first=err))
            del t
            torch.cuda.empty_cache()
    default = dict(splits=None, block_n=64, warps=4, stages=2, fp16_dot=False)
    print(f"{'case':>10} {'kv':>9} {'default us':>10} {'best us':>8} {'TB/s':>5} {'floor us':>8}  best setting")
    best_rows = []
    for (bs, ctx, kv), group in itertools.groupby(rows, key=lambda r: (r["bs"], r["ctx"], r["kv"])):
        group = list(group)
        cap = max(1, min(16, -(-2 * 132 // ((1 << (bs - 1).bit_length()) * KV_HEADS))))  # the backend's cap
        dflt = [r for r in group if r["splits"] == min(cap, 4) and all(r[k] == v for k, v in default.items()
                                                                        if v is not None)]
        best = min(group, key=lambda r: r["us"])
        floor = 2 * bs * ctx * KV_HEADS * DIM * (1 if kv == "fp8_e4m3" else 2) / (HBM_TBPS * 1e6)
        print(f"{bs:>4}:{ctx:<5} {kv:>9} {dflt[0]['us'] if dflt else float('nan'):>10.1f} {best['us']:>8.1f} "
              f"{best['tbps']:>5.2f} {floor:>8.1f}  splits {best['splits']} block_n {best['block_n']} warps "
              f"{best['warps']} stages {best['stages']} fp16_dot {best['fp16_dot']} "
              f"(diff {best['max_diff_vs_first']:.2g})")
        best_rows.append(dict(best, default_us=dflt[0]["us"] if dflt else None, floor_us=round(floor, 1)))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), best=best_rows, all=rows), f, indent=1)


if __name__ == "__main__":
    main()
