"""OpenAI's API, sans-IO: request bodies checked and turned into what the front door runs
(:func:`completion_request`, :func:`chat_request`).

What is accepted follows OpenAI's API and the extras vLLM's server takes (``top_k``,
``ignore_eos``, ``min_tokens``, ``repetition_penalty``...): a field orchestr implements is
checked and used; a field it does not implement is accepted at its neutral value
(``repetition_penalty: 1.0``, ``presence_penalty: 0``, ``echo: false``...) and refused with
a 400 naming it otherwise; a field neither knows is ignored, as vLLM's server does. Every
refusal is an :class:`APIError` carrying OpenAI's error body. The answers' parts are in
:mod:`._answers`.
"""

from __future__ import annotations

import dataclasses
import operator
import time
import uuid
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Protocol

from ..generator._core._types import MAX_ID_CHARS, MAX_STOP_CHARS, MAX_STOPS, MAX_TOP_LOGPROBS
from ._fields import (
    NEUTRAL,
    APIError,
    bad,
    bool_field,
    error_body,
    float_field,
    int_field,
    neutral,
    text,
)

__all__ = [
    "MAX_ID_CHARS",
    "MAX_N",
    "MAX_PROMPTS",
    "MAX_STOPS",
    "MAX_STOP_CHARS",
    "MAX_TOP_LOGPROBS",
    "NEUTRAL",
    "APIError",
    "Job",
    "Model",
    "chat_request",
    "completion_request",
    "encode_prompt",
    "error_body",
]

#: The most choices per prompt, and prompts per request (each prompt's ``n`` choices count
#: against the front door's admission).
MAX_N = 128
MAX_PROMPTS = 256
#: The largest integer a field that reaches a kernel may hold (a 64-bit one).
MAX_INT64 = 2**63 - 1


class Model(Protocol):
    """What checking a request needs to know of the model served."""

    @property
    def names(self) -> Sequence[str]: ...

    @property
    def aliases(self) -> Collection[str]:
        """Every name a request may give (the names and any others accepted)."""
        ...

    @property
    def max_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_prompt_chars(self) -> int:
        """The most characters a prompt's text can have and still fit the context."""
        ...

    def encode(self, text: str, *, special: bool = ...) -> list[int]: ...

    def render_chat(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool
    ) -> str: ...


@dataclasses.dataclass
class Job:
    """A checked request: one token prompt per entry of ``prompts`` (choices ``n`` each),
    what each choice runs with (:class:`~orchestr.roles.Request`'s fields but ``id`` and
    ``prompt``), and how to answer."""

    kind: str  # "completion" or "chat"
    model: str
    prompts: list[list[int]]
    n: int
    params: dict[str, Any]
    stream: bool
    include_usage: bool
    continuous_usage: bool
    logprobs: int | None  # completions: top-n per token (0: the chosen token's only); chat too
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            prefix = "chatcmpl-" if self.kind == "chat" else "cmpl-"
            self.id = prefix + uuid.uuid4().hex

    def choice_params(self, index: int) -> dict[str, Any]:
        """Sampling fields of choice ``index`` (of ``n`` per prompt): a given seed is moved by
        the choice's place among its prompt's, so ``n`` seeded choices differ."""
        params = dict(self.params)
        if params.get("seed") is not None:
            params["seed"] = params["seed"] + index % self.n
        return params


def _common(body: Any, model: Model) -> tuple[str, dict[str, Any], int, bool, bool, bool]:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    name = body.get("model")
    if name is None and len(model.names) >= 1:
        name = model.names[0]  # vLLM serves the one model when none is named
    if not isinstance(name, str) or name not in model.aliases:
        raise APIError(
            f"The model {name!r:.80} does not exist; this server serves {', '.join(model.names)}",
            param="model",
            code="model_not_found",
        )
    neutral(body)
    n = int_field(body, "n", 1, 1, MAX_N)
    assert n is not None
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise bad(
            "'best_of' other than n is not supported by this server", "best_of", "unsupported"
        )
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [text(stop, "stop")] if stop else []
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if len(stop) > MAX_STOPS:
            raise bad(f"'stop' may have at most {MAX_STOPS} strings, got {len(stop)}", "stop")
        stops = [text(s, "stop") for s in stop if s]
    else:
        raise bad(f"'stop' must be a string or a list of strings, got {stop!r:.60}", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise bad(f"a stop string may have at most {MAX_STOP_CHARS} characters", "stop")
    seed = body.get("seed")
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**63
    ):
        raise bad(f"'seed' must be a 64-bit integer, got {seed!r:.40}", "seed")
    top_k = int_field(body, "top_k", 0, -1, MAX_INT64)
    top_p = float_field(body, "top_p", 1.0, 0.0, 1.0)
    if top_p <= 0:
        raise bad("'top_p' must be greater than 0", "top_p")
    params: dict[str, Any] = {
        "temperature": float_field(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": top_p,
        "top_k": min(max(top_k or 0, 0), model.vocab_size),  # past the vocabulary: all
        "seed": seed,
        "stop": stops,
        "ignore_eos": bool_field(body, "ignore_eos", False),
    }
    if (salt := _salt(body)) is not None:
        params["cache_salt"] = salt
    stream = bool_field(body, "stream", False)
    options = body.get("stream_options")
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    if options and not stream:
        raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    include_usage = bool_field(options, "include_usage", False)
    continuous = bool_field(options, "continuous_usage_stats", False)
    return name, params, n, stream, include_usage, continuous


def _salt(body: Mapping[str, Any]) -> str | None:
    salt = body.get("cache_salt")
    if salt is not None and (
        not isinstance(salt, str) or not 0 < len(text(salt, "cache_salt")) <= MAX_ID_CHARS
    ):
        raise bad(f"'cache_salt' must be a string of 1 to {MAX_ID_CHARS} characters", "cache_salt")
    return salt


def _max_tokens(value: int | None, prompt: int, model: Model, param: str) -> int:
    if value is None:
        value = model.max_len - prompt
    if prompt + value > model.max_len or value < 1:
        raise bad(
            f"This model's maximum context length is {model.max_len} tokens. However, you "
            f"requested {prompt + value} tokens ({prompt} in the prompt, {value} in the "
            f"completion). Please reduce the prompt or the completion length.",
            param if prompt < model.max_len else "prompt",
            "context_length_exceeded",
        )
    return value


def _too_long(what: int, unit: str, model: Model) -> APIError:
    return APIError(
        f"This model's maximum context length is {model.max_len} tokens; the prompt has "
        f"{what} {unit}, more than fit. Please reduce the prompt.",
        param="prompt",
        code="context_length_exceeded",
    )


def _token_list(value: Any, model: Model) -> list[int] | None:
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    ):
        return None
    if len(value) > model.max_len:
        raise _too_long(len(value), "tokens", model)
    for t in value:
        if not 0 <= t < model.vocab_size:
            raise bad(
                f"prompt token {t} is outside the vocabulary [0, {model.vocab_size})", "prompt"
            )
    return [operator.index(t) for t in value]


