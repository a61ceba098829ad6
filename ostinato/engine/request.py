"""A request's state inside the engine core."""

import enum
from dataclasses import dataclass, field
from typing import Any

from ostinato.runner.next_tokens import PENDING_TOKEN
from ostinato.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    rid: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the sampling seed: params.seed, or one drawn when the request arrived
    eos_token_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    req_pool_idx: int | None = None
    kv_len: int = 0  # leading tokens whose K/V is in the cache
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_retractions: int = 0
    num_pending: int = 0  # trailing PENDING_TOKENs in output_token_ids (launched steps not yet resolved)
    mm: Any = None  # multimodal.inputs.MultiModalInputs of a request with images

    @property
    def rope_delta(self) -> int:
        """M-RoPE: a token past the prompt sits at position index + rope_delta (0 without images)."""
        return 0 if self.mm is None else self.mm.rope_delta
    # prefix cache: tokens [0, cached_len) of the row are slots of the radix tree, locked through last_node
    cached_len: int = 0
    last_node: Any = None
    num_cached_tokens: int | None = None  # prompt tokens found in the cache at first admission
    # params.prompt_logprobs: prompt token i+1's logprob entry at index i, filled chunk by chunk; handed out
    # with the request's first output
    prompt_logprobs: list | None = None
    prompt_logprobs_sent: bool = False
    grammar: Any = None  # params.structured_outputs: its xgrammar GrammarMatcher (engine/structured.py)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prompt's logprobs are still to be computed (the prefix cache must not skip any of it)."""
        return (self.params.prompt_logprobs is not None and not self.prompt_logprobs_sent
                and len(self.prompt_logprobs or ()) < len(self.prompt_token_ids) - 1)

    def prompt_logprob_targets(self, start: int, n: int) -> list[int]:
        """The prompt tokens that positions start .. start+n-1 predict (those still inside the prompt)."""
        return self.prompt_token_ids[start + 1 : min(start + n + 1, len(self.prompt_token_ids))]

    @property
    def seq_len(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens start..end of prompt + outputs, without building the whole concatenation (a decoding
        request's one token in a mixed step would otherwise copy its whole sequence)."""
        prompt, n = self.prompt_token_ids, len(self.prompt_token_ids)
        if end <= n:
            return prompt[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return prompt[start:] + self.output_token_ids[: end - n]

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def add_pending(self) -> None:
        """A step that samples this request's next token was launched."""
        self.output_token_ids.append(PENDING_TOKEN)
        self.num_pending += 1

    def resolve_pending(self, token: int) -> None:
        """The oldest pending token arrived: put it in place and check stops. A request that stops here drops
        the later pending tokens (steps launched before the stop was known; their results are ignored)."""
        out = self.output_token_ids
        n = len(out) - self.num_pending + 1  # outputs known, this one included
        out[n - 1] = token
        self.num_pending -= 1
        p = self.params
        if n >= p.min_tokens and (token in self.eos_token_ids or token in p.stop_token_ids) or n >= p.max_tokens:
            self.check_stop_token(n)  # (the common case, no stop, skips the call: this runs per request and step)
            if self.finish_reason is not None and self.num_pending:
                del out[n:]
                self.num_pending = 0

    @property
    def can_sample_more(self) -> bool:
        """False once max_tokens outputs are sampled or pending: another step would be wasted."""
        return len(self.output_token_ids) < self.params.max_tokens

    def check_stop_token(self, n: int | None = None) -> None:
        """After the n-th output token (default: the last) is known: finish on EOS, a stop token id or
        max_tokens."""
        p = self.params
        n = len(self.output_token_ids) if n is None else n
        last = self.output_token_ids[n - 1]
        if n >= p.min_tokens:
            if not p.ignore_eos and last in self.eos_token_ids:
                self.finish_reason, self.stop_reason = "stop", None
            elif last in p.stop_token_ids:
                self.finish_reason, self.stop_reason = "stop", last
        if self.finish_reason is None and n >= p.max_tokens:
            self.finish_reason = "length"
