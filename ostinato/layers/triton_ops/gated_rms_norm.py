"""RMSNorm(y * silu(z)) per group of channels in one Triton kernel (the Mamba2 mixer's output norm).
The twin is `gated_rms_norm` in `layers/mamba2.py` (transformers' RMSNormGated numerics: float32 math,
rounded to the model dtype before the weight)."""

import torch
import triton
import triton.language as tl

from ostinato.layers.triton_ops.pdl import enabled as pdl_enabled


@triton.jit
def _gated_rms_norm_kernel(y_ptr, z_ptr, w_ptr, out_ptr, stride_y, stride_z, stride_out, eps,
                           GROUP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    t = tl.program_id(0)
    offs = tl.program_id(1) * GROUP + tl.arange(0, BLOCK)
    mask = tl.arange(0, BLOCK) < GROUP
    # z (in_proj's) and w before the PDL wait: in_proj ran three or more launches back (layers/triton_ops/pdl.py)
    z = tl.load(z_ptr + t * stride_z + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    gate = z / (1.0 + tl.exp(-z))
    if PDL:  # y (the scan's), and the store, after it
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    y = tl.load(y_ptr + t * stride_y + offs, mask=mask, other=0.0).to(tl.float32)
    h = y * gate
    h = h * tl.rsqrt(tl.sum(h * h, axis=0) / GROUP + eps)
    out = w * h.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * stride_out + offs, out, mask=mask)


def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, groups: int, eps: float,
                   dtype: torch.dtype, num_warps: int = 4) -> torch.Tensor:
    """y [T, I] (float32 or the model dtype; the math is float32), z [T, I] (row-strided view fine) -> [T, I] in
    `dtype`. One program per token and group, of `num_warps` warps (benchmarks/bench_ssd_scan.py --norm-sweep)."""
    T, inter = y.shape
    assert y.stride(-1) == 1 and z.stride(-1) == 1 and weight.is_contiguous() and weight.dtype == dtype
    out = torch.empty(T, inter, dtype=dtype, device=y.device)
    group = inter // groups
    pdl = pdl_enabled(y)
    _gated_rms_norm_kernel[(T, groups)](y, z, weight, out, y.stride(0), z.stride(0), out.stride(0), float(eps),
                                        GROUP=group, BLOCK=triton.next_power_of_2(group), PDL=pdl,
                                        launch_pdl=pdl, num_warps=num_warps)
    return out
