"""Tensor parallelism: decode ms/step at TP 1 and 2 (graph vs eager), and an all-reduce micro-benchmark.

Decode: the whole engine (`LLM`, dummy weights, bf16), `bs` requests of `--ctx` prompt tokens decoding
together; ms/step is the engine's own decode-step wall time (EngineCore.step_seconds / step_counts, overlap
scheduling on, so it is the GPU's step time once the GPU is the bottleneck), taken over the decode steps of a
measured run after a warm-up run. Beside it the per-GPU HBM floor: the bytes one rank must read per step
(its weight shard + its KV heads of the batch's context) over the measured copy bandwidth.

All-reduce: `--ar-ranks` processes over NCCL, bf16 messages of 8 KB to 8 MB, ms per call of
torch.distributed.all_reduce eagerly, of the engine's op (`ostinato::all_reduce`) eagerly, and of that op
replayed from a CUDA graph (as inside the decode graphs), median over `--ar-iters` calls.

python benchmarks/bench_tp.py --out benchmarks/results/tp_h200x2.json              # 2 GPUs, < 5 min
python benchmarks/bench_tp.py --tp 1 2 4 --out benchmarks/results/tp_h200x4.json   # 4 GPUs
CPU smoke (gloo, tiny model): python benchmarks/bench_tp.py --device cpu --model <config.json> --bs 1 4 --modes eager
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import RESULTS, copy_bandwidth, cuda_ms_per_call, device_tag, write_report

from ostinato import LLM, SamplingParams


def decode_case(llm: LLM, bs: int, ctx: int, steps: int) -> dict:
    """ms per decode step of `bs` requests at `ctx` tokens of context (the last run's decode steps)."""
    g = torch.Generator().manual_seed(bs)
    vocab = llm.engine.runner.vocab_size
    prompts = [{"prompt_token_ids": torch.randint(10, vocab - 10, (ctx,), generator=g).tolist()} for _ in range(bs)]
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate(prompts, warm, use_tqdm=False)
    core = llm.engine
    n0, t0 = core.step_counts["decode"], core.step_seconds["decode"]
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True), use_tqdm=False)
    wall = time.perf_counter() - start
    n, t = core.step_counts["decode"] - n0, core.step_seconds["decode"] - t0
    return {"bs": bs, "ctx": ctx, "decode_steps": n, "ms_per_step": 1e3 * t / max(n, 1),
            "run_ms_per_token_step": 1e3 * wall / steps}


def floor_ms(llm: LLM, bs: int, ctx: int, bandwidth: float) -> float:
    """Bytes one rank reads per decode step (weights shard + KV of the batch) over the copy bandwidth."""
    r = llm.engine.runner
    kv = bs * (ctx + 1) * r.kv_cache.bytes() / max(r.kv_cache.size, 1)
    return 1e3 * (r.weight_bytes + kv) / bandwidth


def bench_decode(args: argparse.Namespace) -> list[dict]:
    """Each (tp, mode) in its own process: all GPU memory back between them, and an NCCL teardown that hangs
    (pytorch#115388) or a failure costs one configuration, not the run."""
    rows = []
    for tp in args.tp:
        for mode in args.modes:
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                cmd = [sys.executable, os.path.abspath(__file__), "--one", f"{tp}:{mode}", "--one-out", f.name,
                       "--model", args.model, "--ctx", str(args.ctx), "--steps", str(args.steps), "--dtype",
                       args.dtype, "--device", args.device, "--bs", *map(str, args.bs)]
                try:
                    proc = subprocess.run(cmd, timeout=args.config_timeout, stderr=subprocess.PIPE, text=True)
                    ok = proc.returncode == 0 and os.path.getsize(f.name) > 0
                    error = None if ok else f"exit {proc.returncode}: {proc.stderr[-2000:]}"
                except subprocess.TimeoutExpired:
                    ok, error = False, f"timed out after {args.config_timeout} s"
                if ok:
                    rows += json.load(open(f.name))
                else:
                    print(f"tp {tp} {mode}: FAILED {error}", flush=True)
                    rows.append({"model": args.model, "tp": tp, "mode": mode, "error": error})
    return rows


def bench_one(args: argparse.Namespace) -> list[dict]:
    tp, mode = int(args.one.split(":")[0]), args.one.split(":")[1]
    rows = []
    device = torch.device(args.device)
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else None
    t0 = time.perf_counter()
    kw = {"load_format": "dummy", "dtype": args.dtype, "device": args.device, "tp_size": tp,
          "disable_cuda_graph": mode == "eager", "max_running_requests": max(args.bs),
          "cuda_graph_bs": sorted(set(args.bs)), "extend_cuda_graph_max_tokens": 0,
          "disable_radix_cache": True, "max_model_len": args.ctx + args.steps + 16}
    if device.type == "cpu":
        kw.pop("cuda_graph_bs")
    llm = LLM(args.model, **kw)
    start_s = time.perf_counter() - t0
    try:
        for bs in args.bs:
            row = {"model": args.model, "tp": tp, "mode": mode, "startup_s": round(start_s, 1),
                   **decode_case(llm, bs, args.ctx, args.steps)}
            if bandwidth:
                row["hbm_floor_ms"] = floor_ms(llm, bs, args.ctx, bandwidth)
            rows.append(row)
            print(f"tp {tp} {mode:5s} bs {bs:4d}: {row['ms_per_step']:.3f} ms/step"
                  + (f" (floor {row['hbm_floor_ms']:.3f})" if bandwidth else ""), flush=True)
    finally:
        with open(args.one_out, "w") as f:
            json.dump(rows, f)
        llm.shutdown()
    return rows


