"""Layer 1 of the memory pool: request slot -> the KV slot of each of its tokens."""

import torch


class ReqToTokenPool:
    """`req_to_token[r, i]` is the KV-cache slot of token `i` of the request holding row `r`.

    A request keeps its row from its first prefill chunk until it finishes or is retracted, so later
    chunks and decode steps only append to the row. One more row, `sink_row`, is never handed out: a decode
    graph's padded batch rows point at it, so what they record there (slot 0, the KV pool's sink) touches no
    request's row.
    """

    def __init__(self, size: int, max_context_len: int, device: torch.device | str) -> None:
        self.size = size
        self.sink_row = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((size + 1, max_context_len), dtype=torch.int32, device=device)
        self.free_slots: list[int] = list(range(size))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self) -> int | None:
        """One row, or None when every row is taken."""
        if not self.free_slots:
            return None
        return self.free_slots.pop(0)

    def free(self, slot: int) -> None:
        assert 0 <= slot < self.size and slot not in self.free_slots, f"double free of request slot {slot}"
        self.free_slots.append(slot)
