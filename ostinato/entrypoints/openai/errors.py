"""Errors in OpenAI's format: {"error": {"message", "type", "param", "code"}}."""

import re
from typing import Any

from pydantic import ValidationError

from ostinato.engine.limits import ContextLengthError

_FIELD = re.compile(r"^([a-z_]+)(?::| must)")


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def engine_dead(message: str) -> OpenAIError:
    return OpenAIError(503, f"The engine is not available: {message}", "server_error", None, "engine_dead")


def from_value_error(e: ValueError, rename: dict[str, str] | None = None) -> OpenAIError:
    """A SamplingParams / engine-limit ValueError (its message starts with the field) as a 400."""
    message = str(e)
    m = _FIELD.match(message)
    param = m.group(1) if m else None
    if param is not None and rename and param in rename:
        new = rename[param]
        message = new + message[len(param):]
        param = new
    code = "context_length_exceeded" if isinstance(e, ContextLengthError) else "invalid_value"
    return OpenAIError(400, message, param=param, code=code)


def from_validation_error(e: ValidationError) -> OpenAIError:
    """The first schema error, naming its field by its dotted location."""
    err = e.errors()[0]
    loc = [str(x) for x in err.get("loc", ())]
    # drop pydantic's union-member tags (e.g. "str", "list[int]") from the location
    loc = [x for x in loc if not re.fullmatch(r"[a-z]+\[.*\]|str|int|float|bool|function-.*", x)]
    param = ".".join(loc) or None
    message = f"{param}: {err['msg']}" if param else err["msg"]
    return OpenAIError(400, message, param=param, code=err.get("type"))
