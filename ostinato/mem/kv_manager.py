"""Per-request KV bookkeeping on top of the three pool layers."""

import numpy as np
import torch

from ostinato.mem.req_to_token_pool import ReqToTokenPool
from ostinato.mem.token_allocator import TokenToKVPoolAllocator


class KVManager:
    """Grows and releases the paged KV of a request.

    Token `i` of a request lives in page `i // page_size` of that request, at offset `i % page_size`;
    its slot is recorded in `req_to_token[req_slot, i]`. All slot arithmetic is tensor ops: no Python
    loop over tokens.
    """

    def __init__(self, req_pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator) -> None:
        self.req_pool = req_pool
        self.allocator = allocator
        self.page_size = allocator.page_size

    def warm_up(self) -> None:
        """Launch once the device ops that a prefix cache's first duplicate frees and row writes would otherwise
        launch first, mid-serving. With CUDA's lazy module loading a kernel's first launch loads it: the floor
        division in `pages_of` and the int64 concatenation cost a step 50-80 ms on an H100 (a process's second
        generate of the same prompts: `benchmarks/profile_first_steps.py`). Changes no state."""
        first = self.req_pool.req_to_token[0, :2].to(torch.int64)
        self.allocator.pages_of(first)
        torch.cat([first, first]).to(torch.int32)

    def pages_needed(self, cur_len: int, new_len: int) -> int:
        p = self.page_size
        return -(-new_len // p) - -(-cur_len // p)

    def extend(self, req_slot: int, cur_len: int, new_len: int) -> torch.Tensor | None:
        """Slots for tokens [cur_len, new_len) of the request, or None (nothing taken) if KV is short."""
        return self.extend_batch([req_slot], [cur_len], [new_len])

    def extend_decode(self, req_slots: list[int], kv_lens: list[int]) -> torch.Tensor | None:
        """One new slot per request (token `kv_lens[i]` of request row `req_slots[i]`), not yet in req_to_token:
        the decode step that uses them records them there on the device before anything reads them
        (NextTokenBuffer.begin_decode_, the first thing every decode forward runs)."""
        if self.page_size > 1:
            return self.extend_batch(req_slots, kv_lens, [n + 1 for n in kv_lens], record=False)
        # page 1 (extend_batch's arithmetic, short-cut: this runs every decode step): a page per request
        pages = self.allocator.alloc_pages(len(req_slots))
        return None if pages is None else self.allocator.page_slots(pages)

    def extend_batch(self, req_slots: list[int], cur_lens: list[int], new_lens: list[int],
                     record: bool = True) -> torch.Tensor | None:
        """Slots for tokens [cur_lens[i], new_lens[i]) of request row `req_slots[i]`, concatenated in request
        order and recorded in `req_to_token` (unless `record` is False); None (nothing taken) if KV is short.

        A fixed handful of device ops whatever the number of requests (the per-token index arithmetic is done
        on the host and copied over once): a step that admits 256 prompts costs what one costs."""
        p = self.page_size
        counts = [self.pages_needed(c, n) for c, n in zip(cur_lens, new_lens, strict=True)]
        new_pages = self.allocator.alloc_pages(sum(counts))
        if new_pages is None:
            return None
        table = self.req_pool.req_to_token
        cur = np.asarray(cur_lens, dtype=np.int64)
        slots = np.asarray(req_slots, dtype=np.int64)
        req_of, pos = token_positions(cur, np.asarray(new_lens, dtype=np.int64) - cur)
        host = [slots[req_of], pos]
        if p > 1:
            partial = cur % p != 0  # a request whose last page is partly filled fills it first
            # the page of each token: an index into [new pages..., the partly filled last pages...]
            pages = np.asarray(counts, dtype=np.int64)
            new_first = np.cumsum(pages) - pages
            rank = np.cumsum(partial) - 1  # a partial request's place among them
            page_of = pos // p - (cur // p)[req_of]  # 0 = the page holding the request's current end
            fills_last = partial[req_of] & (page_of == 0)
            pick = np.where(fills_last, len(new_pages) + rank[req_of], new_first[req_of] + page_of - partial[req_of])
            host += [pick, pos % p, slots[partial], cur[partial] - 1]
        rows, cols, *paged = to_device(host, table.device)
        if p == 1:
            loc = self.allocator.page_slots(new_pages)
        else:
            pick, offset, last_rows, last_cols = paged
            last_pages = self.allocator.pages_of(table[last_rows, last_cols].to(torch.int64))
            loc = self.allocator.page_slots(torch.cat([new_pages, last_pages])[pick]) + offset
        if record:
            table[rows, cols] = loc.to(torch.int32)
        return loc

    def read_rows(self, req_slots: list[int], lens: list[int]) -> list[torch.Tensor]:
        """Slots of tokens [0, lens[i]) of each request row, as int64 (one gather for all rows)."""
        table = self.req_pool.req_to_token
        return list(table[row_index(req_slots, [0] * len(lens), lens, table.device)].to(torch.int64).split(lens))

    def write_rows(self, req_slots: list[int], starts: list[int], values: list[list[torch.Tensor]]) -> None:
        """Record `values[i]` (slot tensors, concatenated) at tokens starts[i].. of row req_slots[i] (one copy for
        all rows)."""
        table = self.req_pool.req_to_token
        index = row_index(req_slots, starts, [sum(len(v) for v in vs) for vs in values], table.device)
        table[index] = torch.cat([v for vs in values for v in vs]).to(torch.int32)

    def release(self, req_slot: int, kv_len: int) -> None:
        """Free the request's pages (its first `kv_len` tokens hold KV) and its request slot."""
        if kv_len:
            first_slots = self.req_pool.req_to_token[req_slot, 0:kv_len : self.page_size]
            self.allocator.free_pages_(self.allocator.pages_of(first_slots.to(torch.int64)))
        self.req_pool.free(req_slot)

    def check_all_free(self, deep: bool = True) -> None:
        """Raise if any page or request slot is still held (call when no request is live). The counts are O(1);
        `deep` also looks for a page on the free list twice (a sort of the whole list: ~1 ms on a GPU, ~0.1 s
        on a CPU at millions of pages)."""
        a, r = self.allocator, self.req_pool
        if a.available_pages() != a.usable_pages or r.available_size() != r.size:
            raise RuntimeError(
                f"KV leak: {a.usable_pages - a.available_pages()} pages and "
                f"{r.size - r.available_size()} request slots held with no live request"
            )
        check_states = getattr(r, "check_all_free", None)  # hybrid models: the Mamba slots too
        if check_states is not None:
            check_states()
        if deep and len(torch.unique(a.free_pages)) != a.available_pages():
            raise RuntimeError("KV pool corrupt: a page is on the free list twice")


# The host side of the row bookkeeping is numpy: single-threaded (torch's CPU ops woke its thread pool, which then
# spun on every core while serving).
def token_positions(starts: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For request i's tokens starts[i] .. starts[i] + lens[i], flattened in request order: each token's request
    index and its position in the request's row."""
    req_of = np.repeat(np.arange(len(lens)), lens)
    pos = np.arange(int(lens.sum())) - (np.cumsum(lens) - lens - starts)[req_of]
    return req_of, pos


def row_index(rows: list[int], starts: list[int], lens: list[int], device: torch.device
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) index tensors of req_to_token[rows[i], starts[i] : starts[i] + lens[i]], concatenated."""
    req_of, pos = token_positions(np.asarray(starts, dtype=np.int64), np.asarray(lens, dtype=np.int64))
    r, c = to_device([np.asarray(rows, dtype=np.int64)[req_of], pos], device)
    return r, c


def to_device(host: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """int64 host vectors on `device`, through one copy from pinned memory on CUDA (non-blocking: the host
    prepares a step while the device runs the previous one)."""
    flat = torch.from_numpy(np.concatenate(host))
    if device.type == "cuda":
        flat = flat.pin_memory()
    return list(flat.to(device, non_blocking=True).split([len(h) for h in host]))
