"""A decoder layer's RMSNorm folded into the projection that reads its output (qkv or in_proj, gate_up).

At decode batch sizes each norm is a launch of its own that moves a few KB, and between two GEMVs that is
latency: Qwen3-0.6B's 57 norms took about 96 us of a 1 ms step at bs 1 (H100). Two steps remove it:
- `fold_norm_weight`, once the weights are in, multiplies the norm's weight into the projection's input columns
  (W[:, k] * w[k]) and sets the norm's weight to ones, so the projection of the bare normalised row is the same
  linear map;
- on the GPU at up to skinny_gemm.PRENORM_MAX_M rows, where the projection runs on the skinny kernel's FMA path
  anyway, that kernel applies the norm as it streams x (`triton_ops/skinny_gemm.skinny_norm_linear`). Otherwise,
  and on the CPU, the norm and the projection run as two ops, as before.
Both return what the unfused pair returns: (projection output, the residual stream after the add).

A norm is folded only where it is the only reader of its output and the projection a plain or column-parallel
Linear (every rank holds all of K).

Above GATED_MAX_M rows (up to the skinny kernel's MAX_M), where gate_up runs on cuBLAS and its activation is a
kernel of its own, the post-attention norm needs no launch either (`attn_out_norm_gate_up_silu`): o_proj's skinny
kernel adds the residual in its epilogue and writes the new residual stream h; gate_up projects h's bare rows;
and the activation kernel scales gate and up by each row's inverse RMS, which it takes from h itself. The norm is
a per-row scale, so it commutes with the linear map; results agree with the unfused chain to the dtype's
rounding (gate_up's outputs are rounded before the scale, not the normalised row before gate_up).

The input norm goes the same way there (`defers_input_norm`): down's skinny kernel adds the residual in its
epilogue (`down_add_residual`), the next layer's qkv projects the stream's bare rows, and attention scales q, k
and v by each row's inverse RMS (`attention.base.Rope.x_rms`: inside the rotary + KV store kernels on the GPU,
in torch elsewhere). At bs 32 on an H200 the norm launches made no-ops took 25 us from Llama-3.2-1B's 1.07 ms
step and 44 us from Qwen3-0.6B's 1.18 ms (docs/gpu-notes.md).
"""

import torch
from torch import nn

from ostinato.distributed.parallel_state import tp_size
from ostinato.layers.activation import silu_and_mul
from ostinato.layers.linear import (
    GATED_MAX_M,
    cuda_gate_up_silu,
    cuda_linear,
    gate_up_silu,
    prefers_skinny,
    try_wide,
)
from ostinato.layers.norm import RMSNorm


@torch.no_grad()
def fold_norm_weight(norm: RMSNorm, linear: nn.Linear) -> None:
    """linear(norm(x)) unchanged as a map, with the norm's weight inside linear's weight and the norm's ones.
    The product is rounded to the weight's dtype once (bf16: half an ulp of each weight)."""
    linear.weight.mul_(norm.weight.to(linear.weight.dtype)[None, :])
    norm.weight.fill_(1.0)
    norm.weight_folded = True


