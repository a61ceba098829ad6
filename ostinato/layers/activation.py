"""The gated MLP's activation: silu(gate) * up over the fused gate_up output, in one op."""

import torch
import torch.nn.functional as F

from ostinato.layers.norm import scale_by_inv_rms


def silu_and_mul_torch(x: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    if norm is not None:  # the deferred RMSNorm's per-row scale (triton_ops/silu_and_mul.py's module doc)
        gate, up = scale_by_inv_rms(*norm, gate, up)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """x [T, 2I] -> silu(x[:, :I]) * x[:, I:]. `norm` (h [T, D], eps): x is the gate_up projection of h's bare
    rows (the RMSNorm's weight folded into gate_up), and gate and up are first scaled by each row's inverse RMS."""
    if x.is_cuda:
        from ostinato.layers import triton_ops  # lazily: see its docstring

        return triton_ops.silu_and_mul(x, norm)
    return silu_and_mul_torch(x, norm)
