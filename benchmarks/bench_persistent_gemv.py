"""Experiment for #16 (bs-1 decode): can one persistent kernel, its GEMVs waiting on each other inside it, stream a
chain of weight GEMVs faster than one PDL launch a GEMV?

The chain is Qwen3-0.6B's four projections a layer at one row, 28 layers (881 MB of weights, each projection's
input the previous one's output cut to its K): qkv 4096 x 1024, o 1024 x 2048, gate_up 6144 x 1024 (ungated here),
down 1024 x 3072. Each way is captured in a CUDA graph; us for the chain, us per GEMV, the weights' TB/s, and the
output's difference from torch (a wait that let a program through early shows there):
- `skinny`: the engine's skinny_linear, one launch per GEMV, PDL on where the engine has it (run first and last);
- `launches`: the chain kernel below, one launch per GEMV without PDL;
- `none`: one launch of the chain kernel with no waiting at all. Its sums are wrong; its time is what the
  persistent form could reach if waiting cost nothing;
- `barrier`: one launch, a grid barrier after every GEMV (an atomic count; `load-poll` polls it with acquire
  loads instead of atomic adds of 0);
- `flags`: one launch, a count per BLOCK_K chunk of each GEMV's output, raised with release order by each row
  tile stored; a program starts a GEMV once the chunks it reads are full (_chain_kernel's SYNC 2);
- `tags`: one launch, the activations as int32 words carrying a per-launch tag, polled until tagged (SYNC 3);
- `+l2`: a program's first row tile of the next GEMV asked of L2 before it waits;
- `resident` (with --resident PER_SM x WARPS ...): one launch a GEMV under PDL, each program's whole W slice
  requested into registers before its wait, the next GEMV's programs let in before it too, a grid of at most
  PER_SM programs an SM (layers/triton_ops/resident_gemv.py; the engine's setting is its PER_SM, NUM_WARPS).
Tried at 6f56c7b and not kept (slower; docs/gpu-notes.md): loading a GEMV's first W chunks before its wait,
counting a program's tiles once a GEMV, programs that pull W into L2 ahead of the others, and a kernel streaming
W through a ring of registers across GEMVs.
All programs of a persistent launch must be resident at once. In Triton's interpreter programs run one after
another, so `--smoke` runs the waiting forms with one program (or a launch a GEMV) on a small chain against
torch.

python benchmarks/bench_persistent_gemv.py --syncs none flags   # H200 / H100
python benchmarks/bench_persistent_gemv.py --smoke               # CPU
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

# Triton's interpreter has no inline asm: there the polls are plain volatile loads (its programs run one after
# another, so nothing is polled for long)
ASM_POLLS = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")
QWEN3_LAYER = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]  # (N, K) of each projection
LLAMA_1B_LAYER = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]  # Llama-3.2-1B's (16 layers)
SMOKE_LAYER = [(512, 256), (256, 512), (768, 256), (256, 384)]  # the same pattern, small, for the interpreter


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
def _wait_chunks(Flags, row, chunks, target, max_spins, MAX_CHUNKS: tl.constexpr):
    """Spin until Flags[row, :chunks] all reach `target` (one vector poll a round trip, acquire order)."""
    offs_c = tl.arange(0, MAX_CHUNKS)
    mask = offs_c < chunks
    ptrs = Flags + row * MAX_CHUNKS + offs_c
    seen = tl.min(tl.where(mask, tl.atomic_add(ptrs, 0, mask=mask, sem="acquire", scope="gpu"), target), 0)
    spins = 0
    while (seen < target) & (spins < max_spins):  # capped: a grid too large to be resident fails, not hangs
        seen = tl.min(tl.where(mask, tl.atomic_add(ptrs, 0, mask=mask, sem="acquire", scope="gpu"), target), 0)
        spins += 1
    tl.debug_barrier()


@triton.jit
def _x_chunk(ptrs, TAGGED: tl.constexpr):
    """An input chunk as fp32, from bf16 values or (TAGGED) from tagged int32 words (SYNC 3 of _chain_kernel)."""
    x = tl.load(ptrs, cache_modifier=".cg")
    if TAGGED:
        x = (x & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def _load_relaxed(ptrs):
    """ld.relaxed.gpu at each address: a strong load (never hoisted, coherent at L2) without the L1 invalidation
    an acquire load brings."""
    return tl.inline_asm_elementwise("ld.relaxed.gpu.global.u32 $0, [$1];", "=r,l", [ptrs], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _poll_words(ptrs, ACQUIRE: tl.constexpr):
    """Tagged words for a poll: acquire or relaxed loads (inline asm), or in the interpreter volatile loads."""
    if ASM_POLLS:
        if ACQUIRE:
            return _load_acquire(ptrs)
        return _load_relaxed(ptrs)
    return tl.load(ptrs, volatile=True)


@triton.jit
def _all_tagged(words, tag):
    return tl.min((((words >> 16) & 0xFFFF) == tag).to(tl.int32), 0)


@triton.jit
def _wait_tagged(X, k, tag, max_spins, MAX_K: tl.constexpr, ACQUIRE: tl.constexpr):
    """Spin until the k words at X all carry `tag` (one vector load a round trip). The polls are strong loads in
    inline asm (acquire, or relaxed without ACQUIRE): a plain load of an address no store in the loop touches may
    be hoisted out of the loop, and the wait then never waits (the first form measured did exactly that). After
    relaxed polls the order of the later x loads rests on the CTA barrier of the poll's reduction and on those
    loads going to L2 (.cg), where the tagged words already are."""
    ptrs = X + tl.minimum(tl.arange(0, MAX_K), k - 1)  # unmasked: past k re-reads word k - 1
    ok = _all_tagged(_poll_words(ptrs, ACQUIRE), tag)
    spins = 0
    while (ok == 0) & (spins < max_spins):
        ok = _all_tagged(_poll_words(ptrs, ACQUIRE), tag)
        spins += 1


@triton.jit
def _chain_kernel(W, A, Meta, Counter, first, last, max_spins,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                  SYNC: tl.constexpr, PREFETCH: tl.constexpr, LOAD_POLL: tl.constexpr = False,
                  Flags=None, MAX_CHUNKS: tl.constexpr = 1, MAX_K: tl.constexpr = 1):
    """GEMVs `first` .. `last` - 1 of the chain. Meta[g] = (N, K, W offset, input offset, output offset) in
    elements of W / A; y_g = W_g @ A[in_g : in_g + K] written at A[out_g : out_g + N]. N % BLOCK_N == 0,
    K % BLOCK_K == 0, and the offsets multiples of 16.

    SYNC says how a GEMV waits for its input:
    - 0: not at all (a launch a GEMV, or in one launch the rate with wrong sums);
    - 1: a grid barrier after every GEMV;
    - 2: per-chunk counts. Each row tile stored adds 1 to Flags[g, its BLOCK_K chunk] (release), and a program
      starts GEMV g once the chunks of g - 1 it reads (K_g / BLOCK_K of them) are full (BLOCK_K / BLOCK_N tiles
      each). No program waits for rows it does not read, nor for programs with no tile in a GEMV, and the
      arrivals spread over many counters instead of one;
    - 3: tagged words. A holds int32 words (bf16 bits low, the writer's launch tag high; Counter is the launch
      count), and a program starts GEMV g once all K_g words of its input carry this launch's tag (a vector poll
      of up to MAX_K words a round trip; LOAD_POLL: acquire loads, else relaxed ones). A word is stored whole,
      so the writer needs no fence or count."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    tag = tl.load(Counter) % 65535 + 1 if SYNC == 3 else 0
    for g in range(first, last):
        # every size and offset a multiple of 16 elements (32 bytes): said, so the loads of the K loop can go through
        # the cp.async ring (an alignment the compiler cannot see costs the pipelining)
        n = tl.load(Meta + g * 5)
        k = tl.multiple_of(tl.load(Meta + g * 5 + 1), 16)
        w_off = tl.multiple_of(tl.load(Meta + g * 5 + 2), 16)
        in_off = tl.multiple_of(tl.load(Meta + g * 5 + 3), 16)
        out_off = tl.multiple_of(tl.load(Meta + g * 5 + 4), 16)
        if g > first:
            if pid < n // BLOCK_N:
                if SYNC == 2:
                    _wait_chunks(Flags, g - 1, k // BLOCK_K, BLOCK_K // BLOCK_N, max_spins, MAX_CHUNKS)
                if SYNC == 3:
                    _wait_tagged(A + in_off, k, tag, max_spins, MAX_K, LOAD_POLL)
        for t in range(pid, n // BLOCK_N, num_programs):
            rows = t * BLOCK_N + offs_n
            w_ptrs = W + w_off + rows.to(tl.int64)[:, None] * k + offs_k[None, :]
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            for k0 in tl.range(0, k, BLOCK_K, num_stages=NUM_STAGES):
                x = _x_chunk(A + in_off + k0 + offs_k, SYNC == 3)  # another program wrote it
                acc += tl.load(w_ptrs + k0).to(tl.float32) * x[None, :]
            if SYNC == 3:
                y = tl.sum(acc, 1).to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
                tl.store(A + out_off + rows, y | (tag << 16))
            else:
                tl.store(A + out_off + rows, tl.sum(acc, 1).to(A.dtype.element_ty))
            if SYNC == 2:  # every thread's stores of the tile before the count's release
                tl.debug_barrier()
                tl.atomic_add(Flags + g * MAX_CHUNKS + (t * BLOCK_N) // BLOCK_K, 1, sem="release", scope="gpu")
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
            if SYNC == 1:
                _grid_barrier(Counter, (g + 1 - first) * num_programs, max_spins, LOAD_POLL)


def chain_meta(layers: int, device: torch.device, shapes: list[tuple[int, int]] = QWEN3_LAYER,
               ) -> tuple[torch.Tensor, int, int, list[tuple[int, ...]]]:
    """Meta rows (N, K, W offset, in offset, out offset) for `layers` layers of `shapes`; W and A sizes."""
    rows, w, a = [], 0, 0
    in_off, a = 0, shapes[0][1]  # A starts with x0
    for _ in range(layers):
        for n, k in shapes:
            rows.append((n, k, w, in_off, a))
            w += n * k
            in_off, a = a, a + n
    return torch.tensor(rows, dtype=torch.int64, device=device).flatten(), w, a, rows


SYNCS = {"launches": 0, "none": 0, "barrier": 1, "flags": 2, "tags": 3}


def run_chain(w: torch.Tensor, a: torch.Tensor, meta: torch.Tensor, counter: torch.Tensor, num_gemvs: int,
              programs: int, sync: str, prefetch: bool, block_n: int = 8, block_k: int = 512,
              stages: int = 3, load_poll: bool = False, flags: torch.Tensor | None = None,
              num_warps: int = 4, max_k: int = 1) -> None:
    """The chain's GEMVs. sync "launches": a launch a GEMV (the interpreter's form, and the kernel's own rate without
    a persistent grid); "none": one launch, no waiting (wrong sums: the rate's upper bound); "barrier": one launch,
    a grid barrier after each GEMV; "flags": one launch, per-chunk counts in `flags` ([num_gemvs, chunks]); "tags":
    one launch, `a` holding tagged int32 words (to_words), `counter` the launch count, `max_k` >= every K."""
    consts = dict(BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=stages, LOAD_POLL=load_poll, num_warps=num_warps)
    if sync == "launches":
        for g in range(num_gemvs):
            _chain_kernel[(programs,)](w, a, meta, counter, g, g + 1, 0, SYNC=0, PREFETCH=False, **consts)
        return
    if sync == "barrier":
        counter.zero_()
    if sync == "flags":
        flags.zero_()
    if sync == "tags":
        counter.add_(1)
    _chain_kernel[(programs,)](w, a, meta, counter, 0, num_gemvs, 1 << 12, SYNC=SYNCS[sync], PREFETCH=prefetch,
                               Flags=flags, MAX_CHUNKS=flags.shape[1] if flags is not None else 1, MAX_K=max_k,
                               **consts)


def to_words(a: torch.Tensor) -> torch.Tensor:
    """bf16 values as int32 words with tag 0 (no launch's tag)."""
    return a.view(torch.int16).to(torch.int32) & 0xFFFF


def from_words(words: torch.Tensor) -> torch.Tensor:
    return (words & 0xFFFF).to(torch.int16).view(torch.bfloat16)


def random_chain(rows: list, w_size: int, a_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh random bf16 weights (scaled by 1 / sqrt(K) to keep the chain's values O(1)) and the activation buffer
    with a random x0 (the first GEMV's K values) and zeros after it."""
    gen = torch.Generator(device).manual_seed(0)
    w = torch.empty(w_size, dtype=torch.bfloat16, device=device)
    for n, k, wo, _, _ in rows:
        w[wo : wo + n * k] = (torch.randn(n * k, generator=gen, device=device) / k**0.5).to(torch.bfloat16)
    a = torch.zeros(a_size, dtype=torch.bfloat16, device=device)
    k0 = rows[0][1]
    a[:k0] = torch.randn(k0, generator=gen, device=device).to(torch.bfloat16)
    return w, a


def time_variants(variants: list, reset, output, ref: torch.Tensor, weight_bytes: int, num_gemvs: int,
                  out: str | None, extra: dict | None = None) -> None:
    """Run each (name, fn) once after `reset()` and compare `output(name)` with the chain's reference (a wait that
    let a program through early shows there), then time it as a replayed graph (one that never opens, its spin
    cap, shows there); print a line each and write the JSON report, with `extra`'s keys, to `out`."""
    report = {"device": torch.cuda.get_device_name(), "gemvs": num_gemvs, "weight_MB": weight_bytes / 1e6,
              **(extra or {}), "rows": []}
    for name, fn in variants:
        reset()
        fn()
        torch.cuda.synchronize()
        got = output(name)
        err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        us = graph_us(fn)
        report["rows"].append(dict(variant=name, us=us, us_per_gemv=us / num_gemvs, TBps=weight_bytes / us / 1e6,
                                   rel_err=err))
        print(f"{name:44} {us:9.1f} us  {us / num_gemvs:6.2f} us/GEMV  {weight_bytes / us / 1e6:5.2f} TB/s  "
              f"err {err:.1e}", flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)


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


def parse_tile(ap: argparse.ArgumentParser, spec: str, shapes: list[tuple[int, int]]) -> tuple[int, int, int, int]:
    """--tiles' "BLOCK_N x BLOCK_K x stages [x warps]" as ints, or an argparse error naming the limit broken: the
    chain kernel needs every N a multiple of BLOCK_N and every K of BLOCK_K, both powers of two."""
    try:
        bn, bk, st, *nw = (int(v) for v in spec.split("x"))
    except ValueError:
        ap.error(f"--tiles {spec!r}: expected BLOCK_N x BLOCK_K x stages [x warps], e.g. 8x512x3")
    if len(nw) > 1 or min(bn, bk, st, *nw) < 1 or bn & (bn - 1) or bk & (bk - 1):
        ap.error(f"--tiles {spec!r}: four positive numbers at most, BLOCK_N and BLOCK_K powers of two")
    if any(n % bn or k % bk for n, k in shapes):
        ap.error(f"--tiles {spec!r}: every N {[n for n, _ in shapes]} must be a multiple of BLOCK_N and every K "
                 f"{[k for _, k in shapes]} of BLOCK_K")
    return bn, bk, st, nw[0] if nw else 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=28, help="Qwen3-0.6B layers in the chain (4 GEMVs each)")
    ap.add_argument("--per-sm", type=int, nargs="*", default=[2, 4],
                    help="persistent programs an SM, one pass each (all must be resident at once)")
    ap.add_argument("--programs", type=int, nargs="*", default=[],
                    help="persistent grids of this many programs, besides --per-sm's")
    ap.add_argument("--syncs", nargs="+", default=["none", "flags"], choices=list(SYNCS),
                    help="how the chain kernel's GEMVs wait for their input (run_chain)")
    ap.add_argument("--tiles", nargs="+", default=["8x512x3"],
                    help="BLOCK_N x BLOCK_K x stages [x warps] of the chain kernel")
    ap.add_argument("--prefetch", type=int, nargs="+", default=[0, 1],
                    help="0 / 1: without / with the L2 prefetch of the next GEMV's first tile")
    ap.add_argument("--load-poll", action="store_true",
                    help="also the barrier polled by acquire loads, and the tags by acquire (not relaxed) loads")
    ap.add_argument("--resident", nargs="*", default=[],
                    help="resident GEMV settings, 'PER_SM x WARPS' each (e.g. 4x4)")
    ap.add_argument("--smoke", action="store_true", help="CPU: one small layer in Triton's interpreter against torch")
    ap.add_argument("--out", default=None, help="JSON path for the figures (none written without it)")
    args = ap.parse_args()
    dev = torch.device("cpu" if args.smoke else "cuda")
    layers = 1 if args.smoke else args.layers
    shapes = SMOKE_LAYER if args.smoke else QWEN3_LAYER
    tiles = [] if args.smoke else [parse_tile(ap, t, shapes) for t in args.tiles]  # the smoke has its own
    meta, w_size, a_size, rows = chain_meta(layers, dev, shapes)
    w, a = random_chain(rows, w_size, a_size, dev)
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    ref = reference(w, a, rows)
    num = len(rows)
    max_k = triton.next_power_of_2(max(k for _, k, *_ in rows))

    def flags_for(block_k: int) -> torch.Tensor:
        return torch.zeros(num, triton.next_power_of_2(max(n for n, *_ in rows) // block_k), dtype=torch.int32,
                           device=dev)

    def rel_err(got: torch.Tensor) -> float:
        return ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()

    if args.smoke:  # the interpreter runs programs one after another: the waiting forms with one program only
        for sync, programs, (bn, bk) in [("launches", 5, (8, 128)), ("flags", 1, (8, 128)), ("flags", 1, (4, 64)),
                                         ("tags", 1, (8, 64))]:
            got, flags = (to_words(a) if sync == "tags" else a.clone()), flags_for(bk)
            run_chain(w, got, meta, counter, num, programs, sync, prefetch=False, block_n=bn, block_k=bk,
                      flags=flags, max_k=max_k)
            if sync == "flags":  # every chunk of every output counted full, and no count past its chunk's tiles
                for g, (n, *_) in enumerate(rows):
                    assert (flags[g, : n // bk] == bk // bn).all() and not flags[g, n // bk :].any(), flags[g]
            if sync == "tags":  # every output stored with the launch's tag
                assert (((got[shapes[0][1] :] >> 16) & 0xFFFF) == counter.item() % 65535 + 1).all()
                got = from_words(got)
            err = rel_err(got)
            print(f"smoke {sync} {programs} programs {bn}x{bk}: {num} GEMVs, max relative difference against torch "
                  f"{err:.2e}")
            assert err < 2e-2, err
        return
    from ostinato.layers.triton_ops import resident_gemv
    from ostinato.layers.triton_ops.skinny_gemm import skinny_linear

    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    views = [(w[wo : wo + n * k].view(n, k), io, oo, n, k) for n, k, wo, io, oo in rows]

    def skinny() -> None:
        for wv, io, oo, n, k in views:
            skinny_linear(a[io : io + k].view(1, k), wv, out=a[oo : oo + n].view(1, n))

    grids = [p * sms for p in args.per_sm] + args.programs
    words = to_words(a)
    variants = [("skinny", skinny)]
    for tile, (bn, bk, st, nw) in zip(args.tiles, tiles, strict=True):
        cfg = dict(block_n=bn, block_k=bk, stages=st, num_warps=nw, flags=flags_for(bk))
        for sync in args.syncs:
            for programs in (grids if sync != "launches" else [0]):
                for pf in (args.prefetch if sync in ("barrier", "flags", "tags") else [0]):
                    for lp in ((False, True) if sync in ("barrier", "tags") and args.load_poll else (False,)):
                        p = programs or max(n for n, *_ in rows) // bn  # launches: a program a row tile
                        name = f"{sync}{'+l2' if pf else ''}{' load-poll' if lp else ''} {tile} {p} programs"
                        variants.append((name, lambda p=p, sync=sync, pf=pf, lp=lp, cfg=cfg: run_chain(
                            w, words if sync == "tags" else a, meta, counter, num, p, sync, prefetch=bool(pf),
                            load_poll=lp, max_k=max_k, **cfg)))
    for spec in args.resident:
        per_sm, warps = (int(v) for v in spec.split("x"))
        cfgs = [resident_gemv.config_for(n, k, 2, sms, per_sm=per_sm, num_warps=warps) for _, _, _, n, k in views]
        if None in cfgs:
            ap.error(f"--resident {spec}: a slice does not fit resident_gemv.RESIDENT_BYTES a thread")

        def resident(cfgs=cfgs) -> None:
            for (wv, io, oo, n, k), cfg in zip(views, cfgs, strict=True):
                resident_gemv.launch(a[io : io + k].view(1, k), wv, a[oo : oo + n].view(1, n), cfg)

        variants.append((f"resident {spec}", resident))
    variants.append(("skinny (again)", skinny))
    a0 = a.clone()

    def reset() -> None:
        a.copy_(a0)
        words.copy_(to_words(a0))

    time_variants(variants, reset, lambda name: from_words(words) if name.startswith("tags") else a, ref,
                  w_size * 2, num, args.out)


if __name__ == "__main__":
    main()
