"""The front door's OpenAPI 3.0 document, sans-IO: :func:`openapi_document`.

It describes every route of :mod:`._http`'s app, with the request bodies' fields, types and
bounds as :mod:`._openai` checks them (its constants, not copies of their numbers), the 200
bodies loosely (what OpenAI's clients read of them) and the error body every refusal carries.
What a schema cannot say is in the descriptions: a prompt and its ``max_tokens`` together fit
the context, ``stream_options`` needs ``stream``, ``best_of`` equals ``n``. The server ignores
fields no check knows, so every body allows more properties. No I/O here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orchestr as oc

from . import _openai
from ._openai import (
    MAX_ID_CHARS,
    MAX_INT64,
    MAX_N,
    MAX_PROMPTS,
    MAX_STOP_CHARS,
    MAX_STOPS,
    MAX_TOP_LOGPROBS,
)
from ._served import MAX_BODY

__all__ = ["openapi_document"]

Schema = dict[str, Any]

#: Each refusal's status: its response's name and description.
_ERRORS = {
    "400": ("BadRequest", "The body is not JSON, or a field is wrong (the error names it)."),
    "401": ("Unauthorized", "No key, or the wrong one (Authorization: Bearer KEY)."),
    "413": (
        "TooLarge",
        "The body is larger than the model's context can use (or {max_body} bytes).",
    ),
    "429": ("Overloaded", "The server is full: retry after Retry-After seconds."),
    "503": ("Unavailable", "No generator is in rotation, or the request's generator died."),
}


def openapi_document(names: Sequence[str], max_len: int, vocab_size: int) -> dict[str, Any]:
    """The OpenAPI 3.0 document of the front door serving a model called ``names`` (the first
    is the default) with a context of ``max_len`` tokens and token ids below ``vocab_size``.
    A new dict each call, the caller's to change; pure, so idempotent. Raises ValueError
    without a name."""
    if not names:
        raise ValueError("a served model has at least one name")
    body = _bodies(names, max_len, vocab_size)
    plain = {"text/plain": {"schema": {"type": "string"}}}
    generation = ["400", "401", "413", "429", "503"]
    # a table, one operation a row (path, method, id, summary, reply, errors): fmt: off keeps it
    # fmt: off
    operations = [
        ("/v1/completions", "post", "createCompletion", "Complete prompts: whole, or streamed "
         "as server-sent events (stream: true).", _streamed("Completion"), generation),
        ("/v1/chat/completions", "post", "createChatCompletion", "Answer a chat: whole, or "
         "streamed as server-sent events (stream: true).", _streamed("ChatCompletion"), generation),
        ("/v1/models", "get", "listModels", "The model's names.", _json("ModelList"), ["401"]),
        ("/tokenize", "post", "tokenize", "Encode a text, or a chat's messages as the template "
         "renders them.", _json("Tokens"), ["400", "401", "413", "429"]),
        ("/detokenize", "post", "detokenize", "Decode token ids.", _json("Text"),
         ["400", "401", "413", "429"]),
        ("/health", "get", "health", "200 while a generator is in rotation, else 503; needs no "
         "key.", {"description": "Serving.", "content": plain}, ["503"]),
        ("/metrics", "get", "metrics", "The front door's and the engines' counters, in "
         "Prometheus' text format.", {"description": "The metrics.", "content": plain}, ["401"]),
        ("/version", "get", "version", "orchestr's version.", _json("Version"), ["401"]),
    ]
    # fmt: on
    paths: dict[str, Schema] = {}
    for path, method, operation_id, summary, ok, errors in operations:
        refs = {code: {"$ref": f"#/components/responses/{_ERRORS[code][0]}"} for code in errors}
        operation: Schema = {
            "operationId": operation_id,
            "summary": summary,
            "responses": {"200": ok, **refs},
        }
        if path in body:
            content = {"application/json": {"schema": body[path]}}
            operation["requestBody"] = {"required": True, "content": content}
        paths[path] = {method: operation}
    paths["/health"]["get"]["security"] = []  # for load balancers
    bearer = {"type": "http", "scheme": "bearer", "description": "The server's --api-key."}
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "orchestr front door",
            "version": oc.__version__,
            "description": "OpenAI's API over orchestr's generators. Every refusal carries "
            "OpenAI's error body; 429 and 503 say when to retry in Retry-After. A server "
            "started without an API key takes any key, or none.",
        },
        "security": [{"bearerAuth": []}],
        "paths": paths,
        "components": {
            "securitySchemes": {"bearerAuth": bearer},
            "schemas": _answers(),
            "responses": _errors(),
        },
    }


# -- requests ----------------------------------------------------------------------------------
def _bodies(names: Sequence[str], max_len: int, vocab_size: int) -> dict[str, Schema]:
    """Each route's request body, by path."""
    longest = max_len - 1  # a prompt has a token at least
    common = _common(names)
    completion = _body(
        "A completion of each prompt (OpenAI's legacy completions, with vLLM's extras).",
        ["prompt"],
        **common,
        prompt=_prompt(longest, vocab_size),
        max_tokens=_int(1, longest, "Tokens to generate (default 16)."),
        logprobs=_int(0, MAX_TOP_LOGPROBS, "Log-probs of the likeliest this many."),
        add_special_tokens=_bool("Add the tokenizer's special tokens (default true)."),
    )
    chat = _body(
        "The assistant's answer to the messages, rendered with the checkpoint's chat template.",
        ["messages"],
        **common,
        messages=_array(_message(), lo=1, hi=max_len),
        max_tokens=_int(1, longest, "Tokens to generate (default: the rest of the context)."),
        max_completion_tokens=_int(1, longest, "Tokens to generate, over max_tokens."),
        logprobs=_bool("Return the chosen tokens' log-probs."),
        top_logprobs=_int(0, MAX_TOP_LOGPROBS, "The likeliest this many (needs logprobs)."),
        add_generation_prompt=_bool("End the prompt with the assistant's turn (default true)."),
    )
    text = _body(
        "A text to encode.",
        ["prompt"],
        prompt={"type": "string"},
        add_special_tokens={"type": "boolean", "description": "Default true."},
    )
    # a chat to encode is checked as one to answer, but for these (the route sets them)
    fields = {k: v for k, v in chat["properties"].items() if k not in ("max_tokens", "stream")}
    rendered = _body("Messages rendered with the chat template, encoded.", ["messages"], **fields)
    ids = _array(_token(vocab_size), hi=max_len)
    return {
        "/v1/completions": completion,
        "/v1/chat/completions": chat,
        "/tokenize": {"anyOf": [text, rendered]},
        "/detokenize": _body("Token ids to decode.", ["tokens"], tokens=ids),
    }


