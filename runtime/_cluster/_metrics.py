"""The head's Prometheus endpoint: ``GET /metrics`` from a tiny HTTP/1.1 server on asyncio.

Each scrape asks every worker that hosts a live actor for its counters (``Worker.Stats``), all
at once, each with a deadline of :data:`SCRAPE_TIMEOUT` seconds. A worker that does not answer
in time is left out of that scrape and counted in ``orchestr_scrape_errors_total``; the head
adds its own gauges and renders the text (:mod:`._exposition`).

One request per connection (``Connection: close``). The request head must arrive within
:data:`READ_TIMEOUT` seconds and :data:`MAX_REQUEST_BYTES` bytes, else the client gets 408 or
431; anything but ``GET /metrics`` gets 404 or 405. Each connection is a task of its own with
deadlines over its whole life, so a slow or garbage client costs one task for a few seconds and
nothing else. At :data:`MAX_CONNECTIONS` at once, a new connection pushes out the oldest one
still waiting for its request head (idle connections cannot lock scrapers out); only when all
are being answered does it get 503.

With ``Config.metrics_token`` set (``orchestr start`` sets it, from ``metrics-token`` in the
state directory), a scrape must carry ``Authorization: Bearer <that token>`` or gets 401. It is
a token of its own, good for reading metrics and nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac

import structlog

from orchestr._control._convert_stats import worker_stats_from_pb
from orchestr._control._grpc import ControlChannel
from orchestr._stats import WorkerStats
from orchestr.config import Config
from orchestr.errors import ConfigError, OrchestrError
from orchestr.protos import orchestr_pb2 as pb
from orchestr.protos import orchestr_pb2_grpc as pb_grpc

from ._exposition import (
    CONTENT_TYPE,
    Family,
    ScrapeReport,
    cluster_families,
    render,
    workers_to_scrape,
)
from ._headstate import HeadState

__all__ = ["MetricsServer"]

log = structlog.get_logger("orchestr.metrics")

#: Seconds a client has to send its request head.
READ_TIMEOUT = 5.0
#: Seconds each worker has to answer a scrape.
SCRAPE_TIMEOUT = 2.0
#: Seconds a client has to take the response.
WRITE_TIMEOUT = 10.0
#: Seconds a refused client has to stop sending before its connection is closed.
LINGER_TIMEOUT = 1.0
#: Largest request head (request line and headers) accepted, in bytes.
MAX_REQUEST_BYTES = 8192
#: Connections served at once; more are answered 503 and closed.
MAX_CONNECTIONS = 16

_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


def response(status: int, body: str, *, content_type: str = "text/plain; charset=utf-8") -> bytes:
    """One complete HTTP/1.1 response that closes the connection."""
    data = body.encode()
    allow = "Allow: GET\r\n" if status == 405 else ""
    if status == 401:
        allow = 'WWW-Authenticate: Bearer realm="orchestr metrics"\r\n'
    return (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Content-Length: {len(data)}\r\n"
        f"{allow}Connection: close\r\n\r\n"
    ).encode() + data


def route(head: bytes, token: str = "") -> int:
    """The status a request head earns before any work: 200 for ``GET /metrics`` (with
    ``Authorization: Bearer <token>`` when ``token`` is set)."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        return 400
    method, target = parts[0], parts[1]
    if target.split(b"?", 1)[0] != b"/metrics":
        return 404
    if method != b"GET":
        return 405
    if token:
        presented = b""
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"authorization":
                presented = value.strip()
        if not hmac.compare_digest(presented, b"Bearer " + token.encode()):
            return 401
    return 200


_ERRORS = {
    400: "not an HTTP/1.x request line\n",
    401: "a scrape needs Authorization: Bearer <the metrics token> (metrics-token in the state "
    "directory)\n",
    404: "nothing here; the metrics are at GET /metrics\n",
    405: "only GET is served here\n",
    408: "no complete request in time\n",
    431: f"the request head is over {MAX_REQUEST_BYTES} bytes\n",
    503: "too many connections at once; try again\n",
}


