"""The host side of ring.cuh: the constants both weight-streaming CUDA kernels are built with, and how they split a
matrix's rows over blocks and a block's rows into ring tiles (what the launchers size buffers and check shapes by)."""

import torch

SLOT_BYTES = 16384  # kSlotBytes: a ring slot
MAX_SLOTS = 16  # kMaxSlots
WARPS = 8  # kWarps: consumer warps a block
DEFAULT_SMEM_OPTIN = 232448  # H100 / H200: 227 KiB a block, where the device properties do not say


def share(n: int, block: int, blocks: int) -> tuple[int, int]:
    """Rows [r0, r1) of n that block `block` of `blocks` owns (ring.cuh's share())."""
    return n * block // blocks, n * (block + 1) // blocks


def rows_per_tile(k: int) -> int:
    """Rows of width k a ring slot holds (ring.cuh's rows_per_tile): a power of two, at most one a consumer warp."""
    r = min(SLOT_BYTES // (2 * k), WARPS)
    return 1 << (r.bit_length() - 1)


def smem_optin(device: torch.device) -> int:
    """The most shared memory one block of a kernel may ask for on `device`."""
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", DEFAULT_SMEM_OPTIN)