def _common(names: Sequence[str]) -> dict[str, Schema]:
    """The fields both generation routes check (``_openai._common``)."""
    stop = {"type": "string", "maxLength": MAX_STOP_CHARS}
    fields: dict[str, Schema] = {
        "model": _nullable({"type": "string", "enum": list(names)}),
        "n": _int(1, MAX_N, "Choices per prompt."),
        "best_of": _int(1, MAX_N, "Only equal to n."),
        "stop": _nullable({"anyOf": [stop, _array(stop, hi=MAX_STOPS)]}),
        "seed": _int(-MAX_INT64 - 1, MAX_INT64, "Choice i samples with seed + i."),
        "top_k": _int(-1, MAX_INT64, "Sample from the likeliest k tokens (0 or -1: all)."),
        "top_p": _nullable(
            {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 1}
        ),
        "temperature": _nullable({"type": "number", "minimum": 0, "maximum": 2}),
        "ignore_eos": _bool("Go on past the end-of-sequence token."),
        "cache_salt": _nullable(
            {
                "type": "string",
                "minLength": 1,
                "maxLength": MAX_ID_CHARS,
                "description": "Prefix-cache entries are shared only with the same salt.",
            }
        ),
        "stream": _bool("Answer as server-sent events, one per token, then [DONE]."),
        "stream_options": _nullable(
            _body(
                "Only with stream: true.",
                [],
                include_usage=_bool("A last chunk with the usage."),
                continuous_usage_stats=_bool("The usage so far in every chunk."),
            )
        ),
    }
    for name, allowed in _openai.NEUTRAL.items():
        if name != "best_of":
            values: list[Any] = []
            for v in allowed:  # 0 and 0.0 are one JSON value, listed once
                if v is not None and not any(_same_json(v, w) for w in values):
                    values.append(v)
            fields[name] = _nullable({"enum": values, "description": "Only its neutral value."})
    return fields


def _prompt(longest: int, vocab_size: int) -> Schema:
    tokens = _array(_token(vocab_size), lo=1, hi=longest)
    return {
        "description": "A text, texts, token ids or lists of them; with max_tokens, each "
        "prompt fits the context.",
        "anyOf": [
            {"type": "string"},
            _array({"type": "string"}, lo=1, hi=MAX_PROMPTS),
            tokens,
            _array(tokens, lo=1, hi=MAX_PROMPTS),
        ],
    }


