"""All-reduce micro-benchmark: NCCL against the one-shot all-reduce over symmetric memory
(ostinato/distributed/custom_all_reduce.py), bf16 messages of 8 KB to 8 MB, eagerly and inside a CUDA graph.

Each algorithm is timed as the engine's all-reduce op runs it (a new output tensor per call):
  nccl     x.clone() then torch.distributed.all_reduce over NCCL
  one-shot one symm_mem kernel (copy in, barrier, sum of the peers' buffers over NVLink, barrier)
Eager: CUDA-event time per call over `--iters` back-to-back calls (includes the host's launch cost when the
host is the bottleneck). Graph: one CUDA graph of `--calls-per-graph` all-reduces (a decode step of a 32-layer
model holds 64), replayed; us per call = replay time / calls. Median of 5 repeats. Every graph's last output is
checked against NCCL's sum.

The table's "recommended_max_bytes" is the largest size up to which the one-shot kernel wins in a graph at
every size: the value for ONE_SHOT_MAX_BYTES[ranks] in custom_all_reduce.py.

python benchmarks/bench_allreduce.py                       # 2 GPUs, about 1 min
python benchmarks/bench_allreduce.py --ranks 4 --out benchmarks/results/allreduce_h200x4.json
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import RESULTS, cuda_ms_per_call, device_tag, write_report

SIZES = [8 << 10 << i for i in range(11)]  # 8 KB .. 8 MB
_cpu_group = None  # the gloo group the repeats start together on


def _barrier() -> None:
    dist.barrier(group=_cpu_group)


def _time(fn, iters: int) -> float:
    """Median over 5 repeats of the CUDA-event ms per call of `fn`, every rank starting each repeat together."""
    return cuda_ms_per_call(fn, iters, before_repeat=_barrier)


def _graph_us(fn, x: torch.Tensor, calls: int, iters: int) -> tuple[float, torch.Tensor]:
    """us per all-reduce of a CUDA graph holding `calls` of them, and the last one's output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            y = fn(x)
    torch.cuda.synchronize()
    ms = _time(graph.replay, iters)
    graph.replay()
    torch.cuda.synchronize()
    return 1e3 * ms / calls, y


def _worker(rank: int, size: int, port: int, args: argparse.Namespace) -> None:
    from ostinato.distributed.custom_all_reduce import create_one_shot
    from ostinato.distributed.parallel_state import init_tp, tp_cpu_group, tp_group

    device = torch.device("cuda", rank)
    global _cpu_group
    init_tp(rank, size, f"tcp://127.0.0.1:{port}", device)  # NCCL, and gloo beside it for the barriers
    _cpu_group = tp_cpu_group()
    one_shot = create_one_shot(tp_group(), _cpu_group, device, rank, size, max_bytes=max(args.sizes))
    if one_shot is None:
        raise SystemExit("the one-shot all-reduce could not be set up (see the warning above)")

    def nccl(x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=tp_group())
        return out

    rows = []
    for nbytes in args.sizes:
        gen = torch.Generator(device).manual_seed(nbytes + rank)
        x = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=device, generator=gen)
        want = nccl(x).float()
        row = {"bytes": nbytes}
        for name, fn in (("nccl", nccl), ("one_shot", one_shot)):
            row[f"{name}_eager_us"] = 1e3 * _time(lambda fn=fn, x=x: fn(x), args.iters)
            replays = max(args.iters // args.calls_per_graph, 10)
            row[f"{name}_graph_us"], y = _graph_us(fn, x, args.calls_per_graph, replays)
            row[f"{name}_max_abs_err"] = (y.float() - want).abs().max().item()
            torch.cuda.empty_cache()
        rows.append(row)
        if rank == 0:
            print(f"{nbytes >> 10:6d} KB  eager: nccl {row['nccl_eager_us']:7.1f} us  one-shot "
                  f"{row['one_shot_eager_us']:7.1f} us   graph: nccl {row['nccl_graph_us']:7.1f} us  one-shot "
                  f"{row['one_shot_graph_us']:7.1f} us  ({row['nccl_graph_us'] / row['one_shot_graph_us']:.2f}x)"
                  f"  max |err| {row['one_shot_max_abs_err']:.3g}", flush=True)
    if rank == 0:
        best = 0
        for row in rows:  # the largest size up to which one-shot wins at every size
            if row["one_shot_graph_us"] >= row["nccl_graph_us"]:
                break
            best = row["bytes"]
        report = {"device": device_tag(device), "torch": torch.__version__, "ranks": size,
                  "command": " ".join(sys.argv), "args": vars(args), "rows": rows, "recommended_max_bytes": best,
                  "in_use_max_bytes": _table_value(size)}
        print(f"recommended ONE_SHOT_MAX_BYTES[{size}] = {best} ({best >> 10} KiB); in use: {_table_value(size)}")
        write_report(report, args.out or os.path.join(RESULTS, f"allreduce_{device_tag(device)}x{size}.json"))
    _barrier()
    sys.stdout.flush()
    os._exit(0)  # no NCCL teardown (it can hang after graph capture: pytorch#115388)


def _table_value(size: int) -> int:
    from ostinato.distributed.custom_all_reduce import one_shot_max_bytes

    return one_shot_max_bytes(size)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--sizes", type=int, nargs="+", default=SIZES, help="message sizes in bytes")
    p.add_argument("--iters", type=int, default=200, help="eager calls per repeat")
    p.add_argument("--calls-per-graph", type=int, default=64)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if torch.cuda.device_count() < args.ranks:
        sys.exit(f"needs {args.ranks} GPUs, found {torch.cuda.device_count()}")
    from ostinato.engine.tp_workers import _free_port

    t0 = time.perf_counter()
    mp.spawn(_worker, args=(args.ranks, _free_port(), args), nprocs=args.ranks)
    print(f"{time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
