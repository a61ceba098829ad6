"""Recurrent state of hybrid (Transformer-Mamba) models: one slot per running request (seed 001).

`MambaPool` holds, for every Mamba layer, the conv state (the last `kernel - 1` conv inputs) and the
temporal (SSM) state of each slot, preallocated as one tensor per kind: `conv[layer, slot]` and
`ssm[layer, slot]`. Slot 0 is never handed out: it is the sink padded rows of a captured decode graph
write to. `HybridReqToTokenPool` is a `ReqToTokenPool` whose request rows also own a Mamba slot,
`req_to_mamba[row]`; the slot is taken with the row (at the first prefill chunk, so later chunks continue
from it) and freed with it (finish, abort, retraction: a retracted request recomputes from a fresh slot).
"""

import torch

from ostinato.mem.req_to_token_pool import ReqToTokenPool

SINK_SLOT = 0


class MambaPool:
    def __init__(self, size: int, num_layers: int, conv_dim: int, conv_kernel: int, num_heads: int, head_dim: int,
                 state_size: int, conv_dtype: torch.dtype, ssm_dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.size = size  # usable slots; the sink comes on top
        self.num_layers = num_layers
        # stored slot-major, so a slot's state over every layer is one contiguous block that an alloc zeroes in
        # one vectorized fill (layer-major, the slice is num_layers strided blocks: on an H200 a new Granite-1B
        # request's 57 MB took 8 kernels and about 45 us); `conv` and `ssm` are the layer-major views the model
        # reads: conv[layer] [slots, conv_dim, K-1], ssm[layer] [slots, heads, head_dim, state] (the kernels take
        # the slot stride as given)
        self._conv_slots = torch.zeros(size + 1, num_layers, conv_dim, conv_kernel - 1, dtype=conv_dtype,
                                       device=device)
        self._ssm_slots = torch.zeros(size + 1, num_layers, num_heads, head_dim, state_size, dtype=ssm_dtype,
                                      device=device)
        self.conv = self._conv_slots.transpose(0, 1)
        self.ssm = self._ssm_slots.transpose(0, 1)
        self.free_slots: list[int] = list(range(1, size + 1))

    @staticmethod
    def bytes_per_slot(num_layers: int, conv_dim: int, conv_kernel: int, num_heads: int, head_dim: int,
                       state_size: int, conv_dtype: torch.dtype, ssm_dtype: torch.dtype) -> int:
        conv = conv_dim * (conv_kernel - 1) * torch.empty((), dtype=conv_dtype).element_size()
        ssm = num_heads * head_dim * state_size * torch.empty((), dtype=ssm_dtype).element_size()
        return num_layers * (conv + ssm)

    def bytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.ssm.numel() * self.ssm.element_size()

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self) -> int | None:
        """A slot whose state (every layer) is zero, or None when all are taken."""
        if not self.free_slots:
            return None
        slot = self.free_slots.pop(0)
        self._conv_slots[slot].zero_()  # on the device, no host tensor, no sync
        self._ssm_slots[slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        assert 0 < slot <= self.size and slot not in self.free_slots, f"double free of Mamba slot {slot}"
        self.free_slots.append(slot)


class HybridReqToTokenPool(ReqToTokenPool):
    """Request rows that each own a Mamba slot as well as a row of KV slots."""

    def __init__(self, size: int, max_context_len: int, device: torch.device | str, mamba_pool: MambaPool) -> None:
        super().__init__(size, max_context_len, device)
        self.mamba_pool = mamba_pool
        # int64 [size + 1]: the Mamba slot of each request row (the sink row's: the sink slot), read on the device
        self.req_to_mamba = torch.full((size + 1,), SINK_SLOT, dtype=torch.int64, device=device)
        self._mamba_of: list[int | None] = [None] * size  # host mirror, so freeing never reads the device

    def alloc(self) -> int | None:
        row = super().alloc()
        if row is None:
            return None
        slot = self.mamba_pool.alloc()
        if slot is None:
            super().free(row)
            return None
        self._mamba_of[row] = slot
        self.req_to_mamba[row] = slot
        return row

    def free(self, slot: int) -> None:
        mamba = self._mamba_of[slot]
        assert mamba is not None, f"request row {slot} holds no Mamba slot"
        self.mamba_pool.free(mamba)
        self._mamba_of[slot] = None
        super().free(slot)

    def mamba_slots(self, req_pool_indices: torch.Tensor) -> torch.Tensor:
        """int64 [bs]: the Mamba slot of each request row (a gather on the device)."""
        return self.req_to_mamba[req_pool_indices]

    def check_all_free(self) -> None:
        m = self.mamba_pool
        if m.available_size() != m.size:
            raise RuntimeError(f"Mamba state leak: {m.size - m.available_size()} Mamba slots held with no live request")