def _message() -> Schema:
    part = _body("A text part.", ["type", "text"], type={"enum": ["text"]}, text={"type": "string"})
    content = {"anyOf": [{"type": "string"}, _array(part)]}
    roles = ["system", "developer", "user", "assistant", "tool"]
    return _body("A message.", ["role"], role={"enum": roles}, content=_nullable(content))


def _body(description: str, required: list[str], **properties: Schema) -> Schema:
    schema: Schema = {"type": "object", "description": description, "properties": properties}
    if required:
        schema["required"] = required
    return schema  # more properties are allowed: OpenAPI's default, and the server's


def _array(items: Schema, *, lo: int = 0, hi: int | None = None) -> Schema:
    schema: Schema = {"type": "array", "items": items}
    if lo:
        schema["minItems"] = lo
    if hi is not None:
        schema["maxItems"] = hi
    return schema


def _int(lo: int, hi: int, description: str) -> Schema:
    return _nullable({"type": "integer", "minimum": lo, "maximum": hi, "description": description})


def _bool(description: str) -> Schema:
    return _nullable({"type": "boolean", "description": description})


def _token(vocab_size: int) -> Schema:
    return {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}


def _nullable(schema: Schema) -> Schema:
    """``schema`` or null (the checks read null as the field's default)."""
    out = {**schema, "nullable": True}
    if "enum" in out:
        out["enum"] = [*out["enum"], None]
    return out


def _same_json(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return bool(a == b)


# -- operations and answers --------------------------------------------------------------------
def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(name: str) -> Schema:
    return {"description": name, "content": {"application/json": {"schema": _ref(name)}}}


def _streamed(name: str) -> Schema:
    return {
        "description": "A JSON answer, or server-sent events: data: {chunk} lines (an error "
        "event if it fails midway), then data: [DONE].",
        "content": {
            "application/json": {"schema": _ref(name)},
            # before OpenAPI 3.2 a stream's schema is each event's
            "text/event-stream": {"schema": _obj(["data"], data={"type": "string"})},
        },
    }


def _obj(required: Sequence[str], **properties: Schema) -> Schema:
    return {"type": "object", "required": list(required), "properties": properties}


def _answers() -> dict[str, Schema]:
    string, count = {"type": "string"}, {"type": "integer", "minimum": 0}
    reason = _nullable({"type": "string", "enum": ["stop", "length", "abort"]})

    def answer(kind: str, **choice: Schema) -> Schema:
        fields = {
            "index": count,
            "finish_reason": reason,
            "logprobs": _nullable({"type": "object"}),
        }
        return _obj(
            ["id", "object", "created", "model", "choices"],
            id=string,
            object={"type": "string", "enum": [kind]},
            created={"type": "integer"},
            model=string,
            choices=_array(_obj(["index", "finish_reason"], **fields, **choice)),
            usage=_ref("Usage"),
        )

    model = _obj(["id", "object"], id=string, object={"type": "string", "enum": ["model"]})
    tokens = ["prompt_tokens", "completion_tokens", "total_tokens"]
    problem = _obj(
        ["message", "type", "param", "code"],
        message=string,
        type=string,
        param=_nullable(string),
        code=_nullable(string),
    )
    return {
        "Usage": _obj(tokens, **dict.fromkeys(tokens, count)),
        "Completion": answer("text_completion", text=string),
        "ChatCompletion": answer(
            "chat.completion", message=_obj(["role", "content"], role=string, content=string)
        ),
        "ModelList": _obj(
            ["object", "data"], object={"type": "string", "enum": ["list"]}, data=_array(model)
        ),
        "Tokens": _obj(
            ["count", "max_model_len", "tokens"],
            count=count,
            max_model_len=count,
            tokens=_array(count),
        ),
        "Text": _obj(["prompt"], prompt=string),
        "Version": _obj(["version"], version=string),
        "Error": _obj(["error"], error=problem),
    }


def _errors() -> dict[str, Schema]:
    retry = {
        "Retry-After": {
            "description": "Seconds to wait before retrying.",
            "schema": {"type": "integer", "minimum": 0},
        }
    }
    out: dict[str, Schema] = {}
    for code, (name, description) in _ERRORS.items():
        response: Schema = {
            "description": description.format(max_body=MAX_BODY),
            "content": {"application/json": {"schema": _ref("Error")}},
        }
        if code in ("429", "503"):
            response["headers"] = retry
        out[name] = response
    return out
