"""Multimodal rotary embedding (M-RoPE) of Qwen2.5-VL / Qwen3-VL.

Each rotary frequency pair takes its angle from one of three position axes (t, h, w). Text tokens have
t = h = w, so with 1-D positions (decode, text-only prefill) M-RoPE is plain RoPE and the decode graphs
need nothing new. With [3, T] positions the per-token cos/sin rows are gathered column by column from the
same table and the ordinary rotary op runs over them (positions 0..T-1 into that per-token table).

Layouts: Qwen2.5-VL gives the first `sections[0]` pairs to t, the next `sections[1]` to h, the rest to w;
Qwen3-VL interleaves them (pair i -> h for i % 3 == 1 below 3 * sections[1], w for i % 3 == 2 below
3 * sections[2], t otherwise).
"""

import torch
from transformers import PretrainedConfig

from ostinato.layers.rotary import RotaryEmbedding, rope_parameters, rotary_embedding_


def mrope_axes(sections: list[int], interleaved: bool) -> torch.Tensor:
    """The position axis (0 t, 1 h, 2 w) of every rotary pair: int64 [sum(sections)]."""
    half = sum(sections)
    if not interleaved:
        return torch.cat([torch.full((n,), axis, dtype=torch.int64) for axis, n in enumerate(sections)])
    axes = torch.zeros(half, dtype=torch.int64)
    for axis in (1, 2):
        axes[axis : sections[axis] * 3 : 3] = axis
    return axes


class MRotaryEmbedding(RotaryEmbedding):
    def __init__(self, config: PretrainedConfig, head_dim: int, max_positions: int, interleaved: bool) -> None:
        super().__init__(config, head_dim, max_positions)
        sections = rope_parameters(config).get("mrope_section")
        if sections is None or sum(sections) != head_dim // 2:
            raise ValueError(f"rope_parameters.mrope_section: {sections} must sum to head_dim / 2 = {head_dim // 2}")
        axes = mrope_axes(list(sections), interleaved)
        self.register_buffer("axes", torch.cat([axes, axes]).to(self.cos_sin.device), persistent=False)

    def token_table(self, positions: torch.Tensor) -> torch.Tensor:
        """cos/sin rows [T, head_dim] for [3, T] positions."""
        rows = self.cos_sin[positions]  # [3, T, D]
        index = self.axes.view(1, 1, -1).expand(1, rows.shape[1], -1)
        return rows.gather(0, index)[0]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
                eps: float = 1e-6) -> None:
        """positions [T] (text-like: all axes equal) or [3, T]; rotates q and k in place."""
        if positions.dim() == 1:
            return super().forward(positions, q, k, q_norm_weight, k_norm_weight, eps)
        table = self.token_table(positions)
        rows = torch.arange(table.shape[0], device=table.device)
        rotary_embedding_(rows, q, k, table, self.head_dim, q_norm_weight, k_norm_weight, eps)


def mrope_positions(input_ids: list[int], image_grid_thw: list[tuple[int, int, int]], image_token_id: int,
                    spatial_merge_size: int) -> tuple[torch.Tensor, int]:
    """M-RoPE positions [3, L] of a prompt whose images are runs of `image_token_id` (one run per image, in
    order), and the delta that makes later (text) positions `index + delta`.

    Text continues one past the largest position so far; an image of t x h x w merged tokens starting at
    position p takes (p + t', p + h', p + w') for its token (t', h', w')."""
    ids = torch.tensor(input_ids, dtype=torch.int64)
    is_image = ids == image_token_id
    out = torch.empty(3, len(input_ids), dtype=torch.int64)
    pos, i, n, grids = 0, 0, len(input_ids), iter(image_grid_thw)
    while i < n:
        if not is_image[i]:
            j = i
            while j < n and not is_image[j]:
                j += 1
            out[:, i:j] = torch.arange(pos, pos + j - i)
            pos += j - i
            i = j
            continue
        t, h, w = next(grids)
        h, w = h // spatial_merge_size, w // spatial_merge_size
        count = t * h * w
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        out[:, i : i + count] = torch.stack([tt, hh, ww]).reshape(3, -1) + pos
        pos += max(t, h, w)
        i += count
    return out, int(pos - n)
