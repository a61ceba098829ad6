"""How the device copy rate (the floors' bandwidth) reads by method, bytes read + written: one 512 MiB copy timed on
the host (common.copy_bandwidth until the forty-first session), CUDA-event timings of one copy and of ten back to
back at 512 MiB and 2 GiB, and common.copy_bandwidth as it is now.

python benchmarks/copy_rate_probe.py [out.json]
"""

import json
import sys
import time

import torch
from common import copy_bandwidth, event_copy_rate


def host_timed(nbytes: int = 1 << 29) -> float:
    src = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return 2 * nbytes / sorted(times)[len(times) // 2]


if __name__ == "__main__":
    out = {"host-timed 512 MB (the earlier method)": host_timed()}
    for size in (1 << 29, 1 << 31):
        for reps in (1, 10):
            out[f"events {size >> 20} MB x {reps}"] = event_copy_rate(torch.device("cuda"), size, reps, trials=15)
    out["common.copy_bandwidth"] = copy_bandwidth(torch.device("cuda"))
    out["host-timed 512 MB again"] = host_timed()
    for k, v in out.items():
        print(f"{k:45} {v / 1e12:.3f} TB/s")
    if len(sys.argv) > 1:
        json.dump({k: v / 1e12 for k, v in out.items()}, open(sys.argv[1], "w"), indent=1)