def encode_prompt(model: Model, text: str, special: bool) -> list[int]:
    """``text`` tokenized, or :class:`APIError` (400) when it is longer than the context can
    take (checked before tokenizing) or the tokenizer refuses it."""
    return _encode(model, text, special)


def _encode(model: Model, text: str, special: bool) -> list[int]:
    if len(text) > model.max_prompt_chars:  # refused before any tokenizing
        raise _too_long(len(text), "characters", model)
    try:
        return model.encode(text, special=special)
    except ValueError as exc:
        raise bad(str(exc), "prompt") from None


def completion_request(body: Any, model: Model) -> Job:
    """A ``POST /v1/completions`` body checked; raises :class:`APIError` (400) naming the
    field that is wrong."""
    name, params, n, stream, usage, continuous = _common(body, model)
    prompt = body.get("prompt")
    special = bool_field(body, "add_special_tokens", True)
    prompts: list[list[int]]
    if isinstance(prompt, str):
        prompts = [_encode(model, prompt, special)]
    elif (tokens := _token_list(prompt, model)) is not None:
        prompts = [tokens]
    elif isinstance(prompt, list) and len(prompt) > MAX_PROMPTS:
        raise bad(f"'prompt' may hold at most {MAX_PROMPTS} prompts, got {len(prompt)}", "prompt")
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        for p in prompt:  # every one checked before any is tokenized
            if len(p) > model.max_prompt_chars:
                raise _too_long(len(p), "characters", model)
        prompts = [_encode(model, p, special) for p in prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = []
        for p in prompt:
            tokens = _token_list(p, model)
            if tokens is None:
                raise bad("a prompt given as lists must be lists of token ids", "prompt")
            prompts.append(tokens)
    else:
        raise bad(
            "'prompt' must be a string, a list of strings, a list of token ids or a list of "
            f"those, got {prompt!r:.60}",
            "prompt",
        )
    if any(not p for p in prompts):
        raise bad("a prompt must have at least one token", "prompt")
    logprobs = int_field(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    asked = int_field(body, "max_tokens", 16, 1)
    longest = max(map(len, prompts))
    params["max_new_tokens"] = _max_tokens(asked, longest, model, "max_tokens")
    params["top_logprobs"] = logprobs or 0
    return Job("completion", name, prompts, n, params, stream, usage, continuous, logprobs)


def _message_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise bad(
                    f"messages[{i}].content: only text parts are supported, got {part!r:.60}",
                    f"messages[{i}].content",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise bad(
        f"messages[{i}].content must be a string or a list of parts", f"messages[{i}].content"
    )


def chat_request(body: Any, model: Model) -> Job:
    """A ``POST /v1/chat/completions`` body checked; the messages rendered with the
    checkpoint's chat template. Raises :class:`APIError` (400) naming the field that is
    wrong."""
    name, params, n, stream, usage, continuous = _common(body, model)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    if len(messages) > model.max_len:
        raise _too_long(len(messages), "messages", model)
    plain: list[dict[str, Any]] = []
    chars = 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a 'role'", f"messages[{i}]")
        if m["role"] not in ("system", "developer", "user", "assistant", "tool"):
            raise bad(
                f"messages[{i}].role {m['role']!r:.40} is not a known role", f"messages[{i}].role"
            )
        role = "system" if m["role"] == "developer" else m["role"]
        plain.append({"role": role, "content": _message_text(m.get("content"), i)})
        chars += len(plain[-1]["content"])
        if chars > model.max_prompt_chars:  # refused before the template renders
            raise _too_long(chars, "characters", model)
    add = bool_field(body, "add_generation_prompt", True)
    try:
        text = model.render_chat(plain, add_generation_prompt=add)
    except ValueError as exc:
        raise bad(f"the chat template failed on these messages: {exc}", "messages") from None
    prompt = _encode(model, text, False)
    if not prompt:
        raise bad("the messages render to an empty prompt", "messages")
    want = bool_field(body, "logprobs", False)
    top = int_field(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top is not None and top > 0 and not want:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    asked = body.get("max_completion_tokens")
    param = "max_completion_tokens"
    if asked is None:
        asked, param = body.get("max_tokens"), "max_tokens"
    value = int_field({param: asked}, param, None, 1)
    params["max_new_tokens"] = _max_tokens(value, len(prompt), model, param)
    params["top_logprobs"] = top or 0
    logprobs = (top or 0) if want else None
    return Job("chat", name, [prompt], n, params, stream, usage, continuous, logprobs)
