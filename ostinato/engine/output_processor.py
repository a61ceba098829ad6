"""Front-end side of generation: detokenize incrementally, apply stop strings, build RequestOutputs.

Stop strings are found here, after detokenization; the request is then aborted in the core and
reported with finish_reason "stop". Each `process` call also leaves on every updated state what it
added (`delta_text`, `delta_token_ids`, `delta_logprobs`), for streaming.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ostinato.engine.detokenizer import IncrementalDetokenizer, fast_decode
from ostinato.outputs import CompletionOutput, Logprob
from ostinato.sampling_params import SamplingParams

if TYPE_CHECKING:  # (torch and the runner: not loaded by the HTTP processes, which use decode_tokens)
    from ostinato.engine.engine_core import EngineCoreOutput
    from ostinato.runner.sampler import TokenLogprobs


@dataclass
class RequestState:
    rid: str
    prompt_token_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer | None
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None  # per output token, when params.logprobs is set
    num_cached_tokens: int = 0  # prompt tokens the engine found in its prefix cache
    prompt_logprobs: list[TokenLogprobs] | None = None  # with the first output, when params.prompt_logprobs
    # what the latest `process` call added
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprobs] = field(default_factory=list)
    delta_prompt_logprobs: list[TokenLogprobs] | None = None

    @property
    def text(self) -> str:
        return self.detok.output_text if self.detok is not None else ""

    @property
    def cumulative_logprob(self) -> float | None:
        return None if self.logprobs is None else sum(lp[0] for lp in self.logprobs)

    def completion(self, index: int = 0) -> CompletionOutput:
        logprobs = None
        if self.logprobs is not None:
            tokenizer = self.detok.tokenizer if self.detok is not None else None
            pairs = zip(self.token_ids, self.logprobs, strict=False)
            logprobs = [logprob_dict(tokenizer, tok, lp) for tok, lp in pairs]
        return CompletionOutput(index, self.text, list(self.token_ids), self.finish_reason, self.stop_reason,
                                self.cumulative_logprob, logprobs)


def prompt_logprob_dicts(tokenizer, prompt_token_ids: list[int],
                         entries: list[TokenLogprobs]) -> list[dict[int, Logprob] | None]:
    """vLLM's RequestOutput.prompt_logprobs: None for the first prompt token, then each token's dict."""
    return [None] + [logprob_dict(tokenizer, tok, lp) for tok, lp in zip(prompt_token_ids[1:], entries, strict=False)]


def decode_tokens(tokenizer, ids: list[int]) -> list[str]:
    """Each id decoded on its own (special tokens kept): the token strings that logprobs report."""
    if tokenizer is None or not ids:
        return [""] * len(ids)
    return tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False)


def logprob_dict(tokenizer, token_id: int, lp: TokenLogprobs) -> dict[int, Logprob]:
    """vLLM's per-position form: the top alternatives (ranks 1..k), and the sampled token with its own rank."""
    chosen, rank, top_ids, top_lps = lp
    ids = [*top_ids, token_id]
    texts = decode_tokens(tokenizer, ids)
    out = {t: Logprob(v, r + 1, s) for r, (t, v, s) in enumerate(zip(top_ids, top_lps, texts, strict=False))}
    out[token_id] = Logprob(chosen, rank, texts[-1])
    return out


class OutputProcessor:
    """`incremental=False`: text only at the end (no `delta_text` before it) for requests without stop strings
    (IncrementalDetokenizer's), for a caller that does not stream."""

    def __init__(self, tokenizer, incremental: bool = True) -> None:
        self.tokenizer = tokenizer
        self.incremental = incremental
        self.states: dict[str, RequestState] = {}
        self._decode = fast_decode(tokenizer) if tokenizer else None

    def add(self, rid: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        detok = (IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params, self._decode, self.incremental)
                 if self.tokenizer else None)
        logprobs = [] if params.logprobs is not None else None
        self.states[rid] = RequestState(rid, prompt_token_ids, params, detok, [], logprobs=logprobs)

    def remove(self, rid: str) -> None:
        self.states.pop(rid, None)

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestState], list[str]]:
        """Updated request states, and the ids of requests a stop string ended (to abort in the core)."""
        updated: dict[str, RequestState] = {}
        to_abort = []
        for out in outputs:
            state = self.states.get(out.rid)
            if state is None:
                continue
            if out.rid not in updated:
                state.delta_text, state.delta_token_ids, state.delta_logprobs = "", [], []
                state.delta_prompt_logprobs = None
                updated[out.rid] = state
            state.token_ids.extend(out.new_token_ids)
            if out.num_cached_tokens is not None:
                state.num_cached_tokens = out.num_cached_tokens
            if out.prompt_logprobs is not None:
                state.prompt_logprobs = state.delta_prompt_logprobs = out.prompt_logprobs
            state.delta_token_ids.extend(out.new_token_ids)
            if state.logprobs is not None and out.logprobs:
                state.logprobs.extend(out.logprobs)
                state.delta_logprobs.extend(out.logprobs)
            stop_str = None
            if state.detok is not None and out.new_token_ids:
                delta, stop_str = state.detok.push(out.new_token_ids)
                state.delta_text += delta
            if stop_str is None and out.finish_reason is not None and state.detok is not None:
                delta, stop_str = state.detok.flush()  # the held-back tail; it may still complete a stop string
                state.delta_text += delta
            if stop_str is not None:
                state.finish_reason, state.stop_reason = "stop", stop_str
                if out.finish_reason is None:
                    to_abort.append(out.rid)
            elif out.finish_reason is not None:
                state.finish_reason, state.stop_reason = out.finish_reason, out.stop_reason
            if state.finish_reason is not None:
                del self.states[out.rid]
        return list(updated.values()), to_abort
