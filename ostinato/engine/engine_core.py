"""The engine core loop: schedule -> run the model -> process outputs."""

import gc
import logging
import random
import time
from dataclasses import dataclass

import torch

from ostinato.attention.forward_batch import ForwardMode
from ostinato.config import EngineArgs
from ostinato.engine.limits import EngineLimits, validate_request
from ostinato.engine.prefix_cache import PrefixCache
from ostinato.engine.request import Request, RequestStatus
from ostinato.engine.scheduler import ScheduledBatch, Scheduler
from ostinato.engine.structured import GrammarCompiler, accept
from ostinato.engine.tp_workers import start_runner
from ostinato.loader import ModelSource
from ostinato.runner.next_tokens import PENDING_TOKEN
from ostinato.runner.sampler import SampledTensors, TokenLogprobs
from ostinato.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def record_prompt_logprobs(req: Request, start: int, entries: list[TokenLogprobs]) -> None:
    """Store a step's prompt-logprob entries (positions start, start+1, ...: the logprobs of prompt tokens
    start+1, ...) in the request, each cut to its own top-k; positions already there (a retracted request's
    recompute) are skipped."""
    if not entries or req.prompt_logprobs_sent:
        return
    got = req.prompt_logprobs = req.prompt_logprobs or []
    k = req.params.prompt_logprobs
    for pos, (chosen, rank, top_ids, top_lps) in enumerate(entries, start):
        if pos == len(got):
            got.append((chosen, rank, top_ids[:k], top_lps[:k]))


@dataclass(slots=True)
class EngineCoreOutput:
    rid: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when the request asked for logprobs
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache at admission
    # with the request's first output, when it asked for prompt logprobs: one entry per prompt token after the
    # first (its logprob and rank, the top alternatives)
    prompt_logprobs: list[TokenLogprobs] | None = None


def eos_token_ids(source: ModelSource) -> frozenset[int]:
    ids: set[int] = set()
    for holder in (getattr(source, "generation_config", None), source.hf_config, source.tokenizer):
        value = getattr(holder, "eos_token_id", None) if holder is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return frozenset(ids)


