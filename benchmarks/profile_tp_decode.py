"""Where a bs-1 tensor-parallel decode step's time goes: torch.profiler over a few decode steps (graph replays)
on rank 0 of the engine, the step split into GEMM / attention / all-reduce / all-gather / other collectives /
other kernels / gaps (no kernel running on rank 0's GPU), per step, as JSON.

One engine (`LLM`, dummy weights, bf16) per configuration, each in its own process: by default TP 1, TP 2
with NCCL only (--disable-custom-all-reduce), and TP 2 with the one-shot all-reduce. One request of `--ctx`
prompt tokens decodes; after `--warmup` decode steps, `--steps` are profiled. A step is the time from the first
kernel of one decode-graph replay to the first kernel of the next (so it holds the host-launched work between
replays too: the per-step slot broadcast, input copies, sampling); `graph_ms` is the replay's own span. Gaps
(rank 0's GPU idle) are split into those between the graph's kernels (`graph_gaps_ms`) and those outside the
replay (`outside_gaps_ms`: waiting for the host, or for the worker's side of the slot broadcast).
Kernel names are put in categories by `kernel_category`. A collective's kernel time includes its wait for the
slower rank. Beside the profile, `engine_ms_per_step` is the engine's own decode ms/step over `--steps` steps
without the profiler.

python benchmarks/profile_tp_decode.py                         # 2 GPUs, llama-3.1-8b, about 2 min
python benchmarks/profile_tp_decode.py --configs 2:one-shot --steps 20
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

CATEGORIES = ("gemm", "attention", "all_reduce", "all_gather", "other_comm", "other")

_RULES = (  # first match wins; names lower-cased
    ("all_reduce", ("allreduce", "all_reduce", "one_shot", "cross_device_reduce")),
    ("all_gather", ("allgather", "all_gather")),
    ("other_comm", ("nccl", "broadcast", "symm_mem", "barrier")),
    ("attention", ("_decode_stage", "_extend_kernel", "attention", "attn", "flash", "_store_kv", "paged")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "splitk", "_skinny_", "matmul", "wgmma")),
)


def kernel_category(name: str) -> str:
    """GEMM, attention (the KV store included), the collectives, or other (norms, rotary, activations,
    embedding, logits, sampling, copies)."""
    low = name.lower()
    for category, needles in _RULES:
        if any(n in low for n in needles):
            return category
    return "other"


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def analyze(trace: dict, device: int | None = None) -> dict:
    """Per-step split of a chrome trace (torch.profiler's export) of decode steps replayed from CUDA graphs.

    Replays are found by the correlation id CUPTI gives a graph's kernels: that of the cudaGraphLaunch (or
    cuGraphLaunch) call. Step k spans [first kernel of replay k, first kernel of replay k + 1); every kernel
    starting in it counts to that step. Returns medians over the steps, in ms."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    launches = {e["args"]["correlation"] for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")
                and "GraphLaunch" in e.get("name", "") and "correlation" in e.get("args", {})}
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
               and (device is None or e.get("args", {}).get("device", device) == device)]
    kernels.sort(key=lambda e: e["ts"])
    replays: dict[int, list[dict]] = defaultdict(list)
    for k in kernels:
        corr = k.get("args", {}).get("correlation")
        if corr in launches:
            replays[corr].append(k)
    groups = sorted(replays.values(), key=lambda g: g[0]["ts"])
    if len(groups) < 2:
        if kernels and launches:  # the graphs' kernels did not carry the launch's correlation id: whole window
            return _aggregate(kernels, len(launches))
        raise ValueError(f"found {len(groups)} graph replays in the trace: at least 2 are needed")
    steps = []
    for g, nxt in zip(groups, groups[1:], strict=False):
        a, b = g[0]["ts"], nxt[0]["ts"]
        inside = [k for k in kernels if a <= k["ts"] < b]
        per_cat = dict.fromkeys(CATEGORIES, 0.0)
        counts = dict.fromkeys(CATEGORIES, 0)
        for k in inside:
            cat = "other" if k.get("cat") != "kernel" else kernel_category(k["name"])
            per_cat[cat] += k["dur"]
            counts[cat] += 1
        busy = _union_us([(k["ts"], min(k["ts"] + k["dur"], b)) for k in inside])
        graph_us = max(k["ts"] + k["dur"] for k in g) - a
        graph_gaps = graph_us - _union_us([(k["ts"], k["ts"] + k["dur"]) for k in g])
        steps.append({"step_us": b - a, "graph_us": graph_us, "busy_us": busy, "gaps_us": (b - a) - busy,
                      "graph_gaps_us": graph_gaps, "outside_gaps_us": (b - a) - busy - graph_gaps,
                      "kernels": len(inside), "graph_kernels": len(g),
                      **{f"{c}_us": v for c, v in per_cat.items()}, **{f"{c}_count": v for c, v in counts.items()}})

    def med(key: str) -> float:
        return statistics.median(s[key] for s in steps)

    out = {"split": "per replay", "steps": len(steps), "step_ms": med("step_us") / 1e3,
           "graph_ms": med("graph_us") / 1e3, "busy_ms": med("busy_us") / 1e3,
           "gaps_ms": med("gaps_us") / 1e3, "graph_gaps_ms": med("graph_gaps_us") / 1e3,
           "outside_gaps_ms": med("outside_gaps_us") / 1e3,
           "kernels_per_step": med("kernels"), "graph_kernels_per_step": med("graph_kernels")}
    for c in CATEGORIES:
        out[f"{c}_ms"] = med(f"{c}_us") / 1e3
        out[f"{c}_kernels"] = med(f"{c}_count")
    # the heaviest kernels over the analysed steps, per step
    first, last = groups[0][0]["ts"], groups[-1][0]["ts"]
    by_name: dict[str, float] = defaultdict(float)
    for k in kernels:
        if first <= k["ts"] < last:
            by_name[k["name"]] += k["dur"]
    out["top_kernels"] = [{"name": n[:120], "category": kernel_category(n), "ms_per_step": us / len(steps) / 1e3}
                          for n, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:15]]
    return out


