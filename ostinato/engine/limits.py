"""Request checks against the engine's limits, without torch: the engine core and the HTTP front end
(which learns the limits from the engine process at start-up) raise the same messages."""

from dataclasses import dataclass

from ostinato.sampling_params import SamplingParams

MAX_LOGPROBS = 20  # most top alternatives a request may ask for per token (OpenAI's top_logprobs limit)


class ContextLengthError(ValueError):
    """The prompt, or the prompt plus max_tokens, does not fit in max_model_len."""


@dataclass(frozen=True)
class EngineLimits:
    vocab_size: int
    max_model_len: int


def validate_request(prompt_token_ids: list[int], params: SamplingParams, limits: EngineLimits) -> None:
    """Raise ValueError naming the field and the limit."""
    n = len(prompt_token_ids)
    if n == 0:
        raise ValueError("prompt: must not be empty")
    vocab, max_len = limits.vocab_size, limits.max_model_len
    bad = next((t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab)), None)
    if bad is not None:
        raise ValueError(f"prompt_token_ids: token id {bad!r} is outside the vocabulary [0, {vocab})")
    if n >= max_len:
        raise ContextLengthError(
            f"prompt: {n} tokens leave no room for output in the context length max_model_len={max_len}"
        )
    if n + params.max_tokens > max_len:
        raise ContextLengthError(
            f"max_tokens: prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {n + params.max_tokens} "
            f"exceeds the context length max_model_len={max_len}"
        )
    bad = next((t for t in params.logit_bias or () if t >= vocab), None)
    if bad is not None:
        raise ValueError(f"logit_bias: token id {bad} is outside the vocabulary [0, {vocab})")
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and k > min(MAX_LOGPROBS, vocab):
            raise ValueError(f"{name}: at most {min(MAX_LOGPROBS, vocab)} top logprobs, got {k}")
