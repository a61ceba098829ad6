"""Experiment for #16 (bs-1 decode): a model's chain of one-row GEMVs (Qwen3-0.6B's 112 projections, 881 MB, or
Llama-3.2-1B's 64, 1.95 GB) in one persistent Gluon kernel whose weight reads never wait for an activation.

Every Triton form of the chain before (bench_persistent_gemv.py, docs/gpu-notes.md's twenty-second session) loads W
in the same warps that wait for x: while a program waits for the GEMV before to finish, it asks HBM for nothing.
Here each program is warp-specialized with Gluon (Triton's lower-level dialect, in the GPU machines' Triton 3.6):
- a loader warp walks the program's share of every GEMV's weight tiles in chain order and copies them by TMA into a
  ring of shared-memory slots (a slot: GROUP consecutive K tiles of a row tile, one box), waiting only for a free
  slot, so it runs ahead across GEMV boundaries;
- four compute warps take slots from the ring. Before a GEMV's first tile they wait until every row tile of the
  GEMV before is stored (a count a GEMV, raised with release order once by each program, or after each row tile),
  read x once into shared memory in one load, multiply, store their rows of y and raise the count.
So HBM keeps streaming W while the compute warps wait; what a wait costs is what the ring cannot cover.

What it showed on an H200 (docs/gpu-notes.md, thirty-eighth session): the ring alone streams at the copy rate, and
the chain is correct, but every GEMV boundary costs about 2 us on the critical path (the releasing program's fence
under the weight stream, the count seen, x's round trip), and a program's share of a GEMV then takes the compute
warps longer than its bytes take HBM; so the chain ran 35% (Qwen3-0.6B) and 6% (Llama-3.2-1B) slower than the
engine's one launch a GEMV. `--modes` isolates the parts: `drain` (the ring alone), `compute` (the compute warps
alone), `no wait`, `tags` (waits on tagged data in place of counts), and `--trace` times each program's phases.

Weights are re-laid out once as [BLOCK_N, BLOCK_K] tiles, each contiguous, so one 2-D tensor descriptor covers the
whole chain (a tile is rows t * BLOCK_N .. of the [tiles * BLOCK_N, BLOCK_K] view). Row tiles are dealt to programs
round-robin in chain order, so a program with no tile in a small GEMV (o, down) loads its next one early. Every
program must be resident at once (the waits spin, capped: a grid that is not shows as wrong sums), so the grid is a
few programs an SM.

Gluon's API moves from release to release: this is written for Triton 3.6, the GPU machines' version (the CPU
venv's newer Triton does not compile it; `pip install --no-deps --target /tmp/t36 triton==3.6.0` and put /tmp/t36
first on PYTHONPATH for --compile-only).

python benchmarks/bench_gluon_gemv_chain.py --compile-only   # CPU: sm_90 registers and shared memory (ptxas -v)
timeout 120 python benchmarks/bench_gluon_gemv_chain.py --layers 1 --per-sm 1   # GPU, first after a change to the
                                                                # ring: a wrong phase hangs (mbarrier waits have no cap)
python benchmarks/bench_gluon_gemv_chain.py --tiles 16x256x6x4 --modes chain "no wait" --release gemv --trace \
    --out FILE                                               # GPU: us for the chain beside the engine's GEMVs
                                                             # (run first and last), and where its time goes
"""

import argparse

import torch
import triton
from bench_persistent_gemv import (
    LLAMA_1B_LAYER,
    QWEN3_LAYER,
    chain_meta,
    parse_tile,
    random_chain,
    reference,
    time_variants,
)
from kernel_regs import ptxas_stats
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# a GEMV's row in the plan: row tiles, K tiles, first tile, input offset, output offset, order (plan_for)
PLAN_COLS = gl.constexpr(6)
TRACE_POINTS = gl.constexpr(6)  # time stamps a program and GEMV (trace_report)
# the chain's projections (N, K) a layer, and the layers, by model
LAYERS = {"qwen3-0.6b": (QWEN3_LAYER, 28), "llama-3.2-1b": (LLAMA_1B_LAYER, 16)}
# the compute warps' modes (_compute)
CHAIN, NO_WAIT, DRAIN, TAGS, COMPUTE = (gl.constexpr(m) for m in range(5))
MODES = {"chain": 0, "no wait": 1, "drain": 2, "tags": 3, "compute": 4}


