"""Where piecewise graphs spend their time: the start-up (cProfile of building the runner: trace, compile,
warm-up, capture) and one extend step of N tokens (torch.profiler: GPU kernel time by kind, beside the wall
time), eager vs piecewise-eager vs piecewise-inductor vs the full extend graph. With --host, also the host
side of each path: the host milliseconds a step takes to issue (no sync), a cProfile of its functions, and
the host cost of single launches (a torch op, a Triton kernel, a one-kernel graph replay, a custom op call).

python benchmarks/profile_piecewise.py --model llama-3.2-1b --tokens 2048 256 --out /tmp/pw-profile.json
python benchmarks/profile_piecewise.py --skip-startup --host --tokens 2048 256 16
"""

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_extend import eager_forward, make_batch, time_ms  # noqa: E402
from common import kernel_times  # noqa: E402

from ostinato import LLM, SamplingParams  # noqa: E402
from ostinato.attention.forward_batch import ForwardMode  # noqa: E402
from ostinato.engine.request import Request  # noqa: E402
from ostinato.engine.scheduler import ScheduledBatch  # noqa: E402
from ostinato.graphs.piecewise import PiecewiseGraphRunner  # noqa: E402

KINDS = [("gemm", ("gemm", "gemv", "sm90", "cutlass", "cublas", "xmma", "skinny", "mm_")),
         ("attention", ("_extend_kernel", "_decode_stage", "attention")),
         ("kv_store", ("store_kv", "_store")),
         ("copy", ("copy", "memcpy", "memset", "fill")),
         ("triton_fused", ("triton_",)),
         ("norm_rope_act", ("rms", "rotary", "silu", "norm"))]


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def kernel_profile(fn, reps: int = 5) -> dict:
    """GPU kernel microseconds per call by kind, kernel launches per call, and the top kernels."""
    by_kind, by_name, launches = defaultdict(float), defaultdict(float), 0.0
    for name, (us, count) in kernel_times(fn, calls=reps).items():
        by_kind[kind_of(name)] += us
        by_name[name[:90]] += us
        launches += count
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    return {"kernel_us_by_kind": dict(by_kind), "kernel_us": sum(by_kind.values()), "launches": launches,
            "top": top}


def startup_profile(runner, compiler: str, max_tokens: int) -> tuple[PiecewiseGraphRunner, dict]:
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    g = PiecewiseGraphRunner(runner, max_tokens, compiler=compiler)
    prof.disable()
    wall = time.perf_counter() - t
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats("ostinato|cuda/graphs|synchronize|capture", 30)
    t2 = io.StringIO()
    pstats.Stats(prof, stream=t2).sort_stats("tottime").print_stats(20)
    return g, {"compiler": compiler, "wall_s": wall, "trace_s": g.trace_seconds, "compile_s": g.compile_seconds,
               "capture_s": g.capture_seconds, "graphs": g.num_graphs, "cumulative": s.getvalue()[-6000:],
               "tottime": t2.getvalue()[-4000:]}


