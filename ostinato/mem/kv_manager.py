"""Per-request KV bookkeeping on top of the three pool layers."""

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
        return self.extend_batch([req_slot], [cur_len], [new_len])

    def extend_decode(self, req_slots: list[int], kv_lens: list[int]) -> torch.Tensor | None:
        """One new slot per request (token `kv_lens[i]` of request row `req_slots[i]`)."""
        return self.extend_batch(req_slots, kv_lens, [n + 1 for n in kv_lens])

    def extend_batch(self, req_slots: list[int], cur_lens: list[int], new_lens: list[int]) -> torch.Tensor | None:
        """Slots for tokens [cur_lens[i], new_lens[i]) of request row `req_slots[i]`, concatenated in request
        order and recorded in `req_to_token`; None (nothing taken) if KV is short.

        A fixed handful of device ops whatever the number of requests (the per-token index arithmetic is done
        on the host and copied over once): a step that admits 256 prompts costs what one costs."""
        p = self.page_size
        counts = [self.pages_needed(c, n) for c, n in zip(cur_lens, new_lens, strict=True)]
        new_pages = self.allocator.alloc_pages(sum(counts))
        if new_pages is None:
            return None
        table = self.req_pool.req_to_token
        lens = torch.tensor([n - c for c, n in zip(cur_lens, new_lens, strict=True)], dtype=torch.int64)
        cur = torch.tensor(cur_lens, dtype=torch.int64)
        num_tokens = int(lens.sum())
        req_of = torch.repeat_interleave(torch.arange(len(cur_lens)), lens)  # each new token's request
        pos = torch.arange(num_tokens) - (torch.cumsum(lens, 0) - lens - cur)[req_of]  # its position in the row
        host = [torch.tensor(req_slots, dtype=torch.int64)[req_of], pos]
        partial = cur % p != 0  # a request whose last page is partly filled fills it first
        if p > 1:
            # the page of each token: an index into [new pages..., the partly filled last pages...]
            pages = torch.tensor(counts, dtype=torch.int64)
            new_first = torch.cumsum(pages, 0) - pages
            rank = torch.cumsum(partial.to(torch.int64), 0) - 1  # a partial request's place among them
            page_of = pos // p - (cur // p)[req_of]  # 0 = the page holding the request's current end
            fills_last = partial[req_of] & (page_of == 0)
            pick = torch.where(fills_last, len(new_pages) + rank[req_of],
                               new_first[req_of] + page_of - partial[req_of].to(torch.int64))
            host += [pick, pos % p, torch.tensor(req_slots, dtype=torch.int64)[partial], cur[partial] - 1]
        rows, cols, *paged = torch.cat(host).to(table.device, non_blocking=True).split(
            [len(h) for h in host])
        if p == 1:
            loc = new_pages
        else:
            pick, offset, last_rows, last_cols = paged
            last_pages = table[last_rows, last_cols].to(torch.int64) // p
            loc = torch.cat([new_pages, last_pages])[pick] * p + offset
        table[rows, cols] = loc.to(torch.int32)
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