@gluon.jit
def _first_row(pid, order, num_programs):
    """The first row tile of a GEMV this program takes, then every num_programs-th (first_row is its CPU twin):
    row tile r of a GEMV whose tiles start at `order` in the chain goes to program (order + r) % num_programs."""
    return (pid - order % num_programs + num_programs) % num_programs


@gluon.jit
def _plan_row(Plan, g):
    """GEMV g's plan row (plan_for): row tiles, K tiles, first tile, input offset, output offset, order."""
    row = Plan + g * PLAN_COLS
    return (gl.load(row), gl.load(row + 1), gl.load(row + 2), gl.load(row + 3), gl.load(row + 4),
            gl.load(row + 5))


@gluon.jit
def _loader(w_desc, bufs, ready, empty, Plan, Trace, num_gemvs, pid, num_programs,
            BLOCK_N: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr, MODE: gl.constexpr,
            TRACE: gl.constexpr):
    """The loader warp: this program's tiles of every GEMV, in the order the compute warps take them, GROUP K tiles
    of a row tile (contiguous in the tiled weights: one TMA box) into the next ring slot once the compute warps have
    released it (a slot's first use waits on nothing). In COMPUTE mode it loads nothing."""
    i = 0
    for g in range(num_gemvs if MODE != COMPUTE else 0):
        rows, k_tiles, first, _, _, order = _plan_row(Plan, g)
        start = _first_row(pid, order, num_programs)
        if start < rows:
            _stamp(Trace, pid, g, num_gemvs, 4, TRACE)
        for r in range(start, rows, num_programs):
            for c in range(0, k_tiles, GROUP):
                s = i % STAGES
                mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s), w_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(w_desc, [(first + r * k_tiles + c) * BLOCK_N, 0], ready.index(s),
                                                bufs.index(s))
                i += 1
        if start < rows:
            _stamp(Trace, pid, g, num_gemvs, 5, TRACE)


@gluon.jit
def _wait_count(Count, target, max_spins):
    """Spin until Count reaches target (acquire order); capped, so a grid that is not all resident fails, not hangs."""
    seen = gl.atomic_add(Count, 0, sem="acquire", scope="gpu")
    spins = 0
    while (seen < target) & (spins < max_spins):
        seen = gl.atomic_add(Count, 0, sem="acquire", scope="gpu")
        spins += 1


@gluon.jit
def _now():
    """The GPU's nanosecond clock (%globaltimer), the same on every SM."""
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def _stamp(Trace, pid, g, num_gemvs, j, TRACE: gl.constexpr):
    """With TRACE, time j of this program's GEMV g into Trace[pid, g, j] (trace_report says what each j is)."""
    if TRACE:
        gl.store(Trace + (pid * num_gemvs + g) * TRACE_POINTS + j, _now())


@gluon.jit
def _poll_tagged(ptrs, mask, tag, max_spins):
    """x from tagged words (the bf16's bits low, the writing run's tag high), read again until every word carries
    this run's tag: the data is its own flag, so its writers need no fence and no count."""
    words = gl.load(ptrs, mask=mask, other=tag << 16, volatile=True)
    spins = 0
    while (gl.sum((((words >> 16) & 0xFFFF) != tag).to(gl.int32)) > 0) & (spins < max_spins):
        words = gl.load(ptrs, mask=mask, other=tag << 16, volatile=True)
        spins += 1
    return (words & 0xFFFF).to(gl.int16).to(gl.bfloat16, bitcast=True)


