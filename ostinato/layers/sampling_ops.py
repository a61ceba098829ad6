"""Logits ops shared by the sampler (runner/) and the decode graphs (graphs/), which both sit above layers/."""

from typing import NamedTuple

import torch
from torch import Tensor

from ostinato.layers.gumbel import gumbel_argmax

ARGMAX_CHUNK = 1024
# a top_p row with top_k at most this has top_p's cut found over the keys its top_k keeps (runner/fused_sample.py's
# kept path, KEPT_CAP keys a row); the sampler tells the fused kernels whether some top_p row lacks such a top_k
KEPT_TOP_K = 2048


class CutPhases(NamedTuple):
    """Which of the fused sampler's cut searches a batch needs (`SamplingTensors.fused_args` works it out from the
    requests): some sampled row has top_k; some has top_p; some top_p row lacks a top_k of at most KEPT_TOP_K, so
    top_p's search passes run (left out: true, the passes stay in)."""
    top_k: bool
    top_p: bool
    top_p_search: bool = True


def padded_vocab(vocab_size: int) -> int:
    """The vocabulary rounded up to whole ARGMAX_CHUNKs (the width of a logits buffer for chunked_argmax)."""
    return -(-vocab_size // ARGMAX_CHUNK) * ARGMAX_CHUNK


def chunked_argmax(x: Tensor, out: Tensor | None = None, scatter: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """argmax over the last dim of x [B, V] (rows may be strided; unit column stride): the first index of the
    maximum, as torch.argmax gives, into `out` (int64 [B]) when given. On CUDA two Triton launches
    (`triton_ops/argmax.py`); elsewhere a few short torch ops (max within chunks of ARGMAX_CHUNK, the tail's max,
    argmax over chunk maxima, gather), the kernels' twin. torch's one reduction per row runs a single 128k-entry
    row in one thread block (~28 us on an H100, 33 us on an H200 at Llama-3's vocabulary, against ~1 us of memory
    traffic). A decode graph's logits buffer is padded_vocab(V) wide with -inf padding. With `scatter` = (dest,
    index), also dest[index[b]] = row b's argmax (a decode graph's next-token store, in the same launch)."""
    if x.is_cuda:
        from ostinato.layers.triton_ops.argmax import argmax_rows

        return argmax_rows(x, out, scatter=scatter)
    b, width = x.shape
    full = width // ARGMAX_CHUNK * ARGMAX_CHUNK
    vals, idx = x[:, :full].unflatten(1, (full // ARGMAX_CHUNK, ARGMAX_CHUNK)).max(dim=-1)
    if full < width:  # the tail, a last (shorter) chunk
        tail_val, tail_idx = x[:, full:].max(dim=-1, keepdim=True)
        vals, idx = torch.cat([vals, tail_val], dim=1), torch.cat([idx, tail_idx], dim=1)
    chunk = vals.argmax(dim=-1, keepdim=True)
    ids = (chunk * ARGMAX_CHUNK + idx.gather(1, chunk))[:, 0]
    if scatter is not None:
        scatter[0][scatter[1]] = ids
    return ids if out is None else out.copy_(ids)


def chunked_draw(x: Tensor, temperatures: Tensor, seeds: Tensor, steps: Tensor, greedy_eps: float, out: Tensor,
                 scatter: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Row b's token into out[b] (int64 [B]): chunked_argmax's where temperatures[b] < greedy_eps, else the Gumbel-max
    draw from x[b] / temperatures[b] with (seeds[b], steps[b])'s noise, the token the sampler's plain draw gives
    (no min_p, top_k, top_p or penalty). x is float32 [B, V] with unit column stride. On CUDA chunked_argmax's two
    launches with the noise added in the first (`triton_ops/argmax.draw_rows`); elsewhere the torch sampler's ops,
    its twin. With `scatter` = (dest, index), also dest[index[b]] = row b's token."""
    if x.is_cuda:
        from ostinato.layers.triton_ops.argmax import draw_rows

        return draw_rows(x, temperatures, seeds, steps, greedy_eps, out, scatter=scatter)
    ids = chunked_argmax(x)
    greedy = temperatures < greedy_eps
    if not bool(greedy.all()):  # (a host sync: this twin runs on the CPU only)
        sampled = gumbel_argmax(x / torch.where(greedy, 1.0, temperatures)[:, None], seeds, steps)
        ids = torch.where(greedy, ids, sampled)
    if scatter is not None:
        scatter[0][scatter[1]] = ids
    return out.copy_(ids)


def penalize(logits: Tensor, counts: Tensor, rows: Tensor | None, frequency: Tensor, presence: Tensor,
             repetition: Tensor | None = None, in_prompt: Tensor | None = None) -> Tensor:
    """The penalized logits, float32 [B, V] (a new tensor): the repetition penalty first (as vLLM and transformers:
    a logit of a token in the prompt or the output so far is divided by the penalty where positive, else multiplied
    by it), then OpenAI's presence and frequency penalties (logit - frequency * count - presence * (count > 0)).
    `counts` [R, V] (any number type) and `in_prompt` (bool [R, V]) are read at row `rows[b]` for logits row b
    (`rows` None: row b); `frequency`, `presence`, `repetition` are float32 [B]. On CUDA one Triton launch
    (`triton_ops/penalize.py`); elsewhere these torch ops, its twin."""
    if logits.is_cuda:
        from ostinato.layers.triton_ops.penalize import penalize_rows

        if rows is None:
            rows = torch.arange(logits.shape[0], device=logits.device)
        return penalize_rows(logits, counts, rows, frequency, presence, repetition, in_prompt)
    c = (counts if rows is None else counts[rows]).float()
    x = logits.float()
    if repetition is not None:
        seen = (c > 0) | (in_prompt if rows is None else in_prompt[rows])
        rp = repetition[:, None]
        x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
    return x - frequency[:, None] * c - presence[:, None] * (c > 0).float()
