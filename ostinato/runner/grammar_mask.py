"""The token masks of structured outputs (engine/structured.py compiles the grammars): a step's allowed
tokens per row, filled on the host by each constrained request's xgrammar matcher and applied to the logits
on the device by xgrammar's kernel (its CPU one on the CPU)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def fill_bitmask(matchers: Sequence[Any], vocab_size: int) -> torch.Tensor:
    """int32 [len(matchers), ceil(vocab / 32)] on the host: row i the tokens matcher i allows next; a row with
    no matcher (an unconstrained request) or a finished one (its request is about to end) allows all."""
    import xgrammar as xgr

    mask = xgr.allocate_token_bitmask(len(matchers), vocab_size)  # every token allowed
    for i, m in enumerate(matchers):
        if m is not None and not m.is_terminated():
            m.fill_next_token_bitmask(mask, i)
    return mask


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor) -> None:
    """Disallowed tokens to -inf, in place (float32 logits [B, V], mask [B, ceil(V / 32)] on their device)."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=logits.shape[1])
