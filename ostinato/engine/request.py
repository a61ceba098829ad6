"""A request's state inside the engine core."""

import enum
from dataclasses import dataclass, field

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

    @property
    def seq_len(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def check_stop_token(self) -> None:
        """After a token is appended: finish on EOS, a stop token id or max_tokens."""
        p, n = self.params, len(self.output_token_ids)
        last = self.output_token_ids[-1]
        if n >= p.min_tokens:
            if not p.ignore_eos and last in self.eos_token_ids:
                self.finish_reason, self.stop_reason = "stop", None
            elif last in p.stop_token_ids:
                self.finish_reason, self.stop_reason = "stop", last
        if self.finish_reason is None and n >= p.max_tokens:
            self.finish_reason = "length"
