"""What one forward pass computes, as tensors the model and attention read."""

import enum
from dataclasses import dataclass
from typing import Any

import torch


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill or a prefill chunk, possibly over a cached prefix
    DECODE = "decode"  # one new token per request


@dataclass
class ForwardBatch:
    mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # int64 [num_tokens]; DECODE may hold PENDING_TOKEN until NextTokenBuffer.resolve_
    positions: torch.Tensor  # int64 [num_tokens]
    req_pool_indices: torch.Tensor  # int64 [bs]
    seq_lens: torch.Tensor  # int64 (or int32) [bs]: KV length once this pass has written its tokens
    out_cache_loc: torch.Tensor  # int64 [num_tokens]: slot each new token's K/V is written to
    logits_indices: torch.Tensor  # int64 [bs]: row of each request's last token in input_ids
    seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int] | None = None  # EXTEND: tokens already in the cache
    extend_seq_lens_cpu: list[int] | None = None  # EXTEND: new tokens per request
    # DECODE from ModelRunner.prepare: int64 [4, bs], rows input_ids, positions, req_pool_indices, seq_lens
    # (the fields above are views of it), so a graph replay takes all four in one copy
    decode_ints: torch.Tensor | None = None
    # from ModelRunner.prepare: int64 [bs], the NextTokenBuffer row each request's sampled token is stored to
    # (its request slot, or the sink when this pass samples nothing for it)
    sample_slots: torch.Tensor | None = None
    # DECODE loaded into the decode graphs' static block (DecodeGraphRunner.load_inputs): int64 [bs], the index of
    # the output token each row samples, already on the device (the sampler graphs read it in place)
    sample_steps: torch.Tensor | None = None
    mm: Any = None  # EXTEND of a vision model with image requests: models.qwen_vl.MMForward
    # hybrid models: int64 [bs], the MambaPool slot of each request (the sink slot for padded graph rows)
    mamba_slots: torch.Tensor | None = None
    # hybrid models in a piecewise-graph step: the step's layout at fixed addresses (layers.mamba_tables), which
    # the captured mixer reads instead of extend_seq_lens_cpu and mamba_slots
    mamba_tables: Any = None
    # EXTEND with prompt logprobs: (rows of input_ids whose next token is a prompt token, those tokens) int64
    # tensors, and k (top alternatives); the step then runs eagerly, whatever graphs exist
    prompt_lp: tuple[torch.Tensor, torch.Tensor, int] | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def mixed_decode_rows(extend_lens: list[int]) -> int:
    """How many decoding rows an extend step mixes in: its trailing one-token requests (the scheduler appends the
    decoding requests after the prefill chunks), which attend like a decode step. 0 when the step is not mixed:
    no such rows, or only such rows (e.g. one-token prompts, left to the one extend launch)."""
    n = 0
    for length in reversed(extend_lens):
        if length != 1:
            break
        n += 1
    return n if n < len(extend_lens) else 0
