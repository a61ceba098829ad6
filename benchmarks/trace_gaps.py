"""Where a profiled step's GPU time goes, from a Chrome trace of `profile_extend.py --trace` (or any torch.profiler
export): per kernel name, the launches, their summed time and their time on the critical path (from the end of
whatever ran before, so PDL overlap is not counted twice and the gap before a kernel is charged to it), then the
largest idle gaps by (kernel before, kernel after). The part timed is the longest run of GPU events with no gap over
`--split-us` (50 us): an extend graph's replay, without the input copies before it (the host work between those is
longer).

python benchmarks/trace_gaps.py benchmarks/results/profile-extend-granite-4.0-h-1b-1x2048-h200-20261126-cublas-*.json.gz
"""

import argparse
import gzip
import json
from collections import defaultdict

GPU_CATS = ("kernel", "gpu_memset", "gpu_memcpy")


def load_step(path: str, split_us: float) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and e.get("cat") in GPU_CATS]
    if not events:
        raise SystemExit(f"{path}: no GPU events (kernels, memsets, memcpys) in this trace")
    events.sort(key=lambda e: e["ts"])
    runs, end = [[]], None
    for e in events:
        if end is not None and e["ts"] - end > split_us:
            runs.append([])
        runs[-1].append(e)
        end = max(end or 0, e["ts"] + e["dur"])
    return max(runs, key=lambda r: r[-1]["ts"] + r[-1]["dur"] - r[0]["ts"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--split-us", type=float, default=50.0)
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args()
    for path in a.traces:
        step = load_step(path, a.split_us)
        per_kernel = defaultdict(lambda: [0, 0.0, 0.0])  # launches, summed us, critical-path us
        gaps = defaultdict(lambda: [0, 0.0])
        end, before = step[0]["ts"], None
        for e in step:
            name = e["name"][:60]
            stop = e["ts"] + e["dur"]
            k = per_kernel[name]
            k[0] += 1
            k[1] += e["dur"]
            k[2] += max(stop - end, 0.0)
            if before is not None and e["ts"] > end:
                g = gaps[(before[:40], name[:40])]
                g[0] += 1
                g[1] += e["ts"] - end
            end, before = max(end, stop), name
        span = step[-1]["ts"] + step[-1]["dur"] - step[0]["ts"]
        idle = sum(g[1] for g in gaps.values())
        print(f"{path}: step span {span:.0f} us, {len(step)} GPU events, idle {idle:.0f} us")
        print(f"  {'launches':>8} {'sum us':>9} {'critical':>9}  kernel")
        for name, (n, total, crit) in sorted(per_kernel.items(), key=lambda kv: -kv[1][2])[: a.top]:
            print(f"  {n:8d} {total:9.1f} {crit:9.1f}  {name}")
        print(f"  {'gaps':>8} {'sum us':>9} {'each':>9}  before -> after")
        for (b, n_), (n, total) in sorted(gaps.items(), key=lambda kv: -kv[1][1])[: a.top // 2]:
            print(f"  {n:8d} {total:9.1f} {total / n:9.2f}  {b} -> {n_}")


if __name__ == "__main__":
    main()
