"""Qwen2.5-VL and Qwen3-VL: a vision tower (`models.vision`) feeding a Qwen2 / Qwen3 decoder with M-RoPE.

The forward takes flat tokens like the text models, plus, for an extend that holds image tokens, an
`MMForward` (built by the runner): which rows are image placeholders, their vision embeddings (and Qwen3-VL's
deepstack features, added to those rows after each of the first decoder layers) and [3, T] M-RoPE positions.
Without it (decode, text-only extends) positions are 1-D and the model is its text decoder.
"""

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from ostinato.layers.mrope import MRotaryEmbedding
from ostinato.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, head_dim_of
from ostinato.models.vision import Grid, Qwen2_5_VisionTower, Qwen3_VisionTower


@dataclass
class MMForward:
    rows: torch.Tensor  # int64 [n]: rows of the batch's flat tokens that are image placeholders
    embeds: torch.Tensor  # [n, hidden]: their vision embeddings
    positions: torch.Tensor  # int64 [3, T]: M-RoPE positions of every token of the batch
    deepstack: torch.Tensor | None = None  # [layers, n, hidden] (Qwen3-VL)


class _QwenVL(nn.Module):
    is_multimodal = True
    text_cls: type[LlamaForCausalLM]
    tower_cls: type[nn.Module]
    interleaved_mrope: bool

    def __init__(self, config: PretrainedConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        text = config.get_text_config()
        text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.language_model = lm = self.text_cls(text, max_positions)
        lm.rotary = MRotaryEmbedding(text, head_dim_of(text), max_positions, self.interleaved_mrope)
        for layer in lm.layers:
            layer.self_attn.rotary = lm.rotary
        self.attention_specs = lm.attention_specs
        self.visual = self.tower_cls(config.vision_config)
        self.image_token_id = config.image_token_id
        self.spatial_merge_size = config.vision_config.spatial_merge_size

    def encode_images(self, pixels: torch.Tensor, grids: list[Grid]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Vision embeddings [sum(t*h*w) / merge^2, hidden] for the packed patches of several images (and the
        deepstack features [layers, same rows, hidden] for Qwen3-VL)."""
        return self.visual(pixels.to(self.visual.patch_embed.proj.weight.dtype), grids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, mm: MMForward | None = None) -> torch.Tensor:
        lm = self.language_model
        x = lm.embed_tokens(input_ids)
        if mm is not None:
            x[mm.rows] = mm.embeds.to(x.dtype)
            positions = mm.positions
        residual = None
        for i, layer in enumerate(lm.layers):
            x, residual = layer(positions, x, residual)
            if mm is not None and mm.deepstack is not None and i < mm.deepstack.shape[0]:
                # the layer's output is x + residual: adding to x adds to it
                x = x.index_add(0, mm.rows, mm.deepstack[i].to(x.dtype))
        return lm.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.language_model.compute_logits(hidden, out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF names: `model.visual.*` / `visual.*` for the tower, `model.language_model.*` / `model.*` and
        `lm_head.*` for the decoder."""
        vision: list[tuple[str, torch.Tensor]] = []

        def text_weights():
            for name, tensor in weights:
                bare = name.removeprefix("model.")
                if bare.startswith("visual."):
                    vision.append((bare.removeprefix("visual."), tensor))
                    continue
                yield ("model." + bare.removeprefix("language_model.") if name.startswith("model.") else name), tensor

        self.language_model.load_weights(text_weights())
        self.visual.load_weights(vision)

    def after_load(self) -> None:
        self.language_model.after_load()


class Qwen2_5_VLForConditionalGeneration(_QwenVL):
    text_cls = Qwen2ForCausalLM
    tower_cls = Qwen2_5_VisionTower
    interleaved_mrope = False


class Qwen3VLForConditionalGeneration(_QwenVL):
    text_cls = Qwen3ForCausalLM
    tower_cls = Qwen3_VisionTower
    interleaved_mrope = True
