"""Experiment for #16 (bs-1 decode): one launch a GEMV, as the engine does, but each GEMV warp-specialized in Gluon
with its weights streamed by TMA into a shared-memory ring from the kernel's first instruction, before its PDL wait.

Why: in a bs-1 step of Llama-3.2-1B the skinny FMA kernel streams gate_up's 67 MB at 3.5 TB/s and down's 33.5 MB
at 3.2 (docs/gpu-notes.md, fortieth session), where the TMA ring of bench_gluon_gemv_chain.py streamed 4.4-4.5 TB/s
alone and the Gluon chain without its waits 3.97 TB/s over Llama-3.2-1B's 64 GEMVs (the engine's forms 3.4). The
chain lost on its grid-wide waits; here there are none: the boundary is the launch under PDL, as in the engine.
- A loader warp lets the next kernel's programs be placed at once (griddepcontrol.launch_dependents: it never makes
  their wait return early), then copies its program's [BLOCK_N, BLOCK_K] tiles of W straight from W's [N, K]
  layout (one 2-D tensor descriptor a weight, no re-layout), row tile after row tile, waiting only for a free slot.
  W is no kernel's output, so this may run before the wait: the ring fills while the GEMV before finishes.
- Four compute warps wait (griddepcontrol.wait: every earlier kernel done), read x whole into shared memory, and
  for each of their row tiles drain the ring, storing y's BLOCK_N rows.
Row tiles go to programs round-robin (tile r to program r % programs). The chain (`main`) is of plain GEMVs: the
question is the streaming rate a launch, beside the engine's kernels on the same chain. The kernel also takes the
forms of Llama-3.2-1B's one-row gate_up (GATED: a gate box and an up box a slot; HAS_RES, PRENORM: the residual
added and the folded norm's inverse RMS), checked against the engine's ops (--check) and timed in the step (--step).

Written for Triton 3.6's Gluon (the GPU machines'); the CPU venv's newer Triton does not compile it
(`pip install --no-deps --target /tmp/t36 triton==3.6.0`, /tmp/t36 first on PYTHONPATH, for --compile-only).

python benchmarks/bench_gluon_gemv.py --compile-only                  # CPU: sm_90 registers, shared memory
timeout 120 python benchmarks/bench_gluon_gemv.py --layers 1 --tiles 16x256x8   # GPU, first after a change to the
                                                    # ring: a wrong phase hangs (mbarrier waits have no cap)
python benchmarks/bench_gluon_gemv.py --check --tiles 16x256x8    # GPU: against the engine's one-row ops
python benchmarks/bench_gluon_gemv.py --model llama-3.2-1b --tiles 16x256x8 32x128x8 --per-sm 1 2 --out FILE
GLUON_GEMV=16:256:65536:1 python benchmarks/bench_gluon_gemv.py --step <bench_decode.py's arguments>
    # the engine's one-row GEMVs that are not resident (Llama-3.2-1B's gate_up and down) on this kernel, in the step
    # (block_n:block_k:ring bytes:programs an SM; GLUON_GEMV unset: the engine's, for A/B in turns)
"""

import argparse
import os
import runpy
import sys

import torch
from bench_gluon_gemv_chain import LAYERS, chain_setup, tile_layout
from bench_persistent_gemv import parse_tile, time_variants
from kernel_regs import ptxas_stats
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