class EngineCore:
    def __init__(self, args: EngineArgs, source: ModelSource) -> None:
        self.args = args
        self.runner, self.tp = start_runner(args, source)  # tp: the tensor-parallel workers, or None
        use_cache = not args.disable_radix_cache and self.runner.supports_prefix_cache
        if not args.disable_radix_cache and not use_cache:
            logger.info("prefix caching is off for this model: a hybrid model's cached prefix has no Mamba state")
        cache = PrefixCache(self.runner.kv_manager, enabled=use_cache)
        self.scheduler = Scheduler(self.runner.kv_manager, self.runner.max_running_requests,
                                   self.runner.chunked_prefill_size, cache, args.schedule_policy,
                                   args.enable_mixed_chunk)
        self.eos_token_ids = eos_token_ids(source)
        self.tokenizer = None if args.skip_tokenizer_init else source.tokenizer
        self._grammars: GrammarCompiler | None = None  # made at the first request with structured outputs
        self.requests: dict[str, Request] = {}
        self._rng = random.Random(args.seed)
        self._aborted: list[EngineCoreOutput] = []
        # overlap scheduling: the launched step whose tokens have not been read back yet
        self._in_flight: tuple[ScheduledBatch, SampledTensors] | None = None
        # cumulative, by mode ("extend" / "decode"): forward passes, the tokens they computed, and the wall
        # time of the step() calls that launched them (with overlap, that call waits for the previous step's
        # tokens, so over a run it adds up to the GPU's time as well as the host's)
        self.step_counts = {"extend": 0, "decode": 0}
        self.step_tokens = {"extend": 0, "decode": 0}
        self.step_seconds = {"extend": 0.0, "decode": 0.0}
        # everything alive after start-up (model, pools, graphs) lives as long as the engine: move it out of
        # the collector's reach, so collections triggered by per-step garbage stay short
        gc.collect()
        gc.freeze()
        r = self.runner
        logger.info(
            "model %s (%s, %s) on %s: weights %.2f GiB loaded in %.1f s; KV pool %d tokens (%.2f GiB, %s, page %d); "
            "max_model_len %d; max_running_requests %d; chunked_prefill_size %d",
            source.path, type(r.model).__name__, str(r.dtype).removeprefix("torch."), r.device,
            r.weight_bytes / 2**30, r.load_seconds, r.max_total_tokens, r.kv_cache.bytes() / 2**30,
            str(r.kv_cache.dtype).removeprefix("torch."), args.page_size, r.max_model_len, r.max_running_requests,
            r.chunked_prefill_size,
        )

    def shutdown(self) -> None:
        """Free the engine's device memory now: the runner drops its graphs, pools and model, and what
        start-up froze out of the collector's reach (gc.freeze) is handed back to it and collected."""
        if getattr(self, "runner", None) is None:
            return
        self.runner.shutdown()  # first: its graphs hold NCCL work of the process group the workers leave next
        if self.tp is not None:
            self.tp.stop()
        self.runner = self.scheduler = None
        self.requests.clear()
        self._in_flight = None
        gc.unfreeze()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def limits(self) -> EngineLimits:
        return EngineLimits(self.runner.vocab_size, self.max_model_len)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming the field and the limit; changes nothing."""
        validate_request(prompt_token_ids, params, self.limits)

    def add_request(self, rid: str, prompt_token_ids: list[int], params: SamplingParams, mm=None,
                    grammar=None) -> None:
        """`mm`: the request's MultiModalInputs (images), for a vision model. `grammar`: its structured-output
        matcher when already compiled (`compile_grammar`, the engine process does it off its loop); else it is
        compiled here."""
        if rid in self.requests:
            raise ValueError(f"request_id: {rid!r} is already in use")
        self.validate(prompt_token_ids, params)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(31)
        if mm is not None and not self.runner.is_multimodal:
            raise ValueError(f"multi_modal_data: {type(self.runner.model).__name__} takes no images")
        if params.prompt_logprobs is not None and self.tp is not None:
            raise ValueError("prompt_logprobs: not supported with tensor parallelism yet")
        if params.structured_outputs is not None and grammar is None:
            grammar = self.compile_grammar(params)
        req = Request(rid, list(prompt_token_ids), params, seed, self.eos_token_ids, mm=mm, grammar=grammar)
        self.requests[rid] = req
        self.scheduler.add(req)

    def compile_grammar(self, params: SamplingParams):
        """The request's structured-output matcher; ValueError naming the field (no tokenizer, no xgrammar,
        tensor parallelism, or a constraint that does not compile). Not thread-safe: one thread at a time."""
        if self.tp is not None:
            raise ValueError("structured_outputs: not supported with tensor parallelism yet")
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs: needs the model's tokenizer (the engine runs without one)")
            try:
                self._grammars = GrammarCompiler(self.tokenizer, self.runner.vocab_size,
                                                 sorted(self.eos_token_ids) or None)
            except ImportError:
                raise ValueError("structured_outputs: needs the xgrammar package (pip install xgrammar)") from None
            except Exception as e:  # a tokenizer xgrammar cannot read: the request fails, not the engine
                raise ValueError(f"structured_outputs: xgrammar cannot use this model's tokenizer: {e}") from None
        return self._grammars.matcher(params.structured_outputs)

    def abort(self, rid: str) -> None:
        req = self.requests.pop(rid, None)
        if req is None or req.is_finished:
            return
        self.scheduler.finish(req, "abort")
        self._aborted.append(EngineCoreOutput(rid, [], "abort", num_cached_tokens=req.num_cached_tokens))

    def has_unfinished(self) -> bool:
        if self.tp is not None:
            self.tp.check()  # a dead worker ends the engine (RuntimeError naming it)
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def step(self) -> list[EngineCoreOutput]:
        """Schedule and launch a step, then read back the previous one's tokens while the GPU runs it.

        Overlap scheduling: the host work of a step (scheduling, inputs, output processing) hides behind the
        GPU's work on the previous one. A decode input whose token is still in flight is PENDING_TOKEN on the
        host and is read from the device (NextTokenBuffer). A request that stops on a token still in flight
        may get one wasted step, whose result is dropped. A step that samples for a request with structured
        outputs is read back at once, because the next one's token mask needs that request's outputs on the host
        (penalties count outputs on the device: runner/penalties.py).
        """
        outputs, self._aborted = self._aborted, []
        start = time.perf_counter()
        sched = self.scheduler.schedule()
        launched = None
        if sched is not None:
            launched = sched, (self.runner if self.tp is None else self.tp).step(sched)
            for req, emits in zip(sched.reqs, sched.sample_mask, strict=True):
                if emits:  # (Request.add_pending, inlined: once per request and step)
                    req.output_token_ids.append(PENDING_TOKEN)
                    req.num_pending += 1
        if self._in_flight is not None:
            outputs += self._read_back(*self._in_flight)
        self._in_flight = launched
        if launched is not None and (self.args.disable_overlap_schedule or launched[1].constrained):
            outputs += self._read_back(*launched)
            self._in_flight = None
        if sched is not None:
            mode = "decode" if sched.mode is ForwardMode.DECODE else "extend"
            self.step_counts[mode] += 1
            self.step_tokens[mode] += sum(sched.extend_lens)
            self.step_seconds[mode] += time.perf_counter() - start
        if not self.has_unfinished() and not self.args.disable_leak_check:
            # the counts only: a request arriving now is not held up (the deep check: EngineLoop, when idle)
            self.check_memory_leak(deep=False)
        return outputs

    def _read_back(self, sched: ScheduledBatch, sampled: SampledTensors) -> list[EngineCoreOutput]:
        """Wait for a launched step's tokens; append them and finish the requests they stop."""
        result = sampled.result()
        logprobs = result.logprobs or [None] * len(sched.reqs)
        if result.prompt_logprobs is not None:
            for req, start, entries in zip(sched.reqs, sched.prefix_lens, result.prompt_logprobs, strict=True):
                record_prompt_logprobs(req, start, entries)
        outputs = []
        finished = RequestStatus.FINISHED
        # (per request and step: the engine's hottest host loop at large batches, kept to plain attribute reads)
        for req, token, lp, emits in zip(sched.reqs, result.token_ids, logprobs, sched.sample_mask, strict=True):
            if not emits or req.status is finished:  # finished (stopped, aborted) after this step was launched
                continue
            req.resolve_pending(token)
            if req.grammar is not None and req.finish_reason is None:
                req.finish_reason = accept(req.grammar, token)
                if req.finish_reason == "abort":
                    logger.error("request %s: token %d breaks its structured output constraint", req.rid, token)
            out = EngineCoreOutput(req.rid, [token], None, None, None if lp is None else [lp], req.num_cached_tokens)
            if req.params.prompt_logprobs is not None and not req.prompt_logprobs_sent:
                out.prompt_logprobs, req.prompt_logprobs_sent = req.prompt_logprobs or [], True
            if req.finish_reason is not None:
                self.scheduler.finish(req, req.finish_reason)
                self.requests.pop(req.rid, None)
                out.finish_reason, out.stop_reason = req.finish_reason, req.stop_reason
            outputs.append(out)
        return outputs

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (as vLLM's `reset_prefix_cache`): False, and nothing dropped, while requests
        are unfinished (their prefixes are locked)."""
        if self.has_unfinished():
            return False
        self.scheduler.cache.reset()
        return True

    def check_memory_leak(self, deep: bool = True) -> None:
        """Raise if a page, request slot or Mamba slot is held with no live request. Without `deep`, counts
        only (O(1)); `deep` also walks the prefix cache and looks for pages free twice (milliseconds)."""
        assert not any(r.status is RequestStatus.RUNNING for r in self.requests.values())
        self.scheduler.cache.check_all_free(deep)
