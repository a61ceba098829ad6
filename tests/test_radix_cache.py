"""The radix tree driven directly against a plain dict-of-prefixes model, and the scheduler with the prefix
cache (no model): slots conserved, locks honoured, every cached prefix matchable, nothing lost."""

import random

import pytest
import torch
from batch_helpers import emit_random_tokens, record_decode_slots

from ostinato.engine.prefix_cache import PrefixCache
from ostinato.engine.request import Request
from ostinato.engine.scheduler import Scheduler
from ostinato.mem.kv_manager import KVManager
from ostinato.mem.radix_cache import RadixCache
from ostinato.mem.req_to_token_pool import ReqToTokenPool
from ostinato.mem.token_allocator import TokenToKVPoolAllocator
from ostinato.sampling_params import SamplingParams


def tree_prefixes(tree: RadixCache) -> dict[tuple, int]:
    """Every cached whole-page prefix -> the slot of its last page's first token."""
    out, p = {}, tree.page_size
    stack = [(tree.root, ())]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            for j in range(0, len(child.key), p):
                out[prefix + tuple(child.key[: j + p])] = int(child.value[j])
            stack.append((child, prefix + tuple(child.key)))
    return out


@pytest.mark.parametrize("page", [1, 2])
def test_random_ops_against_dict_model(page):
    rng = random.Random(page)
    num_pages = 120
    alloc = TokenToKVPoolAllocator(num_pages * page, page, "cpu")
    tree = RadixCache(alloc)
    model: dict[tuple, int] = {}  # cached prefix -> slot of its last page (first token of the page)
    locks: list[tuple[object, tuple]] = []  # (node, prefix) locked by the test
    lock_count: dict[tuple, int] = {}  # prefix -> how many locks cover it

    def rand_key() -> list[int]:
        pages = rng.randint(1, 10)
        if model and rng.random() < 0.6:  # extend an existing prefix: lots of sharing and splits
            base = list(rng.choice(list(model)))[: rng.randint(1, 10) * page]
        else:
            base = []
        return base + [rng.randrange(3) for _ in range(pages * page)]

    for step in range(3000):
        op = rng.random()
        if op < 0.4:  # insert
            key = rand_key()
            n = len(key) // page
            short = n - alloc.available_pages()
            if short > 0:
                tree.evict(short * page)
                after = tree_prefixes(tree)
                assert set(after) <= set(model)
                assert all(lock_count.get(k, 0) == 0 for k in model if k not in after), "a locked prefix was evicted"
                model = {k: model[k] for k in after}
            pages = alloc.alloc_pages(n)
            if pages is None:  # everything left is locked
                continue
            value = (pages[:, None] * page + torch.arange(page)).flatten()
            had = sum(1 for j in range(1, n + 1) if tuple(key[: j * page]) in model)
            existing = tree.insert(key, value)
            assert existing == had * page
            alloc.free_pages_(pages[:had])  # the caller's duplicates
            for j in range(had, n):
                model[tuple(key[: (j + 1) * page])] = int(value[j * page])
        elif op < 0.7:  # match (any key, cached or not)
            key = rand_key() if rng.random() < 0.5 or not model else list(rng.choice(list(model)))
            key = key + [rng.randrange(3) for _ in range(rng.randrange(page + 1))]  # unaligned tail
            slots, node = tree.match_prefix(key)
            m = 0
            while tuple(key[: m + page]) in model and m + page <= len(key):
                m += page
            assert len(slots) == m
            for j in range(0, m, page):
                assert int(slots[j]) == model[tuple(key[: j + page])]
                assert torch.equal(slots[j : j + page], slots[j] + torch.arange(page))
            if m and rng.random() < 0.5:  # lock it
                tree.lock(node)
                locks.append((node, tuple(key[:m])))
                for j in range(page, m + 1, page):
                    lock_count[tuple(key[:j])] = lock_count.get(tuple(key[:j]), 0) + 1
        elif op < 0.85 and locks:  # unlock
            node, prefix = locks.pop(rng.randrange(len(locks)))
            tree.unlock(node)
            for j in range(page, len(prefix) + 1, page):
                lock_count[prefix[:j]] -= 1
        else:  # evict
            want = rng.randint(1, 30) * page
            before_evictable = tree.evictable_size
            freed = tree.evict(want)
            assert freed >= min(want, before_evictable), "evictable tokens were left while short"
            after = tree_prefixes(tree)
            assert set(after) <= set(model)
            assert all(lock_count.get(k, 0) == 0 for k in model if k not in after), "a locked prefix was evicted"
            model = {k: model[k] for k in after}
        # invariants, every step
        tree.check()
        assert tree.protected_size == page * sum(1 for k in model if lock_count.get(k, 0) > 0)
        if step % 50 == 0:
            assert tree_prefixes(tree) == model
            held = tree.all_slots()
            assert alloc.available_pages() + len(held) // page == num_pages - 1, "a page was lost or duplicated"
            allpages = torch.cat([alloc.free_pages, held[::page] // page])
            assert len(torch.unique(allpages)) == len(allpages)
            for k in rng.sample(list(model), min(10, len(model))):
                assert len(tree.match_prefix(list(k))[0]) == len(k), "a cached prefix is not matchable"
    while locks:
        tree.unlock(locks.pop()[0])
    tree.evict(10**9)
    assert tree.total_size() == 0 and alloc.available_pages() == num_pages - 1


@pytest.mark.parametrize("page", [1, 4])
def test_scheduler_with_prefix_cache_shares_evicts_retracts_and_frees(page):
    """Requests sharing prompts run through the scheduler (outputs made up): the cache hits, eviction and
    retraction both happen, no request is lost and every page ends free or in the tree, unlocked."""
    rng = random.Random(page)
    kv = KVManager(ReqToTokenPool(6, 512, "cpu"), TokenToKVPoolAllocator(300 + page, page, "cpu"))
    cache = PrefixCache(kv)
    sched = Scheduler(kv, max_running_requests=6, chunked_prefill_size=40, cache=cache, policy="lpm")
    systems = [[rng.randrange(100) for _ in range(rng.randint(20, 60))] for _ in range(3)]
    reqs = []
    for i in range(30):
        prompt = rng.choice(systems) + [rng.randrange(100) for _ in range(rng.randint(1, 30))]
        req = Request(str(i), prompt, SamplingParams(max_tokens=rng.randint(1, 40)), seed=i)
        reqs.append(req)
        sched.add(req)
    steps = 0
    while sched.has_unfinished():
        steps += 1
        assert steps < 5000
        batch = sched.schedule()
        assert batch is not None, "nothing scheduled while requests remain: deadlock"
        assert len(batch.out_cache_loc) == sum(batch.extend_lens)
        record_decode_slots(kv, batch)  # the step's forward, before anything reads the rows
        live = torch.cat([kv.req_pool.req_to_token[r.req_pool_idx, r.cached_len : r.kv_len] for r in sched.running])
        free = kv.allocator.free_pages
        assert not bool(torch.isin(live // page, free).any()), "a running request's slot is on the free list"
        cache.tree.check()
        emit_random_tokens(sched, batch, rng)
    assert sched.num_retractions > 0 and cache.tree.num_evicted > 0
    assert cache.hit_tokens > 0
    assert all(r.finish_reason == "length" and len(r.output_token_ids) == r.params.max_tokens for r in reqs)
    cache.check_all_free()


def test_idle_check_counts_and_deep_check_find_a_page_both_free_and_cached():
    """The O(1) idle check (counts) catches a page held by nobody; a page both on the free list and in the tree,
    with another one lost so the counts balance, passes it and is caught by the deep check."""
    rng = random.Random(7)
    kv = KVManager(ReqToTokenPool(4, 64, "cpu"), TokenToKVPoolAllocator(64, 1, "cpu"))
    cache = PrefixCache(kv)
    cache.tree.insert([rng.randrange(100) for _ in range(8)], kv.allocator.alloc_pages(8))
    cache.check_all_free(deep=True)
    lost = kv.allocator.alloc_pages(1)  # held by no request and not in the tree
    for deep in (False, True):
        with pytest.raises(RuntimeError, match="KV leak"):
            cache.check_all_free(deep)
    cached = cache.tree.all_slots()[:1]
    kv.allocator.free_pages_(cached)  # a cached page now free as well; with `lost` gone the counts balance
    assert lost is not None
    cache.check_all_free(deep=False)
    with pytest.raises(RuntimeError, match="corrupt"):
        cache.check_all_free(deep=True)