def print_summary(rows: list[dict]) -> None:
    """Per batch size: each TP's ms/step relative to TP 1 (graph), and graph's speed-up over eager."""
    ms = {(r["tp"], r["mode"], r["bs"]): r["ms_per_step"] for r in rows if "ms_per_step" in r}
    for bs in sorted({k[2] for k in ms}):
        parts = [f"bs {bs:4d}:"]
        for tp in sorted({k[0] for k in ms}):
            g, e = ms.get((tp, "graph", bs)), ms.get((tp, "eager", bs))
            base = ms.get((1, "graph", bs))
            if g is not None:
                parts.append(f"TP{tp} graph {g:.3f} ms" + (f" ({g / base:.2f}x TP1)" if base and tp > 1 else ""))
            if g is not None and e is not None:
                parts.append(f"eager/graph {e / g:.2f}x")
        print("  ".join(parts))


# ---------------------------------------------------------------------- all-reduce
def _ar_worker(rank: int, size: int, port: int, sizes: list[int], iters: int, out: dict) -> None:
    from ostinato.distributed.comm import all_reduce
    from ostinato.distributed.parallel_state import destroy_tp, init_tp

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    init_tp(rank, size, f"tcp://127.0.0.1:{port}", device)
    results = []
    for nbytes in sizes:
        gen = torch.Generator(device).manual_seed(nbytes)  # the same x on every rank: the sum is x * size
        x = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=device, generator=gen)
        row = {"bytes": nbytes}
        z = x.clone()  # summed in place over and over
        for name, fn in (("nccl_eager_ms", lambda z=z: dist.all_reduce(z)), ("op_eager_ms", lambda x=x: all_reduce(x))):
            row[name] = _time_calls(fn, iters)
        graph, calls = torch.cuda.CUDAGraph(), 20
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                all_reduce(x)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            for _ in range(calls):
                y = all_reduce(x)
        torch.cuda.synchronize()
        row["op_graph_ms"] = _time_calls(graph.replay, max(iters // calls, 5)) / calls
        ref = x.float() * size
        row["graph_result_ok"] = bool(torch.allclose(y.float(), ref, rtol=2e-2, atol=1e-2))
        results.append(row)
        del graph
    if rank == 0:
        out["rows"] = results
    dist.barrier()
    destroy_tp()


def _time_calls(fn, iters: int) -> float:
    return cuda_ms_per_call(fn, iters, warmup=5)


def bench_all_reduce(args: argparse.Namespace) -> list[dict]:
    sizes = [8 << 10 << i for i in range(11)]  # 8 KB .. 8 MB
    from ostinato.engine.tp_workers import _free_port

    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_ar_worker, args=(args.ar_ranks, _free_port(), sizes, args.ar_iters, out), nprocs=args.ar_ranks)
        rows = list(out["rows"])
    for row in rows:
        print(f"all-reduce {row['bytes'] / 1024:7.0f} KB: nccl {row['nccl_eager_ms'] * 1e3:7.1f} us, op "
              f"{row['op_eager_ms'] * 1e3:7.1f} us, op in graph {row['op_graph_ms'] * 1e3:7.1f} us"
              f"{'' if row['graph_result_ok'] else '  WRONG RESULT'}")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--modes", nargs="+", default=["graph", "eager"], choices=["graph", "eager"])
    p.add_argument("--bs", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--ctx", type=int, default=128)
    p.add_argument("--steps", type=int, default=64, help="decode steps measured per case")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--ar-ranks", type=int, default=2, help="all-reduce ranks (0: skip the micro-benchmark)")
    p.add_argument("--ar-iters", type=int, default=200)
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--config-timeout", type=int, default=240, help="seconds for one (tp, mode) configuration")
    p.add_argument("--out", default=None)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # "tp:mode": one configuration, in a child
    p.add_argument("--one-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        bench_one(args)
        os._exit(0)  # no NCCL teardown: it can hang after graph capture, and the rows are written
    device = torch.device(args.device)
    report = {"device": device_tag(device), "torch": torch.__version__, "args": vars(args)}
    t0 = time.perf_counter()
    if not args.skip_decode:
        report["decode"] = bench_decode(args)
        print_summary(report["decode"])
    if args.ar_ranks > 1 and device.type == "cuda":
        report["all_reduce"] = bench_all_reduce(args)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    write_report(report, args.out or os.path.join(RESULTS, f"tp_{device_tag(device)}.json"))


if __name__ == "__main__":
    sys.exit(main())
