"""nn.Linear whose decode-sized calls on the GPU may run the skinny GEMM kernel instead of cuBLAS.

At a few rows a linear layer is a read of its weight. cuBLAS reads the o_proj / down_proj shapes at
1.4-2.4 TB/s at M = 1 (few CTAs, or split-K plus a reduce kernel); the skinny kernel at 1.8-3.3 on an H200
(`benchmarks/bench_skinny_gemm.py`). It loses on wide outputs (gate_up, N = 8 K: 0.86-0.99x), and on
qkv-shaped ones (N = 1.5 K) once M > 4, so those stay on cuBLAS. The choice depends only on shapes, so a
captured graph keeps the one it made at capture.
"""

import torch
import torch.nn.functional as F
from torch import nn

from ostinato.layers.activation import silu_and_mul

GATED_MAX_M = 4  # the gated kernel's FMA path; its tensor-core path (M > 4) is not measured faster


def prefers_skinny(m: int, n: int, k: int) -> bool:
    """Whether x [m, k] @ W [n, k]^T is faster on the skinny kernel than on cuBLAS (measured shapes:
    N x K = 2048 x 2048, 2048 x 8192 at M <= 16 faster; 3072 x 2048 faster at M <= 4; 16384 x 2048 never)."""
    return m <= 16 and (n <= k or (m <= 4 and n <= 2 * k))


def static_rows(x: torch.Tensor) -> int | None:
    """x's row count when it is a plain int; None under torch.compile with the token dimension dynamic (the
    piecewise graphs): a branch on it there would make dynamo guard on the count and re-trace the whole model
    at each threshold crossed (three traces for the default piecewise sizes), so such calls take cuBLAS."""
    m = x.shape[0]
    return None if isinstance(m, torch.SymInt) else m


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = static_rows(x)
        if x.is_cuda and self.bias is None and x.dim() == 2 and m is not None and prefers_skinny(m, *self.weight.shape):
            from ostinato.layers.triton_ops import skinny_gemm  # lazily: see triton_ops' docstring

            if skinny_gemm.supports(x, self.weight):
                return skinny_gemm.skinny_linear(x, self.weight)
        return F.linear(x, self.weight, self.bias)


def gate_up_silu(gate_up: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """silu_and_mul(gate_up(x)) for the MLP's fused gate/up layer: at decode sizes on the GPU one kernel that
    applies the activation to its accumulators, instead of a GEMM, a [M, 2I] round trip and a second kernel."""
    m = static_rows(x)
    if x.is_cuda and gate_up.bias is None and x.dim() == 2 and m is not None and m <= GATED_MAX_M:
        from ostinato.layers.triton_ops import skinny_gemm  # lazily: see triton_ops' docstring

        if skinny_gemm.supports_gate_up(x, gate_up.weight):
            return skinny_gemm.skinny_gate_up_silu(x, gate_up.weight)
    return silu_and_mul(gate_up(x))