def _fused(x: torch.Tensor, residual: torch.Tensor | None, eps: float, weight: torch.Tensor,
           gated: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The one-launch form of a folded norm where it applies (a CUDA x of <= skinny_gemm.PRENORM_MAX_M rows the
    skinny kernel takes), else None."""
    if not (x.is_cuda and x.dim() == 2):
        return None
    from ostinato.layers.triton_ops import skinny_gemm  # lazily: see triton_ops' docstring

    m = x.shape[0]
    skinny = m <= GATED_MAX_M if gated else prefers_skinny(m, *weight.shape)
    if not (skinny and 1 <= m <= skinny_gemm.PRENORM_MAX_M):
        return None
    ok = skinny_gemm.supports_gate_up(x, weight) if gated else skinny_gemm.supports(x, weight)
    if not ok or (residual is not None and (residual.dtype != x.dtype or residual.shape != x.shape
                                             or residual.stride(1) != 1)):
        return None
    return skinny_gemm.skinny_norm_linear(x, weight, eps, residual, gated=gated)


def _add_norm_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                     folded: bool, weight: torch.Tensor, gated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The CUDA path with a residual, fused or not (the body of the op torch.compile sees)."""
    from ostinato.layers.norm import fused_add_rms_norm

    if folded:
        fused = _fused(x, residual, eps, weight, gated)
        if fused is not None:
            return fused
    h, residual = fused_add_rms_norm(x, residual, norm_weight, eps)
    return (cuda_gate_up_silu(h, weight) if gated else cuda_linear(h, weight)), residual


# under torch.compile (piecewise graphs: the row count is dynamic) the choice happens inside an opaque op, as
# for linear_op
add_norm_linear_op = torch.library.custom_op("ostinato::add_norm_linear", _add_norm_linear, mutates_args=())


@add_norm_linear_op.register_fake
def _(x, residual, norm_weight, eps, folded, weight, gated):
    return x.new_empty(x.shape[0], weight.shape[0] // (2 if gated else 1)), torch.empty_like(x)


def _norm_project(norm: RMSNorm, linear: nn.Linear, x: torch.Tensor, residual: torch.Tensor | None,
                  gated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if x.is_cuda and linear.bias is None and x.dim() == 2:
        folded = norm.weight_folded
        if residual is not None:
            op = add_norm_linear_op if torch.compiler.is_compiling() else _add_norm_linear
            return op(x, residual, norm.weight, norm.eps, folded, linear.weight, gated)
        if folded and not torch.compiler.is_compiling():  # the first layer's norm: unfused under compile
            fused = _fused(x, None, norm.eps, linear.weight, gated)
            if fused is not None:
                return fused
    if residual is None:
        h, residual = norm(x), x
    else:
        h, residual = norm(x, residual)
    return (gate_up_silu(linear, h) if gated else linear(h)), residual


def norm_linear(norm: RMSNorm, linear: nn.Linear, x: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(norm(x + residual)), x + residual); with residual None (the first layer) (linear(norm(x)), x)."""
    return _norm_project(norm, linear, x, residual, gated=False)


def norm_gate_up_silu(norm: RMSNorm, gate_up: nn.Linear, x: torch.Tensor,
                      residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """norm_linear for the MLP's fused gate/up layer, with its activation: (gate_up_silu(gate_up,
    norm(x + residual)), x + residual)."""
    return _norm_project(norm, gate_up, x, residual, gated=True)


def _deferrable(x: torch.Tensor, norm: RMSNorm, *linears: nn.Linear) -> bool:
    """What both deferred norms need: on the GPU, eager, tp 1, a folded norm, bias-free projections, and
    GATED_MAX_M < rows <= the skinny kernel's MAX_M (its epilogue adds the residual)."""
    if not (x.is_cuda and x.dim() == 2 and norm.weight_folded and not torch.compiler.is_compiling()
            and tp_size() == 1 and all(linear.bias is None for linear in linears)):
        return False
    from ostinato.layers.triton_ops import skinny_gemm  # lazily: see triton_ops' docstring

    return GATED_MAX_M < x.shape[0] <= skinny_gemm.MAX_M


def _defers_norm(o_proj: nn.Linear, a: torch.Tensor, residual: torch.Tensor, norm: RMSNorm,
                 gate_up: nn.Linear) -> bool:
    """Whether attn_out_norm_gate_up_silu takes its one-launch-fewer form for these inputs."""
    if not _deferrable(a, norm, o_proj, gate_up):
        return False
    from ostinato.layers.triton_ops import skinny_gemm

    m = a.shape[0]
    return (prefers_skinny(m, *o_proj.weight.shape) and skinny_gemm.supports(a, o_proj.weight)
            and residual.shape == (m, o_proj.weight.shape[0]) and residual.dtype == a.dtype
            and residual.stride(1) == 1)


def attn_out_norm_gate_up_silu(o_proj: nn.Linear, a: torch.Tensor, residual: torch.Tensor, norm: RMSNorm,
                               gate_up: nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention block's tail and the MLP's head: (gate_up_silu(gate_up, norm(o_proj(a) + residual)),
    o_proj(a) + residual). At GATED_MAX_M-MAX_M rows on the GPU (a folded norm, tp 1) without the norm's launch:
    see the module doc."""
    if not _defers_norm(o_proj, a, residual, norm, gate_up):
        return norm_gate_up_silu(norm, gate_up, o_proj(a), residual)
    return deferred_norm_gate_up_silu(o_proj.weight, a, residual, norm.eps, gate_up.weight)


def deferred_norm_gate_up_silu(o_weight: torch.Tensor, a: torch.Tensor, residual: torch.Tensor, eps: float,
                               gate_up_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The deferred form's three launches (see the module doc): (act, h) with h = a @ o_weight^T + residual from the
    skinny kernel's epilogue, and act = silu_and_mul(h @ gate_up_weight^T) with gate and up scaled by h's inverse
    RMS. gate_up_weight holds the norm's weight (folded). On CPU tensors the skinny kernel needs Triton's
    interpreter; the projection is then F.linear and the activation its torch twin."""
    from ostinato.layers.triton_ops import skinny_gemm

    h = skinny_gemm.skinny_linear(a, o_weight, add=residual)
    if (act := try_wide(h, gate_up_weight, gated=True, norm_eps=eps)) is not None:
        return act, h
    return silu_and_mul(cuda_linear(h, gate_up_weight), norm=(h, eps)), h


def defers_input_norm(x: torch.Tensor, norm: RMSNorm, qkv: nn.Linear, down: nn.Linear) -> bool:
    """Whether a decoder layer at x's rows takes its input norm deferred (module doc): where the post-attention
    norm can be (`_deferrable`), with down on the skinny kernel in x's dtype (it adds the residual)."""
    if not _deferrable(x, norm, qkv, down):
        return False
    from ostinato.layers.triton_ops import skinny_gemm

    return (prefers_skinny(x.shape[0], *down.weight.shape) and x.dtype in skinny_gemm.DTYPES
            and down.weight.dtype == x.dtype)


def down_add_residual(down: nn.Linear, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """down(x) + residual, on the GPU the add in the skinny kernel's epilogue (rounded as the two ops round): the
    residual stream after the MLP, which the next layer takes whole (its input norm deferred). Elsewhere, or for
    what the kernel does not take, the two ops (the twin the CPU tests run the deferred layer with)."""
    if x.is_cuda:
        from ostinato.layers.triton_ops import skinny_gemm  # lazily: see triton_ops' docstring

        if skinny_gemm.supports(x, down.weight):
            return skinny_gemm.skinny_linear(x, down.weight, add=residual)
    return down(x) + residual
