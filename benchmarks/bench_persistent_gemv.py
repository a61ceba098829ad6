"""Experiment for #16 (bs-1 decode): is a kernel boundary between two weight-streaming GEMVs cheaper as a grid-wide
barrier inside one persistent kernel, with the next GEMV's weights pulled into L2 before the barrier?

The chain is Qwen3-0.6B's four projections a layer at one row, 28 layers (881 MB of weights, each projection's
input the previous one's output cut to its K): qkv 4096 x 1024, o 1024 x 2048, gate_up 6144 x 1024 (ungated here),
down 1024 x 3072. Three ways, each captured in a CUDA graph, us per GEMV and the weights' TB/s:
- `skinny`: the engine's skinny_linear, one launch per GEMV, PDL on where the engine has it;
- `persistent`: one launch for the whole chain, every program walking its row tiles of each GEMV, then a grid
  barrier (an atomic count in global memory, a zero-filled counter per launch);
- `persistent+l2`: the same, and each program prefetches into L2 the rows it takes next, for the next GEMV, before
  its barrier, so the next GEMV's first bytes are already on chip;
- `load-poll`: either, with the barrier's count polled by acquire loads instead of atomic adds of 0.
All programs of a persistent launch must be resident at once (the barrier waits for every one); the grid is
`--per-sm` programs an SM. On the CPU (Triton's interpreter runs programs one after another, so a barrier would
never open) each GEMV is its own launch of the same kernel: `--smoke` checks the arithmetic that way.

python benchmarks/bench_persistent_gemv.py            # H200 / H100
python benchmarks/bench_persistent_gemv.py --smoke    # CPU: tiny chain in the interpreter against torch
"""

import argparse
import json
import os
import sys

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

QWEN3_LAYER = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]  # (N, K) of each projection


@triton.jit
def _l2_prefetch(ptrs):
    """prefetch.global.L2 at each address (one 128-byte line each); returns nothing useful."""
    return tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _load_acquire(ptrs):
    """ld.acquire.gpu at each address: a plain load with acquire order (no read-modify-write at L2)."""
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.u32 $0, [$1];", "=r,l", [ptrs], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _poll(Counter, LOAD_POLL: tl.constexpr):
    if LOAD_POLL:
        return tl.max(_load_acquire(Counter + tl.zeros([1], dtype=tl.int32)), 0)
    return tl.atomic_add(Counter, 0, sem="acquire", scope="gpu")


@triton.jit
def _grid_barrier(Counter, target, max_spins, LOAD_POLL: tl.constexpr):
    """Every program's stores before it, visible to every program after it (the count reaches `target`). The count
    is polled by an atomic add of 0, or (LOAD_POLL) by acquire loads, which every program's poll can take from L2
    at once instead of queueing at the atomic unit."""
    tl.debug_barrier()
    tl.atomic_add(Counter, 1, sem="release", scope="gpu")
    seen = _poll(Counter, LOAD_POLL)
    spins = 0
    while (seen < target) & (spins < max_spins):  # capped: a grid too large to be resident fails, not hangs
        seen = _poll(Counter, LOAD_POLL)
        spins += 1
    tl.debug_barrier()


