"""What a sampler launch costs when none of its rows has work, and what part of that is the kernel's own reads.

The question behind it (#16, filters at bs 32; forty-ninth session): a top_p pass costs about 3.4 us in the sampler
graph even where no row is searched, and a filtered step at 32 rows launches 15 kernels, most of them empty. Whether
that is the launch and its waves of programs (then only fewer launches help) or the empty program's reads of the
row's inputs and the acceptance sums before it can exit (then a per-row flag read first helps) decides the next
change. Times, as graphs of CALLS launches each, us a launch:
Every tensor is allocated before the capture (an allocation that fills would add its own kernel to each launch).
- the engine's own kernels with every row inactive (T=0.6 rows, and `_verdict_kernel`'s list empty: every program
  exits), at the shapes a 32-row step launches them, and the verdict kernel itself;
- a stand-in kernel over the same grid that reads one int32 flag a row and exits, with a light body and with a
  body as heavy in registers as a top_p pass (a [16, 1024] accumulator), at 8, 4 and 1 warps and over one program
  a row.

    python benchmarks/probe_empty_launch.py [--batch 32] [--vocab 128256] [--out F.json]
"""

import argparse
import json

import torch
import triton
import triton.language as tl
from common import capture, replay_us

from ostinato.runner import fused_sample as fs

CALLS = 20