@gluon.jit
def _griddep(PTX: gl.constexpr):
    """A griddepcontrol instruction (PTX: "wait" or "launch_dependents")."""
    gl.inline_asm_elementwise(PTX + " mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _loader(w_desc, bufs, ready, empty, row_tiles, k_tiles, n_out, pid, num_programs, BLOCK_N: gl.constexpr,
            BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GATED: gl.constexpr, PDL: gl.constexpr):
    """The loader warp: this program's row tiles' K tiles, in the order the compute warps take them, into the next
    ring slot once the compute warps have freed it (a slot's first use waits on nothing). GATED: a slot holds the
    gate rows' tile and the up rows' (n_out rows further on), two boxes on one barrier."""
    if PDL:
        _griddep("griddepcontrol.launch_dependents;")
    halves: gl.constexpr = 2 if GATED else 1
    i = 0
    for r in range(pid, row_tiles, num_programs):
        for c in range(k_tiles):
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), halves * w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(w_desc, [r * BLOCK_N, c * BLOCK_K], ready.index(s),
                                            bufs.index(s * halves))
            if GATED:
                tma.async_copy_global_to_shared(w_desc, [n_out + r * BLOCK_N, c * BLOCK_K], ready.index(s),
                                                bufs.index(s * 2 + 1))
            i += 1


@gluon.jit
def _compute(X, Y, R, R_out, eps, bufs, ready, empty, x_smem, x_rows, row_tiles, k_tiles, pid, num_programs,
             BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, X_CHUNKS: gl.constexpr,
             GATED: gl.constexpr, PRENORM: gl.constexpr, HAS_RES: gl.constexpr, PDL: gl.constexpr):
    """The compute warps: after the PDL wait, x (k_tiles chunks of BLOCK_K) into shared memory in one load, then
    y[rows of a tile] = W[those rows] @ x a slot at a time, fp32 sums, each tile's rows stored in x's dtype.
    As the engine's skinny / resident GEMVs do under the same names: HAS_RES adds R to x first (rounded to x's
    dtype, as HF adds it; program 0 stores it to R_out), PRENORM scales the sums by x's inverse RMS (the norm's
    weight folded into W), GATED applies silu_and_mul to the gate and up sums with its rounding."""
    dt: gl.constexpr = Y.dtype.element_ty
    lanes_k: gl.constexpr = 32 if BLOCK_K >= 256 else BLOCK_K // 8
    tile_layout_: gl.constexpr = gl.BlockedLayout([1, 8], [32 // lanes_k, lanes_k], [gl.num_warps(), 1], [1, 0])
    offs_n = gl.arange(0, BLOCK_N, gl.SliceLayout(1, tile_layout_))
    offs_chunk = gl.arange(0, X_CHUNKS, gl.SliceLayout(1, tile_layout_))
    offs_k = gl.arange(0, BLOCK_K, gl.SliceLayout(0, tile_layout_))
    if PDL:  # every earlier kernel done (x is whole, and nobody reads Y any more)
        _griddep("griddepcontrol.wait;")
        _griddep("griddepcontrol.launch_dependents;")
    x_offs = gl.expand_dims(offs_chunk, 1) * BLOCK_K + gl.expand_dims(offs_k, 0)
    x_mask = gl.expand_dims(offs_chunk, 1) < k_tiles
    x_all = gl.load(X + x_offs, mask=x_mask, other=0.0, cache_modifier=".cg")
    if HAS_RES:
        res = gl.load(R + x_offs, mask=x_mask, other=0.0, cache_modifier=".cg")
        x_all = (x_all.to(gl.float32) + res.to(gl.float32)).to(dt)
        gl.store(R_out + x_offs, x_all, mask=x_mask & (pid == 0))
    if PRENORM:
        xf = x_all.to(gl.float32)
        inv_rms = gl.rsqrt(gl.sum(gl.sum(xf * xf, axis=1), axis=0) / (k_tiles * BLOCK_K) + eps)
    x_smem.store(x_all)
    gl.thread_barrier()
    halves: gl.constexpr = 2 if GATED else 1
    i = 0
    for r in range(pid, row_tiles, num_programs):
        acc = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, tile_layout_)
        acc_up = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, tile_layout_)  # (unused without GATED)
        for c in range(k_tiles):
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            w = bufs.index(s * halves).load(tile_layout_)
            if GATED:
                w_up = bufs.index(s * 2 + 1).load(tile_layout_)
            mbarrier.arrive(empty.index(s), count=1)
            x = x_rows.index(c).load(tile_layout_).to(gl.float32)  # [1, BLOCK_K]
            acc += w.to(gl.float32) * x
            if GATED:
                acc_up += w_up.to(gl.float32) * x
            i += 1
        y = gl.sum(acc, axis=1)
        if PRENORM:
            y = y * inv_rms
        if GATED:  # silu_and_mul.silu_mul_rounded
            up = gl.sum(acc_up, axis=1)
            if PRENORM:
                up = up * inv_rms
            gate = y.to(dt).to(gl.float32)
            y = (gate / (1.0 + gl.exp(-gate))).to(dt).to(gl.float32) * up.to(dt).to(gl.float32)
        gl.store(Y + r * BLOCK_N + offs_n, y.to(dt))


