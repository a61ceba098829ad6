"""Static look at the skinny GEMV's FMA kernel (skinny_gemm.py, 1-4 rows) at given tiles, without a GPU: compile it
for sm_90 with Triton's bundled ptxas and print registers, spilled bytes (STACK), shared memory and the cp.async
copies in its PTX. Run with the GPU machines' Triton (3.6) on the path: PYTHONPATH=/tmp/t36:$PWD, after
`pip install --no-deps --target /tmp/t36 triton==3.6.0`.

python benchmarks/sass_skinny_fma.py                 # the tiles config_for / prenorm_config give Llama-3.2-1B's
                                                     # and Qwen3-0.6B's one-row gate_up and down
python benchmarks/sass_skinny_fma.py g:1:32:128:5 d:0:8:512:3  # kind (g gated, d plain):prenorm:block_n:block_k:stages
"""

import re
import sys

from sass_decode_attention import compile_sm90, cuobjdump

from ostinato.layers.triton_ops import skinny_gemm

PTRS = dict(X="*bf16", W="*bf16", Out="*bf16", R="*bf16", R_out="*bf16", Add="*bf16")


def compile_fma(gated: bool, prenorm: bool, block_n: int, block_k: int, stages: int, m_pad: int = 1, warps: int = 4):
    """The kernel as _launch launches it on Hopper (PDL, its L2 prefetch lines), every int argument divisible by 16."""
    fn = skinny_gemm._skinny_fma_kernel
    consts = dict(M_PAD=m_pad, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=stages, GATED=gated, PRENORM=prenorm,
                  HAS_RES=prenorm, PDL=True, HAS_ADD=False,
                  PREFETCH_LINES=skinny_gemm.prefetch_lines(
                      skinny_gemm.SkinnyConfig(m_pad, block_n, block_k, False, warps, stages), 2))
    return compile_sm90(fn, consts, PTRS, ("eps",), ("M",), num_warps=warps, num_stages=stages)


def report(label: str, gated: bool, prenorm: bool, block_n: int, block_k: int, stages: int) -> None:
    k = compile_fma(gated, prenorm, block_n, block_k, stages)
    usage = cuobjdump(k.asm["cubin"], "-res-usage")
    regs, stack = (int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "STACK"))
    copies = len(re.findall(r"cp\.async\.c[ag]", k.asm["ptx"]))
    print(f"{label:34} {'gated' if gated else 'plain'} prenorm {int(prenorm)} block_n {block_n:3} block_k "
          f"{block_k:5} stages {stages}: regs {regs:3} stack {stack:3} smem {k.metadata.shared:6} cp.async {copies}",
          flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        for spec in sys.argv[1:]:
            kind, pre, bn, bk, st = spec.split(":")
            report(spec, kind == "g", pre == "1", int(bn), int(bk), int(st))
    else:
        shapes = {"Llama-3.2-1B gate_up (norm folded)": (8192, 2048, True),
                  "Llama-3.2-1B down": (2048, 8192, False),
                  "Qwen3-0.6B gate_up (norm folded)": (3072, 1024, True),
                  "Qwen3-0.6B down": (1024, 3072, False)}
        for label, (n, k, gated) in shapes.items():
            cfg = (skinny_gemm.prenorm_config if gated else skinny_gemm.config_for)(1, n, k, 132, gated)
            report(label, gated, gated, cfg.block_n, cfg.block_k, cfg.num_stages)
