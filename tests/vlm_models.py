"""Tiny random-weight Qwen2.5-VL / Qwen3-VL checkpoints built offline: a transformers config, a word-level
tokenizer (with the Qwen special tokens at the config's ids) and the model's own processor, saved with
`save_pretrained` so Ostinato's normal loader reads them."""

import os

import torch

from ostinato.multimodal.processor import qwen2_vl_image_processor_class

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>"]
WORDS = ("user assistant system describe the image picture what is in this and that compare two three left right "
         "color red green blue a an of to it cat dog sky sea tree house car big small please say hello world "
         "one four five six seven eight nine ten yes no maybe look here there now then").split()
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') or 'image' in part %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + ["<unk>"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast, vocab


def _ids(vocab: dict) -> dict:
    return dict(image_token_id=vocab["<|image_pad|>"], video_token_id=vocab["<|video_pad|>"],
                vision_start_token_id=vocab["<|vision_start|>"], vision_end_token_id=vocab["<|vision_end|>"])


def make_qwen2_5_vl(path: str, vocab_size: int = 128) -> str:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tok, vocab = _tokenizer()
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                         rms_norm_eps=1e-6, eos_token_id=vocab["<|im_end|>"], bos_token_id=0),
        # window 56 px = 2x2 merged tokens per window; block 1 is full attention
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[1], in_channels=3),
        tie_word_embeddings=False, eos_token_id=vocab["<|im_end|>"], bos_token_id=0, **_ids(vocab))
    _save(path, config, Qwen2_5_VLForConditionalGeneration, tok,
          qwen2_vl_image_processor_class()(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 40, patch_size=14,
                                             merge_size=2))
    return path


def make_qwen3_vl(path: str, vocab_size: int = 128) -> str:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tok, vocab = _tokenizer()
    config = Qwen3VLConfig(
        text_config=dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                          "mrope_interleaved": True},
                         rms_norm_eps=1e-6, eos_token_id=vocab["<|im_end|>"], bos_token_id=0),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                           deepstack_visual_indexes=[0, 1], in_channels=3),
        tie_word_embeddings=False, eos_token_id=vocab["<|im_end|>"], bos_token_id=0, **_ids(vocab))
    _save(path, config, Qwen3VLForConditionalGeneration, tok,
          qwen2_vl_image_processor_class()(min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 40, patch_size=16,
                                             merge_size=2))
    return path


def _save(path, config, model_cls, tok, image_processor) -> None:
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():  # HF's init leaves norms at 1 and biases at 0: perturb so every path is exercised
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    # the image processor alone: transformers' Qwen processors need torchvision (their video processor) to be
    # built at all; Ostinato uses the image processor and the tokenizer directly
    image_processor.save_pretrained(path)


def image(w: int, h: int, seed: int):
    """A random RGB Pillow image."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
