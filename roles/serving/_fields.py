"""Checking one field of a request body, sans-IO: each refusal an :class:`APIError` carrying
OpenAI's error body and naming the field; fields accepted only at their neutral values
(:data:`NEUTRAL`). What a whole body must be is in :mod:`._openai`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ._router import ServingError

__all__ = [
    "NEUTRAL",
    "APIError",
    "bad",
    "bool_field",
    "error_body",
    "float_field",
    "int_field",
    "neutral",
    "text",
]


class APIError(ServingError):
    """A request refused: the HTTP ``status`` and OpenAI's error fields."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = (
            message,
            status,
            type,
            param,
            code,
        )
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(message, param=param, code=code)


def int_field(
    body: Mapping[str, Any], name: str, default: int | None, lo: int, hi: int | None = None
) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"'{name}' must be an integer, got {value!r:.40}", name)
    if value < lo or (hi is not None and value > hi):
        bound = f"at least {lo}" if hi is None else f"from {lo} to {hi}"
        raise bad(f"'{name}' must be {bound}, got {value}", name)
    return value


def float_field(body: Mapping[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not finite(value):
        raise bad(f"'{name}' must be a finite number, got {value!r:.40}", name)
    if not lo <= value <= hi:
        raise bad(f"'{name}' must be from {lo} to {hi}, got {value}", name)
    return float(value)


def finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past a float's range
        return False


def bool_field(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"'{name}' must be true or false, got {value!r:.40}", name)
    return value


#: Fields accepted only at their neutral values (anything else is refused by name).
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "repetition_penalty": (None, 1, 1.0),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "echo": (None, False),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "min_tokens": (None, 0),
    "best_of": (None,),  # checked against n below
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
    "min_p": (None, 0, 0.0),
    "length_penalty": (None, 1, 1.0),
    "use_beam_search": (None, False),
    "prompt_logprobs": (None, 0),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "include_stop_str_in_output": (None, False),
    "continue_final_message": (None, False),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "structured_outputs": (None,),
    "stop_token_ids": (None, []),
    "priority": (None, 0),
}


def same(value: Any, allowed: Any) -> bool:
    if isinstance(value, bool) or isinstance(allowed, bool):
        return value is allowed
    return bool(value == allowed)


def neutral(body: Mapping[str, Any]) -> None:
    for name, allowed in NEUTRAL.items():
        if name == "best_of" or name not in body:
            continue
        value = body[name]
        if not any(same(value, a) for a in allowed):
            raise bad(
                f"'{name}' = {value!r:.60} is not supported by this server", name, "unsupported"
            )


def text(value: Any, name: str) -> str:
    """``value`` as a string that UTF-8 can carry (a lone surrogate cannot travel to a
    generator), or a refusal naming ``name``."""
    if not isinstance(value, str):
        raise bad(f"'{name}' must be a string, got {value!r:.40}", name)
    try:
        value.encode()
    except UnicodeEncodeError:
        raise bad(f"'{name}' is not valid Unicode (a lone surrogate)", name) from None
    return value
