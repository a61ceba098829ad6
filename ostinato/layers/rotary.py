"""Rotary position embedding (the HF "rotate half" layout) with a precomputed fp32 cos/sin table, applied in
place to q and k, optionally after Qwen3's per-head q/k RMSNorm (one Triton launch on CUDA)."""

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ostinato.layers.norm import rms_norm_torch


def rope_parameters(config: PretrainedConfig) -> dict:
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def inverse_frequencies(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """Per-pair frequencies and the attention scaling the config's rope type asks for."""
    params = rope_parameters(config)
    if params["rope_type"] == "default":
        exponent = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
        return (1.0 / params["rope_theta"] ** exponent).float(), 1.0
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


def rotary_embedding_torch(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                           head_dim: int, q_norm_weight: torch.Tensor | None = None,
                           k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6) -> None:
    """The Triton kernel's twin, same contract and numerics: see `ostinato.layers.triton_ops.rotary`."""
    cos, sin = cos_sin_cache[positions].to(q.dtype)[:, None, :].chunk(2, dim=-1)  # [T, 1, D/2]
    for x, w in ((q, q_norm_weight), (k, k_norm_weight)):
        y = x if w is None else rms_norm_torch(x, w, eps)
        x1, x2 = y.chunk(2, dim=-1)
        x.copy_(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1))


def rotary_embedding_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
                      head_dim: int, q_norm_weight: torch.Tensor | None = None,
                      k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6) -> None:
    """In place on q [T, H, D] and k [T, Hkv, D] (views with any row stride), after an optional per-head
    RMSNorm (Qwen3's q_norm/k_norm weights [D])."""
    if q.is_cuda:
        from ostinato.layers import triton_ops  # lazily: see its docstring

        triton_ops.rotary_embedding_(positions, q, k, cos_sin_cache, head_dim, q_norm_weight, k_norm_weight, eps)
        return
    rotary_embedding_torch(positions, q, k, cos_sin_cache, head_dim, q_norm_weight, k_norm_weight, eps)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: PretrainedConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq, scaling = inverse_frequencies(config, head_dim)
        t = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
        freqs = torch.outer(t, inv_freq)
        # [max_positions, head_dim]: cos in the first half of the last dim, sin in the second
        self.register_buffer(
            "cos_sin", torch.cat([freqs.cos() * scaling, freqs.sin() * scaling], dim=-1), persistent=False
        )

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
                eps: float = 1e-6) -> None:
        """Rotates q [T, H, D] and k [T, Hkv, D] in place at `positions` [T]."""
        rotary_embedding_(positions, q, k, self.cos_sin, self.head_dim, q_norm_weight, k_norm_weight, eps)
