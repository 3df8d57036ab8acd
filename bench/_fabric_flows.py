"""Concurrent TCP flows between the namespace hosts of an emulated fabric, each checked by the
SHA-256 of what arrived: the transfers that ``bench/fabric.py`` times.

A flow sends ``nbytes`` of one shared payload from ``offset`` on. Every host taking part in a
set of flows gets one thread inside its network namespace (``NetnsFabric.call_in``) running its
own event loop, with a listener per incoming flow and a sender per outgoing one, over orchestr's
``tcp://`` stream transport (plain TCP: these hosts have no certificates). Listeners come up
first; then all senders start at once, and the time runs from that start to the last
receiver's end of stream. Addresses are the fabric's own: only namespaces this run created.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import threading
import time
from collections.abc import Sequence
from typing import Any

from orchestr.fabric import connect_stream, listen_stream, split_url
from orchestr.fabric.optical import NetnsFabric

CHUNK = 256 * 1024


@dataclasses.dataclass(frozen=True)
class Flow:
    """``nbytes`` of the payload from ``offset`` on, sent from host ``src`` to host ``dst``."""

    src: str
    dst: str
    offset: int
    nbytes: int


@dataclasses.dataclass
class Arrival:
    """What a receiver saw (written by its host's thread, read once that thread is done)."""

    nbytes: int = 0
    done: float = 0.0
    digest: str = ""
    error: BaseException | None = None


class _Sink(asyncio.Protocol):
    def __init__(self, arrival: Arrival, finished: asyncio.Future[None]) -> None:
        self._arrival, self._finished, self._hash = arrival, finished, hashlib.sha256()

    def data_received(self, data: bytes) -> None:
        self._arrival.nbytes += len(data)
        self._hash.update(data)

    def eof_received(self) -> None:
        self._arrival.done = time.monotonic()
        self._arrival.digest = self._hash.hexdigest()

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None:
            self._arrival.error = exc
        if not self._finished.done():
            self._finished.set_result(None)


class _Source(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.writable = asyncio.Event()
        self.writable.set()
        self.lost: asyncio.Future[Exception | None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if isinstance(transport, asyncio.Transport):
            self.transport = transport

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.writable.set()
        if not self.lost.done():
            self.lost.set_result(exc)


async def _send(url: str, data: memoryview) -> None:
    src = await connect_stream(url, _Source)
    if not isinstance(src, _Source) or src.transport is None:
        raise RuntimeError(f"tcp stream to {url} gave no transport")
    for at in range(0, len(data), CHUNK):
        await src.writable.wait()
        if src.lost.done():
            raise ConnectionError(f"stream to {url} closed after {at} of {len(data)} bytes")
        src.transport.write(data[at : at + CHUNK])
    src.transport.close()  # sends what is buffered, then the end of stream
    exc = await src.lost
    if exc is not None:
        raise exc


class _Shared:
    """What the host threads of one set of flows share with the caller: the listeners'
    ports, the receivers' arrivals, the start signal, and each host's loop and task so the
    caller can call them all off (an error elsewhere, Ctrl-C)."""

    def __init__(self, count: int) -> None:
        self.ports: list[concurrent.futures.Future[int]] = [
            concurrent.futures.Future() for _ in range(count)
        ]
        self.arrivals = [Arrival() for _ in range(count)]
        self.start: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._lock = threading.Lock()
        self._tasks: list[tuple[asyncio.AbstractEventLoop, asyncio.Task[Any]]] = []
        self._off = False

    def enlist(self) -> None:
        """Called by a host's task, first thing."""
        task = asyncio.current_task()
        with self._lock:
            if self._off or task is None:
                raise RuntimeError("the flows were called off")
            self._tasks.append((asyncio.get_running_loop(), task))

    def call_off(self) -> None:
        with self._lock:
            self._off = True
            for loop, task in self._tasks:
                with contextlib.suppress(RuntimeError):  # that loop has finished
                    loop.call_soon_threadsafe(task.cancel)
        if not self.start.done():
            self.start.set_exception(RuntimeError("the flows were called off"))


async def _host(
    address: str,
    incoming: list[int],
    outgoing: list[tuple[int, str, memoryview]],
    shared: _Shared,
    timeout_s: float,
) -> None:
    """One host's part: listen for ``incoming`` flows, then send ``outgoing`` ones (flow
    index, peer address, bytes) once started; return when all are done."""
    loop = asyncio.get_running_loop()
    ports = shared.ports
    listeners = []
    try:
        shared.enlist()
        async with asyncio.timeout(timeout_s):
            finished: list[asyncio.Future[None]] = []
            for i in incoming:
                fut: asyncio.Future[None] = loop.create_future()
                finished.append(fut)
                arrival = shared.arrivals[i]
                listener = await listen_stream(
                    f"tcp://{address}:0", lambda a=arrival, f=fut: _Sink(a, f)
                )
                listeners.append(listener)
                ports[i].set_result(split_url(listener.url)[2])
            await asyncio.shield(asyncio.wrap_future(shared.start))
            async with asyncio.TaskGroup() as tg:
                for i, peer, data in outgoing:
                    port = await asyncio.shield(asyncio.wrap_future(ports[i]))
                    tg.create_task(_send(f"tcp://{peer}:{port}", data))
            await asyncio.gather(*finished)  # the incoming flows ran alongside
    except BaseException as exc:
        for i in incoming:  # no one waits forever for a port this host will not open
            if not ports[i].done():
                ports[i].set_exception(RuntimeError(f"host {address} failed: {exc!r}"))
        raise
    finally:
        for listener in listeners:
            await listener.aclose()


async def run_flows(
    fabric: NetnsFabric,
    flows: Sequence[Flow],
    payload: bytes,
    digests: Sequence[str],
    timeout_s: float,
) -> float:
    """Run ``flows`` at once; returns the seconds from their start to the last one's end.

    ``digests[i]`` is the SHA-256 of flow ``i``'s bytes. Raises RuntimeError naming the flow
    when one failed or arrived short or different; TimeoutError past ``timeout_s``. Cancelled
    (or failing), it calls the host threads off before it returns.
    """
    hosts = sorted({f.src for f in flows} | {f.dst for f in flows})
    shared = _Shared(len(flows))
    view = memoryview(payload)

    def run_host(host: str) -> None:
        incoming = [i for i, f in enumerate(flows) if f.dst == host]
        outgoing = [
            (i, fabric.address(f.dst), view[f.offset : f.offset + f.nbytes])
            for i, f in enumerate(flows)
            if f.src == host
        ]
        address = fabric.address(host)
        fabric.call_in(
            host, lambda: asyncio.run(_host(address, incoming, outgoing, shared, timeout_s))
        )

    t0 = 0.0
    try:
        async with asyncio.TaskGroup() as tg:
            for host in hosts:
                tg.create_task(asyncio.to_thread(run_host, host))
            async with asyncio.timeout(timeout_s):
                for port in shared.ports:
                    await asyncio.shield(asyncio.wrap_future(port))
            t0 = time.monotonic()
            shared.start.set_result(None)
    except BaseException:
        shared.call_off()
        raise
    for i, (flow, got) in enumerate(zip(flows, shared.arrivals, strict=True)):
        if got.error is not None or got.nbytes != flow.nbytes or got.digest != digests[i]:
            raise RuntimeError(
                f"flow {flow.src} -> {flow.dst}: {got.nbytes} of {flow.nbytes} bytes, "
                f"digest {'ok' if got.digest == digests[i] else 'different'}, error {got.error!r}"
            )
    return max(a.done for a in shared.arrivals) - t0


def digest_of(payload: bytes, flow: Flow) -> str:
    return hashlib.sha256(memoryview(payload)[flow.offset : flow.offset + flow.nbytes]).hexdigest()
