"""Vision towers of Qwen2.5-VL and Qwen3-VL, over packed patches of any number of images.

Input: pixel patches [N, C * T * P * P] as transformers' image processor makes them (in spatial-merge-block
order) and each image's (t, h, w) patch grid. Output: merged tokens [N / merge^2, out_hidden] in the same
order, one per image placeholder token (Qwen3-VL adds its deepstack features, one [N / merge^2, out_hidden]
per deepstack layer). Parameter names follow the HF checkpoints (`visual.*`), so loading is a copy, except the
Conv3d patch embedding, which is a Linear over the flattened patch here (the conv's stride equals its kernel).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

Grid = tuple[int, int, int]


@dataclass
class VisionBatch:
    """What a tower's blocks and mergers read, made eagerly by `VisionTower.prepare` (a graph runner copies it
    into its static buffers). cu_seqlens are host lists: each caller puts them where its kernels read them."""

    x: torch.Tensor  # [N, hidden] patch embeddings (Qwen2.5-VL: in window order)
    cos: torch.Tensor  # [N, head_dim] float32 rotary tables, rows as x
    sin: torch.Tensor
    cu_seqlens: list[int]  # full-attention segments (whole frames), in patches
    cu_window_seqlens: list[int] | None  # Qwen2.5-VL: window segments
    output_indices: torch.Tensor | None  # merged rows in image order: merged[output_indices] (undoes the windows)


def vision_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The torch reference of `vision_attention`: one SDPA call per non-empty segment. It reads the segment
    boundaries on the host, so on a GPU it syncs and cannot be captured; the CPU path and the test oracle."""
    out = torch.empty_like(q)
    cu = cu_seqlens.tolist()
    for s, e in zip(cu[:-1], cu[1:], strict=True):
        if e > s:
            qs, ks, vs = (x[s:e].transpose(0, 1) for x in (q, k, v))
            out[s:e] = F.scaled_dot_product_attention(qs, ks, vs).transpose(0, 1)
    return out.flatten(1)


def vision_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Bidirectional attention within each segment [cu[i], cu[i+1]) of packed q, k, v [N, H, D] -> [N, H * D].
    `cu_seqlens`: int32 on q's device, cu[-1] = N, repeated entries allowed (empty segments). The one op every
    vision block calls: on a GPU the Triton varlen kernel, whose launch depends on N only (a captured graph
    replays any segmentation written into its cu_seqlens buffer); on the CPU the SDPA-per-segment reference."""
    if q.is_cuda:
        from ostinato.layers.triton_ops.varlen_attention import varlen_attention

        return varlen_attention(q, k, v, cu_seqlens).flatten(1)
    return vision_attention_ref(q, k, v, cu_seqlens)


def rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in fp32 on x [N, H, D] with cos/sin [N, D]."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


def block_order_hw(grid: Grid, merge: int) -> torch.Tensor:
    """(h, w) patch coordinates [t * h * w, 2] in spatial-merge-block order (the processor's patch order)."""
    t, h, w = grid
    hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    shape = (h // merge, merge, w // merge, merge)
    hw = torch.stack([hh.reshape(shape).transpose(1, 2).flatten(), ww.reshape(shape).transpose(1, 2).flatten()], -1)
    return hw.repeat(t, 1)


class VisionRotary(nn.Module):
    """2-D rotary: the first half of each head's pairs rotate by the row, the second half by the column."""

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        quarter = head_dim // 2
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter),
                             persistent=False)

    def forward(self, hw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = (hw.to(self.inv_freq.device)[..., None].float() * self.inv_freq).flatten(1)  # [N, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


class VisionRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, -1).unbind(1)
        return self.proj(vision_attention(rotate_(q, cos, sin), rotate_(k, cos, sin), v, cu_seqlens))


class PatchEmbed(nn.Module):
    def __init__(self, cfg: PretrainedConfig, bias: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2, cfg.hidden_size,
                              bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.to(self.proj.weight.dtype))


