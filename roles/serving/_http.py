"""The front door over HTTP: OpenAI's API as a Starlette app (decision record 0011).

:func:`openai_app` builds the ASGI app for a started :class:`~._frontdoor.FrontDoor` and
the checkpoint's :class:`ServedModel`; mount it in an app of your own or serve it with
uvicorn (:func:`serve`). Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models``, ``POST /tokenize``, ``POST /detokenize``, ``GET /health``,
``GET /metrics``, ``GET /version``, and the OpenAPI document of them all at
``GET /openapi.json`` (:mod:`._schema`).

Streams are server-sent events, one chunk per token (``data: {json}``), then ``data:
[DONE]``; with ``stream_options.include_usage`` a last chunk with the usage and no choices
comes before it. A client that goes away ends its requests on their generators, streaming
or not (a task watches the connection while a whole answer is computed). Every error is
OpenAI's error body with its status: 400 for a bad request, 401 without the API key, 413 for
a body larger than the model's context can use, 429 with ``Retry-After`` when the front door
is full, 503 when no generator is in rotation or a request's generator died. Every response
of a guarded route carries an ``X-Request-Id``; a 5xx body says only a fixed message and that
id, and the details go to the server's log under it (never the request's body or key).

Nothing a client sends is worked on at length on the event loop: a body is refused past
:func:`body_limit` bytes as it arrives, a prompt's text past the model's
``max_prompt_chars`` before it is tokenized, and tokenizing, rendering a chat template and
detokenizing run in worker threads, at most :data:`WORKERS` at once with at most the front
door's ``max_pending`` plus :data:`QUEUED` waiting (then 429).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import traceback
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import structlog
from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

import orchestr as oc

from . import _openai
from ._frontdoor import FrontDoor
from ._generate import INTERNAL, RETRY_AFTER_S, Generation, with_request_id
from ._openai import APIError
from ._schema import openapi_document
from ._served import ServedModel, body_limit

__all__ = ["ServedModel", "openai_app"]

log = structlog.get_logger("orchestr.roles.serving")

#: Checks of requests (tokenizing, chat templates) and detokenizing run at most this many at
#: once, in threads; at most the front door's ``max_pending`` plus :data:`QUEUED` more wait
#: (then 429).
WORKERS = 2
QUEUED = 64

T = TypeVar("T")


def openai_app(front: FrontDoor, model: ServedModel, *, api_key: str | None = None) -> Starlette:
    """The ASGI app serving OpenAI's API through ``front`` (started by its owner). With
    ``api_key``, every route but ``/health`` needs ``Authorization: Bearer <api_key>``."""
    return _App(front, model, api_key).app


def _json(
    body: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    return JSONResponse(body, status_code=status, headers=headers)


class _App:
    def __init__(self, front: FrontDoor, model: ServedModel, api_key: str | None) -> None:
        self.front, self.model = front, model
        self._generation = Generation(front, model)
        self._key = None if api_key is None else f"Bearer {api_key}".encode()
        self._limit = body_limit(model)
        self._workers = asyncio.Semaphore(WORKERS)
        self._queued = 0
        routes = [
            Route("/v1/completions", self._guard(self.completions), methods=["POST"]),
            Route("/v1/chat/completions", self._guard(self.chat), methods=["POST"]),
            Route("/v1/models", self._guard(self.models), methods=["GET"]),
            Route("/tokenize", self._guard(self.tokenize), methods=["POST"]),
            Route("/detokenize", self._guard(self.detokenize), methods=["POST"]),
            Route("/metrics", self._guard(self.metrics), methods=["GET"]),
            Route("/version", self._guard(self.version), methods=["GET"]),
            Route("/openapi.json", self._guard(self.openapi), methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ]
        self._document: dict[str, Any] | None = None
        self.app = Starlette(
            routes=routes,
            exception_handlers={404: self._not_found, 405: self._not_allowed},
        )

    # -- plumbing ----------------------------------------------------------------------------
    def _authorized(self, request: HTTPRequest) -> bool:
        # the header is compared here, so no long-lived frame (a traceback's) holds the key
        return self._key is None or hmac.compare_digest(
            request.headers.get("authorization", "").encode(), self._key
        )

    def _guard(
        self, handler: Callable[[HTTPRequest], Awaitable[Response]]
    ) -> Callable[[HTTPRequest], Awaitable[Response]]:
        """``handler`` behind the API key check, with every error in OpenAI's shape and the
        request's id in its ``X-Request-Id``."""

        async def guarded(request: HTTPRequest) -> Response:
            rid = uuid.uuid4().hex
            request.state.request_id = rid
            with structlog.contextvars.bound_contextvars(request_id=rid):
                response = await self._answer(handler, request, rid)
            response.headers["X-Request-Id"] = rid
            return response

        return guarded

    async def _answer(
        self, handler: Callable[[HTTPRequest], Awaitable[Response]], request: HTTPRequest, rid: str
    ) -> Response:
        try:
            if not self._authorized(request):
                raise APIError(
                    "Incorrect API key provided: give `Authorization: Bearer <key>`",
                    status=401,
                    code="invalid_api_key",
                )
            return await handler(request)
        except APIError as exc:
            exc = with_request_id(exc, rid)
            return _json(exc.body(), exc.status, exc.headers)
        except Exception:
            # the traceback as text: a renderer that prints frames' locals would print the
            # request's body and headers
            log.error(
                "front door: unexpected error",
                path=request.url.path,
                traceback=traceback.format_exc(),
            )
            return _json(_openai.error_body(f"{INTERNAL} (request id {rid})", "server_error"), 500)

    async def _not_found(self, request: HTTPRequest, exc: Exception) -> Response:
        return _json(
            _openai.error_body(f"no route {request.url.path!r:.200}", "invalid_request_error"),
            404,
        )

    async def _not_allowed(self, request: HTTPRequest, exc: Exception) -> Response:
        return _json(
            _openai.error_body(
                f"{request.method} is not allowed on {request.url.path!r:.200}",
                "invalid_request_error",
            ),
            405,
        )

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a worker thread, at most :data:`WORKERS` at once; 429 when
        ``max_pending`` + :data:`QUEUED` calls wait already."""
        if self._queued >= self.front.max_pending + QUEUED:
            self.front.counts["rejected"] += 1
            raise APIError(
                f"the server is at capacity; retry after {RETRY_AFTER_S} s",
                status=429,
                type="rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self._queued += 1
        try:
            async with self._workers:
                return await asyncio.to_thread(fn, *args)
        finally:
            self._queued -= 1

    async def _body(self, request: HTTPRequest) -> Any:
        """The body as JSON: refused (413) as soon as it passes the model's limit, before
        it is parsed; nesting too deep for the parser is a 400."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self._limit:
            raise _too_large(self._limit)
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > self._limit:
                raise _too_large(self._limit)
        try:
            return json.loads(raw)
        except RecursionError:
            raise APIError("the request body is nested too deeply") from None
        except ValueError as exc:
            raise APIError(f"the request body is not valid JSON: {exc!s:.200}") from None

    # -- generation --------------------------------------------------------------------------
    async def completions(self, request: HTTPRequest) -> Response:
        body = await self._body(request)
        job = await self._off_loop(_openai.completion_request, body, self.model)
        return await self._generation.answer(request, job)

    async def chat(self, request: HTTPRequest) -> Response:
        body = await self._body(request)
        job = await self._off_loop(_openai.chat_request, body, self.model)
        return await self._generation.answer(request, job)

    # -- the rest ----------------------------------------------------------------------------
    async def models(self, request: HTTPRequest) -> Response:
        data = [
            {
                "id": name,
                "object": "model",
                "created": self.model.created,
                "owned_by": "orchestr",
                "root": self.model.names[0],
                "parent": None,
                "max_model_len": self.model.max_len,
            }
            for name in self.model.names
        ]
        return _json({"object": "list", "data": data})

    async def tokenize(self, request: HTTPRequest) -> Response:
        body = await self._body(request)
        if not isinstance(body, dict):
            raise APIError("the request body must be a JSON object")
        if "messages" in body:
            job = await self._off_loop(
                _openai.chat_request, {**body, "max_tokens": 1, "stream": False}, self.model
            )
            tokens = job.prompts[0]
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise APIError("'prompt' must be a string", param="prompt")
            special = body.get("add_special_tokens", True)
            if not isinstance(special, bool):
                raise APIError(
                    "'add_special_tokens' must be true or false", param="add_special_tokens"
                )
            tokens = await self._off_loop(_openai.encode_prompt, self.model, prompt, special)
        return _json({"count": len(tokens), "max_model_len": self.model.max_len, "tokens": tokens})

    async def detokenize(self, request: HTTPRequest) -> Response:
        body = await self._body(request)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if (
            not isinstance(tokens, list)
            or len(tokens) > self.model.max_len
            or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.model.vocab_size
                for t in tokens
            )
        ):
            raise APIError(
                f"'tokens' must be a list of at most {self.model.max_len} token ids in "
                f"[0, {self.model.vocab_size})",
                param="tokens",
            )
        return _json({"prompt": await self._off_loop(self.model.decode, tokens)})

    async def health(self, request: HTTPRequest) -> Response:
        if not self.front.workers:
            return _json(
                _openai.error_body("no generator is in rotation", "service_unavailable"),
                503,
                {"Retry-After": str(RETRY_AFTER_S)},
            )
        return PlainTextResponse("")

    async def openapi(self, request: HTTPRequest) -> Response:
        if self._document is None:
            self._document = openapi_document(
                self.model.names, self.model.max_len, self.model.vocab_size
            )
        return _json(self._document)

    async def version(self, request: HTTPRequest) -> Response:
        return _json({"version": oc.__version__})

    async def metrics(self, request: HTTPRequest) -> Response:
        front = self.front
        lines: list[str] = []

        def family(name: str, kind: str, help: str, value: float) -> None:
            lines.extend(
                (
                    f"# HELP {name} {help}",
                    f"# TYPE {name} {kind}",
                    f'{name}{{model_name="{_label(self.model.names[0])}"}} {value!r}',
                )
            )

        counts = front.counts
        # a table, one metric a row (name, kind, help, value): fmt: skip keeps the rows
        for name, kind, help, value in (
            ("vllm:num_requests_running", "gauge", "Requests in flight at the front door.",
             front.pending),
            ("vllm:request_success_total", "counter", "Requests finished.", counts["finished"]),
            ("orchestr:frontdoor_requests_total", "counter", "Requests admitted.",
             counts["requests"]),
            ("orchestr:frontdoor_rejected_total", "counter",
             "Requests refused for capacity (429).", counts["rejected"]),
            ("orchestr:frontdoor_lost_total", "counter", "Requests whose generator died.",
             counts["lost"]),
            ("orchestr:frontdoor_resent_total", "counter",
             "Requests sent again after their generator died.", counts["resent"]),
            ("orchestr:frontdoor_generators", "gauge", "Generators in rotation.",
             len(front.workers)),
        ):  # fmt: skip
            family(name, kind, help, float(value))
        if front.prefill is not None:  # which path each request's prompt took
            for path, help in (
                ("remote", "Prompts prefilled on a prefill generator and handed off."),
                ("local", "Prompts under the handoff threshold, prefilled where they decode."),
                ("fallback", "Prompts prefilled where they decode as no prefill generator could."),
                ("spilled", "Requests served whole on a prefill generator, the decode pool full."),
            ):
                value = front.prefill.counts[f"prefill_{path}"]
                family(f"orchestr:frontdoor_prefill_{path}_total", "counter", help, float(value))
        engine = front.engine_metrics()
        for name, kind, help in (
            (
                "vllm:prefix_cache_queries",
                "counter",
                "Prompt tokens looked up in the prefix caches.",
            ),
            ("vllm:prefix_cache_hits", "counter", "Prompt tokens found in the prefix caches."),
            ("vllm:num_preemptions", "counter", "Sequences preempted."),
            ("orchestr:kv_transfers", "counter", "Requests whose prefilled KV was read."),
            ("orchestr:kv_transfer_bytes", "counter", "Bytes of prefilled KV read."),
            ("orchestr:kv_transfer_seconds", "counter", "Seconds reading prefilled KV."),
            (
                "orchestr:kv_transfer_exposed_seconds",
                "counter",
                "Seconds reading prefilled KV after its prefill had finished.",
            ),
            ("orchestr:kv_transfer_reads", "counter", "One-sided reads of prefilled KV."),
            ("orchestr:kv_transfer_failures", "counter", "Prefilled KV reads that failed."),
            ("orchestr:kv_handoff_expired", "counter", "Prefill leases no reader ended."),
        ):
            if name in engine:
                family(f"{name}_total", kind, help, engine[name])
        return PlainTextResponse(
            "\n".join(lines) + "\n", media_type="text/plain; version=0.0.4; charset=utf-8"
        )


def _too_large(limit: int) -> APIError:
    return APIError(
        f"the request body is larger than {limit} bytes, more than this model's context can use",
        status=413,
    )


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