class MetricsServer:
    """Serves ``GET /metrics`` for a head. :meth:`start` and :meth:`aclose` bound its life."""

    def __init__(self, state: HeadState, token: str, config: Config) -> None:
        self.state = state
        self.token = token
        self.config = config
        self.read_timeout = READ_TIMEOUT
        self.scrape_timeout = SCRAPE_TIMEOUT
        #: ``host:port`` it listens on, once started; ``None`` when metrics are off.
        self.address: str | None = None
        #: Workers that did not answer a scrape in time, since the start.
        self.scrape_errors = 0
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[object]] = set()
        #: Connections still waiting for their request head, oldest first.
        self._waiting: dict[asyncio.Task[object], None] = {}
        self._channels: dict[str, ControlChannel] = {}

    async def start(self) -> None:
        """Listen on ``Config.bind_host`` and ``Config.metrics_port`` (none when that is -1).

        Raises :class:`ConfigError` when the port cannot be bound. Idempotent."""
        port = self.config.metrics_port
        if port < 0 or self._server is not None:
            return
        host = self.config.bind_host
        try:
            self._server = await asyncio.start_server(
                self._connected, host, port, limit=MAX_REQUEST_BYTES
            )
        except OSError as exc:
            raise ConfigError(
                f"cannot serve metrics on {host}:{port}: {exc}; set ORCHESTR_METRICS_PORT to a "
                f"free port, 0 for any, or -1 for no metrics"
            ) from exc
        self.address = f"{host}:{self._server.sockets[0].getsockname()[1]}"
        log.info("metrics served", url=f"http://{self.address}/metrics")

    async def aclose(self) -> None:
        """Stop listening, drop the connections being served and the workers' channels.
        Idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        handlers = list(self._handlers)
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        if server is not None:
            await server.wait_closed()
        channels, self._channels = self._channels, {}
        for ch in channels.values():
            await ch.aclose()

    # -- a scrape --------------------------------------------------------------------------------
    async def collect(self) -> str:
        """Ask every worker with a live actor for its counters and render the exposition.
        Blocks for at most about :data:`SCRAPE_TIMEOUT` seconds; raises nothing for a worker
        that fails (it is counted instead)."""
        return render(await self.families())

    async def families(self) -> list[Family]:
        """One scrape's metric families (:func:`collect`'s, not yet rendered; the dashboard
        reads them too)."""
        addresses = workers_to_scrape(self.state)
        results = await asyncio.gather(*(self._ask(a) for a in addresses))
        answers = [r for r in results if r is not None]
        self.scrape_errors += len(addresses) - len(answers)
        await self._forget_channels(set(addresses))
        report = ScrapeReport(len(addresses), len(answers), self.scrape_errors)
        return cluster_families(self.state, answers, report)

    async def _ask(self, address: str) -> WorkerStats | None:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = ControlChannel(address, self.token, self.config)
        try:
            reply = await ch.rpc(
                ch.stub(pb_grpc.WorkerStub).Stats, pb.Empty(), timeout=self.scrape_timeout
            )
        except OrchestrError as exc:
            log.warning("a worker did not answer for metrics", worker=address, error=str(exc))
            return None
        return worker_stats_from_pb(reply)

    async def _forget_channels(self, live: set[str]) -> None:
        for address in [a for a in self._channels if a not in live]:
            await self._channels.pop(address).aclose()

    # -- HTTP ------------------------------------------------------------------------------------
    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._handlers) >= MAX_CONNECTIONS:
            if not self._waiting:
                writer.write(response(503, _ERRORS[503]))
                writer.close()
                return
            oldest = next(iter(self._waiting))
            del self._waiting[oldest]
            oldest.cancel()  # the oldest idle one makes room
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            await self._answer(reader, writer, task)
        except (ConnectionError, TimeoutError):
            writer.transport.abort()  # the client went away, or does not take the response
        except asyncio.CancelledError:
            writer.transport.abort()
            if self._server is None:
                raise  # closing down; otherwise it was pushed out and is done
        finally:
            self._handlers.discard(task)
            self._waiting.pop(task, None)
            writer.close()

    async def _answer(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, task: asyncio.Task[object]
    ) -> None:
        self._waiting[task] = None
        try:
            async with asyncio.timeout(self.read_timeout):
                head = await reader.readuntil(b"\r\n\r\n")
        except TimeoutError:
            status = 408
        except asyncio.LimitOverrunError:
            status = 431
        except asyncio.IncompleteReadError:
            return  # closed before a whole request: nobody to answer
        else:
            status = route(head, self.config.metrics_token)
        finally:
            self._waiting.pop(task, None)
        if status != 200:
            await self._send(writer, response(status, _ERRORS[status]))
            await _linger(reader, writer)
            return
        try:
            text = await self.collect()
        except Exception:
            log.exception("rendering the metrics failed")
            await self._send(writer, response(500, "rendering the metrics failed; see the log\n"))
            return
        await self._send(writer, response(200, text, content_type=CONTENT_TYPE))

    async def _send(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(data)
        async with asyncio.timeout(WRITE_TIMEOUT):
            await writer.drain()


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """After refusing a request: end our side, then read and drop what the client still sends
    (a little, briefly). Closing with unread bytes would reset the connection, and the client
    might lose the answer."""
    if not writer.can_write_eof():
        return
    writer.write_eof()
    left = 1 << 20
    with contextlib.suppress(TimeoutError, ConnectionError):
        async with asyncio.timeout(LINGER_TIMEOUT):
            while left > 0 and (chunk := await reader.read(65536)):
                left -= len(chunk)
