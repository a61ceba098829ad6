"""Host us to build a step's sampling inputs (`SamplingTensors.from_params`, what ModelRunner does each time the
decode batch changes), at a few batch sizes, greedy and at a temperature, with its parts: the Python and numpy
work alone (built for the CPU), a pinned host buffer's allocation, and one small pinned copy to the device.

In the engine (probe_sample_step.py, H200, forty-fourth session) a rebuild took 0.51-0.65 ms of host time at T=0.6
and 0.14-0.16 greedy at 256 rows; with the inputs in one pinned copy, 0.39-0.59 and 0.095-0.107. This script, in turns
with the tree before: from_params at 256 rows T=0.6 306-344 -> 192-198 us, greedy 128-138 -> 56-60
(benchmarks/results/sampling-inputs-*-h200-20261128-s44.json).

  python benchmarks/bench_sampling_inputs.py --rows 32 256 [--iters 2000] [--out F]
"""

import argparse
import json
import random
import statistics
import sys
import time

import torch

from ostinato.runner.sampler import SamplingTensors
from ostinato.sampling_params import SamplingParams


def us_a_call(fn, iters: int, repeats: int = 5) -> float:
    """Median over `repeats` of the mean host us of `iters` calls (after a warm-up of `iters // 10`)."""
    for _ in range(max(1, iters // 10)):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        times.append(1e6 * (time.perf_counter() - t) / iters)
    return statistics.median(times)


def time_row(b: int, temperature: float, vocab: int, iters: int, device: torch.device) -> dict:
    rng = random.Random(b)
    seeds, steps = [rng.getrandbits(63) for _ in range(b)], [rng.randrange(1000) for _ in range(b)]
    params = [SamplingParams(temperature=temperature, max_tokens=100) for _ in range(b)]
    row = {"rows": b, "temperature": temperature, "device": str(device)}
    row["from_params_us"] = us_a_call(lambda: SamplingTensors.from_params(params, seeds, steps, vocab, device), iters)
    row["host_part_us"] = us_a_call(lambda: SamplingTensors.from_params(params, seeds, steps, vocab, "cpu"), iters)
    if device.type == "cuda":
        nbytes = 48 * b  # three int64 and three float32 columns
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        row["pin_us"] = us_a_call(lambda: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), iters)
        row["copy_us"] = us_a_call(lambda: pinned.to(device, non_blocking=True), iters)
        torch.cuda.synchronize()
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 0.6])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if min(args.rows) < 1 or args.iters < 1:
        ap.error(f"--rows and --iters: 1 or more, got {args.rows}, {args.iters}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for b in args.rows:
        for temperature in args.temperature:
            row = time_row(b, temperature, args.vocab, args.iters, device)
            rows.append(row)
            print("  ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
                  flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
