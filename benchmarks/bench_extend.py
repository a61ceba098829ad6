"""Extend (prefill) step time by new-token count: eager vs the full extend graph vs piecewise graphs (eager
and inductor pieces), for one request and for 8 requests sharing the tokens; plus the piecewise start-up
(compile + capture), cold and with a warm compile cache (each in a fresh process).

python benchmarks/bench_extend.py                      # Llama-3.2-1B and Qwen3-0.6B, dummy bf16 weights
python benchmarks/bench_extend.py --models qwen3-0.6b --tokens 1 16 256 --skip-startup
python benchmarks/bench_extend.py --models llama-3.2-1b --startup-only   # start-up split, cold and warm cache
Writes benchmarks/results/extend-<device>.json and .png.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import RESULTS, device_tag, write_report  # noqa: E402

from ostinato import LLM, SamplingParams  # noqa: E402
from ostinato.attention.forward_batch import ForwardMode  # noqa: E402
from ostinato.engine.request import Request  # noqa: E402
from ostinato.engine.scheduler import ScheduledBatch  # noqa: E402
from ostinato.graphs.piecewise import PiecewiseGraphRunner  # noqa: E402

TOKENS = [1, 4, 16, 64, 128, 256, 512, 1024, 2048]


def make_batch(runner, num_tokens: int, num_reqs: int, rng: torch.Generator):
    """`num_tokens` new tokens split over `num_reqs` fresh requests (no cached prefix)."""
    num_reqs = min(num_reqs, num_tokens)
    lens = [num_tokens // num_reqs + (i < num_tokens % num_reqs) for i in range(num_reqs)]
    reqs, locs = [], []
    for i, n in enumerate(lens):
        r = Request(f"b{i}", torch.randint(1000, 10000, (n,), generator=rng).tolist(), SamplingParams(), seed=0)
        r.req_pool_idx = runner.req_to_token_pool.alloc()
        locs.append(runner.kv_manager.extend(r.req_pool_idx, 0, n))
        r.kv_len = n
        reqs.append(r)
    sched = ScheduledBatch(ForwardMode.EXTEND, reqs, [0] * num_reqs, lens, torch.cat(locs), [True] * num_reqs)
    return runner.prepare(sched), reqs


def time_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def eager_forward(runner, batch):
    saved = runner.extend_graph_runner, runner.piecewise_graph_runner
    runner.extend_graph_runner = runner.piecewise_graph_runner = None
    try:
        return runner.forward(batch)
    finally:
        runner.extend_graph_runner, runner.piecewise_graph_runner = saved


def startup(model: str, compiler: str) -> dict:
    """Run in a child process: build the model and the piecewise graphs, report their start-up."""
    llm = LLM(model, load_format="dummy", dtype="bfloat16", max_total_tokens=8192, chunked_prefill_size=2048,
              disable_cuda_graph=True, extend_cuda_graph_max_tokens=0)
    t = time.perf_counter()
    g = PiecewiseGraphRunner(llm.engine.runner, 2048, compiler=compiler)
    return {"model": model, "compiler": compiler, "seconds": time.perf_counter() - t, "pieces": g.num_pieces,
            "compiled_pieces": g.backend.num_compiled, "sizes": g.sizes, "trace_s": g.trace_seconds,
            "compile_s": g.compile_seconds, "capture_s": g.capture_seconds, "graphs": g.num_graphs,
            "graph_gib": g.graph_memory_bytes / 2**30, "dynamo_traces": len(g.backend.splits), **g.capture_split}


def measure_startup(model: str, compiler: str) -> list[dict]:
    cache = tempfile.mkdtemp(prefix="ostinato-cc-")
    env = {**os.environ, "OSTINATO_CACHE_DIR": cache}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    rows = []
    for run in ("cold", "warm"):
        out = subprocess.run([sys.executable, __file__, "--startup-child", model, compiler], env=env, check=True,
                             capture_output=True, text=True).stdout
        row = eval(out.strip().splitlines()[-1])  # the child's last line: a dict literal
        rows.append({**row, "cache": run})
        print(f"start-up {model} {compiler} {run}: {row['seconds']:.1f} s ({row['pieces']} pieces, "
              f"{row['compiled_pieces']} compiled; dynamo trace {row['trace_s']:.1f} s, compile {row['compile_s']:.1f} "
              f"s, capture {row['capture_s']:.1f} s of {row['graphs']} graphs (first run {row['first_run_s']:.1f}, "
              f"warm-ups {row['warmup_s']:.1f}, graph capture {row['graphs_s']:.1f} s), {row['graph_gib']:.2f} GiB, "
              f"{row['dynamo_traces']} dynamo trace(s))")
    return rows


def bench_model(model: str, tokens: list[int], iters: int) -> list[dict]:
    llm = LLM(model, load_format="dummy", dtype="bfloat16", max_total_tokens=16384, chunked_prefill_size=2048,
              extend_cuda_graph_max_tokens=2048, max_running_requests=16, cuda_graph_bs=[1])
    runner = llm.engine.runner
    pieces = {}
    for compiler in ("eager", "inductor"):
        t = time.perf_counter()
        pieces[compiler] = PiecewiseGraphRunner(runner, 2048, compiler=compiler)
        g = pieces[compiler]
        print(f"{model}: piecewise-{compiler} ready in {time.perf_counter() - t:.1f} s ({g.num_pieces} pieces, "
              f"compile {g.compile_seconds:.1f} s, capture {g.capture_seconds:.1f} s, "
              f"{g.graph_memory_bytes / 2**30:.2f} GiB)")
    rng = torch.Generator().manual_seed(0)
    full = runner.extend_graph_runner
    rows = []
    print(f"{'model':14} {'reqs':>4} {'tokens':>6} {'eager':>8} {'full':>8} {'pw-eager':>8} {'pw-ind':>8}  ms")
    for num_reqs in (1, 8):
        for n in tokens:
            batch, reqs = make_batch(runner, n, num_reqs, rng)
            with torch.inference_mode():
                ms = {"eager": time_ms(lambda b=batch: eager_forward(runner, b), iters)}
                ms["extend_graph"] = (time_ms(lambda b=batch: full.replay(b), iters)
                                      if full and full.can_run(batch) else None)
                for compiler, g in pieces.items():
                    ms[f"piecewise_{compiler}"] = time_ms(lambda g=g, b=batch: g.replay(b), iters)
                ref = eager_forward(runner, batch)
                err = {k: (g.replay(batch) - ref).abs().max().item() for k, g in pieces.items()}
            for r in reqs:
                runner.kv_manager.release(r.req_pool_idx, r.kv_len)
            row = {"model": model, "reqs": min(num_reqs, n), "requested_reqs": num_reqs, "tokens": n,
                   **{f"{k}_ms": v for k, v in ms.items()},
                   "max_abs_logit_diff": err}
            rows.append(row)
            fmt = lambda v: f"{v:8.2f}" if v is not None else "       -"  # noqa: E731
            print(f"{model:14} {row['reqs']:>4} {n:>6} {fmt(ms['eager'])} {fmt(ms['extend_graph'])} "
                  f"{fmt(ms['piecewise_eager'])} {fmt(ms['piecewise_inductor'])}")
    llm.engine.runner.piecewise_graph_runner = None
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return rows


def plot(report: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def multi(r: dict) -> bool:  # the 8-request pass's 1-token step has one request: it belongs to that pass
        return r.get("requested_reqs", r["reqs"]) > 1

    combos = sorted({(r["model"], multi(r)) for r in report["rows"]})
    fig, axes = plt.subplots(1, len(combos), figsize=(5 * len(combos), 4), squeeze=False)
    for ax, (model, many) in zip(axes[0], combos, strict=True):
        rows = sorted((r for r in report["rows"] if r["model"] == model and multi(r) == many),
                      key=lambda r: r["tokens"])
        for key in ("eager", "extend_graph", "piecewise_eager", "piecewise_inductor"):
            pts = [(r["tokens"], r[f"{key}_ms"]) for r in rows if r[f"{key}_ms"] is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=key)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("new tokens in the step")
        ax.set_ylabel("ms / extend step")
        ax.set_title(f"{model}, {'8 requests' if many else '1 request'} ({report['device']})")
        ax.grid(alpha=0.3)
        ax.legend()
    out = path.replace(".json", ".png")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return out


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--startup-child":
        print(repr(startup(sys.argv[2], sys.argv[3])))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["llama-3.2-1b", "qwen3-0.6b"])
    ap.add_argument("--tokens", nargs="+", type=int, default=TOKENS)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--skip-startup", action="store_true")
    ap.add_argument("--startup-only", action="store_true", help="only the piecewise start-up, cold and warm")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    assert torch.cuda.is_available(), "a GPU benchmark"
    device = torch.device("cuda")
    report = {"device": device_tag(device), "torch": torch.__version__, "rows": [], "startup": []}
    if not args.skip_startup:
        for compiler in ("eager", "inductor"):
            report["startup"] += measure_startup(args.models[0], compiler)
    for model in args.models if not args.startup_only else []:
        report["rows"] += bench_model(model, args.tokens, args.iters)
    path = args.out or os.path.join(RESULTS, f"extend-{report['device']}.json")
    write_report(report, path)
    if report["rows"]:
        print(f"wrote {plot(report, path)}")


if __name__ == "__main__":
    main()
