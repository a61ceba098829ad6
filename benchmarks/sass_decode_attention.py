"""Static look at the decode kernel's settings without a GPU: compile stage 1 for sm90 with Triton's bundled
ptxas, then print registers, shared memory, the KV buffers the pipeliner allocated, programs per SM that the
registers and shared memory allow, the loads in flight that gives, and the SASS instructions of the key loop per
128 keys of one KV head (all warps), with the loop's commonest opcodes.

python benchmarks/sass_decode_attention.py                       # the bf16 and fp8 defaults
python benchmarks/sass_decode_attention.py fp8:fp16:64:1:5:whole  # kv:variant:block_n:warps:stages[:whole]
MAXNREG=128 TOP=30 COMBINE=0 PAGE=1 python benchmarks/sass_decode_attention.py ...  # a register cap, 30 opcodes,
                                                                                     # no combine, pages of 1
ROPE=1 [NORM=1] [XNORM=1] python benchmarks/sass_decode_attention.py ...  # stage 1 rotating q, storing the new K/V
                                                                        # (rope_attend) [with the input norm's scale]
EARLY_KV=2 python benchmarks/sass_decode_attention.py ...  # with early_kv's L2 requests for 2 key blocks
HEADS=16:8:128 python benchmarks/sass_decode_attention.py ...  # Qwen3-0.6B's heads (query:KV:dim; default 32:8:64)
OFFS32=0 python benchmarks/sass_decode_attention.py ...  # K/V offsets in int64 (OSTINATO_DECODE_OFFS32=0's form)
HEAD=200 python benchmarks/sass_decode_attention.py ...  # also the order of the global loads, exits, barriers,
                                                         # shared-memory shuffles, L2 prefetches (CCTL) and the PDL
                                                         # wait / trigger (ACQBULK / PREEXIT) in the first 200
                                                         # instructions
"""

import collections
import importlib
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ostinato.layers.triton_ops.l2_prefetch import lines_for

da = importlib.import_module("ostinato.attention.triton_ops.decode_attention")
TOP = int(os.environ.get("TOP", "8"))  # opcodes shown
PAGE = int(os.environ.get("PAGE", "16"))  # the pool's page size
EARLY_KV = int(os.environ.get("EARLY_KV", "0"))  # decode_attention's early_kv: key blocks asked of L2 before the wait
MAXNREG = {"maxnreg": int(os.environ["MAXNREG"])} if os.environ.get("MAXNREG") else {}  # a register cap for ptxas
Q_HEADS, KV_HEADS, DIM = (int(x) for x in os.environ.get("HEADS", "32:8:64").split(":"))
GROUP = Q_HEADS // KV_HEADS
KV_PER_PROG = da.kv_group_size(Q_HEADS, KV_HEADS, DIM)  # the kv_group variant's KV heads a program, as the engine's
VARIANT_CONSTS = dict(cast={}, fp16=dict(FP16_DOT=True), fp16_vcvt=dict(FP16_DOT=True, V_CVT=True),
                      bits=dict(FP16_DOT=True, CVT_BITS=True, BITS_FACTOR=256.0),
                      qk8=dict(QK_FP8=True), qk8_vcvt=dict(QK_FP8=True, V_CVT=True),
                      fp16_fold=dict(FP16_DOT=True, FOLD=True),
                      fp16_vcvt_fold=dict(FP16_DOT=True, V_CVT=True, FOLD=True), bf16_fold=dict(FOLD=True))


def early_lines(fp8: bool) -> int:
    """The KV_LINES constant decode_attention passes for EARLY_KV (0: off): a head row's lines."""
    return lines_for(DIM * (1 if fp8 else 2)) if EARLY_KV else 0


