"""RMSNorm with HF LlamaRMSNorm numerics, optionally fused with the residual add before it.

Each op has a plain-torch twin (the CPU path and the test oracle) and a Triton kernel for CUDA tensors;
the choice is made once, on the device, at the op boundary.
"""

from typing import overload

import torch
from torch import nn


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def fused_add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    residual = residual + x  # in the model dtype, as HF adds residuals
    return rms_norm_torch(residual, weight, eps), residual


def scale_by_inv_rms(h: torch.Tensor, eps: float, *ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A deferred RMSNorm's per-row scale, the torch twin of the kernels that apply it: each t [T, ...] (a
    projection of h's bare rows, the norm's weight folded into it) times each row's inverse RMS of h [T, D], in
    fp32, rounded to t's dtype."""
    inv_rms = torch.rsqrt(h.float().pow(2).mean(-1) + eps)
    return tuple((t.float() * inv_rms.view(-1, *[1] * (t.dim() - 1))).to(t.dtype) for t in ts)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.is_cuda:
        from ostinato.layers import triton_ops  # lazily: see its docstring

        return triton_ops.rms_norm(x, weight, eps)
    return rms_norm_torch(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (rms_norm(residual + x), residual + x)."""
    if x.is_cuda:
        from ostinato.layers import triton_ops

        return triton_ops.fused_add_rms_norm(x, residual, weight, eps)
    return fused_add_rms_norm_torch(x, residual, weight, eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.weight_folded = False  # True once norm_linear.fold_norm_weight moved the weight into the next layer

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or with a residual (norm(residual + x), residual + x)."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)
