"""Decode-sized linear layers, y = x @ W^T: torch.nn.functional.linear (cuBLAS) vs skinny_linear, in us per
call and TB/s of weight bytes, beside the device copy bandwidth (bytes read + written per second).

Each figure is one call's share of a CUDA graph of 20 back-to-back calls (decode runs inside graphs: no
launch overhead, but each call's ramp-up and tail count). The calls cycle through copies of W that add up
to 3x the L2 cache (their number divides the calls, so the cycle holds across replays), so every call
reads its W from HBM as a model's layers do. M above 32 is torch only, for reference. `err` is
max |skinny - torch|, `ref` the largest |y|.

python benchmarks/bench_skinny_gemm.py [--out PATH] [--sweep]
--sweep also times variants of each heuristic config (one field changed at a time); takes minutes.

python benchmarks/bench_skinny_gemm.py --prenorm --shapes 3072x2048 8192x2048g 4096x1024 6448x1536 --ms 1 2
--prenorm times a norm and its projection: fused_add_rms_norm then the skinny kernel (two launches), or then
cuBLAS (and silu_and_mul), against skinny_norm_linear (one, M <= 2) at prenorm_config's tiles, per shape and M; a
`g` after a shape is the gated gate_up form (N the output width I, W [2I, K]). With --sweep, also the fused kernel at
config_for's tiles and wider ones.

python benchmarks/bench_skinny_gemm.py --wide --shapes 3072x2048 8192x2048g 4096x1024 3072x1024g --ms 8 16 32
--wide times triton_ops/wide_gemm.py (W's rows on the MMA's M side) against what the engine runs without it at 5-64
rows: cuBLAS (plain), or cuBLAS then silu_and_mul with the deferred norm's scale (`g`: gate_up), and the skinny
kernel (plain). With --sweep, also its tiles around config_for's.
"""

import argparse
import functools
import math
import os
import sys

import torch
import torch.nn.functional as F
from common import RESULTS, copy_bandwidth, device_tag, write_report

from ostinato.layers.activation import silu_and_mul
from ostinato.layers.norm import fused_add_rms_norm
from ostinato.layers.triton_ops import wide_gemm
from ostinato.layers.triton_ops.skinny_gemm import (
    MAX_M,
    PRENORM_MAX_M,
    SkinnyConfig,
    config_for,
    prenorm_config,
    skinny_gate_up_silu,
    skinny_linear,
    skinny_norm_linear,
)

SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]  # (N, K)
MS = [1, 2, 4, 8, 16, 32]


