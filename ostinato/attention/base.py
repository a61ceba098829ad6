"""The attention-backend interface every backend implements."""

import abc
from dataclasses import dataclass

import torch

from ostinato.attention.forward_batch import ForwardBatch, ForwardMode
from ostinato.layers.norm import scale_by_inv_rms
from ostinato.layers.rotary import rotary_embedding_
from ostinato.mem.kv_cache import KVCache
from ostinato.mem.req_to_token_pool import ReqToTokenPool


class AttentionBackend(abc.ABC):
    """Reads and writes the paged KV cache for one forward pass.

    `init_forward_metadata` runs once per batch, before the model; `forward_*` run once per layer
    (from inside the `ostinato::attention` op) and must not re-derive per-batch metadata.
    """

    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_cache: KVCache) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.kv_cache = kv_cache

    @abc.abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None: ...

    # ---- decode graph capture: metadata lives in buffers allocated once, before any capture.
    @abc.abstractmethod
    def init_cuda_graph_state(self, max_bs: int) -> None:
        """Allocate every buffer a captured decode step reads, sized for `max_bs` requests."""

    @abc.abstractmethod
    def init_forward_metadata_capture(self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """Point decode metadata at the graph runner's static buffers (views of the first `bs` rows).

        Anything derived from `seq_lens` / `req_pool_indices` must be computed on the device from
        these buffers, inside the captured region or in `init_forward_metadata_replay`; never from a
        host value seen at capture time.
        """

    @abc.abstractmethod
    def init_forward_metadata_replay(self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """Called after the runner has written the static buffers and before replay."""

    def begin_graph_step(self) -> None:
        """Called at the start of a captured decode step, inside the captured region (so on every replay), before
        the forward: metadata derived from the static buffers that every layer reads (none by default)."""
        return None

    # ---- extend graph capture (optional): a backend whose extend kernels take a fixed launch grid
    supports_extend_graphs = False

    def init_extend_graph_state(self, max_reqs: int, max_tokens: int) -> None:
        """Allocate the buffers captured extend steps read: up to `max_reqs` requests, `max_tokens` tokens."""
        raise NotImplementedError(f"{type(self).__name__} does not support extend graphs")

    def init_forward_metadata_extend_graph(self, batch: ForwardBatch, num_tokens: int) -> None:
        """Write `batch`'s extend metadata into the static buffers, laid out for the graph captured at
        `num_tokens` tokens (the batch padded to that many tokens and `max_reqs` requests)."""
        raise NotImplementedError(f"{type(self).__name__} does not support extend graphs")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "AttentionSpec",
                batch: ForwardBatch, rope: "Rope | None" = None) -> torch.Tensor:
        """q [T, H*D], k/v [T, Hkv*D] -> [T, H*D]: `store`, then `attend`."""
        return self.attend(self.store(q, k, v, layer, batch, rope), layer, batch)

    def store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "AttentionSpec", batch: ForwardBatch,
              rope: "Rope | None" = None) -> torch.Tensor:
        """Writes k/v [T, Hkv*D] at batch.out_cache_loc and returns q [T, H*D] as `attend` takes it. With `rope`, q
        and k come before rotary and are rotated here, after the deferred input norm's scale if `rope.x_rms` (the
        unfused path: the reference of the fused one), and the returned q is a new tensor; without it, q itself.

        It reads only q, k, v, the positions and batch.out_cache_loc, so a captured graph may hold it (piecewise
        graphs capture it inside their pieces: graphs/piecewise.py)."""
        k = k.view(-1, layer.num_kv_heads, layer.head_dim)
        v = v.view(-1, layer.num_kv_heads, layer.head_dim)
        if rope is not None:
            q, k, v = rope.prescaled(q, k, v)
            q, k = rope.rotated(q.view(-1, layer.num_heads, layer.head_dim), k)
            q = q.view(-1, layer.num_heads * layer.head_dim)
        self.store_kv(layer.layer_id, batch.out_cache_loc, k, v)
        return q

    def rope_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "AttentionSpec",
                    batch: ForwardBatch, rope: "Rope") -> torch.Tensor | None:
        """`forward` with `rope` in fewer launches, where the backend can (q, k, v before rotary): the output
        [T, H*D], or None where it cannot (the caller then stores and attends)."""
        return None

    def store_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k/v [T, Hkv, D] (rotated) into the cache at `loc`."""
        self.kv_cache.set_kv_buffer(layer_id, loc, k, v)

    def attend(self, q: torch.Tensor, layer: "AttentionSpec", batch: ForwardBatch,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, H*D] (rotated, its K/V stored) -> [T, H*D]. `out` (extend only): a [T, H*D] tensor to write into
        instead of a new one (piecewise graphs hand a buffer of fixed address, so no copy precedes the next
        piece's replay)."""
        q = q.view(-1, layer.num_heads, layer.head_dim)
        if batch.mode is ForwardMode.DECODE:
            assert out is None, "attend: `out` is for extend steps"
            o = self.forward_decode(q, layer, batch)
        else:
            o = self.forward_extend(q, layer, batch, None if out is None else out.view(q.shape))
        return o.reshape(-1, layer.num_heads * layer.head_dim)

    @abc.abstractmethod
    def forward_extend(self, q: torch.Tensor, layer: "AttentionSpec", batch: ForwardBatch,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, H, D] -> [T, H, D] (into `out` when given): causal over the cached prefix plus the new tokens."""

    @abc.abstractmethod
    def forward_decode(self, q: torch.Tensor, layer: "AttentionSpec", batch: ForwardBatch) -> torch.Tensor:
        """q [bs, H, D] -> [bs, H, D]: one query per request over its whole cached sequence."""


class AttentionSpec:
    """The shape facts of one attention layer a backend needs."""

    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float) -> None:
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling


@dataclass
class Rope:
    """Rotary position embedding the backend applies to pre-rope q and k (HF's rotate-half layout, the model's
    fp32 cos/sin table, so Llama-3's scaled rope too), after an optional per-head RMSNorm (Qwen3's q/k norm).
    A backend may fuse it with the K/V store (the Triton backend does)."""

    positions: torch.Tensor  # int64 [T]
    cos_sin: torch.Tensor  # fp32 [max_positions, D]: cos in the first half, sin in the second
    q_norm_weight: torch.Tensor | None = None  # [D], both or neither
    k_norm_weight: torch.Tensor | None = None
    eps: float = 1e-6
    # The layer's input RMSNorm, deferred (layers/norm_linear.defers_input_norm): q, k and v are the projection of
    # these residual-stream rows [T, hidden] bare (the norm's weight folded in), and each is first scaled by its
    # row's inverse RMS (`layers.norm.scale_by_inv_rms`), before the q/k norm and rotary
    x_rms: torch.Tensor | None = None
    x_rms_eps: float = 1e-6

    def prescaled(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k, v with the deferred input norm's scale applied (the torch twin; as they are without x_rms)."""
        return (q, k, v) if self.x_rms is None else scale_by_inv_rms(self.x_rms, self.x_rms_eps, q, k, v)

    def rotated(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated copies of q [T, H, D] and k [T, Hkv, D] (the rotary kernel on CUDA, its torch twin on the CPU):
        the attention op declares no mutation of its inputs, so they are not rotated in place."""
        q, k = q.clone(), k.clone()
        rotary_embedding_(self.positions, q, k, self.cos_sin, q.shape[-1], self.q_norm_weight, self.k_norm_weight,
                          self.eps)
        return q, k
