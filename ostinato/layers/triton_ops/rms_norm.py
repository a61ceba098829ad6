"""RMSNorm over the last dim, optionally after the residual add: one program per row, fp32 math.

Rounding follows HF's LlamaRMSNorm and decoder layer exactly: the residual sum is rounded to the model
dtype (HF adds residuals in that dtype), the normalised row is rounded to it before the weight multiply,
and the product is rounded once more.
"""

import torch
import triton
import triton.language as tl

from ostinato.layers.triton_ops.pdl import enabled as pdl_enabled


@triton.jit
def _rms_norm_kernel(
    X, Residual, W, Out, New_residual,
    stride_x, stride_r, stride_o, stride_nr, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):
    if PDL:  # layers/triton_ops/pdl.py: nothing read or written before the wait
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(Residual + row * stride_r + offs, mask=mask, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(New_residual + row * stride_nr + offs, x, mask=mask)
    xf = x.to(tl.float32)
    # masked lanes hold 0 and add nothing to the sum
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * inv_rms).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + offs, (w * normed).to(Out.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            out: torch.Tensor, new_residual: torch.Tensor | None) -> None:
    n = x.shape[-1]
    x2, out2 = x.view(-1, n), out.view(-1, n)
    r2 = x2 if residual is None else residual.view(-1, n)
    nr2 = out2 if new_residual is None else new_residual.view(-1, n)
    assert x2.stride(1) == 1 and r2.stride(1) == 1 and weight.is_contiguous() and weight.shape == (n,)
    if x2.shape[0] == 0:
        return
    block = triton.next_power_of_2(n)
    pdl = pdl_enabled(x)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, r2, weight, out2, nr2,
        x2.stride(0), r2.stride(0), out2.stride(0), nr2.stride(0), n, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
        PDL=pdl, launch_pdl=pdl,
    )


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, None, weight, eps, out, None)
    return out


def _fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    assert residual.shape == x.shape and residual.dtype == x.dtype
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, residual, weight, eps, out, new_residual)
    return out, new_residual


rms_norm_op = torch.library.custom_op("ostinato::rms_norm", _rms_norm, mutates_args=())
fused_add_rms_norm_op = torch.library.custom_op("ostinato::fused_add_rms_norm", _fused_add_rms_norm, mutates_args=())


@rms_norm_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@fused_add_rms_norm_op.register_fake
def _(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty(x.shape, dtype=x.dtype, device=x.device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., n] (last dim contiguous), weight [n] -> [..., n] in x's dtype."""
    # the custom op only where torch.compile needs an opaque node: its eager dispatch costs ~25 us a call
    return (rms_norm_op if torch.compiler.is_compiling() else _rms_norm)(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (rms_norm(residual + x), residual + x), both new tensors in x's dtype."""
    return (fused_add_rms_norm_op if torch.compiler.is_compiling() else _fused_add_rms_norm)(x, residual, weight, eps)
