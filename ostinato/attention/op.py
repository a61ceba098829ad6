"""The one call through which every model layer reaches attention (`attention`).

Under `torch.compile` it is two registered custom ops, opaque nodes: `ostinato::rope_store` (rotary and the
K/V store, captured inside piecewise graphs' pieces) and `ostinato::attention` (the split point of piecewise
graphs). What the ops need besides q/k/v (the backend, the batch, the layer's shape) comes from the forward
context set around each forward pass.
"""

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ostinato.attention.base import AttentionBackend, AttentionSpec, Rope
from ostinato.attention.forward_batch import ForwardBatch, ForwardMode


@dataclass
class ForwardContext:
    backend: AttentionBackend | None = None
    batch: ForwardBatch | None = None
    layers: dict[int, AttentionSpec] = field(default_factory=dict)
    # extend steps of piecewise graphs: a [max_tokens, H*D] buffer of fixed address every layer's attention
    # writes into (its first T rows), so the next piece reads it in place instead of from a copy
    attn_out: torch.Tensor | None = None


_ctx = ForwardContext()


@contextlib.contextmanager
def forward_context(backend: AttentionBackend, batch: ForwardBatch, layers: dict[int, AttentionSpec],
                    attn_out: torch.Tensor | None = None) -> Iterator[None]:
    """Set for one forward pass of one model: its backend, batch and attention layers by layer id."""
    _ctx.backend, _ctx.batch, _ctx.layers, _ctx.attn_out = backend, batch, layers, attn_out
    try:
        yield
    finally:
        _ctx.backend, _ctx.batch, _ctx.layers, _ctx.attn_out = None, None, {}, None


def current_batch() -> ForwardBatch:
    """The batch of the forward pass in progress (for other stateful ops, e.g. the Mamba mixer)."""
    if _ctx.batch is None:
        raise RuntimeError("no forward pass in progress: call inside forward_context()")
    return _ctx.batch


def _backend() -> AttentionBackend:
    if _ctx.backend is None:
        raise RuntimeError("ostinato attention ops called outside forward_context()")
    return _ctx.backend


def _context() -> tuple[AttentionBackend, ForwardBatch]:
    backend = _backend()
    if _ctx.batch is None:
        raise RuntimeError("ostinato attention ops called outside forward_context()")
    return backend, _ctx.batch


def _rope_store(layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                cos_sin: torch.Tensor, q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None,
                eps: float) -> torch.Tensor:
    backend, batch = _context()
    rope = Rope(positions, cos_sin, q_norm_weight, k_norm_weight, eps)
    return backend.store(q, k, v, _ctx.layers[layer_id], batch, rope)


def rope_store_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, positions: torch.Tensor,
                    cos_sin: torch.Tensor, q_norm_weight: torch.Tensor | None = None,
                    k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """Rotates q and k (by the fp32 table `cos_sin`, after the optional per-head RMSNorm), stores k and v at the
    batch's KV slots of the layer whose K cache is `k_cache`, and returns the rotated q as a new tensor (the
    inputs are not written)."""
    layer_id = _backend().kv_cache.layer_of(k_cache)
    return _rope_store(layer_id, q, k, v, positions, cos_sin, q_norm_weight, k_norm_weight, eps)


def attention_impl(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer_id: int) -> torch.Tensor:
    """Attention of q over the cache; with k/v, stores them first (q and k already rotated, if the model rotates)."""
    backend, batch = _context()
    layer = _ctx.layers[layer_id]
    if k is not None:
        q = backend.store(q, k, v, layer, batch)
    out = _ctx.attn_out
    if out is not None and (batch.mode is ForwardMode.DECODE or out.dtype != q.dtype or out.shape[1] != q.shape[1]):
        out = None  # not an extend step of piecewise graphs, or not this layer's shape: a fresh output
    return backend.attend(q, layer, batch, None if out is None else out[: q.shape[0]])


# Two registered custom ops, opaque to torch.compile. The rope + K/V store reads only what a captured graph can
# hold (the positions, the batch's KV slots, which piecewise graphs keep in their static buffers), so it is an
# ordinary node that piecewise graphs capture inside their pieces. It takes its layer's K cache as an argument,
# not the layer id: the pieces of the middle layers then stay one function of their arguments, compiled once
# (a constant layer id would make each layer's piece a function of its own). It writes the cache without
# declaring it (declared, inductor's functionalized pieces would copy the layer's whole cache); nothing in a
# piece reads the cache, and the rotated q it returns orders it before the attention, which reads it.
# The attention is the split point: it runs eagerly between pieces, on the real batch's metadata.
rope_store_op = torch.library.custom_op("ostinato::rope_store", rope_store_impl, mutates_args=())
attention_op = torch.library.custom_op("ostinato::attention", attention_impl, mutates_args=())


@rope_store_op.register_fake
def _(q, k, v, k_cache, positions, cos_sin, q_norm_weight=None, k_norm_weight=None, eps=1e-6):
    return torch.empty_like(q)


@attention_op.register_fake
def _(q, k, v, layer_id):
    return torch.empty_like(q)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, positions: torch.Tensor | None = None,
              cos_sin: torch.Tensor | None = None, q_norm_weight: torch.Tensor | None = None,
              k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6, x_rms: torch.Tensor | None = None,
              x_rms_eps: float = 1e-6) -> torch.Tensor:
    """What a model layer calls: q [T, H*D], k/v [T, Hkv*D] -> [T, H*D]. With `positions`, q and k come before
    rotary and the backend rotates them (fused with its K/V store where it can) before the attention. With
    `x_rms` (eager, with `positions`), q, k and v are also before the layer's input RMSNorm's per-row scale
    (`Rope.x_rms`).

    Under torch.compile the two steps are the custom ops above; run eagerly, their functions are called
    directly (a custom op's dispatch costs the host tens of microseconds a call on the GPU machines)."""
    compiling = torch.compiler.is_compiling()
    # the deferred input norm's scale comes before rotary: with the model rotating (no positions), the model applies it
    assert x_rms is None or (positions is not None and not compiling), "x_rms: eager, with positions, only"
    if positions is not None and compiling:
        # traced code reads the backend only: touching `_ctx.batch` would make dynamo guard on each batch
        k_cache = _backend().kv_cache.get_store_buffer(layer_id)[0]
        q = rope_store_op(q, k, v, k_cache, positions, cos_sin, q_norm_weight, k_norm_weight, eps)
        k = v = None
    elif positions is not None:
        backend, batch = _context()
        layer = _ctx.layers[layer_id]
        rope = Rope(positions, cos_sin, q_norm_weight, k_norm_weight, eps, x_rms, x_rms_eps)
        out = backend.rope_attend(q, k, v, layer, batch, rope)
        if out is not None:  # rotary, store and attention fused (the Triton backend's small decode batches)
            return out
        q = backend.store(q, k, v, layer, batch, rope)
        k = v = None
    return (attention_op if compiling else attention_impl)(q, k, v, layer_id)
