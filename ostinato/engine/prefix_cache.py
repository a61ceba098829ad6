"""The scheduler's side of prefix caching: requests meet the radix tree here.

A request's `req_to_token` row is two parts: tokens [0, cached_len) are slots owned by the tree and locked
through `req.last_node`; tokens [cached_len, kv_len) are slots the request allocated itself. The request's
slots join the tree when it finishes, is retracted or aborted (`release`) and at chunk boundaries while it
prefills (`cache_unfinished`); duplicates of what the tree already holds are freed. Only tokens whose id is
known and whose K/V was computed (a launched step writes it before any later step reads it) are cached:
never a pending (in flight) token, and never positions past `kv_len`.

With the cache disabled (`tree is None`) every method falls back to plain KV bookkeeping.
"""

import torch

from ostinato.engine.request import Request
from ostinato.mem.kv_manager import KVManager
from ostinato.mem.radix_cache import RadixCache


def cache_key(req: Request, n: int) -> list[int]:
    """The tree key of the request's first n tokens: its token ids, except that an image placeholder token
    becomes an id derived from its image's content hash, so two different images never share K/V."""
    ids = req.all_token_ids[:n]
    if req.mm is not None:
        for row, key in zip(req.mm.image_rows.tolist(), req.mm.placeholder_keys(), strict=True):
            if row >= n:
                break
            ids[row] = key
    return ids


