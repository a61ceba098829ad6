"""Registers, spills and shared memory of the Mamba extend kernels at granite-4.0-h-1b's shape, compiled for
sm_90 (H100/H200) without a GPU: Triton lowers to PTX, then its bundled ptxas (-v) reports. Spills cost
local-memory traffic; this is how the SSD kernels' default tiles were chosen on a CPU-only machine.

python benchmarks/kernel_regs.py        # ~1 min on 2 cores; needs a Triton wheel with the CUDA backend
"""

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
PTR_TYPES = dict(x_ptr="bf16", b_ptr="bf16", c_ptr="bf16", dt_ptr="bf16", w_ptr="bf16", out_ptr="bf16",
                 slot_ptr="i64", cu_ptr="i32", req_ptr="i32", chunk_cu_ptr="i32", chunk_req_ptr="i32",
                 chunk_start_ptr="i32", counts_ptr="i32", win_ptr="bf16", cb_ptr="fp32")
FLOATS = ("dt_min", "dt_max")


def ptxas() -> str:
    """The bundled ptxas that reads Triton's PTX version (newer wheels ship two)."""
    for name in ("ptxas-blackwell", "ptxas"):
        path = os.path.join(BIN, name)
        if os.path.exists(path):
            return path
    raise FileNotFoundError(f"no ptxas under {BIN}")


def compile_sm90(fn, constexprs: dict, num_warps: int, ptr_types: dict | None = None) -> dict:
    ptr_types = {**PTR_TYPES, **(ptr_types or {})}
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name], consts[(i,)] = "constexpr", constexprs[name]
        elif name.endswith("_ptr"):
            sig[name] = "*" + ptr_types.get(name, "fp32")
            attrs[(i,)] = [["tt.divisibility", 16]]  # as a launch specializes 16-byte aligned pointers
        else:
            sig[name] = "fp32" if name in FLOATS else "i32"
            if name.startswith("stride"):  # the strides at granite's shapes are multiples of 16
                attrs[(i,)] = [["tt.divisibility", 16]]
    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=num_warps))
    ptx = k.asm["ptx"]
    return dict(ptxas_stats(ptx), smem=k.metadata.shared,
                mma="wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "none")


def ptxas_stats(ptx: str) -> dict:
    """Registers a thread and spilled bytes that ptxas -v reports for sm_90a PTX (regs None where it failed; its
    error text then in `ptxas_errors`)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        err = subprocess.run([ptxas(), "-arch=sm_90a", "-v", path, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", err)
    return dict(regs=int(regs.group(1)) if regs else None,
                spill_bytes=sum(map(int, re.findall(r"(\d+) bytes spill stores", err))),
                **({"ptxas_errors": err} if "error" in err else {}))


def main() -> None:
    from ostinato.layers.triton_ops import conv_extend, ssd_scan

    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    shape = dict(HEADS_PER_GROUP=48, P=64, N=128, H=48, PRECISION="low", HAS_COUNTS=False)
    cases = [("conv extend", conv_extend._conv_extend_kernel, dict(HAS_BIAS=True, K=4, BLOCK_T=bt, BLOCK_D=bd), 4)
             for bt, bd in ((32, 64), (16, 128))]
    cases += [("ssd prep", ssd_scan._ssd_prep_kernel, dict(H=48, G=1, N=128, CHUNK=256, BLOCK_H=4, BLOCK_M=bm,
                                                           BLOCK_N=128, PRECISION="low", HAS_COUNTS=False), 4)
              for bm in (32, 64)]
    cases += [("ssd states", ssd_scan._ssd_states_kernel,
               dict(shape, BLOCK_P=64, BLOCK_N=bn, BLOCK_L=bl, CHUNK=256), w)
              for bn, bl, w in ((64, 64, 4), (128, 64, 4), (128, 64, 8), (64, 128, 4))]
    cases += [("ssd carry", ssd_scan._ssd_carry_kernel, dict(H=48, P=64, N=128, CHUNK=256, BLOCK=b,
                                                              HAS_COUNTS=False), 4) for b in (1024, 2048)]
    cases += [("ssd outputs", ssd_scan._ssd_outputs_kernel, dict(shape, BLOCK_M=bm, BLOCK_S=bs, BLOCK_P=64,
                                                                  BLOCK_N=128, CHUNK=256), w)
              for bm, bs, w in ((32, 32, 4), (32, 64, 4), (32, 64, 8), (64, 64, 8), (16, 64, 4))]
    for name, fn, const, warps in cases:
        tiles = {k: v for k, v in const.items() if k.startswith("BLOCK") or k == "CHUNK"}
        stats = compile_sm90(fn, const, warps, dict(state_ptr="bf16") if name == "conv extend" else None)
        print(f"{name:<18} warps {warps} {tiles}: {stats}", flush=True)


if __name__ == "__main__":
    main()
