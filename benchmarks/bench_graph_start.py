"""How long a CUDA graph's second kernel waits after its first, by the graph's size: a decode graph's first two
kernels (the bookkeeping kernel and the embedding) run 9.5 us apart with nothing between them
(`profile_step_boundary.py`), where later nodes follow each other in 1-2 us.

Graphs of N chained one-block kernels (an in-place add on one element), each replayed after a small host-to-device
copy as a decode step is, under torch.profiler; per N the median gap from node 1's end to node 2's start, from node
2's end to node 3's, and the mean gap over the rest of the chain. The chains (`--kinds`):
- `aten`: torch adds; `aten+branch` with a second root kernel beside node 1, as the memset hoist leaves the decode
  graph;
- `triton`: Triton adds, no PDL;
- `pdl-body`: as the decode graph: nodes 1 and 2 plain launches, nodes 3..N launched with PDL (each waits for its
  predecessor's grid, `gdc_wait`, then lets its successor start, `gdc_launch_dependents`), so the graph holds
  programmatic edges;
- `pdl-all`: every node launched with PDL;
- `split`: `pdl-body` as two graphs replayed back to back, nodes 1-2 and nodes 3..N.

python benchmarks/bench_graph_start.py [--sizes 2 10 50 170] [--kinds aten triton pdl-body] [--out FILE]
"""

import argparse
import json
import os
import statistics
import tempfile

import torch
import triton
import triton.language as tl
from common import RESULTS, write_report

REPLAYS = 30


@triton.jit
def _add_one(X, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
    x = tl.load(X)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(X, x + 1.0)


def triton_graphs(n: int, kind: str) -> tuple[list[torch.cuda.CUDAGraph], list[torch.Tensor]]:
    """`kind`'s chain of n Triton adds on one element, as one graph (two for `split`)."""
    x = torch.zeros(1, device="cuda")

    def launch(i: int) -> None:
        pdl = kind == "pdl-all" or (kind in ("pdl-body", "split") and i >= 2)
        _add_one[(1,)](x, PDL=pdl, launch_pdl=pdl)

    for i in range(n):  # compile outside the capture
        launch(i)
    torch.cuda.synchronize()
    parts = [range(0, min(2, n)), range(2, n)] if kind == "split" else [range(n)]
    parts = [part for part in parts if len(part)]  # (a split of 2 nodes: one graph)
    graphs = []
    for part in parts:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in part:
                launch(i)
        graphs.append(graph)
    return graphs, [x]


def chain_graph(n: int, branch: bool) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor]]:
    """A graph of n dependent one-element adds (and, with `branch`, one add on another tensor, a second root)."""
    x = torch.zeros(1, device="cuda")
    y = torch.zeros(1, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            x.add_(1.0)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        if branch:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                y.mul_(0.0)
        for _ in range(n):
            x.add_(1.0)
        if branch:
            torch.cuda.current_stream().wait_stream(side)
    return graph, [x, y]


def gaps(n: int, kind: str) -> dict[str, float]:
    if kind.startswith("aten"):
        graph, _keep = chain_graph(n, kind == "aten+branch")
        graphs = [graph]
    else:
        graphs, _keep = triton_graphs(n, kind)
    host = torch.arange(64, dtype=torch.int64).pin_memory()
    dev = torch.empty(64, dtype=torch.int64, device="cuda")
    for _ in range(3):
        dev.copy_(host, non_blocking=True)
        for graph in graphs:
            graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            dev.copy_(host, non_blocking=True)
            for graph in graphs:
                graph.replay()
        torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and e.get("cat") in
                  ("kernel", "gpu_memcpy")]
    events.sort(key=lambda e: e["ts"])
    first, second, rest, after_copy = [], [], [], []
    copies = [i for i, e in enumerate(events) if e["cat"] == "gpu_memcpy"]
    for c, i in enumerate(copies):
        stop = copies[c + 1] if c + 1 < len(copies) else len(events)
        chain = [e for e in events[i + 1: stop] if "Mul" not in e["name"] and "mul" not in e["name"]]
        if len(chain) != n:
            continue
        ends = [e["ts"] + e["dur"] for e in chain]
        after_copy.append(chain[0]["ts"] - (events[i]["ts"] + events[i]["dur"]))
        if n >= 2:
            first.append(chain[1]["ts"] - ends[0])
        if n >= 3:
            second.append(chain[2]["ts"] - ends[1])
            rest.extend(chain[k + 1]["ts"] - ends[k] for k in range(2, n - 1))
    med = statistics.median
    return {"nodes": n, "kind": kind, "replays": len(after_copy),
            "copy_to_node1_us": med(after_copy) if after_copy else None,
            "node1_to_node2_us": med(first) if first else None,
            "node2_to_node3_us": med(second) if second else None,
            "later_mean_us": statistics.fmean(rest) if rest else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[2, 10, 50, 170])
    ap.add_argument("--kinds", nargs="+", default=["aten", "aten+branch"],
                    choices=["aten", "aten+branch", "triton", "pdl-body", "pdl-all", "split"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for kind in args.kinds:
        for n in args.sizes:
            r = gaps(n, kind)
            rows.append(r)
            print(f"{n:4d} nodes {kind:>12}: copy -> node 1 {r['copy_to_node1_us'] or 0:.1f} us, "
                  f"node 1 -> 2 {r['node1_to_node2_us'] or 0:.1f}, node 2 -> 3 {r['node2_to_node3_us'] or 0:.1f}, "
                  f"later {r['later_mean_us'] or 0:.2f} ({r['replays']} replays)", flush=True)
    write_report({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows},
                 args.out or os.path.join(RESULTS, "graph-start.json"))


if __name__ == "__main__":
    main()