@triton.jit
def _chain_kernel(W, A, Meta, Counter, first, last, max_spins,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                  BARRIER: tl.constexpr, PREFETCH: tl.constexpr, LOAD_POLL: tl.constexpr = False):
    """GEMVs `first` .. `last` - 1 of the chain. Meta[g] = (N, K, W offset, input offset, output offset) in
    elements of W / A; y_g = W_g @ A[in_g : in_g + K] written at A[out_g : out_g + N]. N % BLOCK_N == 0,
    K % BLOCK_K == 0, and the offsets multiples of 16."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    for g in range(first, last):
        # every size and offset a multiple of 16 elements (32 bytes): said, so the loads of the K loop can go through
        # the cp.async ring (an alignment the compiler cannot see costs the pipelining)
        n = tl.load(Meta + g * 5)
        k = tl.multiple_of(tl.load(Meta + g * 5 + 1), 16)
        w_off = tl.multiple_of(tl.load(Meta + g * 5 + 2), 16)
        in_off = tl.multiple_of(tl.load(Meta + g * 5 + 3), 16)
        out_off = tl.multiple_of(tl.load(Meta + g * 5 + 4), 16)
        for t in range(pid, n // BLOCK_N, num_programs):
            rows = t * BLOCK_N + offs_n
            w_ptrs = W + w_off + rows.to(tl.int64)[:, None] * k + offs_k[None, :]
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            for k0 in tl.range(0, k, BLOCK_K, num_stages=NUM_STAGES):
                x = tl.load(A + in_off + k0 + offs_k, cache_modifier=".cg")  # another program wrote it
                acc += tl.load(w_ptrs + k0).to(tl.float32) * x.to(tl.float32)[None, :]
            tl.store(A + out_off + rows, tl.sum(acc, 1).to(A.dtype.element_ty))
        if g + 1 < last:
            if PREFETCH:  # this program's first row tile of the next GEMV, every 128-byte line of it, into L2
                n2 = tl.load(Meta + g * 5 + 5)
                k2 = tl.load(Meta + g * 5 + 6)
                w2 = tl.load(Meta + g * 5 + 7)
                if pid < n2 // BLOCK_N:
                    lines = tl.arange(0, BLOCK_K // 64) * 64  # a line is 64 bf16 elements
                    tile = W + w2 + (pid * BLOCK_N + offs_n).to(tl.int64)[:, None] * k2 + lines[None, :]
                    for c in range(0, k2, BLOCK_K):
                        _l2_prefetch(tile + c)
            if BARRIER:
                _grid_barrier(Counter, (g + 1 - first) * num_programs, max_spins, LOAD_POLL)


def chain_meta(layers: int, device: torch.device) -> tuple[torch.Tensor, int, int, list[tuple[int, ...]]]:
    """Meta rows (N, K, W offset, in offset, out offset) for `layers` layers of QWEN3_LAYER; W and A sizes."""
    rows, w, a = [], 0, 0
    in_off, a = 0, QWEN3_LAYER[0][1]  # A starts with x0
    for _ in range(layers):
        for n, k in QWEN3_LAYER:
            rows.append((n, k, w, in_off, a))
            w += n * k
            in_off, a = a, a + n
    return torch.tensor(rows, dtype=torch.int64, device=device).flatten(), w, a, rows


def run_chain(w: torch.Tensor, a: torch.Tensor, meta: torch.Tensor, counter: torch.Tensor, num_gemvs: int,
              programs: int, barrier: bool, prefetch: bool, block_n: int = 8, block_k: int = 512,
              stages: int = 3, load_poll: bool = False) -> None:
    if barrier:
        counter.zero_()
        _chain_kernel[(programs,)](w, a, meta, counter, 0, num_gemvs, 1 << 15, BLOCK_N=block_n, BLOCK_K=block_k,
                                   NUM_STAGES=stages, BARRIER=True, PREFETCH=prefetch, LOAD_POLL=load_poll,
                                   num_warps=4)
        return
    for g in range(num_gemvs):  # the interpreter's form: a launch a GEMV
        _chain_kernel[(programs,)](w, a, meta, counter, g, g + 1, 0, BLOCK_N=block_n, BLOCK_K=block_k,
                                   NUM_STAGES=stages, BARRIER=False, PREFETCH=False, num_warps=4)


def reference(w: torch.Tensor, a: torch.Tensor, rows: list) -> torch.Tensor:
    """The chain in float32 from a's x0 (each output rounded to a's dtype, as the kernels store it)."""
    a = a.clone()
    for n, k, wo, io, oo in rows:
        y = w[wo : wo + n * k].view(n, k).float() @ a[io : io + k].float()
        a[oo : oo + n] = y.to(a.dtype)
    return a


def graph_us(fn, reps: int = 30) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=28, help="Qwen3-0.6B layers in the chain (4 GEMVs each)")
    ap.add_argument("--per-sm", type=int, nargs="+", default=[2, 4],
                    help="persistent programs an SM, one pass each (all must be resident at once)")
    ap.add_argument("--smoke", action="store_true", help="CPU: one layer in Triton's interpreter against torch")
    ap.add_argument("--out", default=None, help="JSON path for the figures (none written without it)")
    args = ap.parse_args()
    dev = torch.device("cpu" if args.smoke else "cuda")
    layers = 1 if args.smoke else args.layers
    meta, w_size, a_size, rows = chain_meta(layers, dev)
    gen = torch.Generator(dev).manual_seed(0)
    w = torch.empty(w_size, dtype=torch.bfloat16, device=dev)
    for n, k, wo, _, _ in rows:  # fresh random weights, scaled to keep the chain's values O(1)
        w[wo : wo + n * k] = (torch.randn(n * k, generator=gen, device=dev) / k**0.5).to(torch.bfloat16)
    a = torch.zeros(a_size, dtype=torch.bfloat16, device=dev)
    a[: QWEN3_LAYER[0][1]] = torch.randn(QWEN3_LAYER[0][1], generator=gen, device=dev).to(torch.bfloat16)
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    ref = reference(w, a, rows)
    num = len(rows)
    if args.smoke:
        got = a.clone()
        run_chain(w, got, meta, counter, num, 5, barrier=False, prefetch=False)
        err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        print(f"smoke: {num} GEMVs, max relative difference against torch {err:.2e}")
        assert err < 2e-2, err
        return
    from ostinato.layers.triton_ops.skinny_gemm import skinny_linear

    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    views = [(w[wo : wo + n * k].view(n, k), io, oo, n, k) for n, k, wo, io, oo in rows]

    def skinny() -> None:
        for wv, io, oo, n, k in views:
            skinny_linear(a[io : io + k].view(1, k), wv, out=a[oo : oo + n].view(1, n))

    bytes_ = w_size * 2
    report = {"device": torch.cuda.get_device_name(dev), "gemvs": num, "weight_MB": bytes_ / 1e6, "rows": []}
    a0 = a.clone()
    for name, fn in [("skinny", skinny)] + [
            (f"persistent{'+l2' if pf else ''}{' load-poll' if lp else ''} {p}/SM",
             lambda p=p, pf=pf, lp=lp: run_chain(w, a, meta, counter, num, p * sms, barrier=True, prefetch=pf,
                                                 load_poll=lp))
            for p in args.per_sm for pf in (False, True) for lp in (False, True)]:
        a.copy_(a0)
        fn()
        torch.cuda.synchronize()
        err = ((a.float() - ref.float()).abs().max() / ref.float().abs().max()).item()  # a barrier let through
        us = graph_us(fn)  # early (its spin cap) shows here
        row = dict(variant=name, us=us, us_per_gemv=us / num, TBps=bytes_ / us / 1e6, rel_err=err)
        report["rows"].append(row)
        print(f"{name:24} {us:9.1f} us  {us / num:6.2f} us/GEMV  {bytes_ / us / 1e6:5.2f} TB/s  err {err:.1e}",
              flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
