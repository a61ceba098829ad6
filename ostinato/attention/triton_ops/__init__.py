"""Triton kernels of the Triton attention backend: one module per kernel."""

from ostinato.attention.triton_ops.decode_attention import decode_attention
from ostinato.attention.triton_ops.extend_attention import extend_attention
from ostinato.attention.triton_ops.kv_store import store_kv
from ostinato.attention.triton_ops.rope_store import rope_store_kv

__all__ = ["decode_attention", "extend_attention", "rope_store_kv", "store_kv"]
