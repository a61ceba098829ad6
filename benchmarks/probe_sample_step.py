"""Where a sampled decode step's extra time goes: the same batch generated greedy and at a temperature, each run
under the torch profiler, and per decode step the wall time, the GPU's busy time (the union of its kernels'
intervals) and the kernels' time by name. What a temperature adds on the GPU (the sampler's kernels) against what it
adds to the wall says whether the rest is host time the GPU waits on.

The forty-third session's offline run (bench_offline.py, Qwen3-0.6B, H200): T=0.6 took 0.16-0.29 ms a decode step
more than greedy at every batch size, where the sampler graph alone times 0.02-0.13 ms (bench_fused_sample.py).
At one batch held (every request the same length) T=0.6 added only its sampler kernels (bs 8 / 32 / 256: 0.025 /
0.026 / 0.12 ms a step); with requests finishing at different steps (--output-len 32 224, bs 256) the wall minus
the GPU's busy time was 0.037 / 0.10 s greedy and 0.060 / 0.233 s at T=0.6 (two passes each): host time on the
steps where the batch changes (sample-step-*-probe-h200-20261128-s43.json). The runner's host ms a call and how
often the sampling inputs were rebuilt are printed with each run.

  python benchmarks/probe_sample_step.py --batch-sizes 32 256 --temperature 0 0.6 [--output-len 32 160]
      [--cprofile] [--out F]
"""

import argparse
import cProfile
import json
import os
import pstats
import random
import sys
import tempfile
import time
from collections import defaultdict

import torch
from bench_offline import logged_steps
from common import add_model_args, gpu_timeline
from probe_extend_host import time_host_calls

from ostinato import LLM, SamplingParams


