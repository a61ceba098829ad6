"""Vision towers of Qwen2.5-VL and Qwen3-VL, over packed patches of any number of images.

Input: pixel patches [N, C * T * P * P] as transformers' image processor makes them (in spatial-merge-block
order) and each image's (t, h, w) patch grid. Output: merged tokens [N / merge^2, out_hidden] in the same
order, one per image placeholder token (Qwen3-VL adds its deepstack features, one [N / merge^2, out_hidden]
per deepstack layer). Parameter names follow the HF checkpoints (`visual.*`), so loading is a copy, except the
Conv3d patch embedding, which is a Linear over the flattened patch here (the conv's stride equals its kernel).
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

Grid = tuple[int, int, int]


def vision_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
    """Bidirectional attention within each segment [cu[i], cu[i+1]) of packed q, k, v [N, H, D] -> [N, H * D].
    The torch reference: one SDPA call per segment (CPU and GPU)."""
    out = torch.empty_like(q)
    for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True):
        if e > s:
            qs, ks, vs = (x[s:e].transpose(0, 1) for x in (q, k, v))
            out[s:e] = F.scaled_dot_product_attention(qs, ks, vs).transpose(0, 1)
    return out.flatten(1)


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

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
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

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
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

    def forward(self, pixels: torch.Tensor, grids: list[Grid]) -> tuple[torch.Tensor, None]:
        unit = self.merge**2
        x = self.patch_embed(pixels)
        order, cu_window = self.window_index(grids)
        order = order.to(x.device)
        hw = torch.cat([block_order_hw(g, self.merge) for g in grids])
        cos, sin = self.rotary_pos_emb(hw)

        def permute(y: torch.Tensor) -> torch.Tensor:  # merged-token units into window order
            return y.view(-1, unit, y.shape[-1])[order].flatten(0, 1)

        x, cos, sin = permute(x), permute(cos), permute(sin)
        cu_full = self.image_segments(grids)
        for i, block in enumerate(self.blocks):
            x = block(x, cu_full if i in self.fullatt else cu_window, cos, sin)
        merged = self.merger.mlp(self.merger.ln_q(x).view(-1, unit * x.shape[-1]))
        return merged[torch.argsort(order)], None


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

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
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

    def forward(self, pixels: torch.Tensor, grids: list[Grid]) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.patch_embed(pixels) + torch.cat([self.position_embedding(g) for g in grids])
        cos, sin = self.rotary_pos_emb(torch.cat([block_order_hw(g, self.merge) for g in grids]))
        cu = self.image_segments(grids)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cu, cos, sin)
            if i in self.deepstack_indexes:
                deepstack.append(self.deepstack_merger_list[self.deepstack_indexes.index(i)](x))
        return self.merger(x), torch.stack(deepstack)