class PrefixCache:
    def __init__(self, kv: KVManager, enabled: bool = True) -> None:
        self.kv = kv
        self.page_size = kv.page_size
        self.tree = RadixCache(kv.allocator) if enabled else None
        # req_to_token writes queued by `admit` and done together by `flush_rows`: (row, first token, slot tensors)
        self._row_writes: list[tuple[int, int, list[torch.Tensor]]] = []
        self.query_tokens = 0  # prompt tokens of admitted requests (first admission only)
        self.hit_tokens = 0  # of those, taken from the cache

    @property
    def enabled(self) -> bool:
        return self.tree is not None

    @staticmethod
    def _known_len(req: Request) -> int:
        return req.seq_len - req.num_pending

    def _free(self, slots: torch.Tensor, start: int, end: int) -> None:
        """Free the pages of slots[start:end] (int64 slots or an int32 row; start page-aligned)."""
        if end > start:
            p = self.page_size
            self.kv.allocator.free_pages_(self.kv.allocator.pages_of(slots[start:end:p].to(torch.int64)))

    def flush_rows(self) -> None:
        """Do the queued req_to_token writes, in one copy. Whatever reads those rows runs after it: the scheduler
        calls it before it takes slots for a batch, and every method here that reads a row calls it first."""
        if self._row_writes:
            rows, starts, values = zip(*self._row_writes, strict=True)
            self._row_writes = []
            self.kv.write_rows(list(rows), list(starts), list(values))

    # ------------------------------------------------------------------ capacity
    def available_pages(self) -> int:
        """Free pages, counting what eviction can free."""
        extra = self.tree.evictable_size // self.page_size if self.tree is not None else 0
        return self.kv.allocator.available_pages() + extra

    def ensure_pages(self, n: int) -> None:
        """Evict until n pages are free (the caller checked `available_pages`)."""
        short = n - self.kv.allocator.available_pages()
        if short > 0 and self.tree is not None:
            self.tree.evict(short * self.page_size)

    def evictable_tokens(self) -> int:
        return self.tree.evictable_size if self.tree is not None else 0

    # ------------------------------------------------------------------ admission
    def match_len(self, req: Request) -> int:
        """Tokens of the request's longest cached prefix (for the longest-prefix-first policy)."""
        if self.tree is None:
            return 0
        n = min(req.seq_len - 1, self._known_len(req))
        return sum(len(v) for v in self.tree.match_values(cache_key(req, n))[0])

    def admit(self, req: Request) -> None:
        """The request just got its request slot: point its row at the longest cached prefix (never the
        last token: the step must compute it to have logits) and lock that prefix."""
        req.kv_len = req.cached_len = 0
        if self.tree is None:
            return
        # prompt logprobs need the logits of every prompt position: nothing is taken from the cache then
        n = 0 if req.wants_prompt_logprobs else min(req.seq_len - 1, self._known_len(req))
        values, node = self.tree.match_values(cache_key(req, n))
        m = sum(len(v) for v in values)
        if m:  # written with the other admissions' rows by flush_rows
            self._row_writes.append((req.req_pool_idx, 0, values))
        self.tree.lock(node)
        req.last_node, req.kv_len, req.cached_len = node, m, m

    def admitted(self, req: Request) -> None:
        """Admission succeeded: count the hit (first admission only; a retracted request's re-admission
        is not a new query)."""
        if req.num_cached_tokens is None:
            req.num_cached_tokens = req.kv_len
            self.query_tokens += len(req.prompt_token_ids)
            self.hit_tokens += min(req.kv_len, len(req.prompt_token_ids))

    # ------------------------------------------------------------------ caching
    def cache_unfinished(self, reqs: list[Request]) -> None:
        """Chunk boundary: move the prefilled whole pages of each request into the tree; a row then uses the
        tree's slots (a duplicate of what another request cached meanwhile is freed), and its lock moves down.
        A fixed handful of device ops for all the requests: one gather of their rows, one copy of the fixes."""
        if self.tree is None:
            return
        self.flush_rows()
        todo = [(r, self.tree.aligned(min(r.kv_len, self._known_len(r)))) for r in reqs]
        todo = [(r, n) for r, n in todo if n > r.cached_len]
        if not todo:
            return
        rows = self.kv.read_rows([r.req_pool_idx for r, _ in todo], [n for _, n in todo])
        for (req, n), slots in zip(todo, rows, strict=True):
            key = cache_key(req, n)
            existing = self.tree.insert(key, slots)
            values, node = self.tree.match_values(key)
            assert sum(len(v) for v in values) == n
            if existing > req.cached_len:  # the row's slots there duplicate the tree's: free them, use the tree's
                self._free(slots, req.cached_len, existing)
                self._row_writes.append((req.req_pool_idx, req.cached_len, _cut(values, req.cached_len, existing)))
            self.tree.lock(node)
            self.tree.unlock(req.last_node)
            req.last_node, req.cached_len = node, n
        self.flush_rows()

    def release(self, req: Request) -> None:
        """The request leaves the running set (finished, retracted or aborted): its computed whole pages
        join the tree, the rest is freed, its prefix is unlocked (kept in the tree) and its row freed."""
        if self.tree is None:
            self.kv.release(req.req_pool_idx, req.kv_len)
            return
        self.flush_rows()
        row = self.kv.req_pool.req_to_token[req.req_pool_idx]
        n = self.tree.aligned(min(req.kv_len, self._known_len(req)))
        if n > req.cached_len:
            existing = self.tree.insert(cache_key(req, n), row[:n].to(torch.int64))
            self._free(row, req.cached_len, existing)
        else:
            n = req.cached_len
        self._free(row, n, req.kv_len)
        self.tree.unlock(req.last_node)
        req.last_node, req.cached_len = None, 0
        self.kv.req_pool.free(req.req_pool_idx)

    def reset(self) -> int:
        """Drop every unlocked cached prefix (its pages go back to the pool); returns the tokens dropped."""
        return self.tree.evict(self.tree.evictable_size) if self.tree is not None else 0

    # ------------------------------------------------------------------ idle check
    def check_all_free(self, deep: bool = True) -> None:
        """With no live request: every page is free or held, unlocked, by the tree; every row is free. The
        counts are O(1); `deep` also walks the tree's invariants and looks for a page both free and cached, or
        free twice (a sort of every page)."""
        if self.tree is None:
            self.kv.check_all_free(deep)
            return
        a, r, t = self.kv.allocator, self.kv.req_pool, self.tree
        held = t.evictable_size + t.protected_size  # tokens in the tree, a whole number of pages
        if t.protected_size or a.available_pages() + held // self.page_size != a.usable_pages \
                or r.available_size() != r.size:
            raise RuntimeError(
                f"KV leak: {a.usable_pages - a.available_pages()} pages held, {held} tokens in the prefix "
                f"cache ({t.protected_size} locked), {r.size - r.available_size()} request slots held with no "
                "live request")
        if not deep:
            return
        t.check()  # (the size counters used above among its invariants)
        held = t.all_slots()
        pages = torch.cat([a.free_pages, a.pages_of(held[:: self.page_size])])
        if len(torch.unique(pages)) != len(pages) or (len(pages) and int(pages.min()) < a.reserved_pages):
            raise RuntimeError("KV pool corrupt: a page is free twice, or both free and in the prefix cache")


def _cut(values: list[torch.Tensor], start: int, end: int) -> list[torch.Tensor]:
    """Views of positions [start, end) of the concatenation of `values`."""
    out, offset = [], 0
    for v in values:
        lo, hi = max(start - offset, 0), min(end - offset, len(v))
        if lo < hi:
            out.append(v[lo:hi])
        offset += len(v)
    return out
