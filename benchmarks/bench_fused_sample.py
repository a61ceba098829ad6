"""The fused sampler's cost per step (runner/fused_sample.py) at a real vocabulary: temperature alone, top_k,
top_p and both, each timed eagerly (kernel launches from Python, as the engine launches them) and as a replayed
CUDA graph (the GPU's time alone).

python benchmarks/bench_fused_sample.py [--vocab 128256] [--batch-sizes 1 32 256] [--out FILE]   # GPU
    [--baseline PATH ...]   # also time other copies of fused_sample.py (e.g. the last commit's), in turns
    [--two-phase-baselines] # copies from before c33771b: given (top_k, top_p) alone, not top_p's search phase
    [--graph-calls 10]      # time graphs of 10 calls (per call): at bs 1 a one-call replay's host cost can exceed
                            # the sampler's GPU time (the sixtieth session read 6-12 us for one 2-launch path)
    [--profile]             # and each replay's kernels, from torch.profiler
    [--profile-order]       # the same, each launch apart, in launch order
    [--scale 3 0.3]         # logits' spread: how often the unrestricted draw survives the cut
    [--decode-draw]         # also the decode graph's draw of a temperature-only step (argmax.draw_rows) and its
                            # greedy argmax (argmax_rows), replayed: the draw's cost over greedy's
"""

import argparse
import os
import sys
import time

import torch
from common import RESULTS, capture, copy_bandwidth, device_tag, load_file_module, write_report

from ostinato.layers.sampling_ops import KEPT_TOP_K
from ostinato.layers.triton_ops.argmax import argmax_rows, draw_rows
from ostinato.runner.fused_sample import fused_sample

SETTINGS = [(None, None), (50, None), (200, None), (1000, None), (None, 0.9), (50, 0.9), (20, 0.95)]  # (top_k, top_p)


def timed(fn, iters: int = 20) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters * 1e3


