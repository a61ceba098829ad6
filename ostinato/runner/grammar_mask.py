"""The token masks of structured outputs (engine/structured.py compiles the grammars): a step's allowed
tokens per constrained row, filled on the host by each request's xgrammar matcher and applied to the logits
on the device by xgrammar's kernel (its CPU one on the CPU)."""

from __future__ import annotations

from typing import Any

import torch


def fill_bitmask(matchers: list[Any], vocab_size: int) -> torch.Tensor:
    """int32 [len(matchers), ceil(vocab / 32)] on the host: row i the tokens matcher i allows next (a finished
    matcher's row allows all: its request is about to be finished)."""
    import xgrammar as xgr

    mask = xgr.allocate_token_bitmask(len(matchers), vocab_size)
    for i, m in enumerate(matchers):
        if not m.is_terminated():
            m.fill_next_token_bitmask(mask, i)
    return mask


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> None:
    """Disallowed tokens of `rows` to -inf, in place (float32 logits [B, V]; mask row j is for rows[j])."""
    import xgrammar as xgr

    full = torch.full((logits.shape[0], mask.shape[1]), -1, dtype=torch.int32, device=mask.device)
    full[rows] = mask
    xgr.apply_token_bitmask_inplace(logits, full, vocab_size=logits.shape[1])
