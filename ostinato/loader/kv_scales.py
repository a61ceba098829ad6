"""Per-layer fp8 KV-cache scales carried by quantized checkpoints, taken out of the weight stream.

The names are those vLLM and SGLang read: `layers.N.self_attn.k_scale` / `.v_scale` (also under
`self_attn.attn.`), the older single `layers.N.self_attn.kv_scale` (both K and V), and ModelOpt's
`layers.N.self_attn.k_proj.output_scale` / `v_proj.output_scale`. A scale s means the cache holds x / s.
`q_scale` and `prob_scale` (fp8 attention math, not used here) are dropped.
"""

import re
from collections.abc import Iterable, Iterator

import torch

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_KIND = {
    "self_attn.k_scale": "k", "self_attn.attn.k_scale": "k", "self_attn.k_proj.output_scale": "k",
    "self_attn.v_scale": "v", "self_attn.attn.v_scale": "v", "self_attn.v_proj.output_scale": "v",
    "self_attn.kv_scale": "kv", "self_attn.attn.kv_scale": "kv",
    "self_attn.q_scale": None, "self_attn.attn.q_scale": None,
    "self_attn.prob_scale": None, "self_attn.attn.prob_scale": None,
}


def kv_scale_kind(name: str) -> tuple[int, str | None] | None:
    """(layer, "k" | "v" | "kv" | None to drop) for a KV-scale tensor name, else None (a weight)."""
    m = _LAYER.search(name)
    if m is None:
        return None
    rest = name[m.end():]
    if rest not in _KIND:
        return None
    return int(m.group(1)), _KIND[rest]


class KVScaleFilter:
    """Wraps a (name, tensor) stream: KV scales are collected into `scales` (layer -> [k, v]), the rest
    passes through. `scales` is complete once the stream has been read to the end."""

    def __init__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._weights = weights
        self.scales: dict[int, list[float | None]] = {}

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self._weights:
            kind = kv_scale_kind(name)
            if kind is None:
                yield name, tensor
                continue
            layer, which = kind
            if which is None:
                continue
            value = float(tensor.float().max())  # per-head scales (rare) collapse to the layer's largest
            pair = self.scales.setdefault(layer, [None, None])
            if which in ("k", "kv"):
                pair[0] = value
            if which in ("v", "kv"):
                pair[1] = value

    def layer_scales(self) -> dict[int, tuple[float, float]]:
        """layer -> (k_scale, v_scale); a side the checkpoint does not give is 1.0."""
        return {layer: (k if k is not None else 1.0, v if v is not None else 1.0)
                for layer, (k, v) in self.scales.items()}