def _aggregate(kernels: list[dict], launches: int) -> dict:
    """The fallback split: the whole window from the first kernel to the last, over the number of replays."""
    a, b = kernels[0]["ts"], max(k["ts"] + k["dur"] for k in kernels)
    busy = _union_us([(k["ts"], k["ts"] + k["dur"]) for k in kernels])
    out = {"split": "aggregate", "steps": launches, "step_ms": (b - a) / launches / 1e3,
           "busy_ms": busy / launches / 1e3, "gaps_ms": (b - a - busy) / launches / 1e3,
           "graph_ms": float("nan"), "graph_gaps_ms": float("nan"), "outside_gaps_ms": float("nan"),
           "kernels_per_step": len(kernels) / launches,
           "graph_kernels_per_step": float("nan")}
    for c in CATEGORIES:
        mine = [k for k in kernels if (kernel_category(k["name"]) if k.get("cat") == "kernel" else "other") == c]
        out[f"{c}_ms"] = sum(k["dur"] for k in mine) / launches / 1e3
        out[f"{c}_kernels"] = len(mine) / launches
    by_name: dict[str, float] = defaultdict(float)
    for k in kernels:
        by_name[k["name"]] += k["dur"]
    out["top_kernels"] = [{"name": n[:120], "category": kernel_category(n), "ms_per_step": us / launches / 1e3}
                          for n, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:15]]
    return out


# ---------------------------------------------------------------------- one configuration (its own process)
def profile_one(args: argparse.Namespace) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from ostinato import LLM, SamplingParams

    tp, ar = args.one.split(":")
    tp = int(tp)
    llm = LLM(args.model, load_format="dummy", dtype="bfloat16", device="cuda", tp_size=tp, cuda_graph_bs=[1],
              max_running_requests=1, disable_radix_cache=True, disable_custom_all_reduce=ar == "nccl",
              extend_cuda_graph_max_tokens=0,
              max_model_len=args.ctx + 2 * (args.warmup + 2 * args.steps) + 64)
    engine = llm.engine
    try:
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(10, engine.runner.vocab_size - 10, (args.ctx,), generator=g).tolist()
        budget = engine.max_model_len - args.ctx
        engine.add_request("p", prompt, SamplingParams(temperature=0, max_tokens=budget, ignore_eos=True))
        while engine.step_counts["decode"] < args.warmup:
            engine.step()
        n0, t0 = engine.step_counts["decode"], engine.step_seconds["decode"]
        for _ in range(args.steps):
            engine.step()
        engine_ms = 1e3 * (engine.step_seconds["decode"] - t0) / (engine.step_counts["decode"] - n0)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                engine.step()
            torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                trace = json.load(f)
        row = {"model": args.model, "tp": tp, "all_reduce": ar if tp > 1 else "-", "ctx": args.ctx,
               "engine_ms_per_step": engine_ms, **analyze(trace, device=engine.runner.device.index)}
        if args.keep_trace:
            prof.export_chrome_trace(args.keep_trace.replace(".json", f"_tp{tp}_{ar}.json"))
        one_shot = None
        if tp > 1:
            from ostinato.distributed.parallel_state import one_shot_all_reduce

            one_shot = one_shot_all_reduce()
        row["one_shot_in_use"] = one_shot is not None
        row["one_shot_max_bytes"] = one_shot.max_bytes if one_shot is not None else 0
        engine.abort("p")
        engine.step()
        return row
    finally:
        llm.shutdown()


