"""A few calls of the split-KV decode kernel at one shape, for Nsight Compute: the bf16 and fp8 settings of the
dim-64 tables at bs 32 x 4096 (Llama-3.2-1B heads, page 1, shuffled slots), then one more fp8 setting.

ncu --clock-control none -k regex:_decode_stage1 -c 9 --section SpeedOfLight --section WarpStateStats \\
    --section SchedulerStats --section Occupancy --section MemoryWorkloadAnalysis --section LaunchStats \\
    python benchmarks/ncu_decode_attention.py      # -> benchmarks/results/ncu-decode-stage1-bs32x4096-h100.txt
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import bench_decode_attention as bench  # noqa: E402

from ostinato.attention.triton_ops.decode_attention import compute_num_kv_splits  # noqa: E402

SETTINGS = [  # (fp8, setting): three calls each
    (False, dict(variant="bf16", block_n=64, num_warps=1, num_stages=5, whole_blocks=True)),
    (True, dict(variant="fp16", block_n=32, num_warps=1, num_stages=5, whole_blocks=True)),
    (True, dict(variant="fp16", block_n=64, num_warps=2, num_stages=3, whole_blocks=True)),
]


def main(bs: int = 32, ctx: int = 4096) -> None:
    gen = torch.Generator().manual_seed(0)
    for fp8, cfg in SETTINGS:
        t = bench.setup(bs, ctx, fp8, 1, "cuda", gen)
        compute_num_kv_splits(t["seq_lens"], t["nsplit"], 64, 2)  # 2 splits a request, as the table's knobs give
        for _ in range(3):
            bench.call(t, cfg, 2)
        torch.cuda.synchronize()
        del t


if __name__ == "__main__":
    main()
