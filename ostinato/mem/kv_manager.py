"""Per-request KV bookkeeping on top of the three pool layers."""

import itertools

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

    def pages_needed(self, cur_len: int, new_len: int) -> int:
        p = self.page_size
        return -(-new_len // p) - -(-cur_len // p)

    def extend(self, req_slot: int, cur_len: int, new_len: int) -> torch.Tensor | None:
        """Slots for tokens [cur_len, new_len) of the request, or None (nothing taken) if KV is short."""
        p = self.page_size
        new_pages = self.allocator.alloc_pages(self.pages_needed(cur_len, new_len))
        if new_pages is None:
            return None
        row = self.req_pool.req_to_token[req_slot]
        if cur_len % p:  # the last page is partly filled: keep filling it first
            last_page = (row[cur_len - 1 : cur_len].to(torch.int64)) // p
            new_pages = torch.cat([last_page, new_pages])
        pos = torch.arange(cur_len, new_len, dtype=torch.int64, device=row.device)
        loc = new_pages[pos // p - cur_len // p] * p + pos % p
        row[cur_len:new_len] = loc.to(torch.int32)
        return loc

    def extend_decode(self, req_slots: list[int], kv_lens: list[int]) -> torch.Tensor | None:
        """One new slot per request (token `kv_lens[i]` of request row `req_slots[i]`), for a whole decode
        batch in a handful of tensor ops; None (nothing taken) if KV is short."""
        p = self.page_size
        opens_page = [n % p == 0 for n in kv_lens]  # the new token starts a fresh page
        new_pages = self.allocator.alloc_pages(sum(opens_page))
        if new_pages is None:
            return None
        table = self.req_pool.req_to_token
        rows = torch.tensor(req_slots, dtype=torch.int64).to(table.device, non_blocking=True)
        lens = torch.tensor(kv_lens, dtype=torch.int64).to(table.device, non_blocking=True)
        if p == 1:
            loc = new_pages
        else:  # continue the last page (the previous token's slot + 1), or start one of the new pages
            # no boolean-mask indexing: it reads the mask's count back to the host, a sync that would stall
            # overlap scheduling every step; a gather and a where do not
            loc = table[rows, (lens - 1).clamp(min=0)].to(torch.int64) + 1
            if new_pages.numel():
                pick = list(itertools.accumulate(opens_page))  # row i takes new page pick[i] - 1 if it opens one
                picks = torch.tensor([max(j - 1, 0) for j in pick]).to(table.device, non_blocking=True)
                fresh = torch.tensor(opens_page).to(table.device, non_blocking=True)
                loc = torch.where(fresh, new_pages[picks] * p, loc)
        table[rows, lens] = loc.to(torch.int32)
        return loc

    def release(self, req_slot: int, kv_len: int) -> None:
        """Free the request's pages (its first `kv_len` tokens hold KV) and its request slot."""
        if kv_len:
            first_slots = self.req_pool.req_to_token[req_slot, 0:kv_len : self.page_size]
            self.allocator.free_pages_(first_slots.to(torch.int64) // self.page_size)
        self.req_pool.free(req_slot)

    def check_all_free(self) -> None:
        """Raise if any page or request slot is still held (call when no request is live)."""
        a, r = self.allocator, self.req_pool
        if a.available_pages() != a.num_pages - 1 or r.available_size() != r.size:
            raise RuntimeError(
                f"KV leak: {a.num_pages - 1 - a.available_pages()} pages and "
                f"{r.size - r.available_size()} request slots held with no live request"
            )
        check_states = getattr(r, "check_all_free", None)  # hybrid models: the Mamba slots too
        if check_states is not None:
            check_states()
        if len(torch.unique(a.free_pages)) != a.available_pages():
            raise RuntimeError("KV pool corrupt: a page is on the free list twice")