class VisionTower(nn.Module):
    """What both towers share: patch embedding, rotary, segment bookkeeping and weight loading."""

    def __init__(self, cfg: PretrainedConfig, patch_bias: bool) -> None:
        super().__init__()
        self.cfg = cfg
        self.merge = cfg.spatial_merge_size
        self.patch_embed = PatchEmbed(cfg, patch_bias)
        self.rotary_pos_emb = VisionRotary(cfg.hidden_size // cfg.num_heads,
                                           (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0))

    def prepare(self, pixels: torch.Tensor, grids: list[Grid]) -> VisionBatch:
        raise NotImplementedError

    def run_blocks(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor,
                   cu_window_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The blocks and the merger(s): merged tokens [N / merge^2, out_hidden] in x's row order, and the deepstack
        features [layers, same rows, out_hidden] or None. Shapes depend on N only: what a graph captures."""
        raise NotImplementedError

    @staticmethod
    def finish(batch: VisionBatch, merged: torch.Tensor, deepstack: torch.Tensor | None,
               copy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Merged rows back in image order; with `copy`, never views of the inputs (a graph's static outputs)."""
        idx = batch.output_indices
        if idx is not None:
            return merged.index_select(0, idx), None if deepstack is None else deepstack.index_select(1, idx)
        if copy:
            return merged.clone(), None if deepstack is None else deepstack.clone()
        return merged, deepstack

    def run(self, b: VisionBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The eager pass over a prepared batch."""
        dev = b.x.device
        cu = torch.tensor(b.cu_seqlens, dtype=torch.int32, device=dev)
        cu_window = None if b.cu_window_seqlens is None else torch.tensor(b.cu_window_seqlens, dtype=torch.int32,
                                                                           device=dev)
        return self.finish(b, *self.run_blocks(b.x, b.cos, b.sin, cu, cu_window))

    def forward(self, pixels: torch.Tensor, grids: list[Grid]) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.run(self.prepare(pixels, grids))

    @staticmethod
    def image_segments(grids: list[Grid]) -> list[int]:
        """cu_seqlens of whole frames (full attention)."""
        cu = [0]
        for t, h, w in grids:
            cu.extend(cu[-1] + h * w * (i + 1) for i in range(t))
        return cu

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        for name, tensor in weights:
            if name not in params:
                raise ValueError(f"checkpoint tensor visual.{name!r} has no parameter in {type(self).__name__}")
            if name == "patch_embed.proj.weight":  # Conv3d [E, C, T, P, P] -> Linear [E, C*T*P*P]
                tensor = tensor.reshape(tensor.shape[0], -1)
            params.pop(name).data.copy_(tensor)
        if params:
            raise ValueError(f"checkpoint is missing {len(params)} vision parameters, e.g. {list(params)[:3]}")


# ---------------------------------------------------------------------------------------------- Qwen2.5-VL
class Qwen2_5_VisionBlock(nn.Module):
    def __init__(self, cfg: PretrainedConfig) -> None:
        super().__init__()
        self.norm1 = VisionRMSNorm(cfg.hidden_size)
        self.norm2 = VisionRMSNorm(cfg.hidden_size)
        self.attn = VisionAttention(cfg.hidden_size, cfg.num_heads)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.mlp.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.mlp.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)
        self.act = ACT2FN[cfg.hidden_act]

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        h = self.norm2(x)
        return x + self.mlp.down_proj(self.act(self.mlp.gate_proj(h)) * self.mlp.up_proj(h))


class Qwen2_5_VisionTower(VisionTower):
    def __init__(self, cfg: PretrainedConfig) -> None:
        super().__init__(cfg, patch_bias=False)
        self.blocks = nn.ModuleList(Qwen2_5_VisionBlock(cfg) for _ in range(cfg.depth))
        self.fullatt = set(cfg.fullatt_block_indexes)
        unit = cfg.hidden_size * self.merge**2
        self.merger = nn.Module()
        self.merger.ln_q = VisionRMSNorm(cfg.hidden_size)
        self.merger.mlp = nn.Sequential(nn.Linear(unit, unit), nn.GELU(), nn.Linear(unit, cfg.out_hidden_size))

    def window_index(self, grids: list[Grid]) -> tuple[torch.Tensor, list[int]]:
        """Order of the merged tokens that makes each window contiguous, and the windows' cu_seqlens in patches.
        A window is `window_size` pixels square: window_size / patch / merge merged tokens a side."""
        side = self.cfg.window_size // self.merge // self.cfg.patch_size
        unit = self.merge**2
        order, cu, base = [], [0], 0
        for t, h, w in grids:
            gh, gw = h // self.merge, w // self.merge
            idx = torch.arange(t * gh * gw).view(t, gh, gw)
            for f in range(t):
                for r in range(0, gh, side):
                    for c in range(0, gw, side):
                        win = idx[f, r : r + side, c : c + side].flatten()
                        order.append(win + base)
                        cu.append(cu[-1] + win.numel() * unit)
            base += t * gh * gw
        return torch.cat(order), cu

    def prepare(self, pixels: torch.Tensor, grids: list[Grid]) -> VisionBatch:
        unit = self.merge**2
        x = self.patch_embed(pixels)
        order, cu_window = self.window_index(grids)
        order = order.to(x.device)
        hw = torch.cat([block_order_hw(g, self.merge) for g in grids])
        cos, sin = self.rotary_pos_emb(hw)

        def permute(y: torch.Tensor) -> torch.Tensor:  # merged-token units into window order
            return y.view(-1, unit, y.shape[-1])[order].flatten(0, 1)

        return VisionBatch(permute(x), permute(cos), permute(sin), self.image_segments(grids), cu_window,
                           torch.argsort(order))

    def run_blocks(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor,
                   cu_window_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, None]:
        # the windows are whole merged units, so full-attention segments (whole images) are unions of windows
        # and window order keeps every image contiguous: cu_seqlens holds in window order too
        for i, block in enumerate(self.blocks):
            x = block(x, cu_seqlens if i in self.fullatt else cu_window_seqlens, cos, sin)
        unit = self.merge**2
        return self.merger.mlp(self.merger.ln_q(x).view(-1, unit * x.shape[-1])), None


# ---------------------------------------------------------------------------------------------- Qwen3-VL
class Qwen3_VisionBlock(nn.Module):
    def __init__(self, cfg: PretrainedConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg.hidden_size, cfg.num_heads)
        self.mlp = nn.Module()
        self.mlp.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.mlp.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)
        self.act = ACT2FN[cfg.hidden_act]

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp.linear_fc2(self.act(self.mlp.linear_fc1(self.norm2(x))))


class Qwen3_PatchMerger(nn.Module):
    def __init__(self, cfg: PretrainedConfig, postshuffle_norm: bool) -> None:
        super().__init__()
        self.unit = cfg.hidden_size * cfg.spatial_merge_size**2
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.unit if postshuffle_norm else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.unit, self.unit)
        self.linear_fc2 = nn.Linear(self.unit, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.unit)) if self.postshuffle_norm else self.norm(x).view(-1, self.unit)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3_VisionTower(VisionTower):
    def __init__(self, cfg: PretrainedConfig) -> None:
        super().__init__(cfg, patch_bias=True)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.side = int(cfg.num_position_embeddings**0.5)
        self.blocks = nn.ModuleList(Qwen3_VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = Qwen3_PatchMerger(cfg, postshuffle_norm=False)
        self.deepstack_indexes = list(cfg.deepstack_visual_indexes)
        self.deepstack_merger_list = nn.ModuleList(Qwen3_PatchMerger(cfg, postshuffle_norm=True)
                                                   for _ in self.deepstack_indexes)

    def position_embedding(self, grid: Grid) -> torch.Tensor:
        """The learned square table resized bilinearly (corners aligned) to the image's patch grid, in
        spatial-merge-block order: [t * h * w, hidden]."""
        t, h, w = grid
        table = self.pos_embed.weight.view(1, self.side, self.side, -1).permute(0, 3, 1, 2).float()
        resized = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0].permute(1, 2, 0)
        m = self.merge
        blocks = resized.reshape(h // m, m, w // m, m, -1).transpose(1, 2).reshape(h * w, -1)
        return blocks.repeat(t, 1).to(self.pos_embed.weight.dtype)

    def prepare(self, pixels: torch.Tensor, grids: list[Grid]) -> VisionBatch:
        x = self.patch_embed(pixels) + torch.cat([self.position_embedding(g) for g in grids])
        cos, sin = self.rotary_pos_emb(torch.cat([block_order_hw(g, self.merge) for g in grids]))
        return VisionBatch(x, cos, sin, self.image_segments(grids), None, None)

    def run_blocks(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor,
                   cu_window_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cu_seqlens, cos, sin)
            if i in self.deepstack_indexes:
                deepstack.append(self.deepstack_merger_list[self.deepstack_indexes.index(i)](x))
        return self.merger(x), torch.stack(deepstack)
