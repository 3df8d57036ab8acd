"""The front door's generation routes: a checked :class:`~._openai.Job` admitted, run on the
generators through the :class:`~._frontdoor.FrontDoor`, and answered whole or as server-sent
events, one chunk per token (:class:`Generation`).

A client that goes away ends its requests on their generators: Starlette cancels a stream's
body when the connection closes, and for a whole answer a task watches the connection while
it is computed. Errors are :class:`~._openai.APIError` with OpenAI's bodies; one that happens
after a stream's headers were sent goes in the stream as an ``error`` event before
``[DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import structlog
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

import orchestr as oc
from orchestr.tasks import TaskOwner

from ..generator._core._types import TokenDelta
from . import _answers
from ._answers import ChoiceText
from ._frontdoor import FrontDoor, GeneratorLostError, OverloadedError, RequestStream
from ._openai import APIError, Job
from ._router import NoWorkerError

if TYPE_CHECKING:
    from ._served import ServedModel

__all__ = ["INTERNAL", "RETRY_AFTER_S", "Generation", "api_error", "with_request_id"]

log = structlog.get_logger("orchestr.roles.serving")

#: Seconds a client is told to wait when the front door is full, or no generator serves.
RETRY_AFTER_S = 1
#: What a 500 says: the cause goes to the log only.
INTERNAL = "internal error; the server's log has the details under this request id"


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


class Generation:
    """Runs the generation routes' jobs through ``front``."""

    def __init__(self, front: FrontDoor, model: ServedModel) -> None:
        self.front, self.model = front, model

    async def _open(self, job: Job) -> list[RequestStream]:
        """Admit and submit every choice of ``job``: all, or none (the ones opened are
        closed again on a failure)."""
        choices = len(job.prompts) * job.n
        if choices > self.front.max_pending:  # never admitted, however long one waits
            raise APIError(
                f"{len(job.prompts)} prompt(s) x n = {job.n} is {choices} requests; this server "
                f"takes at most {self.front.max_pending} at once",
                param="n",
            )
        if self.front.pending + choices > self.front.max_pending:
            self.front.counts["rejected"] += 1
            raise APIError(
                f"the server is at capacity ({self.front.pending} requests in flight); retry "
                f"after {RETRY_AFTER_S} s",
                status=429,
                type="rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        opened: list[RequestStream] = []
        try:
            for p, prompt in enumerate(job.prompts):
                for i in range(job.n):
                    opened.append(await self.front.open(prompt, **job.choice_params(p * job.n + i)))
        except BaseException as exc:
            for s in opened:
                s.close()
            raise api_error(exc) from None
        return opened

    async def answer(self, request: HTTPRequest, job: Job) -> Response:
        streams = await self._open(job)
        if job.stream:
            rid = getattr(request.state, "request_id", "")
            return StreamingResponse(
                self._events(job, streams, rid),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        async with TaskOwner() as tasks:
            work = tasks.start(self._whole(job, streams))
            gone = tasks.start(_disconnected(request))
            try:
                await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
                if not work.done():
                    work.cancel()  # the client went away (or this handler was cancelled)
                    for s in streams:
                        s.close()
                    await asyncio.gather(work, return_exceptions=True)
        if work.cancelled():
            return Response(status_code=499)  # nobody is there to read it
        return JSONResponse(work.result())

    async def _whole(self, job: Job, streams: list[RequestStream]) -> dict[str, Any]:
        try:
            finals = await asyncio.gather(*(self._collect(job, s) for s in streams))
        except BaseException as exc:
            for s in streams:
                s.close()
            raise api_error(exc) from None
        choices, completion_tokens = [], 0
        for index, (text, reason, tokens, logprobs) in enumerate(finals):
            completion_tokens += len(tokens)
            if job.kind == "chat":
                choices.append(
                    {
                        "index": index,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": logprobs,
                        "finish_reason": _answers.finish_reason(reason),
                    }
                )
            else:
                choices.append(
                    {
                        "index": index,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": _answers.finish_reason(reason),
                    }
                )
        return {
            "id": job.id,
            "object": "chat.completion" if job.kind == "chat" else "text_completion",
            "created": job.created,
            "model": job.model,
            "choices": choices,
            "usage": _answers.usage(self._prompt_tokens(job), completion_tokens),
        }

    async def _collect(
        self, job: Job, stream: RequestStream
    ) -> tuple[str, str | None, list[int], Any]:
        tokens: list[int] = []
        logprobs: list[float] = []
        top: list[dict[int, float]] = []
        last: TokenDelta | None = None
        async for delta in stream:
            tokens += delta.tokens
            logprobs += delta.logprobs
            top += delta.top_logprobs or []
            last = delta
        assert last is not None
        shown = ChoiceText(self.model.decode, stream.stops).finish(tokens, last.text)
        lp: Any = None
        if job.logprobs is not None:
            given = top if job.logprobs else None
            if job.kind == "chat":
                lp = _answers.chat_logprobs(self.model.token_text, tokens, logprobs, given)
            else:
                lp = _answers.completion_logprobs(self.model.token_text, tokens, logprobs, given, 0)
        return shown, last.finish_reason, tokens, lp

    def _prompt_tokens(self, job: Job) -> int:
        return sum(len(p) for p in job.prompts) * job.n

    async def _events(
        self, job: Job, streams: list[RequestStream], rid: str = ""
    ) -> AsyncIterator[str]:
        """The server-sent events of a streamed job; its requests are cancelled if the
        client goes away (Starlette cancels this generator) or a write fails."""
        chat = job.kind == "chat"
        head = {
            "id": job.id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": job.created,
            "model": job.model,
        }
        prompt_tokens = self._prompt_tokens(job)
        generated = 0
        texts = [ChoiceText(self.model.decode, s.stops) for s in streams]
        offsets = [0] * len(streams)
        try:
            if chat:
                for index in range(len(streams)):
                    first = {
                        "index": index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    yield _event({**head, "choices": [first]})
            async for index, delta in _merged(streams):
                n = len(delta.tokens)
                for k in range(max(n, 1)):
                    tokens = delta.tokens[k : k + 1]
                    last = k == max(n, 1) - 1 and delta.finish_reason is not None
                    text = texts[index]
                    piece = text.finish(tokens, delta.text) if last else text.push(tokens)
                    lp: Any = None
                    if job.logprobs is not None and tokens:
                        top = (
                            delta.top_logprobs[k : k + 1]
                            if job.logprobs and delta.top_logprobs
                            else None
                        )
                        lp = (
                            _answers.chat_logprobs(
                                self.model.token_text, tokens, delta.logprobs[k : k + 1], top
                            )
                            if chat
                            else _answers.completion_logprobs(
                                self.model.token_text,
                                tokens,
                                delta.logprobs[k : k + 1],
                                top,
                                offsets[index],
                            )
                        )
                    offsets[index] += len(piece)
                    reason = _answers.finish_reason(delta.finish_reason) if last else None
                    choice: dict[str, Any] = {"index": index}
                    if chat:
                        choice["delta"] = {"content": piece} if piece or not last else {}
                    else:
                        choice["text"] = piece
                    choice["logprobs"] = lp
                    choice["finish_reason"] = reason
                    generated += len(tokens)
                    body: dict[str, Any] = {**head, "choices": [choice]}
                    if job.continuous_usage:
                        body["usage"] = _answers.usage(prompt_tokens, generated)
                    yield _event(body)
            if job.include_usage:
                yield _event(
                    {**head, "choices": [], "usage": _answers.usage(prompt_tokens, generated)}
                )
        except Exception as exc:  # after the headers: the error goes in the stream
            with structlog.contextvars.bound_contextvars(request_id=rid):
                err = with_request_id(api_error(exc), rid)
            yield _event(err.body())
        finally:
            for s in streams:
                s.close()
        yield "data: [DONE]\n\n"


def api_error(exc: BaseException) -> APIError:
    """The HTTP error for a failure of the front door or a generator. A 5xx says a fixed
    message (the details, which may hold a remote traceback, go to the log)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, OverloadedError):
        return APIError(
            str(exc),
            status=429,
            type="rate_limit_error",
            code="rate_limit_exceeded",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    if isinstance(exc, NoWorkerError | GeneratorLostError | oc.ClosedResourceError):
        log.warning("front door: no generator served a request", error=str(exc)[:2000])
        return APIError(
            "no generator could serve this request now; retry",
            status=503,
            type="service_unavailable",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    if isinstance(exc, ValueError):  # a generator refused the request: our checks' words
        return APIError(str(exc)[:1000])
    if isinstance(exc, asyncio.CancelledError):
        raise exc
    log.error("front door: request failed", error=repr(exc)[:2000])
    return APIError(INTERNAL, status=500, type="server_error")


def with_request_id(err: APIError, rid: str) -> APIError:
    """``err`` with the request's id in its message when it is a 5xx (whose message is a
    fixed one: :func:`api_error` logged the details, under that id)."""
    if err.status >= 500:
        err.message = f"{err.message} (request id {rid})"
    return err


async def _disconnected(request: HTTPRequest) -> None:
    """Returns when the client has gone away (its ``http.disconnect``)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, TokenDelta]]:
    """The deltas of ``streams`` as they come, with each one's index."""
    if len(streams) == 1:
        async for delta in streams[0]:
            yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, TokenDelta | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for delta in stream:
                queue.put_nowait((index, delta))
        except Exception as exc:
            queue.put_nowait((index, exc))
        queue.put_nowait((index, None))

    pumps = TaskOwner()
    for i, s in enumerate(streams):
        pumps.start(pump(i, s))
    try:
        left = len(streams)
        while left:
            index, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        with contextlib.suppress(BaseException):
            await pumps.aclose()  # cancels the pumps first
