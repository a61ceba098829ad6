"""The one call through which every model layer reaches attention.

It is a registered custom op, so `torch.compile` sees an opaque node: the split point of piecewise
graphs. What the op needs besides q/k/v (the backend, the batch, the layer's shape) comes from the
forward context set around each forward pass.
"""

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ostinato.attention.base import AttentionBackend, AttentionSpec, Rope
from ostinato.attention.forward_batch import ForwardBatch


@dataclass
class ForwardContext:
    backend: AttentionBackend | None = None
    batch: ForwardBatch | None = None
    layers: dict[int, AttentionSpec] = field(default_factory=dict)


_ctx = ForwardContext()


@contextlib.contextmanager
def forward_context(backend: AttentionBackend, batch: ForwardBatch, layers: dict[int, AttentionSpec]) -> Iterator[None]:
    """Set for one forward pass of one model: its backend, batch and attention layers by layer id."""
    _ctx.backend, _ctx.batch, _ctx.layers = backend, batch, layers
    try:
        yield
    finally:
        _ctx.backend, _ctx.batch, _ctx.layers = None, None, {}


def current_batch() -> ForwardBatch:
    """The batch of the forward pass in progress (for other stateful ops, e.g. the Mamba mixer)."""
    if _ctx.batch is None:
        raise RuntimeError("no forward pass in progress: call inside forward_context()")
    return _ctx.batch


@torch.library.custom_op("ostinato::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, positions: torch.Tensor | None = None,
              cos_sin: torch.Tensor | None = None, q_norm_weight: torch.Tensor | None = None,
              k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """With `positions`, q and k come before rotary (by the fp32 table `cos_sin`, after the optional per-head
    RMSNorm) and the backend rotates them, fused with its K/V store where it can (the inputs are not written)."""
    if _ctx.backend is None or _ctx.batch is None:
        raise RuntimeError("ostinato::attention called outside forward_context()")
    rope = None if positions is None else Rope(positions, cos_sin, q_norm_weight, k_norm_weight, eps)
    return _ctx.backend.forward(q, k, v, _ctx.layers[layer_id], _ctx.batch, rope)


@attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, positions: torch.Tensor | None = None,
      cos_sin: torch.Tensor | None = None, q_norm_weight: torch.Tensor | None = None,
      k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    return torch.empty_like(q)