def print_row(r: dict) -> None:
    if "error" in r:
        print(f"TP {r['tp']} {r['all_reduce']}: FAILED {r['error'][-500:]}")
        return
    parts = "  ".join(f"{c} {r[f'{c}_ms']:.3f} ({r[f'{c}_kernels']:.0f})" for c in CATEGORIES)
    print(f"TP {r['tp']} {r['all_reduce']:8s} step {r['step_ms']:.3f} ms (engine {r['engine_ms_per_step']:.3f}, "
          f"graph {r['graph_ms']:.3f}, busy {r['busy_ms']:.3f}, gaps {r['gaps_ms']:.3f}: in graph "
          f"{r['graph_gaps_ms']:.3f}, outside {r['outside_gaps_ms']:.3f})  {parts}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--configs", nargs="+", default=["1:-", "2:nccl", "2:one-shot"],
                   help="tp:all-reduce, all-reduce one-shot (the default path) or nccl (--disable-custom-all-reduce)")
    p.add_argument("--ctx", type=int, default=128)
    p.add_argument("--warmup", type=int, default=30, help="decode steps before measuring")
    p.add_argument("--steps", type=int, default=20, help="decode steps measured, and profiled")
    p.add_argument("--keep-trace", default=None, help="also write each chrome trace (path.json -> path_tpN_ar.json)")
    p.add_argument("--config-timeout", type=int, default=150, help="seconds for one configuration")
    p.add_argument("--out", default=None)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--one-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        row = profile_one(args)
        with open(args.one_out, "w") as f:
            json.dump(row, f)
        os._exit(0)  # no NCCL teardown (it can hang after graph capture: pytorch#115388)
    t0 = time.perf_counter()
    rows = []
    for config in args.configs:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, os.path.abspath(__file__), "--one", config, "--one-out", f.name, "--model",
                   args.model, "--ctx", str(args.ctx), "--warmup", str(args.warmup), "--steps", str(args.steps)]
            if args.keep_trace:
                cmd += ["--keep-trace", args.keep_trace]
            try:
                proc = subprocess.run(cmd, timeout=args.config_timeout, stderr=subprocess.PIPE, text=True)
                error = None if proc.returncode == 0 and os.path.getsize(f.name) else \
                    f"exit {proc.returncode}: {proc.stderr[-3000:]}"
            except subprocess.TimeoutExpired:
                error = f"timed out after {args.config_timeout} s"
            tp, ar = config.split(":")
            row = json.load(open(f.name)) if error is None else {"tp": int(tp), "all_reduce": ar, "error": error}
        rows.append(row)
        print_row(row)
    ok = {(r["tp"], r["all_reduce"]): r for r in rows if "error" not in r}
    base = next((r for (tp, _), r in ok.items() if tp == 1), None)
    if base:
        for r in ok.values():
            if r["tp"] > 1:
                print(f"TP {r['tp']} {r['all_reduce']}: {r['step_ms'] / base['step_ms']:.2f}x TP 1's profiled step "
                      f"({r['engine_ms_per_step'] / base['engine_ms_per_step']:.2f}x by the engine's timer)")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch
    from common import RESULTS, device_tag, write_report

    device = torch.device("cuda")
    report = {"device": device_tag(device), "torch": torch.__version__, "command": " ".join(sys.argv),
              "args": vars(args), "rows": rows, "seconds": round(time.perf_counter() - t0, 1)}
    write_report(report, args.out or os.path.join(RESULTS, f"profile_tp_decode_{device_tag(device)}.json"))


if __name__ == "__main__":
    main()