def kernel_times(fn, iters: int = 10, in_order: bool = False) -> dict[str, float]:
    """Mean GPU microseconds per call of `fn`, per kernel name (summed over a name's launches in a call), or with
    `in_order` per launch, in launch order ("name #i": a name's i-th launch in a call)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    if in_order:
        kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA" and e.device_time_total > 0),
                         key=lambda e: e.time_range.start)
        per_call = len(kernels) // iters
        for i, e in enumerate(kernels[: per_call * iters]):
            nth = sum(k.name == e.name for k in kernels[i - i % per_call: i])
            key = f"{e.name[:40]} #{nth}"
            out[key] = out.get(key, 0.0) + e.device_time_total / iters
        return out
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and e.device_time_total > 0:
            out[e.key[:40]] = e.device_time_total / iters
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--baseline", nargs="*", default=[], help="other fused_sample.py files, timed beside the tree's")
    ap.add_argument("--graph-calls", type=int, default=1,
                    help="calls a timed graph holds (10: a replay's host cost no longer counts where a call is short)")
    ap.add_argument("--two-phase-baselines", action="store_true",
                    help="give the baselines two cut phases (copies of fused_sample.py from before c33771b)")
    ap.add_argument("--profile", action="store_true", help="print each replay's kernels and their mean times")
    ap.add_argument("--profile-order", action="store_true",
                    help="--profile with each launch in launch order (a name's passes apart) instead of by name")
    ap.add_argument("--scale", type=float, nargs="+", default=[3.0],
                    help="logits ~ N(0, scale^2), one pass each: at T=0.6 a scale of 3 puts most of the mass on a few "
                         "hundred tokens (the unrestricted draw survives top_k 200), 0.3 spreads it (it rarely does)")
    ap.add_argument("--decode-draw", action="store_true",
                    help="also time the decode graph's draw (draw_rows at T=0.6) and argmax (argmax_rows), replayed")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev, v, rows = torch.device("cuda"), args.vocab, []
    bandwidth = copy_bandwidth(dev) if args.decode_draw else 0.0
    impls = {"tree": fused_sample}
    for i, path in enumerate(args.baseline):
        name = os.path.splitext(os.path.basename(path))[0].lstrip(".")
        impls = {name: load_file_module(path, f"fused_sample_baseline{i}").fused_sample} | impls
    for scale, b in [(scale, b) for scale in args.scale for b in args.batch_sizes]:
        logits = torch.randn(b, v, device=dev, generator=torch.Generator(dev).manual_seed(b)) * scale
        temps = torch.full((b,), 0.6, device=dev)
        seeds = torch.arange(b, device=dev)
        steps = torch.zeros(b, dtype=torch.int64, device=dev)
        if args.decode_draw:
            out = torch.empty(b, dtype=torch.int64, device=dev)
            calls = (("argmax", lambda x=logits, o=out: argmax_rows(x, o)),
                     ("draw", lambda x=logits, t=temps, s=seeds, n=steps, o=out: draw_rows(x, t, s, n, 1e-5, o)))
            for name, step in calls:
                graph = capture(step, 20)  # 20 calls a replay: the GPU's time, not the host's replay
                graph.replay()
                rows.append(dict(impl=f"decode-{name}", batch_size=b, scale=scale,
                                 graph_ms=timed(graph.replay, 20) / 20, floor_ms=b * v * 4 / bandwidth * 1e3))
                print(f"decode-{name:6} scale {scale} bs {b:3}: graph {rows[-1]['graph_ms'] * 1e3:.1f} us "
                      f"(logits read once: {rows[-1]['floor_ms'] * 1e3:.1f} us)", flush=True)
        for top_k, top_p in SETTINGS:
            cut = top_k is not None or top_p is not None
            tk = torch.full((b,), top_k or v, dtype=torch.int64, device=dev) if cut else None
            tp = torch.full((b,), top_p or 1.0, device=dev) if cut else None

            # whether a top_p row lacks a small top_k (SamplingTensors.fused_args' third phase), as the engine passes
            # it; copies from before c33771b take the first two (--two-phase-baselines)
            search = top_p is not None and (top_k is None or top_k > KEPT_TOP_K)
            for name, fn in impls.items():
                third = () if args.two_phase_baselines and name != "tree" else (search,)
                phases = (top_k is not None, top_p is not None) + third

                def step(x=logits, t=temps, tk=tk, tp=tp, s=seeds, n=steps, fn=fn, phases=phases) -> torch.Tensor:
                    return fn(x, t, None, tk, tp, s, n, v, 1e-5, cut_phases=phases)

                step()
                eager = timed(step)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()
                graph.replay()
                # rows whose draw is the unrestricted one (the tree keeps those without searching)
                free = fn(logits, temps, None, None, None, seeds, steps, v, 1e-5)
                kept = (step() == free).float().mean().item() if cut else 1.0
                if args.graph_calls > 1:  # the GPU's time per call, past the host's cost of a replay
                    many = capture(step, args.graph_calls)
                    graph_ms = timed(many.replay) / args.graph_calls
                else:
                    graph_ms = timed(graph.replay)
                rows.append(dict(impl=name, batch_size=b, scale=scale, top_k=top_k, top_p=top_p, eager_ms=eager,
                                 graph_ms=graph_ms, graph_calls=args.graph_calls, unrestricted_kept=kept))
                print(f"{name:8} scale {scale} bs {b:3} top_k {top_k} top_p {top_p}: eager {eager:.3f} ms, graph "
                      f"{rows[-1]['graph_ms']:.3f} ms, unrestricted draw kept in {kept:.0%} of rows", flush=True)
                if args.profile or args.profile_order:
                    rows[-1]["kernels_us"] = kernel_times(graph.replay, in_order=args.profile_order)
                    print("    " + ", ".join(f"{k} {us:.1f}" for k, us in rows[-1]["kernels_us"].items()))
    report = dict(device=torch.cuda.get_device_name(dev), vocab=v,
                  command=" ".join([os.path.basename(sys.executable)] + sys.argv), rows=rows)
    write_report(report, args.out or os.path.join(RESULTS, f"fused-sample-{device_tag(dev)}.json"))


if __name__ == "__main__":
    main()
