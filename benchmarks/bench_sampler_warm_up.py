"""How long the sampler's start-up warm-up takes (`fused_sample.warm_up`), temperature only and with every filter
combination, each in a fresh process with an empty Triton cache and then again with that cache filled: the cost
of moving every sampler compile out of serving (where the first top_k request stalled every running one for
seconds) into start-up. As the engine runs it (`warm_up_workers.warm_up_sampler`): with --workers, the compiles
shared over that many child processes first, then the process's own warm-up from the cache they filled; with the
cache filled, the marker left by the first run starts no children.

python benchmarks/bench_sampler_warm_up.py --vocab 128256 151936 --max-batch 256 --workers 0 8
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = """
import sys, time, torch
from ostinato.runner.warm_up_workers import warm_up_sampler
vocab, max_batch, filters, workers = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
torch.zeros(1, device="cuda")
t = time.perf_counter()
warm_up_sampler(workers, max_batch, vocab, torch.device("cuda"), filters)  # the engine's (0 workers: alone)
torch.cuda.synchronize()
print(time.perf_counter() - t)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, nargs="+", default=[128256])
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--workers", type=int, nargs="+", default=[0], help="child processes (0: none)")
    ap.add_argument("--filters", choices=["both", "none", "all"], default="both")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for vocab in args.vocab:
        for filters, workers in [(f, w) for f in {"both": (False, True), "none": (False,), "all": (True,)}[args.filters]
                                 for w in args.workers]:
            with tempfile.TemporaryDirectory() as cache:
                env = dict(os.environ, TRITON_CACHE_DIR=cache)
                times = []
                for _ in ("cold", "warm"):
                    t = time.perf_counter()
                    out = subprocess.run([sys.executable, "-c", CHILD, str(vocab), str(args.max_batch),
                                          "1" if filters else "0", str(workers)],
                                         env=env, capture_output=True, text=True)
                    if out.returncode:
                        raise SystemExit(out.stderr[-2000:])
                    times.append((float(out.stdout.split()[-1]), time.perf_counter() - t))
                kernels = sum(f.endswith(".cubin") for _, _, fs in os.walk(cache) for f in fs)
            row = dict(vocab=vocab, filters=filters, workers=workers, kernels=kernels, cold_s=times[0][0],
                       warm_s=times[1][0], cold_process_s=times[0][1], warm_process_s=times[1][1])
            rows.append(row)
            print(f"vocab {vocab:>6} {'every filter' if filters else 'temperature only':<16} {workers} workers "
                  f"{kernels:4d} kernels: "
                  f"warm-up {times[0][0]:6.1f} s cold, {times[1][0]:5.2f} s from the cache", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
