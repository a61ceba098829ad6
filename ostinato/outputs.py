"""What generation returns, shaped like vLLM's RequestOutput."""

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float  # log_softmax of the logits after penalties, before temperature
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id; None for EOS / length
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs (with SamplingParams.logprobs)
    logprobs: list[dict[int, Logprob]] | None = None  # per token: the sampled one and the top `logprobs` others

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int | None = None  # prompt tokens taken from the prefix cache (the first sample's, n > 1)
    # SamplingParams.prompt_logprobs: per prompt token, None for the first, else the token and the top
    # alternatives (vLLM's form)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
