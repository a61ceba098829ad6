"""Continuous batching: which requests run in the next forward pass, and their KV.

Each step is either an EXTEND batch (new prompts and prompt chunks, bounded by
`chunked_prefill_size` tokens) or a DECODE batch (one token for every running request). Prefill goes
first when it can make progress. When a decode step finds too little KV, the latest-admitted
requests are retracted: their KV is freed and they are requeued at the front, to be recomputed
from prompt + output so far; no request is lost.
"""

from collections import deque

from ostinato.attention.forward_batch import ForwardMode
from ostinato.engine.prefix_cache import PrefixCache
from ostinato.engine.request import Request, RequestStatus
from ostinato.mem.kv_manager import KVManager
from ostinato.runner.scheduled_batch import ScheduledBatch


class Scheduler:
    # Decode rows go longest context first. The attention kernel's programs launch in row order, so the longest
    # start first and the short ones fill the tail: a 256-row step of 100-1,500-token contexts took 4.3% less GPU
    # time on an H200 than in arrival order (docs/gpu-notes.md, forty-fifth session). False: arrival order (A/B)
    longest_first = True

    def __init__(self, kv: KVManager, max_running_requests: int, chunked_prefill_size: int,
                 cache: PrefixCache | None = None, policy: str = "fcfs", enable_mixed_chunk: bool = False) -> None:
        self.kv = kv
        # prefix cache (radix tree); by default off here, on in the engine (EngineArgs.disable_radix_cache)
        self.cache = cache if cache is not None else PrefixCache(kv, enabled=False)
        self.policy = policy  # "lpm": longest cached prefix first among waiting requests; "fcfs"
        self.enable_mixed_chunk = enable_mixed_chunk
        self.max_running_requests = max_running_requests
        self.chunked_prefill_size = chunked_prefill_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admitted, holding a request slot (prefilling or decoding)
        self.num_retractions = 0
        self._extended: list[Request] = []  # the last extend batch: its K/V joins the prefix cache next step

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        # what the last extend computed is shareable now (a later step reads it after it is written)
        self.cache.cache_unfinished([r for r in self._extended if r.status is RequestStatus.RUNNING])
        self._extended = []
        return self._schedule_extend() or self._schedule_decode()

    # ---------------------------------------------------------------- extend
    def _pending(self, req: Request) -> int:
        """Tokens whose K/V must be computed before the request can decode."""
        return req.seq_len - req.kv_len

    def _schedule_extend(self) -> ScheduledBatch | None:
        budget = self.chunked_prefill_size
        reqs, prefix, lens = [], [], []
        taken = 0  # pages promised to the requests above; taken from the pool in one go at the end
        # a request cut by the last chunk continues first, then new ones in arrival order (_pending inlined: this
        # pass over the running requests runs every step)
        partial = [r for r in self.running if len(r.prompt_token_ids) + len(r.output_token_ids) - r.kv_len > 1]
        if not partial and not self.waiting:
            return None
        decoding = len(self.running) - len(partial)
        # mixed chunk: the decoding requests ride along as 1-token extends, inside the token budget
        mixed = [r for r in self.running if self._pending(r) == 1 and r.can_sample_more] \
            if self.enable_mixed_chunk else []
        budget -= len(mixed)
        for req in partial + self._waiting_order():
            if budget <= 0:
                break
            admitted = req.status is RequestStatus.RUNNING
            if not admitted:
                if len(self.running) >= self.max_running_requests:
                    break
                slot = self.kv.req_pool.alloc()
                if slot is None:
                    break
                req.req_pool_idx = slot
                self.cache.admit(req)  # kv_len = the cached prefix, locked
            n = min(self._pending(req), budget)
            # keep one page per decoding request free so the next decode step does not retract at once
            reserve = decoding if not admitted else 0
            pages = self.kv.pages_needed(req.kv_len, req.kv_len + n)
            if pages + taken + reserve > self.cache.available_pages():
                if not admitted:  # undo: unlock the prefix, give the row back
                    self.cache.release(req)
                    req.req_pool_idx, req.kv_len = None, 0
                break
            if not admitted:
                req.status = RequestStatus.RUNNING
                self.waiting.remove(req)
                self.running.append(req)
                self.cache.admitted(req)
            taken += pages
            reqs.append(req)
            prefix.append(req.kv_len)
            lens.append(n)
            budget -= n
        if not reqs:
            return None
        if self.cache.enabled:  # the prefill chunks' pages join the tree next step; decoded tokens join at release
            self._extended = list(reqs)
        for req in mixed:  # those that do not fit decode in a later step (which may retract)
            pages = self.kv.pages_needed(req.kv_len, req.kv_len + 1)
            if pages + taken > self.cache.available_pages():
                continue
            taken += pages
            reqs.append(req)
            prefix.append(req.kv_len)
            lens.append(1)
        self.cache.flush_rows()  # the admitted requests' cached prefixes, in their rows
        self.cache.ensure_pages(taken)
        loc = self.kv.extend_batch([r.req_pool_idx for r in reqs], prefix,
                                   [c + n for c, n in zip(prefix, lens, strict=True)])
        assert loc is not None  # pages were checked above
        for req, n in zip(reqs, lens, strict=True):
            req.kv_len += n
        batch = ScheduledBatch(ForwardMode.EXTEND, reqs, prefix, lens, loc, [r.kv_len == r.seq_len for r in reqs])
        wanting = [r for r in reqs if r.wants_prompt_logprobs]
        if wanting:
            batch.prompt_lp_targets = [r.prompt_logprob_targets(s, n) if r.wants_prompt_logprobs else []
                                       for r, s, n in zip(reqs, prefix, lens, strict=True)]
            batch.prompt_lp_k = max(r.params.prompt_logprobs for r in wanting)
        return batch

    # ---------------------------------------------------------------- decode
    def _schedule_decode(self) -> ScheduledBatch | None:
        # a decoding request has exactly one token without K/V: its last output (or, when a chunk
        # stopped one short, its last prompt token)
        # (overlap scheduling: one whose pending outputs already reach max_tokens will finish; skip it)
        decoding = [r for r in self.running if len(r.prompt_token_ids) + len(r.output_token_ids) - r.kv_len == 1
                    and len(r.output_token_ids) < r.params.max_tokens]  # (seq_len, can_sample_more inlined)
        if not decoding:
            return None
        if self.longest_first:  # every row grows one token a step: the order holds until the batch changes
            decoding.sort(key=lambda r: r.kv_len, reverse=True)
        p = self.kv.page_size
        while True:
            need = len(decoding) if p == 1 else sum(r.kv_len % p == 0 for r in decoding)  # new pages
            if need <= self.cache.available_pages():
                self.cache.ensure_pages(need)
                break
            victim = self.running[-1]
            self.retract(victim)
            if victim in decoding:
                decoding.remove(victim)
            if not decoding:
                return None
        prefix = [r.kv_len for r in decoding]
        loc = self.kv.extend_decode([r.req_pool_idx for r in decoding], prefix)  # the step records them
        assert loc is not None  # pages were checked above
        for r in decoding:
            r.kv_len += 1
        return ScheduledBatch(ForwardMode.DECODE, decoding, prefix, [1] * len(decoding), loc, [True] * len(decoding))

    def retract(self, req: Request) -> None:
        """Free the request's KV and requeue it first; it is recomputed from all its tokens later."""
        self._release(req)
        req.status, req.kv_len = RequestStatus.WAITING, 0
        req.num_retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(req)

    # ---------------------------------------------------------------- finish / abort
    def finish(self, req: Request, reason: str) -> None:
        if req.status is RequestStatus.RUNNING:
            self._release(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = req.finish_reason or reason

    def _release(self, req: Request) -> None:
        self.running.remove(req)
        self.cache.release(req)  # its computed prefix stays in the prefix cache, unlocked
        req.req_pool_idx = None

    def _waiting_order(self) -> list[Request]:
        """Arrival order, or with the "lpm" policy the longest cached prefix first (stable; as SGLang, plain
        arrival order when the queue is long, since every waiting request is matched against the tree)."""
        if (self.policy != "lpm" or not self.cache.enabled or not 1 < len(self.waiting) <= 128
                or len(self.running) >= self.max_running_requests):  # (none can be admitted: no need to sort)
            return list(self.waiting)
        return sorted(self.waiting, key=lambda r: -self.cache.match_len(r))
