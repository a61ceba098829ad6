"""Test helpers: a scheduled extend over requests with cached prefixes (extend-graph and piecewise tests), and
a stand-in for a model step's sampling (scheduler tests)."""

import torch

from ostinato.attention.forward_batch import ForwardMode
from ostinato.engine.request import Request
from ostinato.runner.scheduled_batch import ScheduledBatch
from ostinato.sampling_params import SamplingParams


def extend_batch(runner, prompts, prefix_lens):
    """Requests whose first prefix_lens[i] tokens are cached (by an earlier eager extend), and a scheduled
    extend of the rest."""
    kv, reqs = runner.kv_manager, []
    for i, (seq, p) in enumerate(zip(prompts, prefix_lens, strict=True)):
        r = Request(str(i), seq, SamplingParams(), seed=0)
        r.req_pool_idx = runner.req_to_token_pool.alloc()
        reqs.append(r)
        if p:
            loc = kv.extend(r.req_pool_idx, 0, p)
            runner.forward(runner.prepare(ScheduledBatch(ForwardMode.EXTEND, [r], [0], [p], loc, [True])))
            r.kv_len = p
    lens = [len(s) - p for s, p in zip(prompts, prefix_lens, strict=True)]
    locs = [kv.extend(r.req_pool_idx, p, p + n) for r, p, n in zip(reqs, prefix_lens, lens, strict=True)]
    for r, n in zip(reqs, lens, strict=True):
        r.kv_len += n
    return ScheduledBatch(ForwardMode.EXTEND, reqs, list(prefix_lens), lens, torch.cat(locs), [True] * len(reqs)), reqs



def record_slots(kv, rows, kv_lens, loc) -> None:
    """What a decode step's forward does first (NextTokenBuffer.begin_decode_): token kv_lens[i] of request row
    rows[i] gets slot loc[i] in req_to_token (`KVManager.extend_decode` takes slots without recording them)."""
    table = kv.req_pool.req_to_token
    table[list(rows), list(kv_lens)] = loc.to(table.dtype)


def record_decode_slots(kv, batch) -> None:
    """`record_slots` for a scheduled decode batch (nothing for other steps)."""
    if batch.mode is ForwardMode.DECODE:
        record_slots(kv, [r.req_pool_idx for r in batch.reqs], batch.prefix_lens, batch.out_cache_loc)


def emit_random_tokens(sched, batch, rng) -> None:
    """What a step does to the scheduler without a model: a decode step records its slots
    (`record_decode_slots`), each row that samples gets a random token below 100, and a request that then stops is
    finished."""
    record_decode_slots(sched.kv, batch)
    for req, emits in zip(batch.reqs, batch.sample_mask, strict=True):
        if emits:
            req.output_token_ids.append(rng.randrange(100))
            req.check_stop_token()
            if req.finish_reason:
                sched.finish(req, req.finish_reason)
