"""The last sampled token of every request slot, kept on the device (overlap scheduling).

The engine launches a step before the previous step's tokens reach the host, so a decode input can be
unknown there (PENDING_TOKEN). Every step stores the tokens it samples here, by request slot, and a decode
step resolves its pending inputs from here on the device. Both run on the one compute stream, so a read
always comes after the store of the step that sampled the token.
"""

import torch

# An output token whose step is still on the GPU (overlap scheduling): it holds the token's place, so lengths,
# positions and sampling step counters are right before the value reaches the host.
PENDING_TOKEN = -1


class NextTokenBuffer:
    def __init__(self, num_slots: int, device: torch.device | str) -> None:
        self.sink = num_slots  # the row that requests sampling nothing this step (a partial prefill) store to
        self.tokens = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)

    def store_(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        self.tokens[slots] = token_ids

    def resolve_(self, input_ids: torch.Tensor, req_slots: torch.Tensor) -> None:
        """Replace pending entries of `input_ids` (in place) by their request slot's last sampled token.
        No host sync, so it can run inside a captured graph."""
        torch.where(input_ids != PENDING_TOKEN, input_ids, self.tokens[req_slots], out=input_ids)
