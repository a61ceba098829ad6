"""silu(gate) * up over the fused gate_up projection output [T, 2I] -> [T, I].

Rounding follows HF's `act_fn(gate_proj(x)) * up_proj(x)`: silu in fp32 rounded to the model dtype, then
the product in fp32 rounded again.

With `norm` (h, eps), the projection was of the bare residual row h, the RMSNorm before it deferred (its weight
folded into gate_up, layers/norm_linear.py): each program first takes its row's inverse RMS from h and scales
gate and up by it (each rounded to the dtype), the norm's per-row scale moved past the linear map.
"""

import torch
import triton
import triton.language as tl

from ostinato.layers.triton_ops.pdl import enabled as pdl_enabled


@triton.jit
def silu_mul_rounded(gate, up, dtype: tl.constexpr):
    """silu(gate) * up on fp32 sums, rounded as _silu_and_mul_kernel rounds a [T, 2I] input of `dtype`."""
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return act * up


@triton.jit
def _silu_and_mul_kernel(X, Out, stride_x, stride_o, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
                         H=None, stride_h=0, h_cols=1, eps=0.0, NORM: tl.constexpr = False, BLOCK_H: tl.constexpr = 1):
    if PDL:  # layers/triton_ops/pdl.py: nothing read or written before the wait
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    gate = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + n_cols + offs, mask=mask, other=0.0).to(tl.float32)
    # the deferred RMSNorm's scale (rms_norm.py's sum; masked lanes add 0). Each of a row's programs sums h itself:
    # a few KB from L2 per program, where sharing it would take the launch the deferral removes
    if NORM:
        offs_h = tl.arange(0, BLOCK_H)
        h = tl.load(H + row * stride_h + offs_h, mask=offs_h < h_cols, other=0.0).to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(h * h, axis=0) / h_cols + eps)
        gate = (gate * inv_rms).to(X.dtype.element_ty).to(tl.float32)
        up = (up * inv_rms).to(X.dtype.element_ty).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(X.dtype.element_ty).to(tl.float32)
    tl.store(Out + row * stride_o + offs, (act * up).to(Out.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    num_tokens, width = x.shape
    n = width // 2
    out = torch.empty(num_tokens, n, dtype=x.dtype, device=x.device)
    assert x.stride(1) == 1 and width == 2 * n
    if num_tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(n))
    pdl = pdl_enabled(x)
    norm_args = {}
    if norm is not None:
        h, eps = norm
        assert h.shape[0] == num_tokens and h.stride(1) == 1 and h.dtype == x.dtype
        norm_args = dict(H=h, stride_h=h.stride(0), h_cols=h.shape[1], eps=eps, NORM=True,
                         BLOCK_H=triton.next_power_of_2(h.shape[1]))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(n, block))](
        x, out, x.stride(0), out.stride(0), n, BLOCK=block, num_warps=4 if block >= 512 else 1, PDL=pdl,
        launch_pdl=pdl, **norm_args,
    )
    return out


def _silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _launch(x)


silu_and_mul_op = torch.library.custom_op("ostinato::silu_and_mul", _silu_and_mul, mutates_args=())


@silu_and_mul_op.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], x.shape[1] // 2)


def silu_and_mul(x: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """x [T, 2I] (last dim contiguous) -> silu(x[:, :I]) * x[:, I:] as a new [T, I] tensor. `norm` (h [T, D],
    eps): x is the projection of h's bare rows, and gate and up are scaled by each row's inverse RMS first (see
    the module doc; not under torch.compile)."""
    if norm is not None:
        assert not torch.compiler.is_compiling(), "the deferred-norm form has no custom op"
        return _launch(x, norm)
    # the custom op only where torch.compile needs an opaque node: its eager dispatch costs ~25 us a call
    return (silu_and_mul_op if torch.compiler.is_compiling() else _silu_and_mul)(x)