def graph_us(calls: list, reps: int) -> float:
    """us per call: median over `reps` replays of a CUDA graph of the calls, back to back."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (Triton compiles, cuBLAS picks its kernels) outside the capture
        for fn in calls[:2]:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # keeps the GPU busy while the host queues the replay: no gap timed
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return sorted(times)[len(times) // 2] * 1e3 / len(calls)


def variants(cfg: SkinnyConfig, m: int) -> list[SkinnyConfig]:
    """The heuristic's config with one field changed at a time (tile bytes kept where a size moves)."""
    out = [cfg._replace(num_stages=s) for s in (2, 4, 5) if s != cfg.num_stages]
    out += [cfg._replace(block_n=cfg.block_n * 2, block_k=max(16, cfg.block_k // 2)),
            cfg._replace(block_k=cfg.block_k * 2), cfg._replace(block_k=max(16, cfg.block_k // 2)),
            cfg._replace(num_warps=8), cfg._replace(num_warps=2)]
    if cfg.block_n > (16 if cfg.use_dot else 2):
        out.append(cfg._replace(block_n=cfg.block_n // 2, block_k=cfg.block_k * 2))
    if not cfg.use_dot and m <= 8:
        out.append(SkinnyConfig(16, 16, 512, True, 4, 4))
    elif cfg.use_dot and m <= 8:
        m_pad = 1 << (m - 1).bit_length()
        out.append(SkinnyConfig(m_pad, 8, max(16, 2048 // m_pad), False, 4, 3))
    return out


def short(cfg: SkinnyConfig) -> str:
    return (f"{'dot' if cfg.use_dot else 'fma'} m{cfg.m_pad} n{cfg.block_n} k{cfg.block_k} "
            f"w{cfg.num_warps} s{cfg.num_stages}")


def weight_copies(rows: int, k: int, args: argparse.Namespace, gen: torch.Generator,
                  device: torch.device) -> tuple[list[torch.Tensor], int]:
    """Copies of a random W [rows, k] that add up to 3x the L2 cache (so every call reads its W from HBM), their
    number dividing the calls (the same reuse distance across a replay's end); and W's bytes."""
    dtype = getattr(torch, args.dtype)
    w_bytes = rows * k * torch.finfo(dtype).bits // 8
    need = max(2, math.ceil(3 * getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20) / w_bytes))
    copies = min(c for c in range(1, args.calls + 1) if args.calls % c == 0 and (c >= need or c == args.calls))
    return [(torch.randn(rows, k, generator=gen, device=device) / k**0.5).to(dtype) for _ in range(copies)], w_bytes


def bench_shape(n: int, k: int, ms: list[int], args: argparse.Namespace, bw: float,
                device: torch.device) -> list[dict]:
    dtype = getattr(torch, args.dtype)
    props = torch.cuda.get_device_properties(device)
    gen = torch.Generator(device).manual_seed(n + k)
    weights, w_bytes = weight_copies(n, k, args, gen, device)
    copies = len(weights)
    rows = []
    for m in ms:
        x = torch.randn(m, k, generator=gen, device=device).to(dtype)
        ws = [weights[i % copies] for i in range(args.calls)]
        torch_us = graph_us([functools.partial(F.linear, x, w) for w in ws], args.reps)
        row = {"N": n, "K": k, "M": m, "dtype": args.dtype, "weight_bytes": w_bytes, "weight_copies": copies,
               "torch_us": torch_us, "torch_TBps": w_bytes / torch_us / 1e6}
        if m <= MAX_M:
            cfg = config_for(m, n, k, props.multi_processor_count)
            out = torch.empty(m, n, dtype=dtype, device=device)
            timed = []
            for c in [cfg, *(variants(cfg, m) if args.sweep else [])]:
                try:
                    calls = [functools.partial(skinny_linear, x, w, out=out, config=c) for w in ws]
                    us = graph_us(calls, args.reps)
                except Exception as e:  # a sweep variant past the shared memory or register limits
                    if c is cfg:
                        raise
                    print(f"    {short(c)}: {type(e).__name__}", flush=True)
                    continue
                timed.append((us, c))
                if args.sweep:
                    print(f"    {short(c):<28}{us:>8.2f} us{w_bytes / us / 1e6:>7.2f} TB/s", flush=True)
            best_us, best = min(timed)
            y_torch, y = F.linear(x, weights[0]), skinny_linear(x, weights[0])
            row.update(config=cfg._asdict(), skinny_us=timed[0][0], skinny_TBps=w_bytes / timed[0][0] / 1e6,
                       speedup=torch_us / timed[0][0], frac_of_copy_bw=w_bytes / timed[0][0] / 1e6 / (bw / 1e12),
                       max_abs_err=(y.float() - y_torch.float()).abs().max().item(),
                       ref_max_abs=y_torch.float().abs().max().item())
            if args.sweep:
                row.update(best_config=best._asdict(), best_us=best_us, best_TBps=w_bytes / best_us / 1e6)
        rows.append(row)
        print_row(row)
    return rows


def bench_prenorm(shape: str, ms: list[int], args: argparse.Namespace, bw: float, device: torch.device) -> list[dict]:
    gated = shape.endswith("g")
    n, k = (int(v) for v in shape.rstrip("g").split("x"))
    dtype = getattr(torch, args.dtype)
    props = torch.cuda.get_device_properties(device)
    gen = torch.Generator(device).manual_seed(n + k)
    weights, w_bytes = weight_copies(2 * n if gated else n, k, args, gen, device)
    copies = len(weights)
    norm_w = torch.ones(k, dtype=dtype, device=device)
    project = skinny_gate_up_silu if gated else skinny_linear
    rows = []
    for m in [m for m in ms if m <= MAX_M]:  # the fused kernel up to PRENORM_MAX_M rows, the pairs above too
        x, residual = (torch.randn(m, k, generator=gen, device=device).to(dtype) for _ in range(2))
        ws = [weights[i % copies] for i in range(args.calls)]

        def pair(w, x=x, residual=residual):
            h, _ = fused_add_rms_norm(x, residual, norm_w, 1e-6)
            return project(h, w)

        def cublas_pair(w, x=x, residual=residual):  # the norm, then cuBLAS (and the activation's kernel)
            h, _ = fused_add_rms_norm(x, residual, norm_w, 1e-6)
            y = F.linear(h, w)
            return silu_and_mul(y) if gated else y

        fused = m <= PRENORM_MAX_M
        cfg = prenorm_config(m, n, k, props.multi_processor_count, gated) if fused else None
        row = {"N": n, "K": k, "M": m, "gated": gated, "dtype": args.dtype, "weight_bytes": w_bytes,
               "config": cfg and cfg._asdict(),
               "pair_us": graph_us([functools.partial(pair, w) for w in ws], args.reps),
               "plain_us": graph_us([functools.partial(project, x, w) for w in ws], args.reps),
               "cublas_pair_us": graph_us([functools.partial(cublas_pair, w) for w in ws], args.reps)}
        plain = config_for(m, n, k, props.multi_processor_count, gated)  # the tiles of the GEMV alone
        configs = [] if not fused else [cfg] + (
            [c for c in (plain, cfg._replace(block_n=cfg.block_n * 2, block_k=max(16, cfg.block_k // 2)),
                         cfg._replace(block_n=cfg.block_n * 2)) if c != cfg] if args.sweep else [])
        for i, c in enumerate(configs):
            calls = [functools.partial(skinny_norm_linear, x, w, 1e-6, residual, gated=gated, config=c) for w in ws]
            row["fused_us" if i == 0 else f"fused_us {short(c)}"] = graph_us(calls, args.reps)
        rows.append(row)
        extra = "".join(f"  {key[9:]} {v:.2f}" for key, v in row.items() if key.startswith("fused_us "))
        fused_col = f"fused {row['fused_us']:7.2f} us  {short(cfg)}" if fused else "fused -"
        print(f"{shape:>12}{m:>4}  norm+gemv {row['pair_us']:7.2f} us  norm+cuBLAS {row['cublas_pair_us']:7.2f} us  "
              f"gemv alone {row['plain_us']:7.2f} us ({w_bytes / row['plain_us'] / 1e6:.2f} TB/s)  {fused_col}"
              f"{extra}", flush=True)
    return rows


def wide_variants(cfg: wide_gemm.WideConfig) -> list[wide_gemm.WideConfig]:
    """Tiles around config_for's: rows a program, K tile, stages, warps."""
    out = []
    for block_n in (32, 64, 128):
        for block_k in (64, 128):
            for stages in (3, 4, 6):
                for warps in (4, 8) if block_n == 128 else (4,):
                    c = cfg._replace(block_n=block_n, block_k=block_k, num_stages=stages, num_warps=warps)
                    if c != cfg:
                        out.append(c)
    return out


def bench_wide(shape: str, ms: list[int], args: argparse.Namespace, device: torch.device) -> list[dict]:
    gated = shape.endswith("g")
    n, k = (int(v) for v in shape.rstrip("g").split("x"))
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device).manual_seed(n + k)
    weights, w_bytes = weight_copies(2 * n if gated else n, k, args, gen, device)
    ws = [weights[i % len(weights)] for i in range(args.calls)]
    eps = 1e-6
    rows = []
    for m in [m for m in ms if wide_gemm.MIN_M <= m <= wide_gemm.MAX_M]:
        x = torch.randn(m, k, generator=gen, device=device).to(dtype)
        if gated:
            def base(w, x=x):  # the engine's deferred-norm form at 5-32 rows
                return silu_and_mul(F.linear(x, w), norm=(x, eps))
            ref = silu_and_mul(F.linear(x, weights[0]), norm=(x, eps))
        else:
            base = functools.partial(F.linear, x)
            ref = F.linear(x, weights[0])
        row = {"N": n, "K": k, "M": m, "gated": gated, "dtype": args.dtype, "weight_bytes": w_bytes,
               "cublas_us": graph_us([functools.partial(base, w) for w in ws], args.reps)}
        if not gated and m <= MAX_M:
            row["skinny_us"] = graph_us([functools.partial(skinny_linear, x, w) for w in ws], args.reps)
        cfg = wide_gemm.config_for(m, n, k, gated)
        timed = []
        for c in [cfg, *(wide_variants(cfg) if args.sweep else [])]:
            fn = functools.partial(wide_gemm.wide_linear, x, gated=gated, norm_eps=eps if gated else None, config=c)
            try:
                us = graph_us([functools.partial(fn, w) for w in ws], args.reps)
            except Exception as e:  # a variant past the shared memory limit
                print(f"    {tuple(c)}: {type(e).__name__}", flush=True)
                continue
            timed.append((us, c))
            if args.sweep:
                print(f"    {shape} M={m} {tuple(c)} {us:8.2f} us", flush=True)
        y = wide_gemm.wide_linear(x, weights[0], gated=gated, norm_eps=eps if gated else None, config=cfg)
        best_us, best = min(timed)
        row.update(config=cfg._asdict(), wide_us=timed[0][0], best_us=best_us, best_config=best._asdict(),
                   max_abs_err=(y.float() - ref.float()).abs().max().item(), ref_max_abs=ref.float().abs().max().item())
        rows.append(row)
        skinny = f"  skinny {row['skinny_us']:7.2f} us" if "skinny_us" in row else ""
        print(f"{shape:>12}{m:>4}  cuBLAS{'+act' if gated else ''} {row['cublas_us']:7.2f} us{skinny}"
              f"  wide {row['wide_us']:7.2f} us {tuple(cfg)}  best {best_us:7.2f} us {tuple(best)}"
              f"  err {row['max_abs_err']:.2e} (ref {row['ref_max_abs']:.1f})", flush=True)
    return rows


def print_row(r: dict) -> None:
    line = f"{r['N']:>6}x{r['K']:<6}{r['M']:>4}{r['torch_us']:>9.2f}{r['torch_TBps']:>7.2f}"
    if "skinny_us" in r:
        line += (f"{r['skinny_us']:>9.2f}{r['skinny_TBps']:>7.2f}{r['speedup']:>7.2f}x{r['frac_of_copy_bw']:>6.0%}"
                 f"{r['max_abs_err']:>9.2e}{r['ref_max_abs']:>7.1f}  {short(SkinnyConfig(**r['config']))}")
        if "best_us" in r:
            best = short(SkinnyConfig(**r["best_config"]))
            line += f"  | best {r['best_us']:.2f} us {r['best_TBps']:.2f} TB/s {best}"
    print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=[f"{n}x{k}" for n, k in SHAPES], help="NxK, W's shape")
    ap.add_argument("--ms", type=int, nargs="+", default=MS, help="batch sizes (above 32: torch only)")
    ap.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    ap.add_argument("--calls", type=int, default=20, help="back-to-back calls in each captured graph")
    ap.add_argument("--reps", type=int, default=50, help="graph replays timed (median)")
    ap.add_argument("--sweep", action="store_true", help="also time variants of each heuristic config")
    ap.add_argument("--prenorm", action="store_true",
                    help="a norm then the skinny kernel or cuBLAS, against the fused kernel (M <= 2)")
    ap.add_argument("--wide", action="store_true", help="triton_ops/wide_gemm.py against cuBLAS (M 5-64)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/skinny-gemm-<device>.json)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    device = torch.device("cuda")
    bw = copy_bandwidth(device)
    print(f"device copy bandwidth {bw / 1e12:.2f} TB/s ({torch.cuda.get_device_name(device)}, {args.dtype})")
    if args.prenorm or args.wide:
        with torch.inference_mode():
            rows = [r for shape in args.shapes for r in (bench_wide(shape, args.ms, args, device) if args.wide
                                                         else bench_prenorm(shape, args.ms, args, bw, device))]
        report = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                  "command": " ".join(["python"] + sys.argv), "copy_bandwidth_TBps": bw / 1e12, "rows": rows}
        kind = "wide" if args.wide else "prenorm"
        write_report(report, args.out or os.path.join(RESULTS, f"skinny-{kind}-{device_tag(device)}.json"))
        return
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    print(f"{'N x K':<13}{'M':>4}{'torch us':>9}{'TB/s':>7}{'skinny':>9}{'TB/s':>7}{'speed':>8}{'copy':>6}"
          f"{'err':>9}{'ref':>7}  config")
    rows = []
    with torch.inference_mode():
        for n, k in shapes:
            rows += bench_shape(n, k, args.ms, args, bw, device)
            torch.cuda.empty_cache()
    report = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "command": " ".join(["python"] + sys.argv), "copy_bandwidth_TBps": bw / 1e12, "rows": rows}
    write_report(report, args.out or os.path.join(RESULTS, f"skinny-gemm-{device_tag(device)}.json"))


if __name__ == "__main__":
    main()
