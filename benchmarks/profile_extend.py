"""Where an extend (prefill) step's time goes: wall time of one engine step that prefills N new prompts of L
tokens, eager and through the extend graphs, against its GPU kernel time (torch.profiler), and the top
host-side ops of the first case.

Extend steps run eagerly (no CUDA graph), so small ones can be bound by host launch cost, not the GPU.
Each case's profiled step also splits its wall: `lead` (host work before the first kernel), `busy` (a kernel
running), `gaps` (none running between the first and the last), `tail` (after the last kernel, to the sync).

python benchmarks/profile_extend.py --model llama-3.2-1b --cases 1:128 8:128 21:128 64:128 1:2048
"""

import argparse
import contextlib
import random
import statistics
import time

import torch
from common import gpu_timeline
from torch.profiler import ProfilerActivity, profile, record_function

from ostinato import LLM, SamplingParams

STEP_EVENT = "profile_extend.step"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def extend_step(engine, n: int, length: int, rng: random.Random, tag: str, around=contextlib.nullcontext) -> float:
    """Wall seconds of the one step that prefills n new prompts of `length` tokens, run inside `around()`
    (then the requests are aborted)."""
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    hi = min(10000, engine.runner.vocab_size)
    for i in range(n):
        engine.add_request(f"{tag}-{i}", [rng.randrange(1000, hi) for _ in range(length)], sp)
    extends = engine.step_counts["extend"]
    sync()
    with around(), record_function(STEP_EVENT):
        t = time.perf_counter()
        engine.step()  # launches the extend (overlap scheduling: without waiting for it)
        sync()
        wall = time.perf_counter() - t
    assert engine.step_counts["extend"] == extends + 1, "the step was not an extend"
    for i in range(n):
        engine.abort(f"{tag}-{i}")
    engine.step()
    return wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--cases", nargs="+", default=["1:128", "8:128", "13:128", "16:128", "30:64", "64:32", "1:2048",
                                                   "64:128"],
                    help="N:L = N new prompts of L tokens in one extend step")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cprofile", action="store_true",
                    help="also a cProfile of the first case's step (host time by Python function)")
    ap.add_argument("--running", type=int, default=0,
                    help="requests kept decoding (128-token prompts) while the extends are measured")
    ap.add_argument("--trace", default=None,
                    help="write each case's profiled step as a Chrome trace: this path with the case appended")
    ap.add_argument("--sort", default="self_cpu_time_total",
                    help="the first case's op table order (self_device_time_total: the kernels by GPU time)")
    args = ap.parse_args()
    llm = LLM(args.model, load_format="dummy", dtype=args.dtype)
    engine = llm.engine
    rng = random.Random(0)
    cases = [tuple(int(x) for x in c.split(":")) for c in args.cases]
    hi = min(10000, engine.runner.vocab_size)
    background = SamplingParams(temperature=0.0, max_tokens=engine.max_model_len - 128, ignore_eos=True)
    for i in range(args.running):
        engine.add_request(f"bg-{i}", [rng.randrange(1000, hi) for _ in range(128)], background)
    while engine.scheduler.waiting or any(r.kv_len < r.seq_len - 1 for r in engine.scheduler.running):
        engine.step()
    for n, length in cases:  # warm-up (Triton compiles, allocator)
        extend_step(engine, n, length, rng, "warm")
    graphs = engine.runner.extend_graph_runner
    print(f"{'prompts':>8} {'tokens':>7} {'eager ms':>9} {'wall ms':>8} {'GPU ms':>7} {'launches':>9}  "
          f"(wall: with extend graphs up to {graphs.max_tokens if graphs else 0} tokens)")
    first_table = None
    for n, length in cases:
        engine.runner.extend_graph_runner = None
        extend_step(engine, n, length, rng, "warm-eager")
        eager = [extend_step(engine, n, length, rng, f"e{i}") for i in range(args.iters)]
        engine.runner.extend_graph_runner = graphs
        walls = [extend_step(engine, n, length, rng, f"t{i}") for i in range(args.iters)]
        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        extend_step(engine, n, length, rng, "prof", around=lambda p=prof: p)
        if args.trace:
            prof.export_chrome_trace(f"{args.trace.removesuffix('.json')}-{n}x{length}.json")
        events = prof.key_averages()
        # the kernels' own rows only: an op's row carries its kernels' time too, so summing every row counted it twice
        gpu_ms = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA") / 1e3
        launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
        step = next(e for e in prof.events() if e.name == STEP_EVENT)
        line = gpu_timeline([(e.time_range.start, e.time_range.end) for e in prof.events()
                             if e.device_type.name == "CUDA"], step.time_range.start, step.time_range.end)
        print(f"{n:>8} {n * length:>7} {1e3 * statistics.median(eager):>9.2f} {1e3 * statistics.median(walls):>8.2f} "
              f"{gpu_ms:>7.2f} {launches:>9}  profiled step (ms): " + "  ".join(f"{k} {v / 1e3:.2f}" for k, v in
                                                                                  line.items()))
        if first_table is None:
            first_table = events.table(sort_by=args.sort, row_limit=25, max_name_column_width=70)
    print(first_table)
    if args.cprofile:
        import cProfile
        import pstats

        n, length = cases[0]
        prof = cProfile.Profile()
        extend_step(engine, n, length, rng, "cprof", around=lambda: prof)
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    for i in range(args.running):
        engine.abort(f"bg-{i}")
    engine.step()


if __name__ == "__main__":
    main()
