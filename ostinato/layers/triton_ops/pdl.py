"""Programmatic Dependent Launch (PDL, Hopper and later) for the Triton kernels of a decode step.

A decode step is a chain of a few hundred short kernels, and each kernel boundary costs the tail of one kernel
plus the launch and ramp-up of the next. With PDL a kernel may start while the kernel before it is still
finishing: its programs get resident and wait there, so the launch and ramp-up overlap the previous kernel's
tail. Measured on an H200: 0.3-0.7 us less per kernel in a CUDA graph (`benchmarks/bench_pdl.py`); decode
steps 3-10% faster (`benchmarks/bench_decode.py --pdl off on`). Loading a GEMV's first weight tile into registers
before the wait was slower (Llama-3.2-1B bs 1: 0.991 against 0.949 ms a step), so every kernel waits first; but the
skinny GEMVs ask L2 for their first weight tiles before it (`prefetch.global.L2`: no registers held, and weights
are no kernel's output), 0.4-3% faster steps at bs 1-32 (skinny_gemm.py's `_prefetch_tiles`).

The contract every kernel launched with `launch_pdl=True` keeps, under its `PDL: tl.constexpr`:
- every program calls `gdc_wait()` before it reads anything an earlier kernel wrote and before it writes
  anything (an earlier kernel may still be reading the buffer): ours call it first thing. It returns once the
  previous grid has completed and its writes are visible, and that grid completed only after its own wait:
  so all earlier kernels are done;
- right after the wait it calls `gdc_launch_dependents()`, which lets the next kernel's programs be scheduled
  (they spin in their own wait). It never makes the next kernel's wait return early.
  The exception is the skinny GEMV (`skinny_gemm.py`), which calls it after its K loop, so the next kernel's
  programs are placed as its own finish. Steps were faster so (H100, `bench_decode.py` with each placement:
  Llama-3.2-1B bs 1 / 4 1.184 -> 1.122 / 1.282 -> 1.226 ms, Qwen3-0.6B 0.912 -> 0.880 / 1.119 -> 1.031,
  Granite-4.0-H-1B 1.730 -> 1.687 / 2.141 -> 2.116; bs 32, on cuBLAS, unchanged). Likely cause, not profiled:
  placed early, the hundreds of programs of a GEMV that follows a GEMV (now that the norms between them are
  folded in) take SM slots beside the running one's and end up spread unevenly.
  The one-row GEMV of `resident_gemv.py` calls it before its wait instead, once its weight loads are issued, so
  the next GEMV's programs are placed and request their weights while this one finishes. A kernel that reads
  before its wait what a kernel further back wrote (below) must then count one kernel more: after a kernel that
  triggers before its wait, only the kernels before that one's predecessor are known to be complete. None of
  those readers follows a resident GEMV that triggers so (one-row o, gate_up and down read weights only before
  their waits; the one-row qkv, which decode stage 1 follows, triggers at its end: `trigger_at_end`).
  The KV store kernels (`rope_store.py`, `kv_store.py`) trigger at their end too, for the split-KV decode
  kernel after them: placed early, its programs ran much slower at long contexts (H200, Llama-3.2-1B bs 32 x
  4096 2.088 -> 2.212 ms a step, Qwen3-0.6B 4.479 -> 5.110), placed late not (2.089, 4.474), while short
  contexts gained either way (Qwen3-0.6B bs 8 x 128 1.026 -> 1.009 ms late). At up to 4 decode rows stage 1
  stores the new K/V itself and follows the qkv GEMV.
Some kernels of the Mamba extend chain wait late, reading and computing before the wait what kernels further
back wrote: when a kernel's programs start, its predecessor has triggered, and a predecessor that triggers only
after its own wait has seen every kernel before it complete. Each still waits before any write.
- the conv's per-request launch (`conv_extend.py`): everything (in_proj's output, the stored window) but its
  stores;
- the SSD prep kernel's dt cumsum (in_proj's dt); it triggers before it waits, and every later kernel of the
  chain waits for all of it;
- the SSD carry: the stored state (the last step's);
- the SSD outputs kernel (`ssd_scan.py`): the intra-chunk sums (conv and prep outputs) while the carry runs;
  it triggers at its start;
- the gated norm (`gated_rms_norm.py`): z (in_proj's) and its gate, while the scan's last kernel finishes.
In the decode step, the same rule lets decode stage 1 (where its table entry sets `early_kv`,
`decode_attention.py`) read the step's inputs (split counts, seq lens, the request's table row) and ask L2 for its
first key blocks before its wait: all were written before the forward (a captured step's kernels count the splits
from seq lens themselves, with no launch to write them). The skinny GEMVs ask L2 for their first weight tiles
there too (`l2_prefetch.py`).
A kernel that is not launched with PDL (cuBLAS, torch ops) simply waits for its predecessor as usual.

On the CPU (Triton's interpreter) and before Hopper the flag is off and the kernels are the plain ones: the
CPU tests run the same code minus the wait. `OSTINATO_PDL=0` turns it off. `tests/test_pdl.py` checks on the GPU
that decoding with it gives the tokens and logprobs, bit for bit, that decoding without it gives.
"""

import functools
import os

import torch

ENABLED = os.environ.get("OSTINATO_PDL", "1") != "0"


@functools.cache
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def enabled(t: torch.Tensor) -> bool:
    """Whether kernels working on `t` launch with PDL: a CUDA tensor on Hopper or later, and not switched off."""
    return ENABLED and t.is_cuda and _supported(t.get_device())
