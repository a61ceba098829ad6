"""Read GGUF (llama.cpp) checkpoints: dequantize to float32 and map tensor names to HF names."""

import re
from collections.abc import Iterator

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from tqdm import tqdm

_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_PER_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_ROPE_PERMUTED_ARCHS = ("llama",)  # llama.cpp permutes q/k rows only for these


def gguf_to_hf_name(name: str) -> str | None:
    """llama.cpp tensor name -> HF parameter name, or None for tensors HF models don't have."""
    if m := _BLOCK.fullmatch(name):
        layer, part, kind = m.groups()
        return f"model.layers.{layer}.{_PER_LAYER[part]}.{kind}" if part in _PER_LAYER else None
    base, _, kind = name.rpartition(".")
    return f"{_TOP_LEVEL[base]}.{kind}" if base in _TOP_LEVEL and kind in ("weight", "bias") else None


def _field(reader: GGUFReader, key: str) -> object:
    field = reader.get_field(key)
    return None if field is None else field.contents()


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: per head, rows are stored as interleaved (x, y) pairs;
    HF's rotate_half layout wants all x rows then all y rows."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_gguf_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    reader = GGUFReader(path)
    arch = str(_field(reader, "general.architecture"))
    n_head = _field(reader, f"{arch}.attention.head_count")
    n_kv_head = _field(reader, f"{arch}.attention.head_count_kv") or n_head
    unpermute = arch in _ROPE_PERMUTED_ARCHS and n_head is not None
    for t in tqdm(reader.tensors, desc="Dequantizing GGUF", unit="tensor", leave=False, disable=None):
        name = gguf_to_hf_name(t.name)
        if name is None:
            continue
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims fastest-first
        w = dequantize(t.data, t.tensor_type).reshape(shape)
        if unpermute and name.endswith("q_proj.weight"):
            w = _unpermute_rope(w, int(n_head))
        elif unpermute and name.endswith("k_proj.weight"):
            w = _unpermute_rope(w, int(n_kv_head))
        yield name, torch.from_numpy(np.array(w, dtype=np.float32))
