"""Does Programmatic Dependent Launch shorten a chain of small kernels inside a CUDA graph (Hopper)?

Two chains, each captured in one CUDA graph and replayed, without and with PDL (`launch_pdl=True`; each kernel
calls `gdc_wait()` before it reads the previous kernel's output and `gdc_launch_dependents()` after):
- `tiny`: 256 kernels that each add 1 to a 4 KB vector (pure launch and node-gap cost);
- `gemv`: 64 GEMVs of 2048 x 2048 bf16 weights, 4 rows a program, weights loaded *before* `gdc_wait()` (what a
  decode layer's skinny GEMMs would do: stream their weights while the previous kernel finishes).
Reports us per kernel and, for the GEMV, the bandwidth it reaches; checks the two chains' outputs are equal
(a missing wait would read a stale vector).

python benchmarks/bench_pdl.py      # ~20 s on an H200
"""

import argparse
import os
import sys

import torch
import triton
import triton.language as tl
from common import RESULTS, copy_bandwidth, device_tag, write_report


@triton.jit
def _add_one(X, Y, N: tl.constexpr, PDL: tl.constexpr):
    offs = tl.arange(0, N)
    if PDL:
        tl.extra.cuda.gdc_wait()
    x = tl.load(X + offs)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(Y + offs, x + 1.0)


@triton.jit
def _gemv(W, X, Y, K: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, K)
    w = tl.load(W + rows[:, None] * K + cols[None, :])  # the weights depend on no earlier kernel
    if PDL:
        tl.extra.cuda.gdc_wait()
    x = tl.load(X + cols)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    y = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(Y + rows, y.to(Y.dtype.element_ty))


def chain(kind: str, pdl: bool, bufs: list[torch.Tensor], weights: list[torch.Tensor], n: int) -> None:
    for i in range(n):
        x, y = bufs[i % 2], bufs[(i + 1) % 2]
        if kind == "tiny":
            _add_one[(1,)](x, y, N=x.numel(), PDL=pdl, launch_pdl=pdl)
        else:
            k = x.numel()
            _gemv[(k // 4,)](weights[i], x, y, K=k, BLOCK_N=4, PDL=pdl, launch_pdl=pdl, num_warps=4)


def run(kind: str, pdl: bool, n: int, iters: int) -> tuple[float, torch.Tensor]:
    gen = torch.Generator("cuda").manual_seed(0)
    if kind == "tiny":
        bufs = [torch.zeros(1024, device="cuda") for _ in range(2)]
        weights: list[torch.Tensor] = []
    else:
        k = 2048
        bufs = [torch.randn(k, device="cuda", generator=gen).bfloat16() for _ in range(2)]
        weights = [(torch.randn(k, k, device="cuda", generator=gen) * k**-0.5).bfloat16() for _ in range(n)]
    start = [b.clone() for b in bufs]
    chain(kind, pdl, bufs, weights, n)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain(kind, pdl, bufs, weights, n)
    for b, s in zip(bufs, start, strict=True):  # one replay from the same start: the output to compare
        b.copy_(s)
    graph.replay()
    torch.cuda.synchronize()
    out = bufs[n % 2].clone()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    graph.replay()
    events[0].record()
    for _ in range(iters):
        graph.replay()
    events[1].record()
    torch.cuda.synchronize()
    return events[0].elapsed_time(events[1]) / iters / n * 1e3, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cuda")
    if torch.cuda.get_device_capability(device)[0] < 9:
        sys.exit("PDL needs compute capability 9.0 (Hopper) or later")
    bw = copy_bandwidth(device)
    rows = []
    print(f"{'chain':<6}{'kernels':>8}{'us/kernel':>11}{'with PDL':>10}{'TB/s':>7}{'with PDL':>10}  outputs equal")
    for kind, n in (("tiny", 256), ("gemv", 64)):
        base_us, base_out = run(kind, False, n, args.iters)
        pdl_us, pdl_out = run(kind, True, n, args.iters)
        equal = torch.equal(base_out, pdl_out)
        tbps = [2048 * 2048 * 2 / (us * 1e-6) / 1e12 if kind == "gemv" else 0.0 for us in (base_us, pdl_us)]
        rows.append({"chain": kind, "kernels": n, "us_per_kernel": base_us, "us_per_kernel_pdl": pdl_us,
                     "TBps": tbps[0], "TBps_pdl": tbps[1], "outputs_equal": equal})
        print(f"{kind:<6}{n:>8}{base_us:>11.2f}{pdl_us:>10.2f}{tbps[0]:>7.2f}{tbps[1]:>10.2f}  {equal}")
    report = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "triton": triton.__version__,
              "command": " ".join(["python"] + sys.argv), "copy_bandwidth_TBps": bw / 1e12, "rows": rows}
    write_report(report, args.out or os.path.join(RESULTS, f"pdl-{device_tag(device)}.json"))


if __name__ == "__main__":
    main()
