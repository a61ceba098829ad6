"""The gated MLP's activation: silu(gate) * up over the fused gate_up output, in one op."""

import torch
import torch.nn.functional as F


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] -> silu(x[:, :I]) * x[:, I:]."""
    if x.is_cuda:
        from ostinato.layers import triton_ops  # lazily: see its docstring

        return triton_ops.silu_and_mul(x)
    return silu_and_mul_torch(x)