@gluon.jit
def _gemv_kernel(w_desc, X, Y, R, R_out, row_tiles, k_tiles, n_out, eps, BLOCK_N: gl.constexpr,
                 BLOCK_K: gl.constexpr, STAGES: gl.constexpr, X_CHUNKS: gl.constexpr, LOADER_REGS: gl.constexpr,
                 PDL: gl.constexpr, GATED: gl.constexpr = False, PRENORM: gl.constexpr = False,
                 HAS_RES: gl.constexpr = False):
    pid = gl.program_id(0)
    num_programs = gl.num_programs(0)
    bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES * (2 if GATED else 1), BLOCK_N, BLOCK_K], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    # x stored whole ([X_CHUNKS, BLOCK_K]), read a chunk at a time as a [1, BLOCK_K] row of the same bytes
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])  # (a view one rank more: the index's)
    x_smem = gl.allocate_shared_memory(w_desc.dtype, [X_CHUNKS, BLOCK_K], plain)
    x_rows = x_smem._reinterpret(w_desc.dtype, [X_CHUNKS, 1, BLOCK_K], plain)
    gl.warp_specialize([
        (_compute, (X, Y, R, R_out, eps, bufs, ready, empty, x_smem, x_rows, row_tiles, k_tiles, pid, num_programs,
                    BLOCK_N, BLOCK_K, STAGES, X_CHUNKS, GATED, PRENORM, HAS_RES, PDL)),
        (_loader, (w_desc, bufs, ready, empty, row_tiles, k_tiles, n_out, pid, num_programs, BLOCK_N, BLOCK_K,
                   STAGES, GATED, PDL)),
    ], [1], [LOADER_REGS])
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))


def weight_descriptor(w: torch.Tensor, block_n: int, block_k: int) -> TensorDescriptor:
    """W [N, K] (rows contiguous) in boxes of [BLOCK_N, BLOCK_K], unswizzled as the compute warps read them."""
    return TensorDescriptor(w, list(w.shape), list(w.stride()), [block_n, block_k], tile_layout())


_DESCRIPTORS: dict[tuple, TensorDescriptor] = {}


