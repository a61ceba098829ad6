"""Scheduler policy without a model: budgets, admission limits, retraction, no request lost."""

import random

import pytest
from batch_helpers import emit_random_tokens

from ostinato.attention.forward_batch import ForwardMode
from ostinato.engine.request import Request
from ostinato.engine.scheduler import Scheduler
from ostinato.mem.kv_manager import KVManager
from ostinato.mem.req_to_token_pool import ReqToTokenPool
from ostinato.mem.token_allocator import TokenToKVPoolAllocator
from ostinato.sampling_params import SamplingParams


@pytest.mark.parametrize("page,mixed", [(1, False), (4, False), (4, True)])
def test_random_workload_respects_limits_and_finishes_everything(page, mixed):
    rng = random.Random(page)
    kv = KVManager(ReqToTokenPool(6, 512, "cpu"), TokenToKVPoolAllocator(300 + page, page, "cpu"))
    sched = Scheduler(kv, max_running_requests=6, chunked_prefill_size=40, enable_mixed_chunk=mixed)
    mixed_steps = 0
    reqs = []
    for i in range(20):
        req = Request(str(i), [rng.randrange(100) for _ in range(rng.randint(1, 90))],
                      SamplingParams(max_tokens=rng.randint(1, 60)), seed=i)
        reqs.append(req)
        sched.add(req)
    steps = 0
    while sched.has_unfinished():
        steps += 1
        assert steps < 5000
        batch = sched.schedule()
        assert batch is not None, "nothing scheduled while requests remain: deadlock"
        assert len(sched.running) <= 6
        if batch.mode is ForwardMode.EXTEND:
            assert sum(batch.extend_lens) <= 40
            mixed_steps += any(r.kv_len == r.seq_len and n == 1 and p == r.seq_len - 1 > 0 for r, n, p in
                               zip(batch.reqs, batch.extend_lens, batch.prefix_lens, strict=True)) \
                and any(n > 1 for n in batch.extend_lens)
        else:
            assert batch.extend_lens == [1] * len(batch.reqs)
        assert len(batch.out_cache_loc) == sum(batch.extend_lens)
        assert all(req.kv_len <= req.seq_len for req in batch.reqs)
        emit_random_tokens(sched, batch, rng)
    assert sched.num_retractions > 0, "the pool was sized to force retraction"
    assert (mixed_steps > 0) == mixed  # decode tokens rode along with prefill chunks only when mixing
    assert all(r.finish_reason == "length" and len(r.output_token_ids) == r.params.max_tokens for r in reqs)
    kv.check_all_free()


def test_mixed_decoding_rows_do_not_rejoin_the_prefix_cache_each_step():
    """With the prefix cache on, a mixed step's prefill chunks join the tree at the next step, but its decoding
    rows do not: inserting each decoder's whole sequence every mixed step (key building, tree walks, device
    copies) cost tens of ms per step on an H200. Their tokens join the tree when they are released."""
    from ostinato.engine.prefix_cache import PrefixCache

    rng = random.Random(7)
    kv = KVManager(ReqToTokenPool(8, 512, "cpu"), TokenToKVPoolAllocator(2048, 4, "cpu"))
    sched = Scheduler(kv, max_running_requests=8, chunked_prefill_size=32, cache=PrefixCache(kv),
                      enable_mixed_chunk=True)
    for i in range(8):
        sched.add(Request(str(i), [rng.randrange(100) for _ in range(rng.randint(20, 120))],
                          SamplingParams(max_tokens=rng.randint(5, 40)), seed=i))
    inserted: list[Request] = []
    real = sched.cache.cache_unfinished
    sched.cache.cache_unfinished = lambda reqs: (inserted.extend(reqs), real(reqs))[1]
    mixed_steps, last_prefill = 0, set()
    while sched.has_unfinished():
        decoding = {r for r in sched.running if r.seq_len - r.kv_len == 1}
        inserted.clear()
        batch = sched.schedule()
        assert set(inserted) <= last_prefill  # the previous step's prefill rows only (those still running)
        last_prefill = set()
        if batch.mode is ForwardMode.EXTEND:
            last_prefill = {r for r in batch.reqs if r not in decoding}
            mixed_steps += len(last_prefill) < len(batch.reqs)
        emit_random_tokens(sched, batch, rng)
    assert mixed_steps > 0


def test_decode_rows_go_longest_context_first_and_keep_their_order():
    """A decode batch lists its rows longest context first (the attention kernel's programs launch in row order),
    and while no request joins or leaves, each step lists the same requests in the same order, so the runner
    reuses the step's sampling inputs (ModelRunner._sampling_tensors compares the rows by identity)."""
    rng = random.Random(11)
    kv = KVManager(ReqToTokenPool(12, 512, "cpu"), TokenToKVPoolAllocator(4096, 1, "cpu"))
    sched = Scheduler(kv, max_running_requests=12, chunked_prefill_size=64)
    assert sched.longest_first
    for i in range(12):  # arrival order unrelated to length
        sched.add(Request(str(i), [rng.randrange(100) for _ in range(rng.randint(2, 200))],
                          SamplingParams(max_tokens=rng.randint(3, 30)), seed=i))
    reordered, unchanged, last = 0, 0, None
    while sched.has_unfinished():
        batch = sched.schedule()
        if batch.mode is ForwardMode.DECODE:
            assert batch.prefix_lens == sorted(batch.prefix_lens, reverse=True)
            reordered += [r.rid for r in batch.reqs] != sorted((r.rid for r in batch.reqs), key=int)  # not arrival
            if last is not None and {id(r) for r in last} == {id(r) for r in batch.reqs}:
                assert [id(r) for r in last] == [id(r) for r in batch.reqs]
                unchanged += 1
            last = batch.reqs
        emit_random_tokens(sched, batch, rng)
    assert reordered > 5 and unchanged > 5
    kv.check_all_free()
