"""The last sampled token of every request slot, kept on the device (overlap scheduling).

The engine launches a step before the previous step's tokens reach the host, so a decode input can be
unknown there (PENDING_TOKEN). Every step stores the tokens it samples here, by request slot, and a decode
step resolves its pending inputs from here on the device. Both run on the one compute stream, so a read
always comes after the store of the step that sampled the token.

A decode step's bookkeeping before its forward is one launch on CUDA (`begin_decode_`): the pending inputs
resolved, and each row's new KV slot recorded in `req_to_token`. Inside a decode graph that takes no stream
operation of its own per step; the scheduler only takes the slots (`KVManager.extend_decode`).
"""

import torch
import triton
import triton.language as tl

# An output token whose step is still on the GPU (overlap scheduling): it holds the token's place, so lengths,
# positions and sampling step counters are right before the value reaches the host.
PENDING_TOKEN = -1
BEGIN_DECODE_BLOCK = 256


@triton.jit
def _begin_decode_kernel(ids_ptr, slots_ptr, seq_lens_ptr, loc_ptr, tokens_ptr, table_ptr, stride_table, n,
                         PENDING: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    ids = tl.load(ids_ptr + offs, mask=mask)
    slots = tl.load(slots_ptr + offs, mask=mask).to(tl.int64)
    pending = ids == PENDING
    last = tl.load(tokens_ptr + slots, mask=mask & pending)
    tl.store(ids_ptr + offs, tl.where(pending, last, ids), mask=mask)
    col = tl.load(seq_lens_ptr + offs, mask=mask).to(tl.int64) - 1
    loc = tl.load(loc_ptr + offs, mask=mask)
    tl.store(table_ptr + slots * stride_table + col, loc.to(table_ptr.dtype.element_ty), mask=mask)


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

    def begin_decode_(self, input_ids: torch.Tensor, req_slots: torch.Tensor, seq_lens: torch.Tensor,
                      out_cache_loc: torch.Tensor, req_to_token: torch.Tensor) -> None:
        """A decode step's inputs, in place: `resolve_`, and each row's new KV slot recorded at
        req_to_token[req_slots[i], seq_lens[i] - 1] (the token the step writes K/V for). No host sync (graph-safe);
        on CUDA one Triton launch (`launch_begin_decode`), elsewhere its twin in torch ops."""
        if input_ids.is_cuda:
            launch_begin_decode(self.tokens, input_ids, req_slots, seq_lens, out_cache_loc, req_to_token)
            return
        self.resolve_(input_ids, req_slots)
        req_to_token[req_slots, seq_lens - 1] = out_cache_loc.to(req_to_token.dtype)


def launch_begin_decode(tokens: torch.Tensor, input_ids: torch.Tensor, req_slots: torch.Tensor,
                        seq_lens: torch.Tensor, out_cache_loc: torch.Tensor, req_to_token: torch.Tensor) -> None:
    """`NextTokenBuffer.begin_decode_` as one Triton launch (any device Triton runs on, its CPU interpreter too)."""
    n = input_ids.numel()
    assert req_to_token.stride(1) == 1 and all(t.is_contiguous() for t in (input_ids, req_slots, seq_lens))
    _begin_decode_kernel[(triton.cdiv(n, BEGIN_DECODE_BLOCK),)](
        input_ids, req_slots, seq_lens, out_cache_loc, tokens, req_to_token, req_to_token.stride(0), n,
        PENDING=PENDING_TOKEN, BLOCK=BEGIN_DECODE_BLOCK, num_warps=1)