@triton.jit
def _flag_exit_kernel(Flags, Logits, Out, stride, NUM: tl.constexpr, HEAVY: tl.constexpr, BLOCK: tl.constexpr):
    """Exit at once where Flags[row] is 0; else a pass-like body (16 masses of a 1024-column block, HEAVY) or a sum."""
    row = tl.program_id(0)
    if tl.load(Flags + row) == 0:
        return
    offs = tl.arange(0, BLOCK)
    x = tl.load(Logits + row * stride + offs)
    if HEAVY:
        cand = tl.arange(0, NUM).to(tl.float32) * 0.1
        acc = tl.where(x[None, :] >= cand[:, None], tl.exp(x)[None, :], 0.0)
        for start in range(BLOCK, 8 * BLOCK, BLOCK):
            y = tl.load(Logits + row * stride + start + offs)
            acc += tl.where(y[None, :] >= cand[:, None], tl.exp(y)[None, :], 0.0)
        tl.store(Out + row * NUM + tl.arange(0, NUM), tl.sum(acc, axis=1))
    else:
        tl.store(Out + row, tl.sum(x, axis=0))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    b, vocab = args.batch, args.vocab
    split_len, num_splits = fs.split_plan(b, vocab)
    pow2 = triton.next_power_of_2(num_splits)
    logits = torch.randn(b, vocab, device=dev) * 3
    temps = torch.full((b,), 0.6, device=dev)
    top_ks = torch.full((b,), vocab, dtype=torch.int64, device=dev)
    top_ps = torch.ones(b, device=dev)
    split_max = logits.view(b, num_splits, -1).amax(-1) if vocab % num_splits == 0 else \
        torch.stack([c.amax(-1) for c in logits.split(split_len, dim=1)], dim=1)
    split_max = (split_max / 0.6).contiguous()
    f32 = dict(dtype=torch.float32, device=dev)
    i32 = dict(dtype=torch.int32, device=dev)
    i64 = dict(dtype=torch.int64, device=dev)
    mass = torch.rand(b, num_splits, fs.MASS_LANES, **f32)
    count, count2 = torch.zeros(b, num_splits, **i32), torch.zeros(b, num_splits, **i32)
    second = torch.ones(b, **i32)
    vals, idx = torch.randn(b, num_splits, **f32), torch.zeros(b, num_splits, **i64)
    vals2, idx2, listed = vals.clone(), idx.clone(), torch.zeros(b + 1, **i32)
    seeds, steps = torch.arange(b, **i64), torch.zeros(b, **i64)
    order = torch.zeros(b + 1, **i32)  # no row needs its cut
    check = dict(Order=order, CHECKED=True)
    row_args = (temps, temps, top_ks, top_ps, split_max)
    state = torch.zeros(b, 2, 2, **i64)
    part = torch.rand(2, b, num_splits, fs._NWAY, **f32)
    goal, cut_k, cuts = torch.rand(b, **f32), torch.zeros(b, **i64), torch.empty(b, **f32)
    cap = fs.gather_cap(b, num_splits)
    gathered = torch.empty(b, num_splits, max(cap, 1), **i32)
    gath_n, above = torch.zeros(b, num_splits, **i32), torch.zeros(b, num_splits, **f32)
    resolved, dense = torch.zeros(b, 2, **i64), torch.empty(b, pow2 * max(cap, 1), **i32)
    hist = torch.zeros(fs.TOP_K_PASSES * b * 256 + b, **i32)
    select = torch.zeros(2, b, 8, **i64)
    k_dense = torch.empty(b, fs.TOP_K_GATHER, **i32)
    meta = dict(HAS_MIN_P=False, SPLITS_POW2=pow2, num_warps=fs._SEARCH_WARPS, **check)
    grid = (num_splits, b)  # over (split, list entry), as the checked kernels run
    p_args = (logits, logits.stride(0), *row_args, state, part, goal, cut_k, vocab, split_len, num_splits, b)

    def top_p_pass(pass_idx: int):
        return lambda: fs._top_p_pass_kernel[grid](*p_args, pass_idx, 1e-5, HAS_K=False, BLOCK=fs._SEARCH_BLOCK,
                                                   NWAY=fs._NWAY, **meta, Gathered=gathered, GathN=gath_n,
                                                   Above=above, Resolved=resolved, GATHER_CAP=cap,
                                                   IS_GATHER=bool(cap) and pass_idx == fs.GATHER_PASS)

    def top_k_pass(pass_idx: int):
        return lambda: fs._top_k_pass_kernel[grid](logits, logits.stride(0), *row_args, select, hist[:-b], k_dense,
                                                   hist[-b:], vocab, split_len, num_splits, b, pass_idx, 1e-5,
                                                   BLOCK=fs._RADIX_BLOCK, FIRST=pass_idx == 0,
                                                   **(meta | dict(num_warps=fs._RADIX_WARPS)))

    variants = {
        "top_p pass 2 (empty)": top_p_pass(2),
        "top_p pass 4, gathers (empty)": top_p_pass(fs.GATHER_PASS),
        "top_p pass 6 (empty)": top_p_pass(6),
        "top_k pass 2 (empty)": top_k_pass(2),
        "cut resolve (one program a row, empty)": lambda: fs._cut_resolve_kernel[(b,)](
            *row_args, state, goal, gathered, gath_n, above, resolved, dense, num_splits, 1e-5, GATHER_CAP=max(cap, 1),
            RESOLVE_BLOCK=fs._RESOLVE_BLOCK, NWAY=fs._NWAY, **meta),
        "cut finish (one program a row, 1 warp)": lambda: fs._cut_finish_kernel[(b,)](
            temps, top_ps, state, part, goal, cut_k, cuts, num_splits, b, 1e-5, HAS_P=True, NWAY=fs._NWAY,
            SPLITS_POW2=pow2, Resolved=resolved, GATHER_CAP=cap, num_warps=1, **check),
        "checked draw (empty)": lambda: fs._split_sample_kernel[grid](
            logits, logits.stride(0), temps, temps, split_max, cuts, seeds, steps, vals, idx, vocab, split_len,
            num_splits, 1e-5, HAS_MIN_P=False, HAS_CUT=True, BLOCK=fs._BLOCK,
            SPLITS_POW2=pow2, num_warps=8, **check),
        # top_p 1.0 and top_k = vocab: every row's draw stands, so nothing is listed (no count grows over replays)
        "verdict (one program a row, 1 warp)": lambda: fs._verdict_kernel[(b,)](
            temps, top_ks, top_ps, mass, count, listed, vocab, num_splits, b, 1e-5, HAS_K=False, HAS_P=True,
            SPLITS_POW2=pow2, Count2=count2, Second=second, SECOND=True, Vals=vals, Idx=idx, Vals2=vals2, Idx2=idx2,
            num_warps=1),
    }
    programs = max(b * num_splits, 132)  # the stand-in's widest grid
    flags = torch.zeros(programs, **i32)
    out = torch.empty(programs * 16, **f32)
    for warps in (8, 4, 1):
        for heavy in (False, True):
            variants[f"flag exit, {b}x{num_splits} programs, {warps} warps, heavy {heavy}"] = (
                lambda w=warps, h=heavy: _flag_exit_kernel[grid](flags, logits, out, logits.stride(0), NUM=16,
                                                                 HEAVY=h, BLOCK=1024, num_warps=w))
    variants[f"flag exit, {b} programs, 8 warps, heavy True"] = lambda: _flag_exit_kernel[(b,)](
        flags, logits, out, logits.stride(0), NUM=16, HEAVY=True, BLOCK=1024, num_warps=8)
    variants["flag exit, 132 programs, 8 warps, heavy True"] = lambda: _flag_exit_kernel[(132,)](
        flags, logits, out, logits.stride(0), NUM=16, HEAVY=True, BLOCK=1024, num_warps=8)
    report = {"batch": b, "vocab": vocab, "num_splits": num_splits, "calls": CALLS, "us_a_launch": {}}
    for name, fn in variants.items():
        graph = capture(fn, CALLS)
        us = min(replay_us(graph, CALLS, reps=5) for _ in range(3))
        report["us_a_launch"][name] = round(us, 3)
        print(f"{name:60s} {us:7.3f} us", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
