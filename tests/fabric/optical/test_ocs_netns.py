"""The ``netns`` OCS driver over an emulated fabric of network namespaces: conformance, a
transfer that speeds up on a circuit, a stream that survives reconfigurations, teardown.

Transfers ride orchestr's ``tcp://`` stream transport (the one actor calls use). Each end runs
its own event loop in a thread inside its host's namespace (``NetnsFabric.call_in``); the test's
loop drives the switch and the routes meanwhile. Rates are compared within one test only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hashlib
import random
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any

import pytest

from orchestr.fabric._optical._conformance import check_ocs_driver
from orchestr.fabric._optical._netns import NetnsError, NetnsFabric, netns_missing
from orchestr.fabric._optical._ocs import OcsDriver
from orchestr.fabric._optical._ocs_netns import NetnsOcs, NetnsRouter
from orchestr.fabric._optical._reconfig import Changes, Reconfigurator
from orchestr.fabric._streams import _transport as _streams
from orchestr.fabric._streams._transport import connect_stream, listen_stream, split_url

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
CHUNK = 64 * 1024
AB, AC, BC = ("a", "b"), ("a", "c"), ("b", "c")
_BLOCK = random.Random(7).randbytes(MiB)


def _require() -> None:
    why = netns_missing()
    if why is not None:
        pytest.skip(why)


@pytest.fixture(autouse=True)
def _plain_tcp() -> Iterator[None]:
    """These hosts have no certificates: streams in plain TCP whatever an earlier test set."""
    saved = _streams._tls
    _streams.set_tls(None)
    yield
    _streams.set_tls(saved)


@pytest.fixture
async def fab() -> AsyncIterator[NetnsFabric]:
    _require()
    async with NetnsFabric(["a", "b", "c"], electrical_mbit=50, circuit_mbit=400) as f:
        yield f
    assert f.leftovers() == []


# -- a stream between two hosts ------------------------------------------------------------------


@dataclasses.dataclass
class Tally:
    """What one end saw; the other threads read it while it grows (ints, under the GIL)."""

    nbytes: int = 0
    first: float = 0.0
    last: float = 0.0
    digest: str = ""
    error: BaseException | None = None

    def rate_mbit(self) -> float:
        return self.nbytes * 8 / 1e6 / max(self.last - self.first, 1e-9)


class _Sink(asyncio.Protocol):
    def __init__(self, tally: Tally, done: asyncio.Future[None]) -> None:
        self._tally, self._done, self._hash = tally, done, hashlib.sha256()

    def data_received(self, data: bytes) -> None:
        t = self._tally
        t.last = time.monotonic()
        if t.nbytes == 0:
            t.first = t.last
        t.nbytes += len(data)
        self._hash.update(data)

    def eof_received(self) -> None:
        self._tally.digest = self._hash.hexdigest()

    def connection_lost(self, exc: Exception | None) -> None:
        self._tally.error = exc
        if not self._done.done():
            self._done.set_result(None)


class _Source(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.writable = asyncio.Event()
        self.writable.set()
        self.lost: asyncio.Future[Exception | None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.writable.set()
        if not self.lost.done():
            self.lost.set_result(exc)


async def _receive(url: str, port: concurrent.futures.Future[int], tally: Tally) -> None:
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    try:
        listener = await listen_stream(url, lambda: _Sink(tally, done))
    except BaseException as exc:
        port.set_exception(exc)
        raise
    try:
        port.set_result(split_url(listener.url)[2])
        async with asyncio.timeout(60):
            await done
    finally:
        await listener.aclose()


async def _send(url: str, tally: Tally, nbytes: int, stop: threading.Event) -> None:
    """Send chunks (numbered, so a lost or repeated one changes the digest) until ``nbytes``
    or ``stop``, then close and wait for the close to finish."""
    src = await connect_stream(url, _Source)
    assert isinstance(src, _Source) and src.transport is not None
    digest = hashlib.sha256()
    async with asyncio.timeout(60):
        seq = 0
        while True:
            if tally.nbytes >= nbytes or stop.is_set() or src.lost.done():
                break
            await src.writable.wait()
            at = (seq * 4099) % (MiB - CHUNK)
            chunk = seq.to_bytes(8, "little") + _BLOCK[at : at + CHUNK - 8]
            src.transport.write(chunk)
            digest.update(chunk)
            tally.nbytes += len(chunk)
            seq += 1
        tally.digest = digest.hexdigest()
        src.transport.close()  # flushes what is buffered first
        tally.error = await src.lost


async def transfer(
    fab: NetnsFabric,
    src: str,
    dst: str,
    nbytes: int,
    during: Callable[[Tally, threading.Event], Coroutine[Any, Any, None]] | None = None,
) -> tuple[Tally, Tally]:
    """Stream ``nbytes`` from ``src`` to ``dst`` (each in its namespace), or until ``during``
    (run alongside with the receiver's tally and a stop event) sets the event; returns what
    was sent and what was received."""
    sent, received = Tally(), Tally()
    port: concurrent.futures.Future[int] = concurrent.futures.Future()
    url = f"tcp://{fab.address(dst)}"
    stop = threading.Event()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(
            asyncio.to_thread(
                fab.call_in, dst, lambda: asyncio.run(_receive(f"{url}:0", port, received))
            )
        )
        bound: int = await asyncio.wrap_future(port)
        at = f"{url}:{bound}"
        tg.create_task(
            asyncio.to_thread(fab.call_in, src, lambda: asyncio.run(_send(at, sent, nbytes, stop)))
        )
        if during is not None:
            tg.create_task(during(received, stop))
    return sent, received


def _intact(sent: Tally, received: Tally) -> None:
    assert sent.error is None and received.error is None, (sent.error, received.error)
    assert received.nbytes == sent.nbytes
    assert received.digest == sent.digest


# -- the tests -----------------------------------------------------------------------------------


async def test_the_driver_passes_the_conformance_suite() -> None:
    _require()
    async with NetnsFabric([f"h{i}" for i in range(6)]) as f:

        async def fresh() -> OcsDriver:
            await asyncio.to_thread(f.disconnect_all)
            return NetnsOcs(f)

        assert await check_ocs_driver(fresh) == []
        # a new driver on the same fabric reads the switch back as it was left
        d = NetnsOcs(f, {0: "h5", 1: "h0", 2: "h1", 3: "h2", 4: "h3", 5: "h4"})
        g, _ = await d.circuits()
        await d.program(g + 1, [(0, 1)], [])
        assert await NetnsOcs(f).circuits() == (g + 1, frozenset({(0, 5)}))
        assert await asyncio.to_thread(f.circuits) == frozenset({("h0", "h5")})
        await d.aclose()


async def test_a_transfer_speeds_up_on_a_circuit_and_slows_down_when_drained(
    fab: NetnsFabric,
) -> None:
    ocs, router = NetnsOcs(fab), NetnsRouter(fab)
    with pytest.raises(NetnsError, match="no circuit between a and b"):
        await router.undrain(frozenset({AB}))
    electrical = await transfer(fab, "a", "b", 8 * MiB)
    await ocs.program(1, [(0, 1)], [])
    await ocs.verify(1, [(0, 1)])
    await router.undrain(frozenset({AB}))
    assert await asyncio.to_thread(fab.route_device, "a", "b") == fab.circuit_device("a", "b")
    assert await asyncio.to_thread(fab.route_device, "b", "a") == fab.circuit_device("b", "a")
    on_circuit = await transfer(fab, "a", "b", 8 * MiB)
    await router.drain(frozenset({AB}))
    assert await asyncio.to_thread(fab.route_device, "a", "b") == "eth0"
    drained = await transfer(fab, "a", "b", 8 * MiB)
    for sent, received in (electrical, on_circuit, drained):
        _intact(sent, received)
    rates = [r.rate_mbit() for _, r in (electrical, on_circuit, drained)]
    assert rates[1] >= 2 * rates[0] and rates[1] >= 2 * rates[2], f"Mbit/s: {rates}"


async def test_a_stream_keeps_flowing_while_circuits_are_reconfigured(fab: NetnsFabric) -> None:
    ocs, router = NetnsOcs(fab), NetnsRouter(fab)
    rc = Reconfigurator(ocs, router, electrical_gbps=0.05, circuit_gbps=0.4, step_timeout_s=20)
    plans = [
        Changes.single(add={(0, 1): AB}),
        Changes.single(remove={(0, 1): AB}, add={(0, 2): AC}),
        Changes.single(remove={(0, 2): AC}, add={(0, 1): AB}),
        Changes.single(remove={(0, 1): AB}, add={(1, 2): BC}),
        Changes.single(remove={(1, 2): BC}, add={(0, 1): AB}),
        Changes.single(remove={(0, 1): AB}),
    ]
    flowed: list[int] = []

    async def reconfigure(received: Tally, stop: threading.Event) -> None:
        try:
            while True:  # wait for the stream to start
                if received.nbytes > 0:
                    break
                await asyncio.sleep(0.02)
            for plan in plans:
                before = received.nbytes
                outcome = await rc.apply(plan)
                assert outcome.ok, outcome
                on = AB in plan.changes["ocs"].add.values()
                want = fab.circuit_device("a", "b") if on else "eth0"
                assert await asyncio.to_thread(fab.route_device, "a", "b") == want
                await asyncio.sleep(0.4)
                flowed.append(received.nbytes - before)
        finally:
            stop.set()

    sent, received = await transfer(fab, "a", "b", 1 << 30, during=reconfigure)
    _intact(sent, received)
    assert len(flowed) == len(plans) and all(n > 0 for n in flowed), flowed
    assert await asyncio.to_thread(fab.circuits) == frozenset()


def test_teardown_kills_what_runs_inside_and_leaves_no_namespace() -> None:
    _require()
    f = NetnsFabric(["a", "b"])
    with f:
        f.connect("a", "b")
        f.route_circuit("a", "b")
        sleeper = subprocess.Popen([*f.exec_args("a"), "sleep", "60"])
        assert len(f.leftovers()) == 3
    try:
        assert sleeper.wait(timeout=10) != 0  # killed
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    assert f.tag not in listed.stdout
    f.close()  # idempotent
