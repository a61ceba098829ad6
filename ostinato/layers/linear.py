"""nn.Linear whose decode-sized calls on the GPU may run a Triton kernel instead of cuBLAS.

At a few rows a linear layer is a read of its weight. cuBLAS reads the o_proj / down_proj shapes at
1.4-2.4 TB/s at M = 1 (few CTAs, or split-K plus a reduce kernel); the skinny kernel at 1.8-3.3 on an H200
(`benchmarks/bench_skinny_gemm.py`). It loses on wide outputs (gate_up, N = 8 K: 0.86-0.99x), and on
qkv-shaped ones (N = 1.5-4 K) once M > 4 alone. Those go, at 5-64 rows, to triton_ops/wide_gemm.py, whose tiles
put W's rows on the MMA's M side as cuBLAS's do, and which also applies gate_up's activation (and the deferred
post-attention norm's scale) and launches under PDL; where it does not apply (K not a multiple of 64, or
OSTINATO_WIDE_GEMM=0) the skinny kernel takes them up to WIDE_MAX_M rows and cuBLAS above. Up to 4 rows the
skinny kernel also takes Granite-4.0-H's Mamba in_proj (N = 4.2 K: 1.01x and 1.13x at M <= 2, 0.93x at M = 4
alone, but faster in the step), where it keeps the step's chain of Programmatic Dependent Launches unbroken
(`triton_ops/pdl.py`). The choice depends only on shapes, so a captured graph keeps the one it made at capture.
"""
import os

import torch
import torch.nn.functional as F
from torch import nn

from ostinato.layers.activation import silu_and_mul

GATED_MAX_M = 4  # the gated kernel's FMA path; with its tensor-core path up to 16 rows, steps at bs 8-16 were 1-3%
# slower (H200, decode-route-h200-20261126.json; qkv on the skinny kernel alone was level there then)

# Up to this many rows the wide shapes too (N <= 5 K: qkv, Granite's in_proj). Since the skinny kernels ask L2 for
# their first weight tiles before their PDL wait (and the kernel after them may start under PDL, which it cannot
# after cuBLAS), 16 rows pay: H100, GPU forward ms a step at bs 8 / 16 / 32 x 128, 4 -> 16 -> 32 rows, two runs of 4
# and 16 (`bench_decode.py --models llama-3.2-1b qwen3-0.6b --cases 8:128 16:128 32:128 --modes graph --no-launches
# --iters 100`, decode-wide-*-h100-20261126-s17*.json): Llama-3.2-1B 1.208 / 1.247 / 1.271 -> 1.199 / 1.233 / 1.271
# -> bs 32 1.301; Qwen3-0.6B 1.037 / 1.076 / 1.217 -> 1.025 / 1.057 / 1.213 -> bs 32 1.258; Granite-4.0-H-1B bs 8 /
# 16 2.228 / 2.608 -> 2.210 / 2.610 (one run each).
WIDE_MAX_M = 16


def prefers_skinny(m: int, n: int, k: int) -> bool:
    """Whether x [m, k] @ W [n, k]^T is faster on the skinny kernel than on cuBLAS: the o / down shapes (N <= K)
    up to 32 rows, and shapes up to N = 5 K up to WIDE_MAX_M rows; wider ones (gate_up, N = 8 K) and M > 32 never.
    H200, M = 32, cuBLAS -> skinny: 6.24 -> 5.47 us (2048 x 2048), 13.97 -> 12.17 (2048 x 8192), 5.91 -> 4.99 (1024
    x 2048), 7.64 -> 5.83 (1024 x 3072); every N > K shape slower there, and every shape at M = 64
    (skinny-gemm-m32-h200-20261126.json). Where the kernel after the GEMV launches with PDL, the skinny kernel's
    start overlaps its predecessor's tail and lets its successor's start overlap its own, which cuBLAS does not
    (H200 steps at bs 4: Qwen3-0.6B 0.893 -> 0.873 ms, Granite 1.715 -> 1.706; decode-route-h200-20261126.json)."""
    return (m <= 32 and n <= k) or (m <= WIDE_MAX_M and n <= 5 * k)


# wide weights (N > K: qkv, gate_up, Granite's in_proj) at 5-64 rows: triton_ops/wide_gemm.py, which beat cuBLAS
# (and silu_and_mul after gate_up) at every such shape timed; OSTINATO_WIDE_GEMM=0 turns it off (for A/B runs)
WIDE_GEMM = os.environ.get("OSTINATO_WIDE_GEMM", "1") != "0"


def try_wide(x: torch.Tensor, weight: torch.Tensor, gated: bool = False,
             norm_eps: float | None = None) -> torch.Tensor | None:
    """wide_gemm.wide_linear(x, weight, gated=, norm_eps=) where it takes the call (a wide weight, 5-64 rows, see
    wide_gemm.supports), else None."""
    if not (WIDE_GEMM and x.is_cuda and weight.shape[0] > weight.shape[1]):
        return None
    from ostinato.layers.triton_ops import wide_gemm  # lazily: see triton_ops' docstring

    if not wide_gemm.supports(x, weight, gated):
        return None
    return wide_gemm.wide_linear(x, weight, gated=gated, norm_eps=norm_eps)


def cuda_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if (y := try_wide(x, weight)) is not None:
        return y
    if prefers_skinny(x.shape[0], *weight.shape):
        from ostinato.layers.triton_ops import skinny_gemm  # lazily: see triton_ops' docstring

        if skinny_gemm.supports(x, weight):
            return skinny_gemm.skinny_linear(x, weight)
    return F.linear(x, weight)


def cuda_gate_up_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if x.shape[0] <= GATED_MAX_M:
        from ostinato.layers.triton_ops import skinny_gemm

        if skinny_gemm.supports_gate_up(x, weight):
            return skinny_gemm.skinny_gate_up_silu(x, weight)
    if (y := try_wide(x, weight, gated=True)) is not None:
        return y
    return silu_and_mul(cuda_linear(x, weight))


# Under torch.compile the choice between the skinny kernel and cuBLAS happens inside an opaque op, at run time:
# a branch on the row count in traced code would make dynamo guard on it, and with the token dimension dynamic
# (piecewise graphs) re-trace the whole model at every threshold crossed (three traces per start-up).
linear_op = torch.library.custom_op("ostinato::linear", cuda_linear, mutates_args=())
gate_up_silu_op = torch.library.custom_op("ostinato::gate_up_silu", cuda_gate_up_silu, mutates_args=())


@linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


@gate_up_silu_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0] // 2)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and self.bias is None and x.dim() == 2:
            return (linear_op if torch.compiler.is_compiling() else cuda_linear)(x, self.weight)
        return F.linear(x, self.weight, self.bias)


def gate_up_silu(gate_up: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """silu_and_mul(gate_up(x)) for the MLP's fused gate/up layer: at decode sizes on the GPU one kernel that
    applies the activation to its accumulators, instead of a GEMM, a [M, 2I] round trip and a second kernel."""
    if x.is_cuda and gate_up.bias is None and x.dim() == 2:
        return (gate_up_silu_op if torch.compiler.is_compiling() else cuda_gate_up_silu)(x, gate_up.weight)
    return silu_and_mul(gate_up(x))
