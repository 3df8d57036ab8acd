"""The limits for actor calls on this machine.

For the small-call metrics: a bare asyncio msgpack echo over uvloop TCP, with no runtime at
all (length-prefixed msgpack ``[id, value]`` frames, a dict of futures on the client). Servers
and n:n callers run in their own processes, as actors would.

For the 64 KiB metric the bound is the wire itself: one process writes 64 KiB chunks to another
over loopback TCP with blocking sockets and the reader drops them (``recv_into`` one buffer);
chunks per second is the most any runtime could deliver 64 KiB arguments between processes.

    python bench/_limit_echo.py REPS SECONDS SYNC_CALLS   # prints one JSON line
"""

from __future__ import annotations

import abc
import asyncio
import itertools
import json
import socket
import statistics
import struct
import subprocess
import sys
import time
from typing import Any

import msgpack
import uvloop

IN_FLIGHT = 1_000
PAYLOAD = b"x" * (64 * 1024)
_LEN = struct.Struct("<I")


class _Framed(asyncio.Protocol):
    def __init__(self) -> None:
        self.buf = bytearray()
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        pos = 0
        while len(self.buf) - pos >= 4:
            (n,) = _LEN.unpack_from(self.buf, pos)
            if len(self.buf) - pos - 4 < n:
                break
            self.frame(msgpack.unpackb(self.buf[pos + 4 : pos + 4 + n]))
            pos += 4 + n
        del self.buf[:pos]

    def send(self, obj: Any) -> None:
        body = msgpack.packb(obj)
        self.transport.write(_LEN.pack(len(body)) + body)

    @abc.abstractmethod
    def frame(self, msg: Any) -> None:
        """Handle one decoded frame."""


class _Server(_Framed):
    def frame(self, msg: Any) -> None:
        call_id, value = msg
        self.send([call_id, len(value) if isinstance(value, bytes) else value])


class _Client(_Framed):
    def __init__(self) -> None:
        super().__init__()
        self.pending: dict[int, asyncio.Future[Any]] = {}
        self.ids = itertools.count()

    def call(self, value: Any) -> asyncio.Future[Any]:
        call_id = next(self.ids)
        fut = asyncio.get_running_loop().create_future()
        self.pending[call_id] = fut
        self.send([call_id, value])
        return fut

    def frame(self, msg: Any) -> None:
        self.pending.pop(msg[0]).set_result(msg[1])


async def _connect(port: int) -> _Client:
    _, client = await asyncio.get_running_loop().create_connection(_Client, "127.0.0.1", port)
    return client


async def _serve() -> None:
    server = await asyncio.get_running_loop().create_server(_Server, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()


async def _drive(ports: list[int], seconds: float) -> None:
    clients = [await _connect(p) for p in ports]
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        await asyncio.gather(*(clients[i % len(clients)].call(i) for i in range(IN_FLIGHT)))
        count += IN_FLIGHT
    print(count / (time.perf_counter() - start), flush=True)


def _start_server() -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, __file__, "serve"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def _summary(samples: list[float]) -> dict[str, float]:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


async def _measure(
    port: int, reps: int, seconds: float, sync_calls: int, ports: list[int]
) -> dict[str, Any]:
    client = await _connect(port)

    async def sync_once() -> float:
        lat = []
        for i in range(sync_calls):
            t = time.perf_counter()
            await client.call(i)
            lat.append(time.perf_counter() - t)
        return statistics.median(lat) * 1e6

    async def rate(value: Any) -> float:
        calls, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            await asyncio.gather(*(client.call(value) for _ in range(IN_FLIGHT)))
            calls += IN_FLIGHT
        return calls / (time.perf_counter() - start)

    def n_n_once() -> float:
        # each caller times itself, so process start-up is not counted
        drivers = [
            subprocess.Popen(
                [sys.executable, __file__, "drive", str(seconds), *map(str, ports)],
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(2)
        ]
        return sum(float(d.communicate()[0]) for d in drivers)

    out: dict[str, Any] = {}
    for name, once in (
        ("1_1_actor_calls_sync_p50_us", sync_once),
        ("1_1_actor_calls_async_per_s", lambda: rate(1)),
    ):
        await once()
        out[name] = _summary([await once() for _ in range(reps)])
    n_n_once()
    out["n_n_actor_calls_async_per_s"] = _summary([n_n_once() for _ in range(reps)])
    return out


def main() -> None:
    if sys.argv[1] == "serve":
        uvloop.run(_serve())
        return
    if sys.argv[1] == "sink":
        _sink()
        return
    if sys.argv[1] == "drive":
        uvloop.run(_drive([int(p) for p in sys.argv[3:]], float(sys.argv[2])))
        return
    reps, seconds, sync_calls = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    servers = [_start_server() for _ in range(3)]
    try:
        result = uvloop.run(
            _measure(servers[0][1], reps, seconds, sync_calls, [servers[1][1], servers[2][1]])
        )
    finally:
        for proc, _ in servers:
            proc.kill()
            proc.wait()
    result["1_1_actor_calls_with_64KiB_arg_per_s"] = _loopback_chunks(reps, seconds)
    print(json.dumps(result))


def _sink() -> None:
    """Accept one connection; read ``u64 total`` then that many bytes; answer one byte."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        print(server.getsockname()[1], flush=True)
        conn, _ = server.accept()
        with conn:
            buf = bytearray(1 << 20)
            while True:
                head = conn.recv(8, socket.MSG_WAITALL)
                if len(head) < 8:
                    return
                (left,) = struct.unpack("<Q", head)
                while left:
                    left -= conn.recv_into(buf, min(left, len(buf)))
                conn.sendall(b"k")


def _loopback_chunks(reps: int, seconds: float) -> dict[str, float]:
    proc = subprocess.Popen([sys.executable, __file__, "sink"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        with socket.create_connection(("127.0.0.1", int(proc.stdout.readline()))) as sock:

            def once(count: int) -> float:
                start = time.perf_counter()
                sock.sendall(struct.pack("<Q", count * len(PAYLOAD)))
                for _ in range(count):
                    sock.sendall(PAYLOAD)
                sock.recv(1)
                return count / (time.perf_counter() - start)

            count = max(1000, int(once(5000) * seconds))  # calibrate to about `seconds`
            return _summary([once(count) for _ in range(reps)])
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    main()
