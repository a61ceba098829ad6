"""Per-request sampling parameters (vLLM's field names and defaults)."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

GREEDY_EPS = 1e-5  # temperatures below this mean greedy decoding (vLLM's threshold)
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # what an int field may hold: the engine's messages carry int64


def _is_int64(x: object) -> bool:
    return _is_int(x) and INT64_MIN <= x <= INT64_MAX


class SamplingParamsTypeError(TypeError, ValueError):
    """A field of the wrong type. A TypeError, and a ValueError too, so callers that map ValueErrors to
    "bad request" (the server, the CLI) report it like any other invalid value."""


def _str_list(name: str, value: object) -> list:
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list | tuple):
        raise SamplingParamsTypeError(f"{name} must be a string or a list of strings, got {value!r}")
    return list(value)


@dataclass
class StructuredOutputsParams:
    """Constrain the output (vLLM's StructuredOutputsParams): exactly one of a JSON schema (a dict or its JSON
    text), any JSON object, a regular expression, one of a list of strings, or an EBNF grammar. The engine
    compiles it with xgrammar and masks every step's logits to the tokens it allows."""

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # JSON (json, json_object) without whitespace between its tokens (vLLM's option): otherwise the grammar
    # allows any, and a model can spend its tokens on it
    disable_any_whitespace: bool = False

    @classmethod
    def from_dict(cls, d: dict) -> StructuredOutputsParams:
        """From a JSON object (the server's `structured_outputs`, the engine's messages); an unknown key is an
        error that lists the fields."""
        try:
            return cls(**d)
        except TypeError:  # an unknown or non-string key
            fields = ", ".join(f.name for f in dataclasses.fields(cls))
            raise SamplingParamsTypeError(f"structured_outputs: the fields are {fields}; got {d!r}") from None

    def __post_init__(self) -> None:
        set_ = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        set_ += ["json_object"] if self.json_object is True else []
        if len(set_) != 1:
            raise ValueError(f"structured_outputs: exactly one of json, json_object, regex, choice, grammar, got "
                             f"{set_ or 'none'}")
        if self.json is not None and not isinstance(self.json, str | dict):
            raise ValueError(f"structured_outputs.json: a JSON schema (dict or JSON text), got {self.json!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name}: a non-empty string, got {value!r}")
        if self.choice is not None and (not isinstance(self.choice, list | tuple) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"structured_outputs.choice: a non-empty list of non-empty strings, got {self.choice!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace: a boolean, got "
                             f"{self.disable_any_whitespace!r}")


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None  # normalized to list[str]
    stop_token_ids: list[int] | None = None  # normalized to list[int]
    ignore_eos: bool = False
    max_tokens: int = 16
    min_tokens: int = 0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # token id -> a bias added to its logit before sampling (OpenAI's logit_bias; -100 bans a token, +100
    # all but forces it); token ids are checked against the vocabulary with the engine's limits
    logit_bias: dict[int, float] | None = None
    # per prompt token after the first: its logprob and the top `prompt_logprobs` alternatives (vLLM's); such a
    # request's prompt is computed whole (no prefix-cache hit)
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self.stop = [] if self.stop is None else _str_list("stop", self.stop)
        if isinstance(self.structured_outputs, dict):  # (as it crosses to the engine process)
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise SamplingParamsTypeError("structured_outputs must be a StructuredOutputsParams, got "
                                          f"{self.structured_outputs!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise SamplingParamsTypeError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
            self.logit_bias = dict(self.logit_bias) or None
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, list | tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        else:
            raise SamplingParamsTypeError(f"stop_token_ids must be a list of ints >= 0, got {self.stop_token_ids!r}")
        self._validate()

    def _validate(self) -> None:
        """Every field, in declaration order; the message starts with the field's name."""

        def check(ok: bool, msg: str, value: object) -> None:
            if not ok:
                raise ValueError(f"{msg}, got {value!r}")

        def real(name: str) -> float:
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise SamplingParamsTypeError(f"{name} must be a number, got {value!r}")
            check(math.isfinite(value), f"{name} must be finite", value)
            return value

        def flag(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise SamplingParamsTypeError(f"{name} must be a bool, got {value!r}")

        check(_is_int(self.n) and self.n >= 1, "n must be an int >= 1", self.n)
        check(-2.0 <= real("presence_penalty") <= 2.0, "presence_penalty must be in [-2, 2]", self.presence_penalty)
        check(-2.0 <= real("frequency_penalty") <= 2.0, "frequency_penalty must be in [-2, 2]",
              self.frequency_penalty)
        check(real("repetition_penalty") > 0.0, "repetition_penalty must be > 0", self.repetition_penalty)
        check(real("temperature") >= 0.0, "temperature must be >= 0", self.temperature)
        check(0.0 < real("top_p") <= 1.0, "top_p must be in (0, 1]", self.top_p)
        check(_is_int64(self.top_k) and self.top_k >= -1, "top_k must be -1, 0 (disabled) or in [1, 2**63 - 1]",
              self.top_k)
        check(0.0 <= real("min_p") <= 1.0, "min_p must be in [0, 1]", self.min_p)
        check(self.seed is None or _is_int64(self.seed), "seed must be None or an int in [-2**63, 2**63 - 1]",
              self.seed)
        check(all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings", self.stop)
        check(
            all(_is_int64(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids must be ints in [0, 2**63 - 1]",
            self.stop_token_ids,
        )
        flag("ignore_eos")
        check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens must be >= 1", self.max_tokens)
        check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens must be >= 0", self.min_tokens)
        check(
            self.min_tokens <= self.max_tokens,
            f"min_tokens must be <= max_tokens ({self.max_tokens})",
            self.min_tokens,
        )
        check(
            self.logprobs is None or (_is_int(self.logprobs) and self.logprobs >= 0),
            "logprobs must be None or an int >= 0",
            self.logprobs,
        )
        check(
            self.prompt_logprobs is None or (_is_int(self.prompt_logprobs) and self.prompt_logprobs >= 0),
            "prompt_logprobs must be None or an int >= 0",
            self.prompt_logprobs,
        )
        for name in ("skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output"):
            flag(name)
        for token, bias in (self.logit_bias or {}).items():
            check(_is_int64(token) and token >= 0, "logit_bias: keys must be token ids (ints >= 0)", token)
            ok = isinstance(bias, numbers.Real) and not isinstance(bias, bool) and math.isfinite(bias)
            check(ok and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS,
                  f"logit_bias: values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}] (token {token})",
                  bias)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        """A presence, frequency or repetition penalty: its sampling reads the counts of the request's earlier
        outputs (and its prompt's tokens, for a repetition penalty)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k >= 1

    def clone(self) -> SamplingParams:
        """A copy with its own stop lists (replace() re-runs __post_init__, which copies them)."""
        return dataclasses.replace(self)
