"""A few calls of the Mamba2 SSD prefill scan at granite-4.0-h-1b's shape (48 heads x 64, state 128, 1 group,
bf16 activations), one request of 2,048 tokens, for Nsight Compute (the outputs kernel is the scan's largest part).

ncu --clock-control none -k regex:_ssd_outputs_kernel -c 3 --section SpeedOfLight --section WarpStateStats \\
    --section SchedulerStats --section Occupancy --section MemoryWorkloadAnalysis --section LaunchStats \\
    python benchmarks/ncu_ssd_scan.py        # -> benchmarks/results/ncu-ssd-outputs-1x2048-h200.txt
"""

import torch

from ostinato.layers.mamba2 import SSD_CHUNK, ssd_chunk_table
from ostinato.layers.triton_ops.ssd_scan import ssd_chunk_scan

H, P, G, N = 48, 64, 1, 128


def main(tokens: int = 2048, calls: int = 3) -> None:
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    conv_out = torch.randn(tokens, H * P + 2 * G * N, generator=g).to(dev, torch.bfloat16)
    x, B, C = conv_out.split([H * P, G * N, G * N], dim=-1)
    dt = torch.randn(tokens, H, generator=g).to(dev, torch.bfloat16)
    A_log = torch.log(torch.rand(H, generator=g) * 4 + 0.5).to(dev)
    D = torch.randn(H, generator=g).to(dev)
    dt_bias = (torch.randn(H, generator=g) * 0.5 - 1).to(dev)
    state = (0.1 * torch.randn(2, H, P, N, generator=g)).to(dev)
    slots = torch.tensor([1], device=dev)
    cu = torch.tensor([0, tokens], dtype=torch.int32, device=dev)
    chunks = tuple(t.to(dev) for t in ssd_chunk_table([tokens], SSD_CHUNK))
    for _ in range(calls):
        ssd_chunk_scan(x, dt, B, C, state, slots, A_log, D, dt_bias, 0.0, float("inf"), H, P, G, cu, chunks,
                       out_dtype=torch.bfloat16)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