def compile_stage1(fp8: bool, variant: str, block_n: int, warps: int, stages: int, whole: bool, page: int = 16):
    """HEADS' heads (Llama-3.2-1B's 32 / 8, dim 64, by default), pages of `page`; every int argument divisible by 16
    (as the graph path's strides are)."""
    kv = "*u8" if fp8 else "*bf16"
    ptrs = dict(Q="*bf16", K_buf=kv, V_buf=kv, Req_to_token="*i32", Req_pool_indices="*i64", Seq_lens="*i32",
                Num_kv_splits="*i32", Mid_o="*fp32", Mid_lse="*fp32", K_scale="*fp32", V_scale="*fp32", Counter="*i32",
                Out="*bf16")
    # as the backend launches it from 8 rows on Hopper (COMBINE=0: as under 8 rows, with a stage-2 launch); BLOCK_S
    # 4 is the combine's tile at split caps 3-4 (decode_attention sizes it by the scratch's depth)
    engine = dict(COMBINE=os.environ.get("COMBINE", "1") == "1", BLOCK_S=4, PDL=True, ROPE=False, HAS_NORM=False)
    if os.environ.get("ROPE") == "1":  # rope_attend's launch: q and the new K/V before rotary
        engine |= dict(ROPE=True, HAS_NORM=os.environ.get("NORM") == "1")  # NORM=1: Qwen3's q/k norm
        ptrs |= dict(Positions="*i64", Loc="*i64", K_new="*bf16", V_new="*bf16", Cos_sin="*fp32", QW="*fp32",
                     KW="*fp32")
        if os.environ.get("XNORM") == "1":  # and the deferred input norm's scale, from Llama-3.2-1B's 2,048-wide rows
            ptrs |= dict(X="*bf16")
    page_const = da.page_arg(page, block_n)
    if variant == "kv_group":
        fn = da._decode_stage1_kv_group_kernel
        consts = dict(GROUP=GROUP, HEAD_DIM=DIM, KV_PER_PROG=KV_PER_PROG, BLOCK_N=block_n, PAGE=page_const,
                      KV_FP8=int(fp8), FP16_DOT=fp8, WHOLE_BLOCKS=whole, PRECISION="tf32") | engine
    else:
        fn = da._decode_stage1_kernel
        consts = dict(GROUP=GROUP, HEAD_DIM=DIM, BLOCK_H=16, BLOCK_D=DIM, BLOCK_N=block_n, PRECISION="tf32",
                      PAGE=page_const, KV_FP8=int(fp8), FP16_DOT=False, V_CVT=False, CVT_BITS=False, QK_FP8=False,
                      BITS_FACTOR=1.0, WHOLE_BLOCKS=whole, GROUP_P2=triton.next_power_of_2(GROUP), FOLD=False,
                      X_NORM="X" in ptrs, BLOCK_X=2048 if "X" in ptrs else 1, KV_LINES=early_lines(fp8),
                      KV_BLOCKS=EARLY_KV or 1, OFFS32=os.environ.get("OFFS32", "1") != "0") | engine
        if fp8 or variant == "bf16_fold":
            consts |= VARIANT_CONSTS[variant]
    consts = {k: v for k, v in consts.items() if k in fn.arg_names}  # the kv_group kernel has no rotary (ROPE, ...)
    return compile_sm90(fn, consts, ptrs, ("qk_scale", "eps", "eps_x"), num_warps=warps, num_stages=stages,
                        **MAXNREG)


def compile_sm90(fn, consts: dict, ptrs: dict, floats: tuple = (), plain_ints: tuple = (), **options):
    """A Triton kernel compiled for sm_90 without a GPU: `consts` its constexprs, `ptrs` its pointer types by
    argument name, `floats` its fp32 scalars, every other argument an i32 divisible by 16 (as Triton specializes a
    launch's strides and sizes), except `plain_ints`."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in ptrs:
            sig[name], attrs[(i,)] = ptrs[name], [["tt.divisibility", 16]]
        elif name in floats:
            sig[name] = "fp32"
        elif name in plain_ints:
            sig[name] = "i32"
        else:
            sig[name], attrs[(i,)] = "i32", [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options=options)


def cuobjdump(cubin: bytes, flag: str) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout


def loop_opcodes(sass: str) -> collections.Counter:
    """Opcodes inside the longest backward branch (the key loop)."""
    lines = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)(.*)", line)
        if m:
            lines.append((int(m.group(1), 16), m.group(2), m.group(3)))
    best: list[str] = []
    for addr, op, rest in lines:
        t = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if t and int(t.group(1), 16) < addr:
            body = [o for a, o, _ in lines if int(t.group(1), 16) <= a <= addr]
            best = body if len(body) > len(best) else best
    return collections.Counter(o.split(".")[0] for o in best)


def report(spec: str) -> None:
    parts = spec.split(":")
    kv, variant, block_n, warps, stages = parts[0], parts[1], int(parts[2]), int(parts[3]), int(parts[4])
    whole = len(parts) > 5 and parts[5] == "whole"
    k = compile_stage1(kv == "fp8", variant, block_n, warps, stages, whole, PAGE)
    usage = cuobjdump(k.asm["cubin"], "-res-usage")
    regs, stack = (int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "STACK"))
    smem = k.metadata.shared
    bufs = [int(x) for x in re.findall(r"local_alloc : \(\) -> !ttg.memdesc<(\d+)x\d+x\d+x", k.asm["ttgir"])]
    progs = min(65536 // (-(-regs // 8) * 8 * 32 * warps), 228 * 1024 // (smem + 1024), 64 // warps)
    heads = KV_PER_PROG if variant == "kv_group" else 1
    tile = block_n * DIM * 2 * (1 if kv == "fp8" else 2) * heads
    sass = cuobjdump(k.asm["cubin"], "-sass")
    ops = loop_opcodes(sass)
    per128 = sum(ops.values()) * warps * 128 // block_n // heads
    print(f"{spec:34} regs {regs:3} stack {stack} smem {smem:6} kv buffers {max(bufs, default=0)} "
          f"programs/SM {progs:2} "
          f"in flight {progs * max(max(bufs, default=1), 1) * tile // 1024:4} KB  loop instr / 128 keys {per128:5}  "
          f"{dict(ops.most_common(TOP))}", flush=True)
    if os.environ.get("HEAD"):  # where the kernel's first loads go out and where it first waits
        body = [ln.strip() for ln in sass.splitlines() if re.match(r"\s*/\*[0-9a-f]+\*/", ln)]
        for ln in body[: int(os.environ["HEAD"])]:
            if re.search(r"\b(LDG|EXIT|BAR|STSM|ACQBULK|PREEXIT|LDGSTS|DEPBAR|CCTL)", ln):
                print("   ", ln.split(";")[0], flush=True)


if __name__ == "__main__":
    for spec in sys.argv[1:] or ["bf16:bf16:64:4:2", "fp8:fp16:128:4:3"]:
        report(spec)