def host_ms(fn, iters: int = 20) -> float:
    """Median host milliseconds to issue one call of `fn` (no sync inside the timed region: the GPU's queue
    absorbs the launches, so this is what the host spends, whatever the GPU does)."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def host_profile(fn, calls: int = 20) -> str:
    """cProfile of `calls` calls of `fn`: the functions by own time (the host's cost centres)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(28)
    return s.getvalue()[-7000:]


def launch_costs() -> dict[str, float]:
    """Host microseconds per call of single launches, each issued 2,000 times back to back."""
    import triton
    import triton.language as tl

    @triton.jit
    def _touch(X, A1, A2, A3, A4, A5, A6, A7, A8, A9, s1, s2, s3, s4, s5, s6, s7, s8, N: tl.constexpr,
               M: tl.constexpr):
        pid = tl.program_id(0)
        tl.store(X + pid, tl.load(X + pid) + 1.0)

    x = torch.zeros(64, device="cuda")
    ints = [torch.zeros(64, dtype=torch.int32, device="cuda") for _ in range(9)]
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        x.add_(1)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        x.add_(1)
    calls = {
        "torch_add_": lambda: x.add_(1),
        "torch_empty": lambda: torch.empty(64, device="cuda"),
        "triton_18_args": lambda: _touch[(1,)](x, *ints, 1, 2, 3, 4, 5, 6, 7, 8, N=4, M=2),
        "graph_replay": g.replay,
        "custom_op_linear_gemv": lambda: torch.ops.ostinato.linear(x[None], x[None]),
    }
    out = {}
    for name, fn in calls.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(2000):
            fn()
        out[name] = (time.perf_counter() - t) / 2000 * 1e6
        torch.cuda.synchronize()
    return out


def mixed_profile(runner, piecewise: PiecewiseGraphRunner, decoders: int, context: int, prompt: int) -> list[dict]:
    """A mixed step (`decoders` requests with `context` cached tokens each, one token each, plus a `prompt`-token
    chunk) through piecewise and eager, against its parts run apart (the prompt alone through the full extend
    graph, the decoders as a decode step through the decode graph). The cached K/V is whatever the pool holds."""
    kv = runner.kv_manager
    rng = torch.Generator().manual_seed(1)

    def request(name: str, cached: int, new: int) -> tuple[Request, torch.Tensor]:
        r = Request(name, torch.randint(1000, 10000, (cached + new,), generator=rng).tolist(), SamplingParams(),
                    seed=0)
        r.req_pool_idx = runner.req_to_token_pool.alloc()
        if cached:
            kv.extend(r.req_pool_idx, 0, cached)
        loc = kv.extend(r.req_pool_idx, cached, cached + new)
        r.kv_len = cached + new
        return r, loc

    p, p_loc = request("p", 0, prompt)
    decs = [request(f"d{i}", context, 1) for i in range(decoders)]
    d_reqs, d_locs = [r for r, _ in decs], [loc for _, loc in decs]
    mode = ForwardMode
    mixed = runner.prepare(ScheduledBatch(mode.EXTEND, [p] + d_reqs, [0] + [context] * decoders,
                                          [prompt] + [1] * decoders, torch.cat([p_loc] + d_locs),
                                          [True] * (decoders + 1)))
    alone = runner.prepare(ScheduledBatch(mode.EXTEND, [p], [0], [prompt], p_loc, [True]))
    decode = runner.prepare(ScheduledBatch(mode.DECODE, d_reqs, [context] * decoders, [1] * decoders,
                                           torch.cat(d_locs), [True] * decoders))
    full, paths = runner.extend_graph_runner, {}
    paths["mixed_piecewise"] = lambda: piecewise.replay(mixed)
    paths["mixed_eager"] = lambda: eager_forward(runner, mixed)
    if full is not None and full.can_run(alone):
        paths["prompt_extend_graph"] = lambda: full.replay(alone)
    paths["decoders_decode_step"] = lambda: runner.forward(decode)
    rows = []
    with torch.inference_mode():
        for name, fn in paths.items():
            row = {"path": name, "wall_ms": time_ms(fn, 10), **kernel_profile(fn, reps=3)}
            rows.append(row)
            kinds = " ".join(f"{k} {v / 1e3:.2f}" for k, v in sorted(row["kernel_us_by_kind"].items()))
            print(f"mixed {decoders}x{context}+{prompt}: {name:22} wall {row['wall_ms']:.2f} ms, kernels "
                  f"{row['kernel_us'] / 1e3:.2f} ms ({row['launches']:.0f} launches): {kinds}")
    for r in [p] + d_reqs:
        kv.release(r.req_pool_idx, r.kv_len)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 256])
    ap.add_argument("--skip-startup", action="store_true", help="no cProfile of the piecewise build")
    ap.add_argument("--out", default="/tmp/pw-profile.json")
    ap.add_argument("--decoders", type=int, default=32, help="mixed step: decoding requests")
    ap.add_argument("--context", type=int, default=8000, help="mixed step: each decoding request's cached tokens")
    ap.add_argument("--prompt", type=int, default=2000, help="mixed step: the prefill chunk's tokens")
    ap.add_argument("--host", action="store_true", help="host ms to issue each path, cProfiles, launch costs")
    args = ap.parse_args()
    llm = LLM(args.model, load_format="dummy", dtype="bfloat16", max_total_tokens=args.decoders * (args.context + 8)
              + 8192, chunked_prefill_size=2048, extend_cuda_graph_max_tokens=2048,
              max_running_requests=args.decoders + 16, cuda_graph_bs=[1, args.decoders])
    runner = llm.engine.runner
    report = {"startup": [], "steps": []}
    pieces = {}
    for compiler in ("eager", "inductor"):
        if args.skip_startup:
            pieces[compiler] = PiecewiseGraphRunner(runner, 2048, compiler=compiler)
            continue
        pieces[compiler], row = startup_profile(runner, compiler, 2048)
        report["startup"].append(row)
        print(f"start-up piecewise-{compiler}: {row['wall_s']:.1f} s (trace {row['trace_s']:.1f}, compile "
              f"{row['compile_s']:.1f}, capture {row['capture_s']:.1f} s, {row['graphs']} graphs)")
        print(row["cumulative"][-5000:])
    rng = torch.Generator().manual_seed(0)
    full = runner.extend_graph_runner
    for n in args.tokens:
        batch, reqs = make_batch(runner, n, 1, rng)
        paths = {"eager": lambda b=batch: eager_forward(runner, b)}
        if full is not None and full.can_run(batch):
            paths["extend_graph"] = lambda b=batch: full.replay(b)
        for compiler, g in pieces.items():
            paths[f"piecewise_{compiler}"] = lambda g=g, b=batch: g.replay(b)
        with torch.inference_mode():
            for name, fn in paths.items():
                row = {"tokens": n, "path": name, "wall_ms": time_ms(fn, 20), **kernel_profile(fn)}
                if args.host:
                    row["host_ms"] = host_ms(fn)
                    if name in ("eager", "extend_graph", "piecewise_eager") and n == min(args.tokens):
                        row["host_profile"] = host_profile(fn)
                        print(f"host profile {n} {name} (20 calls):\n{row['host_profile']}")
                report["steps"].append(row)
                kinds = " ".join(f"{k} {v / 1e3:.2f}" for k, v in sorted(row["kernel_us_by_kind"].items()))
                host = f", host {row['host_ms']:.2f} ms" if "host_ms" in row else ""
                print(f"{n:5} {name:20} wall {row['wall_ms']:.2f} ms{host}, kernels {row['kernel_us'] / 1e3:.2f} ms "
                      f"({row['launches']:.0f} launches): {kinds}")
        for r in reqs:
            runner.kv_manager.release(r.req_pool_idx, r.kv_len)
    for n in args.tokens:
        for row in report["steps"]:
            if row["tokens"] == n and row["path"] in ("eager", "piecewise_inductor"):
                print(f"top kernels {n} {row['path']}:")
                for name, us in row["top"]:
                    print(f"   {us:9.1f} us  {name}")
    if args.host:
        report["launch_costs_us"] = launch_costs()
        print("host us per launch:", {k: round(v, 2) for k, v in report["launch_costs_us"].items()})
    report["mixed"] = mixed_profile(runner, pieces["eager"], args.decoders, args.context, args.prompt)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
