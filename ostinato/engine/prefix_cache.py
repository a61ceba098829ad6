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
        self.query_tokens = 0  # prompt tokens of admitted requests (first admission only)
        self.hit_tokens = 0  # of those, taken from the cache

    @property
    def enabled(self) -> bool:
        return self.tree is not None

    @staticmethod
    def _known_len(req: Request) -> int:
        return req.seq_len - req.num_pending

    def _free(self, row: torch.Tensor, start: int, end: int) -> None:
        """Free the pages of row[start:end] (start page-aligned)."""
        if end > start:
            p = self.page_size
            self.kv.allocator.free_pages_(row[start:end:p].to(torch.int64) // p)

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
        return len(self.tree.match_prefix(cache_key(req, n))[0])

    def admit(self, req: Request) -> None:
        """The request just got its request slot: point its row at the longest cached prefix (never the
        last token: the step must compute it to have logits) and lock that prefix."""
        req.kv_len = req.cached_len = 0
        if self.tree is None:
            return
        n = min(req.seq_len - 1, self._known_len(req))
        slots, node = self.tree.match_prefix(cache_key(req, n))
        m = len(slots)
        if m:
            self.kv.req_pool.req_to_token[req.req_pool_idx, :m] = slots.to(torch.int32)
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
    def cache_unfinished(self, req: Request) -> None:
        """Chunk boundary: move the prefilled whole pages into the tree; the row then uses the tree's
        slots (a duplicate of what another request cached meanwhile is freed), and the lock moves down."""
        if self.tree is None:
            return
        n = self.tree.aligned(min(req.kv_len, self._known_len(req)))
        if n <= req.cached_len:
            return
        row = self.kv.req_pool.req_to_token[req.req_pool_idx]
        key = cache_key(req, n)
        existing = self.tree.insert(key, row[:n].to(torch.int64))
        self._free(row, req.cached_len, existing)
        slots, node = self.tree.match_prefix(key)
        assert len(slots) == n
        row[req.cached_len : n] = slots[req.cached_len :].to(torch.int32)
        self.tree.lock(node)
        self.tree.unlock(req.last_node)
        req.last_node, req.cached_len = node, n

    def release(self, req: Request) -> None:
        """The request leaves the running set (finished, retracted or aborted): its computed whole pages
        join the tree, the rest is freed, its prefix is unlocked (kept in the tree) and its row freed."""
        if self.tree is None:
            self.kv.release(req.req_pool_idx, req.kv_len)
            return
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

    # ------------------------------------------------------------------ idle check
    def check_all_free(self) -> None:
        """With no live request: every page is free or held, unlocked, by the tree; every row is free."""
        if self.tree is None:
            self.kv.check_all_free()
            return
        a, r, t = self.kv.allocator, self.kv.req_pool, self.tree
        t.check()
        held = t.all_slots()
        if t.protected_size or a.available_pages() + len(held) // self.page_size != a.num_pages - 1 \
                or r.available_size() != r.size:
            raise RuntimeError(
                f"KV leak: {a.num_pages - 1 - a.available_pages()} pages held, {len(held)} tokens in the prefix "
                f"cache ({t.protected_size} locked), {r.size - r.available_size()} request slots held with no "
                "live request")
        pages = torch.cat([a.free_pages, held[:: self.page_size] // self.page_size])
        if len(torch.unique(pages)) != len(pages) or (len(pages) and int(pages.min()) < 1):
            raise RuntimeError("KV pool corrupt: a page is free twice, or both free and in the prefix cache")