def gluon_gemv(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, *, gated: bool = False,
               eps: float | None = None, residual: torch.Tensor | None = None,
               residual_out: torch.Tensor | None = None, block_n: int = 16, block_k: int = 256,
               ring_bytes: int = 65536, per_sm: int = 1, num_sms: int = 132, max_k: int = 8192) -> None:
    """out [1, n] = x [1, K] @ weight^T (gated: weight [2n, K], silu_and_mul of gate and up), launched with PDL; `eps`
    given: the folded pre-norm, with `residual` added to x first and the sum written to `residual_out` (the engine's
    skinny_norm_linear). The ring holds about `ring_bytes` of W; at most per_sm programs an SM."""
    n, k = out.shape[1], x.shape[1]
    if x.shape[0] != 1 or k % block_k or n % block_n or k > max_k:
        raise ValueError(f"one row, K a multiple of {block_k} up to {max_k}, N of {block_n}: got x {tuple(x.shape)}, "
                         f"out {tuple(out.shape)}")
    key = (weight.data_ptr(), tuple(weight.shape), block_n, block_k)
    if key not in _DESCRIPTORS:
        _DESCRIPTORS[key] = weight_descriptor(weight, block_n, block_k)
    halves = 2 if gated else 1
    stages = max(2, ring_bytes // (halves * block_n * block_k * weight.element_size()))
    r, r_out = (residual, residual_out) if residual is not None else (x, x)  # unread without a residual
    row_tiles = n // block_n
    _gemv_kernel[(min(row_tiles, per_sm * num_sms),)](
        _DESCRIPTORS[key], x, out, r, r_out, row_tiles, k // block_k, n, 0.0 if eps is None else eps,
        **settings(block_n, block_k, stages, max_k), PDL=True, launch_pdl=True, GATED=gated, PRENORM=eps is not None,
        HAS_RES=residual is not None, num_warps=4, maxnreg=128)


def x_chunks(max_k: int, block_k: int) -> int:
    """x's shared-memory rows: K / BLOCK_K rounded up to a power of two (a tensor's dims are)."""
    return 1 << max(0, (max_k // block_k - 1).bit_length())


def tile_order(row_tiles: int, k_tiles: int, programs: int) -> list[list[tuple[int, int]]]:
    """Each program's (row tile, K tile) in the order its loader copies them and its compute warps take them: the
    kernels' index math, for checking on a CPU."""
    return [[(r, c) for r in range(pid, row_tiles, programs) for c in range(k_tiles)] for pid in range(programs)]


def emulate_gemv(w: torch.Tensor, x: torch.Tensor, programs: int, block_n: int, block_k: int, gated: bool = False,
                 eps: float | None = None, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, x + residual) as the kernel computes them, from tile_order's tiles: x + residual rounded to x's dtype,
    fp32 sums in K-tile order, scaled by the inverse RMS with `eps`, silu_and_mul's rounding when `gated` (w [2n,
    K]), rows rounded to x's dtype once each. x [K]."""
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
    n = w.shape[0] // (2 if gated else 1)
    k = w.shape[1]
    inv_rms = torch.rsqrt(x.float().pow(2).sum() / k + eps) if eps is not None else torch.tensor(1.0)
    y = torch.empty(n, dtype=x.dtype)
    for seq in tile_order(n // block_n, k // block_k, programs):
        sums: dict[int, list[torch.Tensor]] = {}
        for r, c in seq:
            xc = x[c * block_k : (c + 1) * block_k].float()
            parts = sums.setdefault(r, [torch.zeros(block_n), torch.zeros(block_n)])
            for h in range(2 if gated else 1):
                rows = slice(h * n + r * block_n, h * n + (r + 1) * block_n)
                parts[h] += w[rows, c * block_k : (c + 1) * block_k].float() @ xc
        for r, (gate, up) in sums.items():
            v = gate * inv_rms
            if gated:
                g = v.to(x.dtype).float()
                v = (g / (1.0 + torch.exp(-g))).to(x.dtype).float() * (up * inv_rms).to(x.dtype).float()
            y[r * block_n : (r + 1) * block_n] = v.to(x.dtype)
    return y, x


def settings(block_n: int, block_k: int, stages: int, max_k: int, loader_regs: int = 32) -> dict:
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, X_CHUNKS=x_chunks(max_k, block_k),
                LOADER_REGS=loader_regs)


def compile_sm90(block_n: int, block_k: int, stages: int, max_k: int, maxnreg: int, num_warps: int = 4,
                 gated: bool = False, prenorm: bool = False) -> dict:
    """Compile for sm_90 without a GPU; ptxas -v's registers, the kernel's shared memory, whether it has TMA and
    both griddepcontrol instructions."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as triton_compile
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    fake = torch.empty(1024, max_k, dtype=torch.bfloat16)
    consts = dict(settings(block_n, block_k, stages, max_k), PDL=True, GATED=gated, PRENORM=prenorm,
                  HAS_RES=prenorm)
    sig = {"w_desc": mangle_type(weight_descriptor(fake, block_n, block_k)), "X": "*bf16", "Y": "*bf16",
           "R": "*bf16", "R_out": "*bf16", "row_tiles": "i32", "k_tiles": "i32", "n_out": "i32", "eps": "fp32",
           **{k: "constexpr" for k in consts}}
    names = list(sig)
    src = GluonASTSource(_gemv_kernel, sig, {(names.index(k),): v for k, v in consts.items()})
    k = triton_compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, maxnreg=maxnreg))
    ptx = k.asm["ptx"]
    return dict(ptxas_stats(ptx), smem=k.metadata.shared, tma="cp.async.bulk.tensor" in ptx,
                pdl=all(f"griddepcontrol.{i}" in ptx for i in ("wait", "launch_dependents")))


def check(model: str, tiles: list[tuple[int, int, int]]) -> bool:
    """GPU: gluon_gemv against the engine's one-row ops on the model's layer shapes (gate_up: the folded norm with a
    residual, gated; the rest plain), each tile setting; prints the largest error relative to the largest output."""
    from ostinato.layers.triton_ops import skinny_gemm

    (qkv, o, gate_up, down), _ = LAYERS[model]
    dev, ok = torch.device("cuda"), True
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    gen = torch.Generator(dev).manual_seed(1)
    for name, (n, k), gated in [("qkv", qkv, False), ("o", o, False), ("gate_up", gate_up, True),
                                ("down", down, False)]:
        w = (torch.randn(n, k, generator=gen, device=dev) / k**0.5).to(torch.bfloat16)
        x, res = (torch.randn(1, k, generator=gen, device=dev).to(torch.bfloat16) for _ in range(2))
        if gated:
            want, want_res = skinny_gemm.skinny_norm_linear(x, w, 1e-5, res, gated=True)
        else:
            want, want_res = skinny_gemm.skinny_linear(x, w), None
        for bn, bk, _ in tiles:
            if k % bk or want.shape[1] % bn:
                continue
            got, got_res = torch.empty_like(want), torch.empty_like(x)
            gluon_gemv(x, w, got, gated=gated, eps=1e-5 if gated else None, residual=res if gated else None,
                       residual_out=got_res, block_n=bn, block_k=bk, num_sms=sms)
            torch.cuda.synchronize()
            err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
            res_ok = want_res is None or torch.equal(got_res, want_res)
            ok &= err < 2e-2 and res_ok
            print(f"check {name:8} {n}x{k} tiles {bn}x{bk}: rel err {err:.1e}, residual {'ok' if res_ok else 'WRONG'}",
                  flush=True)
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=list(LAYERS), default="llama-3.2-1b", help="whose projections make the chain")
    ap.add_argument("--layers", type=int, default=None, help="layers in the chain (default: the model's)")
    ap.add_argument("--per-sm", type=int, nargs="+", default=[1, 2], help="programs an SM at most, a pass each")
    ap.add_argument("--tiles", nargs="+", default=["16x256x8"], help="BLOCK_N x BLOCK_K x ring slots")
    ap.add_argument("--maxnreg", type=int, default=128, help="registers a thread (the loader's are set apart)")
    ap.add_argument("--no-pdl", action="store_true", help="also time each Gluon variant launched without PDL")
    ap.add_argument("--compile-only", action="store_true", help="CPU: compile each --tiles for sm_90 and report")
    ap.add_argument("--check", action="store_true", help="GPU: each --tiles against the engine's ops, then exit")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    shapes, model_layers = LAYERS[args.model]
    layers = model_layers if args.layers is None else args.layers
    if layers < 1 or min(args.per_sm) < 1:
        ap.error("--layers and --per-sm must be >= 1")
    tiles = []
    for spec in args.tiles:
        bn, bk, st, _ = parse_tile(ap, spec, shapes)
        if bn > 256 or bk > 256:
            ap.error(f"--tiles {spec!r}: a TMA box is at most 256 a side")
        tiles.append((bn, bk, st))
    max_k = max(k for _, k in shapes)
    if args.compile_only:
        for bn, bk, st in tiles:
            print(f"{bn}x{bk}x{st}: {compile_sm90(bn, bk, st, max_k, args.maxnreg)}", flush=True)
        return
    if args.check:
        raise SystemExit(0 if check(args.model, tiles) else 1)
    rows, _, w_size, a, a0, ref, sms, views, engine = chain_setup(layers, shapes)

    def gluon_chain(descs: list, cfg: dict, per_sm: int, pdl: bool) -> None:
        for desc, (_, io, oo, n, k) in zip(descs, views, strict=True):
            row_tiles = n // cfg["BLOCK_N"]
            _gemv_kernel[(min(row_tiles, per_sm * sms),)](
                desc, a[io:], a[oo:], a, a, row_tiles, k // cfg["BLOCK_K"], n, 0.0, **cfg, PDL=pdl, launch_pdl=pdl,
                num_warps=4, maxnreg=args.maxnreg)

    variants = [("engine (skinny_linear)", engine)]
    for bn, bk, st in tiles:
        descs = [weight_descriptor(wv, bn, bk) for wv, *_ in views]
        cfg = settings(bn, bk, st, max_k)
        for per_sm in args.per_sm:
            for pdl in [True, False] if args.no_pdl else [True]:
                name = f"gluon {bn}x{bk}x{st} <= {per_sm}/SM" + ("" if pdl else " no PDL")
                variants.append((name, lambda d=descs, c=cfg, p=per_sm, q=pdl: gluon_chain(d, c, p, q)))
    variants.append(("engine (again)", engine))
    time_variants(variants, lambda: a.copy_(a0), lambda _: a, ref, w_size * 2, len(rows), args.out)


def patch_engine(spec: str) -> None:
    """GLUON_GEMV="block_n:block_k:ring bytes:programs an SM": skinny_gemm's launches of one row that the resident
    GEMV does not take, with no add after them and shapes the kernel takes, go to gluon_gemv (real outputs)."""
    from ostinato.layers.triton_ops import resident_gemv, skinny_gemm

    fields = spec.split(":")
    if len(fields) != 4 or not all(f.isdigit() and int(f) > 0 for f in fields):
        raise ValueError(f"GLUON_GEMV must be block_n:block_k:ring bytes:programs an SM (positive integers), "
                         f"got {spec!r}")
    bn, bk, ring, per_sm = (int(v) for v in fields)
    engine_launch = skinny_gemm._launch

    def launch(x, weight, out, config, gated=False, prenorm=None, add=None):
        (m, k), n = x.shape, out.shape[1]
        sms = skinny_gemm._num_sms(x.device)
        if (config is None and x.is_cuda and m == 1 and add is None and x.is_contiguous() and k % bk == 0
                and n % bn == 0 and k <= 8192 and resident_gemv.config_for_call(x, weight, sms, gated) is None):
            pre = {} if prenorm is None else dict(eps=prenorm.eps, residual=prenorm.residual,
                                                  residual_out=prenorm.residual_out)
            gluon_gemv(x, weight, out, gated=gated, **pre, block_n=bn, block_k=bk, ring_bytes=ring, per_sm=per_sm,
                       num_sms=sms)
            return
        engine_launch(x, weight, out, config, gated, prenorm, add)

    skinny_gemm._launch = launch


if __name__ == "__main__":
    if "--step" in sys.argv:  # bench_decode.py with the engine patched (GLUON_GEMV), its arguments after --step
        if os.environ.get("GLUON_GEMV"):
            patch_engine(os.environ["GLUON_GEMV"])
        here = os.path.dirname(os.path.abspath(__file__))
        sys.argv = [os.path.join(here, "bench_decode.py")] + [a for a in sys.argv[1:] if a != "--step"]
        runpy.run_path(sys.argv[0], run_name="__main__")
    else:
        main()
