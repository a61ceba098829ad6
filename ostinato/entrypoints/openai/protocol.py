"""Request schemas (pydantic) of the OpenAI-compatible API and of the Tokn batch endpoint.

Ranges are checked by SamplingParams and the engine limits, whose messages name the field; the
schemas check types and shapes. Unknown fields are ignored, as OpenAI and vLLM do.
"""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

from ostinato.entrypoints.chat_utils import CHAT_ROLES
from ostinato.entrypoints.openai.errors import OpenAIError
from ostinato.sampling_params import SamplingParams, StructuredOutputsParams


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


# fields that OpenAI's schema lets be null, meaning the default (some clients send null for every field they do
# not set); the defaults are the fields' own below
NULL_DEFAULTS = {"n": 1, "stream": False, "echo": False, "logprobs": False}


def _null_is_default(value: Any, info: ValidationInfo) -> Any:
    return NULL_DEFAULTS[info.field_name] if value is None else value


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class SamplingFields(OpenAIModel):
    """Fields shared by the generation endpoints; the extras (top_k, min_p, ignore_eos, ...) are vLLM's."""

    _null_n_stream = field_validator("n", "stream", mode="before")(_null_is_default)

    model: str | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    # refused here until beam search exists (never silently dropped)
    use_beam_search: Any = None
    best_of: int | None = None

    def check_supported(self) -> None:
        if self.use_beam_search:
            _unsupported("use_beam_search", "beam search is not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            _unsupported("best_of", f"only best_of == n ({self.n}) is supported, got {self.best_of}")

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Raises ValueError naming the field (SamplingParams' checks)."""
        return SamplingParams(
            n=self.n,
            presence_penalty=_or(self.presence_penalty, 0.0),
            frequency_penalty=_or(self.frequency_penalty, 0.0),
            repetition_penalty=_or(self.repetition_penalty, 1.0),
            temperature=_or(self.temperature, 1.0),
            top_p=_or(self.top_p, 1.0),
            top_k=_or(self.top_k, 0),
            min_p=_or(self.min_p, 0.0),
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self._logit_bias(),
            structured_outputs=self._structured_outputs(),
        )

    def _structured_given(self) -> dict[str, Any]:
        """The fields that name a structured-output constraint, with their values."""
        given = {name: getattr(self, name) for name in ("guided_json", "guided_regex", "guided_choice",
                                                        "guided_grammar", "structured_outputs")
                 if getattr(self, name) is not None}
        rf = self.response_format
        if rf is not None and (rf.get("type", "text") if isinstance(rf, dict) else None) != "text":
            given["response_format"] = rf
        return given

    @property
    def structured_field(self) -> str | None:
        """The field that names the request's structured-output constraint (the engine's errors say
        "structured_outputs"), or None."""
        return next(iter(self._structured_given()), None)

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """The one constraint the request names, from whichever field names it; OpenAIError naming the field."""
        given = self._structured_given()
        if not given:
            return None
        if len(given) > 1:
            raise OpenAIError(400, f"{', '.join(given)}: give one structured-output constraint, not several",
                              param=next(iter(given)), code="invalid_value")
        (name, value), = given.items()
        try:
            if name == "response_format":
                return response_format_constraint(value)
            if name == "structured_outputs":
                if not isinstance(value, dict):
                    raise ValueError(f"structured_outputs: an object, got {value!r}")
                return StructuredOutputsParams.from_dict(value)
            return StructuredOutputsParams(**{name.removeprefix("guided_"): value})
        except (ValueError, TypeError) as e:
            message = str(e)
            if not message.startswith(name):
                message = f"{name}: {message}"
            raise OpenAIError(400, message, param=name, code="invalid_value") from None

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI's logit_bias keys are token ids written as strings."""
        if not self.logit_bias:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            try:
                out[int(key)] = bias
            except ValueError:
                raise OpenAIError(400, f"logit_bias: keys must be token ids (integers), got {key!r}",
                                  param="logit_bias", code="invalid_value") from None
        return out

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def response_format_constraint(rf: dict[str, Any]) -> StructuredOutputsParams:
    """OpenAI's response_format: {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema"}}."""
    kind = rf.get("type")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ValueError("response_format.json_schema.schema: a JSON schema object is required")
        return StructuredOutputsParams(json=schema)
    raise ValueError(f"response_format.type: one of text, json_object, json_schema, got {kind!r}")


def _unsupported(name: str, why: str) -> None:
    raise OpenAIError(400, f"{name}: {why}", param=name, code="unsupported_value")


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    _null_echo = field_validator("echo", mode="before")(_null_is_default)

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise OpenAIError(400, "suffix: not supported by this server", param="suffix", code="unsupported_value")


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ImageURL(OpenAIModel):
    url: str
    detail: str | None = None


class ImageURLPart(OpenAIModel):
    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(OpenAIModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... reach the chat template
    role: str
    content: str | list[TextPart | ImageURLPart] | None = None

    @property
    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(isinstance(p, ImageURLPart) for p in self.content)

    def for_template(self) -> dict[str, Any]:
        d = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            d["content"] = "".join(p.text for p in self.content if isinstance(p, TextPart))
        elif self.content is None:
            d["content"] = ""
        return d


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    _null_logprobs = field_validator("logprobs", mode="before")(_null_is_default)

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise OpenAIError(400, "tools: not supported by this server", param="tools", code="unsupported_value")
        if not self.messages:
            raise OpenAIError(400, "messages: must not be empty", param="messages", code="invalid_value")
        for i, m in enumerate(self.messages):
            if m.role not in CHAT_ROLES:
                raise OpenAIError(400, f"messages[{i}].role: unknown role {m.role!r} (allowed: "
                                       f"{', '.join(CHAT_ROLES)})", param=f"messages[{i}].role", code="invalid_value")
            if m.content is None and m.role != "assistant":  # (OpenAI's assistant turn may carry tool calls only)
                raise OpenAIError(400, f"messages[{i}].content: missing (required for a {m.role} message)",
                                  param=f"messages[{i}].content", code="invalid_value")

    def num_chars(self) -> int:
        """Characters of the messages' strings (what the chat template gets from the client)."""
        return sum(len(v) for m in self.messages for v in m.for_template().values() if isinstance(v, str))

    @property
    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise OpenAIError(400, "top_logprobs: needs logprobs=true", param="top_logprobs",
                                  code="invalid_value")
            return None
        return self.top_logprobs or 0


class BatchRequest(SamplingFields):
    """Tokn's `POST /completions`: {"prompts": [...]} -> {"0": text, "1": text, ...}."""

    prompts: list[str]
    max_tokens: int = 16


class TokenizeRequest(OpenAIModel):
    """vLLM's `POST /tokenize`: a prompt, or chat messages (templated as /v1/chat/completions would)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise OpenAIError(400, "prompt, messages: give one of them", param="prompt", code="invalid_value")


class DetokenizeRequest(OpenAIModel):
    """vLLM's `POST /detokenize`: token ids -> text."""

    model: str | None = None
    tokens: list[int]