def kernel_spans(prof) -> list[tuple[str, float, float]]:
    """(name, start s, end s) of every GPU kernel in a profile, from its Chrome trace."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return [(e["name"], e["ts"] * 1e-6, (e["ts"] + e["dur"]) * 1e-6) for e in events
            if e.get("ph") == "X" and e.get("cat") == "kernel"]


def idle_by_boundary(spans: list[tuple[str, float, float]], top: int = 8) -> list[tuple[str, int, float]]:
    """The GPU's idle time (no kernel running) summed by the boundary it fell at, "kernel before -> kernel after"
    (names cut to 40 characters): (boundary, gaps, ms), largest first. Says whether a step's waits come before its
    first layer (the host late to launch the step), between the decode and sampler graphs, or inside a graph."""
    gaps: dict[str, list] = defaultdict(lambda: [0, 0.0])
    ordered = sorted(spans, key=lambda k: k[1])
    if not ordered:
        return []
    last_name, run_end = ordered[0][0], ordered[0][2]
    for name, s, e in ordered[1:]:
        if s > run_end:
            g = gaps[f"{last_name[:40]} -> {name[:40]}"]
            g[0] += 1
            g[1] += 1e3 * (s - run_end)
        if e >= run_end:
            last_name, run_end = name, e
    return sorted(((k, n, round(ms, 3)) for k, (n, ms) in gaps.items()), key=lambda r: -r[2])[:top]


def run(llm: LLM, bs: int, prompt_len: int, out_len: tuple[int, int], temperature: float, vocab: int,
        cprofile: bool = False) -> dict:
    """`out_len` (lo, hi): each request's max_tokens drawn in [lo, hi], so with lo < hi requests finish at different
    steps and the batch changes as they do (the offline shape's churn)."""
    rng = random.Random(bs)
    prompts = [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(prompt_len)]} for _ in range(bs)]
    params = [SamplingParams(temperature=temperature, max_tokens=rng.randint(*out_len), ignore_eos=True)
              for _ in range(bs)]
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: the same shapes
    llm.reset_prefix_cache()
    host: dict[str, list] = defaultdict(list)
    runner = llm.engine.runner
    time_host_calls(runner, host)  # the runner's prepare / forward / sample host ms, each call
    rebuilds = []
    build = runner._sampling_tensors

    def counted(reqs, *a, **k):  # whether the step's sampling inputs were built anew (a changed batch), host ms
        before, t = runner._last_sampling, time.perf_counter()
        out = build(reqs, *a, **k)
        rebuilds.append(runner._last_sampling is not before)
        host["inputs built" if rebuilds[-1] else "inputs reused"].append(round(1e3 * (time.perf_counter() - t), 3))
        return out
    runner._sampling_tensors = counted
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof, logged_steps(llm) as log:
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
    for name in ("prepare", "forward", "sample", "extend_path", "_sampling_tensors"):
        runner.__dict__.pop(name, None)  # the class's methods again
    hot = []
    if cprofile:  # the same run again under cProfile, no torch profiler: the host's hot calls by own time
        llm.reset_prefix_cache()
        profile = cProfile.Profile()
        profile.enable()
        llm.generate(prompts, params, use_tqdm=False)
        profile.disable()
        stats = pstats.Stats(profile).stats
        hot = [(f"{os.path.basename(f)}:{line}({fn})", calls, round(1e3 * own, 2))
               for (f, line, fn), (_, calls, own, _, _) in sorted(stats.items(), key=lambda kv: -kv[1][2])[:25]]
    spans = kernel_spans(prof)
    decode = [sec for mode, *_, sec in log if mode == "decode"]
    by_name: dict[str, float] = defaultdict(float)
    for name, s, e in spans:
        by_name[name] += e - s
    steps = len(decode)
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:15]
    return {"batch_size": bs, "temperature": temperature, "wall_s": wall, "decode_steps": steps,
            "decode_step_ms_median": 1e3 * sorted(decode)[steps // 2] if steps else None,
            "decode_step_ms_mean": 1e3 * sum(decode) / steps if steps else None,
            "gpu_busy_s": gpu_timeline([(s, e) for _, s, e in spans], 0.0, 0.0)["busy"],  # (busy: any span)
            "kernel_sum_s": sum(by_name.values()), "kernels": len(spans),
            "sampling_rebuilds": sum(rebuilds), "host_ms_mean": {k: round(sum(v) / len(v), 3) for k, v in host.items()
                                                                 if k != "path" and v},
            "top_kernels_ms_per_step": [(n[:90], round(1e3 * v / max(steps, 1), 4)) for n, v in top],
            "idle_by_boundary_ms": idle_by_boundary(spans),
            "host_hot_calls_own_ms": hot}


def main() -> None:
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 0.6])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, nargs=2, default=[128, 128], help="lo hi: each request's in [lo, hi]")
    ap.add_argument("--cprofile", action="store_true", help="each run once more under cProfile: host calls by own ms")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not 1 <= args.output_len[0] <= args.output_len[1]:
        ap.error(f"--output-len: lo hi with 1 <= lo <= hi, got {args.output_len}")
    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype, max_running_requests=max(args.batch_sizes))
    vocab = llm.engine.runner.vocab_size
    rows = []
    for bs in args.batch_sizes:
        for temperature in args.temperature:
            r = run(llm, bs, args.prompt_len, args.output_len, temperature, vocab, args.cprofile)
            rows.append(r)
            print(f"bs {bs:>4} outputs {args.output_len} T={temperature}: wall {r['wall_s']:.3f} s, "
                  f"{r['decode_steps']} decode steps, step {r['decode_step_ms_mean']:.3f} ms mean / "
                  f"{r['decode_step_ms_median']:.3f} median, GPU busy {r['gpu_busy_s']:.3f} s, kernels {r['kernels']} "
                  f"({r['kernel_sum_s']:.3f} s); host ms a call {r['host_ms_mean']}, sampling inputs built "
                  f"{r['sampling_rebuilds']} times", flush=True)
            for name, ms in r["top_kernels_ms_per_step"][:8]:
                print(f"    {ms:8.4f} ms/step  {name}")
            for name, n, ms in r["idle_by_boundary_ms"]:
                print(f"    idle {ms:9.3f} ms, {n:>6} gaps  {name}")
            for name, calls, ms in r["host_hot_calls_own_ms"][:12]:
                print(f"    host {ms:9.2f} ms own, {calls:>6} calls  {name}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "device": str(llm.engine.runner.device), "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
