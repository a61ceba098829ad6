"""Logits ops shared by the sampler (runner/) and the decode graphs (graphs/), which both sit above layers/."""

import torch
from torch import Tensor

ARGMAX_CHUNK = 1024


def padded_vocab(vocab_size: int) -> int:
    """The vocabulary rounded up to whole ARGMAX_CHUNKs (the width of a logits buffer for chunked_argmax)."""
    return -(-vocab_size // ARGMAX_CHUNK) * ARGMAX_CHUNK


def chunked_argmax(x: Tensor) -> Tensor:
    """argmax over the last dim of x [B, V] (rows may be strided): the first index of the maximum, as
    torch.argmax gives. A few short kernels (max within chunks of ARGMAX_CHUNK, the tail's max, argmax over
    chunk maxima, gather) instead of one reduction per row, which for a single 128k-entry row runs in one
    thread block (~28 us on an H100, 33 us on an H200 at Llama-3's vocabulary, against ~1 us of memory
    traffic). A decode graph's logits buffer is padded_vocab(V) wide with -inf padding: no tail."""
    b, width = x.shape
    full = width // ARGMAX_CHUNK * ARGMAX_CHUNK
    vals, idx = x[:, :full].unflatten(1, (full // ARGMAX_CHUNK, ARGMAX_CHUNK)).max(dim=-1)
    if full < width:  # the tail, a last (shorter) chunk
        tail_val, tail_idx = x[:, full:].max(dim=-1, keepdim=True)
        vals, idx = torch.cat([vals, tail_val], dim=1), torch.cat([idx, tail_idx], dim=1)
    chunk = vals.argmax(dim=-1, keepdim=True)
    return (chunk * ARGMAX_CHUNK + idx.gather(1, chunk))[:, 0]
