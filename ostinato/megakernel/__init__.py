"""A decode step of one request as one persistent CUDA kernel (Hopper), for Llama-family models.

At one request a decode step reads every weight once and does little else, yet a chain of ~12 launches a layer
leaves HBM idle at each hand-off (2-3 us a boundary under PDL, docs/gpu-notes.md). Here a block an SM runs all the
layers: a producer warp streams the block's share of each weight matrix through a shared-memory ring by bulk copies,
ahead of the data dependencies, while the consumer warps run each operation once the one before it is counted
complete across the grid (except down, which each block runs on its own gate/up rows as split-K, adding into the
residual stream by fp32 atomics: the step is not bit-reproducible). `decode_bs1.cu` is the kernel, `build.py`
compiles it with nvcc, `decode_bs1.py` launches it, `reference.py` is its torch twin (what the CPU tests check),
`weights.py` what it reads and supports.

Its blocks wait for each other, so all of them must be resident at once: the grid is the SMs the process may use
(`device_info.usable_sms`, an MPS client's share counted; under a share the MPS daemon sets without telling the
process it would hang, and `--decode-megakernel off`, the default, is the way out). Opt-in: on the H200 it is slower
than the layers' own kernels today (docs/gpu-notes.md, fifty-second to fifty-sixth sessions).
"""