@gluon.jit
def _compute(A, A32, Epoch, Plan, Counts, Trace, slots, ready, empty, x_groups, x_whole, num_gemvs, pid,
             num_programs, max_spins, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
             GROUP: gl.constexpr, X_CHUNKS: gl.constexpr, MODE: gl.constexpr, RELEASE_EACH_TILE: gl.constexpr,
             TRACE: gl.constexpr):
    """The compute warps: y_g[rows of a tile] = W_g[those rows] @ x_g, x_g the output of GEMV g - 1 (or the chain's
    input), for this program's row tiles of each GEMV in turn, GROUP K tiles (one ring slot) at a time: one wait,
    one load and one release a slot (on the H200 slots of 1, 2 or 4 tiles timed the same).
    MODE: CHAIN waits for x; NO_WAIT does not (wrong sums: the rate when waiting is free); DRAIN only takes slots
    from the ring and frees them (the ring's own rate); COMPUTE reads the slots as they are, with no loads into them
    and no waits (wrong sums: the compute warps' own rate); TAGS keeps GEMV outputs in A32 as tagged words
    (_poll_tagged), the run's tag being Epoch + 1, which program 0 stores when done (every program has read it by
    then: all are resident, and program 0's last GEMVs wait on every program's first). In CHAIN the count of GEMV g
    is raised after each stored row tile (RELEASE_EACH_TILE) or once, by the program's row tiles, after its last:
    a release costs a memory fence."""
    # a slot as [GROUP, BLOCK_N, BLOCK_K]: each thread holds its (row, columns) of every K tile of the group, so the
    # sum over the group stays in the thread; a warp spans min(32, BLOCK_K / 8) lanes of 8 columns along K
    lanes_k: gl.constexpr = 32 if BLOCK_K >= 256 else BLOCK_K // 8
    slot_layout: gl.constexpr = gl.BlockedLayout([GROUP, 1, 8], [1, 32 // lanes_k, lanes_k],
                                                 [1, gl.num_warps(), 1], [2, 1, 0])
    acc_layout: gl.constexpr = gl.SliceLayout(0, slot_layout)
    x_layout: gl.constexpr = gl.SliceLayout(1, slot_layout)
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    offs_n = gl.arange(0, BLOCK_N, row_layout)
    whole_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // lanes_k, lanes_k], [gl.num_warps(), 1], [1, 0])
    offs_chunk = gl.arange(0, X_CHUNKS, gl.SliceLayout(1, whole_layout))
    offs_k = gl.arange(0, BLOCK_K, gl.SliceLayout(0, whole_layout))
    epoch = gl.load(Epoch)
    tag = (epoch + 1) & 0xFFFF
    i = 0
    prev_rows = 0
    for g in range(num_gemvs):
        rows, k_tiles, _, in_off, out_off, order = _plan_row(Plan, g)
        in_off = gl.multiple_of(in_off, 16)  # activation offsets are multiples of 1024: x loads as 16-byte words
        out_off = gl.multiple_of(out_off, 16)
        start = _first_row(pid, order, num_programs)
        if MODE == DRAIN:
            for _ in range(gl.maximum(rows - start + num_programs - 1, 0) // num_programs * (k_tiles // GROUP)):
                s = i % STAGES
                mbarrier.wait(ready.index(s), (i // STAGES) & 1)
                mbarrier.arrive(empty.index(s), count=1)
                i += 1
        elif start < rows:
            _stamp(Trace, pid, g, num_gemvs, 0, TRACE)
            if MODE == CHAIN and g > 0:  # every row tile of GEMV g - 1 stored: x is whole
                _wait_count(Counts + g - 1, prev_rows, max_spins)
            _stamp(Trace, pid, g, num_gemvs, 1, TRACE)
            # x once into shared memory, in one load (one L2 round trip; .cg: other SMs wrote it)
            x_offs = in_off + gl.expand_dims(offs_chunk, 1) * BLOCK_K + gl.expand_dims(offs_k, 0)
            x_mask = gl.expand_dims(offs_chunk, 1) < k_tiles
            if MODE == TAGS and g > 0:
                x_all = _poll_tagged(A32 + x_offs, x_mask, tag, max_spins)
            else:
                x_all = gl.load(A + x_offs, mask=x_mask, cache_modifier=".cg")
            x_whole.store(x_all)
            gl.thread_barrier()
            _stamp(Trace, pid, g, num_gemvs, 2, TRACE)
            for r in range(start, rows, num_programs):
                acc = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, acc_layout)
                for c in range(0, k_tiles, GROUP):
                    s = i % STAGES
                    if MODE != COMPUTE:
                        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
                    w = slots.index(s).load(slot_layout)
                    if MODE != COMPUTE:
                        mbarrier.arrive(empty.index(s), count=1)
                    x = x_groups.index(c // GROUP).load(x_layout)
                    acc += gl.sum(w.to(gl.float32) * gl.expand_dims(x.to(gl.float32), 1), axis=0)
                    i += 1
                y = gl.sum(acc, axis=1).to(A.dtype.element_ty)
                if MODE == TAGS:
                    gl.store(A32 + out_off + r * BLOCK_N + offs_n,
                             (y.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF) | (tag << 16))
                else:
                    gl.store(A + out_off + r * BLOCK_N + offs_n, y)
                if RELEASE_EACH_TILE and MODE != TAGS:
                    gl.thread_barrier()  # every warp's stores of the tile before the count's release
                    gl.atomic_add(Counts + g, 1, sem="release", scope="gpu")
            gl.thread_barrier()  # (and x is rewritten for the next GEMV only once every warp has read it)
            _stamp(Trace, pid, g, num_gemvs, 3, TRACE)
            if not RELEASE_EACH_TILE and MODE != TAGS:
                gl.atomic_add(Counts + g, (rows - start + num_programs - 1) // num_programs, sem="release",
                              scope="gpu")
        prev_rows = rows
    if MODE == TAGS and pid == 0:
        gl.store(Epoch, epoch + 1)


@gluon.jit
def _chain_kernel(w_desc, A, A32, Epoch, Plan, Counts, Trace, num_gemvs, max_spins, BLOCK_N: gl.constexpr,
                  BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr, X_CHUNKS: gl.constexpr,
                  LOADER_REGS: gl.constexpr, MODE: gl.constexpr = 0, RELEASE_EACH_TILE: gl.constexpr = False,
                  TRACE: gl.constexpr = False):
    pid = gl.program_id(0)
    num_programs = gl.num_programs(0)
    # ring slots of GROUP K tiles ([GROUP * BLOCK_N, BLOCK_K], the TMA box); the compute warps read a slot through
    # a [GROUP, BLOCK_N, BLOCK_K] view of the same bytes (unswizzled rows: row-major, as TMA writes them)
    bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, GROUP * BLOCK_N, BLOCK_K], w_desc.layout)
    slots = bufs._reinterpret(w_desc.dtype, [STAGES, GROUP, BLOCK_N, BLOCK_K],
                              gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0]))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    # x in shared memory: stored whole ([X_CHUNKS, BLOCK_K]), read a slot's GROUP chunks at a time
    x_whole = gl.allocate_shared_memory(w_desc.dtype, [X_CHUNKS, BLOCK_K],
                                        gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    x_groups = x_whole._reinterpret(w_desc.dtype, [X_CHUNKS // GROUP, GROUP, BLOCK_K],
                                    gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    gl.warp_specialize([
        (_compute, (A, A32, Epoch, Plan, Counts, Trace, slots, ready, empty, x_groups, x_whole, num_gemvs, pid,
                    num_programs, max_spins, BLOCK_N, BLOCK_K, STAGES, GROUP, X_CHUNKS, MODE, RELEASE_EACH_TILE,
                    TRACE)),
        (_loader, (w_desc, bufs, ready, empty, Plan, Trace, num_gemvs, pid, num_programs, BLOCK_N, STAGES, GROUP,
                   MODE, TRACE)),
    ], [1], [LOADER_REGS])
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))


def tile_layout() -> gl.NVMMASharedLayout:
    """The ring slots' layout: unswizzled rows (the compute warps read slots as plain row-major bytes)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)


def tiled_weights(w: torch.Tensor, rows: list[tuple[int, ...]], block_n: int, block_k: int) -> torch.Tensor:
    """The chain's flat W with each GEMV's [N, K] block re-laid out as [N / BLOCK_N, K / BLOCK_K] tiles of
    [BLOCK_N, BLOCK_K], row-major, each tile contiguous; GEMV g's tiles start at its W offset."""
    out = torch.empty_like(w)
    for n, k, wo, _, _ in rows:
        if n % block_n:
            raise ValueError(f"N = {n} must be a multiple of BLOCK_N {block_n}")
        if k % block_k:
            raise ValueError(f"K = {k} must be a multiple of BLOCK_K {block_k}")
        tiles = w[wo : wo + n * k].view(n // block_n, block_n, k // block_k, block_k).permute(0, 2, 1, 3)
        out[wo : wo + n * k] = tiles.reshape(-1)
    return out


def plan_for(rows: list[tuple[int, ...]], block_n: int, block_k: int, device: torch.device) -> torch.Tensor:
    """Plan rows (row tiles, K tiles, first tile, input offset, output offset, order), int32: `order` is the number
    of row tiles of the GEMVs before, so row tile r of GEMV g goes to program (order + r) % programs."""
    plan, order = [], 0
    for n, k, wo, io, oo in rows:
        assert n % block_n == 0 and k % block_k == 0 and wo % (block_n * block_k) == 0, (n, k, wo)
        plan.append((n // block_n, k // block_k, wo // (block_n * block_k), io, oo, order))
        order += n // block_n
    return torch.tensor(plan, dtype=torch.int32, device=device).flatten()


def first_row(pid: int, order: int, programs: int) -> int:
    """_first_row on the CPU."""
    return (pid - order % programs + programs) % programs


def slot_schedule(plan: torch.Tensor, programs: int, group: int) -> list[list[tuple[int, int, int, int]]]:
    """Each program's ring slots in the order its loader copies them and its compute warps take them (both walk the
    plan the same way): (GEMV, row tile, first K tile, descriptor row of the box), a box being `group` consecutive
    tiles. The kernels' index math, for checking on a CPU."""
    rows = plan.view(-1, PLAN_COLS.value).tolist()
    return [[(g, r, c, first + r * k_tiles + c)
             for g, (n_tiles, k_tiles, first, _, _, order) in enumerate(rows)
             for r in range(first_row(pid, order, programs), n_tiles, programs)
             for c in range(0, k_tiles, group)] for pid in range(programs)]


def tile_schedule(plan: torch.Tensor, programs: int) -> list[list[tuple[int, int, int, int]]]:
    """Each program's (GEMV, row tile, K tile, descriptor row), one tile a slot."""
    return slot_schedule(plan, programs, 1)


def trace_report(trace: torch.Tensor) -> dict:
    """Where a chain's time goes, from TRACE's stamps ([programs, GEMVs, TRACE_POINTS] ns; 0 where a program has no
    tile of a GEMV). The compute warps stamp their start (0), past the wait (1), x stored (2) and tiles stored (3);
    the loader its first box's turn (4, before waiting for the slot) and its last box issued (5). In us averaged
    over GEMVs 1..: `period` from the last program done with GEMV g - 1 to the last done with g; `notice` from that
    last one to the first / last program past its wait (the release seen); `x` the x load; `tiles` a program's share
    of tiles after x, mean and slowest; `loader_ahead` how long before a program's tiles began its loader had issued
    every box of them (negative: it was still issuing), and `loader_span` from its first box's turn to its last."""
    t = trace.double() / 1e3
    has = t[:, :, 0] > 0
    big = torch.tensor(float("inf"), dtype=t.dtype)
    last_done = torch.where(has, t[:, :, 3], -big).amax(0)
    first_past = torch.where(has, t[:, :, 1], big).amin(0)
    last_past = torch.where(has, t[:, :, 1], -big).amax(0)

    def mean(v: torch.Tensor) -> float:
        return round(v[1:].mean().item(), 3)

    def mean_has(v: torch.Tensor) -> torch.Tensor:  # over the programs with tiles, a GEMV each
        return torch.where(has, v, 0).sum(0) / has.sum(0)

    return dict(period=mean(last_done.diff(prepend=last_done[:1])),
                notice_first=mean(first_past - last_done.roll(1)), notice_last=mean(last_past - last_done.roll(1)),
                x=mean(mean_has(t[:, :, 2] - t[:, :, 1])), tiles=mean(mean_has(t[:, :, 3] - t[:, :, 2])),
                tiles_slowest=mean(torch.where(has, t[:, :, 3] - t[:, :, 2], -big).amax(0)),
                loader_ahead=mean(mean_has(t[:, :, 2] - t[:, :, 5])),
                loader_span=mean(mean_has(t[:, :, 5] - t[:, :, 4])))


def tagged(x: torch.Tensor, tag: int) -> torch.Tensor:
    """bf16 values as the TAGS kernel stores them: int32 words, the bf16's bits low and the tag high."""
    return (x.view(torch.int16).to(torch.int32) & 0xFFFF) | (tag << 16)


def untagged(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(bf16 values, tags) of tagged words, as _poll_tagged reads them."""
    return (words & 0xFFFF).to(torch.int16).view(torch.bfloat16), (words >> 16) & 0xFFFF


def emulate_chain(w_tiled: torch.Tensor, plan: torch.Tensor, a: torch.Tensor, programs: int, block_n: int,
                  block_k: int) -> torch.Tensor:
    """The chain computed as the kernel computes it, from the tiles of `tile_schedule` read through the
    descriptor's [tiles * BLOCK_N, BLOCK_K] view (fp32 sums, each tile's rows stored in a's dtype), GEMV by GEMV."""
    a = a.clone()
    view = w_tiled.view(-1, block_k)
    plan_rows = plan.view(-1, PLAN_COLS.value).tolist()
    schedule = tile_schedule(plan, programs)
    for g, (_, k_tiles, _, in_off, out_off, _) in enumerate(plan_rows):
        x = a[in_off : in_off + k_tiles * block_k].float().view(k_tiles, block_k)
        for seq in schedule:
            acc: dict[int, torch.Tensor] = {}
            for gg, r, c, tile in seq:
                if gg == g:
                    w = view[tile * block_n : (tile + 1) * block_n].float()
                    acc[r] = acc.get(r, torch.zeros(block_n)) + w @ x[c]
            for r, y in acc.items():
                a[out_off + r * block_n : out_off + (r + 1) * block_n] = y.to(a.dtype)
    return a


def descriptor(w_tiled: torch.Tensor, block_n: int, block_k: int, group: int = 1) -> TensorDescriptor:
    """The tiled weights as [tiles * BLOCK_N, BLOCK_K] rows, in boxes of `group` consecutive tiles."""
    view = w_tiled.view(-1, block_k)
    return TensorDescriptor(view, list(view.shape), list(view.stride()), [group * block_n, block_k], tile_layout())


def settings(block_n: int, block_k: int, stages: int, group: int, max_k: int, loader_regs: int = 32) -> dict:
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, GROUP=group,
                X_CHUNKS=max(group, triton.next_power_of_2(max_k // block_k)), LOADER_REGS=loader_regs)


def compile_sm90(block_n: int, block_k: int, stages: int, group: int, max_k: int, maxnreg: int,
                 num_warps: int = 4, mode: str = "chain", trace: bool = False) -> dict:
    """Compile for sm_90 without a GPU; ptxas -v's registers, and the kernel's shared memory."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    fake = torch.empty(1024, block_k, dtype=torch.bfloat16)
    consts = dict(settings(block_n, block_k, stages, group, max_k), MODE=MODES[mode], RELEASE_EACH_TILE=False,
                  TRACE=trace)
    sig = {"w_desc": mangle_type(descriptor(fake, block_n, block_k, group)), "A": "*bf16", "A32": "*i32",
           "Epoch": "*i32", "Plan": "*i32",
           "Counts": "*i32", "Trace": "*i64", "num_gemvs": "i32", "max_spins": "i32",
           **{k: "constexpr" for k in consts}}
    names = list(sig)
    src = GluonASTSource(_chain_kernel, sig, {(names.index(k),): v for k, v in consts.items()})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, maxnreg=maxnreg))
    return dict(ptxas_stats(k.asm["ptx"]), smem=k.metadata.shared, tma="cp.async.bulk.tensor" in k.asm["ptx"])


def chain_setup(layers: int, shapes: list[tuple[int, int]]) -> tuple:
    """A chain of `layers` layers of `shapes` on the GPU: (meta rows, random weights, their element count, the
    activation buffer with its x0, a copy of it, the float32 reference, the SM count, each GEMV's (W [N, K] view,
    in offset, out offset, N, K), and the engine's one-row GEMVs over it as a function)."""
    from ostinato.layers.triton_ops.skinny_gemm import skinny_linear

    dev = torch.device("cuda")
    _, w_size, a_size, rows = chain_meta(layers, dev, shapes)
    w, a = random_chain(rows, w_size, a_size, dev)
    ref, a0 = reference(w, a, rows), a.clone()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    views = [(w[wo : wo + n * k].view(n, k), io, oo, n, k) for n, k, wo, io, oo in rows]

    def engine() -> None:  # the engine's one-row GEMVs: skinny_linear takes resident_gemv where the shape fits
        for wv, io, oo, n, k in views:
            skinny_linear(a[io : io + k].view(1, k), wv, out=a[oo : oo + n].view(1, n))

    return rows, w, w_size, a, a0, ref, sms, views, engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=list(LAYERS), default="qwen3-0.6b", help="whose projections make the chain")
    ap.add_argument("--layers", type=int, default=None, help="layers in the chain (default: the model's)")
    ap.add_argument("--per-sm", type=int, nargs="+", default=[1, 2], help="persistent programs an SM, a pass each")
    ap.add_argument("--tiles", nargs="+", default=["16x256x6x4"],
                    help="BLOCK_N x BLOCK_K x ring slots [x K tiles a slot, a power of two (default 1)]")
    ap.add_argument("--maxnreg", type=int, default=128,
                    help="registers a thread (the compute warps get what the loader leaves): 2 programs an SM at 128")
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                    help="chain: the real chain; tags: waits on tagged data; no wait: no waits (wrong sums); drain: "
                    "the ring alone; compute: the compute warps alone, on whatever the ring holds")
    ap.add_argument("--release", nargs="+", choices=["gemv", "tile"], default=["gemv", "tile"],
                    help="raise a GEMV's count once a program (gemv) or after each row tile (tile)")
    ap.add_argument("--warps", type=int, nargs="+", default=[4], help="compute warps a program, a pass each")
    ap.add_argument("--trace", action="store_true",
                    help="run each chain-mode variant once more with time stamps and report where its time goes")
    ap.add_argument("--compile-only", action="store_true", help="CPU: compile each --tiles for sm_90 and report")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    counts_given = {"layers": [] if args.layers is None else [args.layers], "per-sm": args.per_sm,
                    "warps": args.warps, "maxnreg": [args.maxnreg]}
    for flag, values in counts_given.items():
        if any(v < 1 for v in values):
            ap.error(f"--{flag} must be >= 1, got {' '.join(map(str, values))}")
    shapes, model_layers = LAYERS[args.model]
    layers = model_layers if args.layers is None else args.layers
    tiles = []
    for spec in args.tiles:
        bn, bk, st, group = parse_tile(ap, spec, shapes)  # (its 4th field is warps there, K tiles a slot here)
        group = group if spec.count("x") == 3 else 1
        if group & (group - 1) or any(k // bk % group for _, k in shapes):
            ap.error(f"--tiles {spec!r}: K tiles a slot must be a power of two that divides every K / BLOCK_K")
        if bn * group > 256 or bk > 256:
            ap.error(f"--tiles {spec!r}: a TMA box (BLOCK_N * K tiles a slot, BLOCK_K) is at most 256 a side")
        tiles.append((bn, bk, st, group))
    max_k = max(k for _, k in shapes)
    if args.compile_only:
        for bn, bk, st, group in tiles:
            for mode in args.modes:
                stats = compile_sm90(bn, bk, st, group, max_k, args.maxnreg, mode=mode)
                print(f"{bn}x{bk}x{st}x{group} {mode}: {stats}", flush=True)
        return
    rows, w, w_size, a, a0, ref, sms, _, engine = chain_setup(layers, shapes)
    dev = a.device
    variants = [("engine (skinny_linear)", engine)]
    counts = torch.zeros(len(rows), dtype=torch.int32, device=dev)
    a32, epoch = torch.zeros(a.numel(), dtype=torch.int32, device=dev), torch.zeros(1, dtype=torch.int32, device=dev)
    no_trace = torch.zeros(1, dtype=torch.int64, device=dev)
    traces: dict[str, dict] = {}

    def launch(desc, plan, programs: int, cfg: dict, mode: str, release: str, warps: int, stamps=no_trace) -> None:
        counts.zero_()
        _chain_kernel[(programs,)](desc, a, a32, epoch, plan, counts, stamps, len(rows), 1 << 14, **cfg,
                                   MODE=MODES[mode], RELEASE_EACH_TILE=release == "tile", TRACE=stamps is not no_trace,
                                   num_warps=warps, maxnreg=args.maxnreg)

    def output(name: str) -> torch.Tensor:  # tags keep the GEMVs' outputs in a32 (x0 stays in a)
        if "tags" not in name:
            return a
        return torch.cat([a[: rows[0][1]], untagged(a32[rows[0][1] :])[0]])

    for bn, bk, st, group in tiles:
        w_tiled, plan = tiled_weights(w, rows, bn, bk), plan_for(rows, bn, bk, dev)
        desc = descriptor(w_tiled, bn, bk, group)
        cfg = settings(bn, bk, st, group, max_k)
        for per_sm, warps in [(p, nw) for p in args.per_sm for nw in args.warps]:
            programs = per_sm * sms
            for mode in args.modes:
                for release in args.release if mode in ("chain", "no wait") else ["-"]:
                    args_ = (desc, plan, programs, cfg, mode, release, warps)
                    name = f"{bn}x{bk}x{st}x{group} {programs}x{warps}w {mode}" + (
                        f", release a {release}" if release != "-" else "")
                    variants.append((f"gluon {name}", lambda args_=args_: launch(*args_)))
                    if args.trace and mode in ("chain", "tags"):
                        stamps = torch.zeros(programs, len(rows), TRACE_POINTS.value, dtype=torch.int64, device=dev)
                        launch(*args_, stamps)
                        traces[name] = trace_report(stamps.cpu())
    variants.append(("engine (again)", engine))
    time_variants(variants, lambda: a.copy_(a0), output, ref, w_size * 2, len(rows), args.out,
                  extra=dict(traces=traces) if traces else None)
    for name, report in traces.items():
        print(f"trace {name}: {report}", flush=True)


if __name__ == "__main__":
    main()
