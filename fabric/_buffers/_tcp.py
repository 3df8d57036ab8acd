"""``tcp://`` one-sided buffers: the owner serves its registered regions over a socket.

This works between any two hosts. The owner runs a small threaded server (started on first
export) that checks each request against its region table and then streams bytes straight from
or into the registered memory; the reader's side is asyncio and lands bytes straight in its
destination. It is one-sided for the application (the owner's actor code takes no part), though
the owner's process does the socket work.

Request: ``OBUF | op u8 | region u64 | key u64 | offset u64 | length u64``; answer: a status
byte and, for errors, a length-prefixed message. A write sends its payload after a go-ahead.

A transfer that makes no progress for the data plane's ``stall_timeout`` (an owner stopped
with SIGSTOP, a host gone silent: the kernel may keep the connection looking alive) fails with
:class:`TransportError`; the owner drops connections that stall the same way, or sit idle
that long between requests (the reader opens a new one when a pooled one was dropped).
"""

from __future__ import annotations

import asyncio
import socket
import socketserver
import struct
import threading
from typing import Any

from orchestr.errors import DescriptorError, StaleDescriptorError, TransportError
from orchestr.fabric._registry import settings

from . import _transport
from ._sidechannel import SideChannel
from ._transport import Descriptor, OneSided, Region

__all__ = ["TcpBuffers"]

_REQ = struct.Struct("<4sBQQQQ")
_MAGIC = b"OBUF"
_READ, _WRITE = 1, 2
_OK, _STALE, _BAD = 0, 1, 2
_ERR = struct.Struct("<BI")
#: Writes go out in pieces of this size, so a stalled owner is noticed between them.
_PIECE = 4 << 20


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = bytearray(_REQ.size)
        while _recv_exactly(sock, memoryview(head)):
            magic, op, region_id, key, offset, length = _REQ.unpack(head)
            try:
                if magic != _MAGIC or op not in (_READ, _WRITE):
                    raise DescriptorError("not a buffer request")
                region = _transport.lookup(region_id, key)
                if offset + length > region.mem.nbytes:
                    raise DescriptorError(
                        f"[{offset}, +{length}) lies outside the {region.mem.nbytes}-byte buffer"
                    )
                if not region.reaches(offset, length):  # this process's own copy of the scope
                    raise DescriptorError(
                        _transport.outside_scope(offset, length, region_id, "this process")
                    )
                if op == _WRITE and region.mem.readonly:
                    raise DescriptorError("the buffer was registered read-only")
                span = region.mem[offset : offset + length]
            except DescriptorError as exc:
                text = str(exc).encode()
                status = _STALE if isinstance(exc, StaleDescriptorError) else _BAD
                sock.sendall(_ERR.pack(status, len(text)) + text)
                return  # a write's payload may follow; drop the connection rather than parse it
            sock.sendall(_ERR.pack(_OK, 0))
            if op == _READ:
                sock.sendall(span)
            else:
                if not _recv_exactly(sock, span):
                    return
                sock.sendall(_ERR.pack(_OK, 0))


def _recv_exactly(sock: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < view.nbytes:
        n = sock.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


class TcpBuffers(OneSided):
    """The ``tcp`` buffer backend."""

    scheme = "tcp"
    scoped = "owner"  # the owner's server checks each request against its own region table

    def __init__(self) -> None:
        self._server: SideChannel | None = None
        self._lock = threading.Lock()
        self._idle: dict[tuple[str, int], list[socket.socket]] = {}

    def probe(self) -> str | None:
        return None

    def reaches(self, owner: str) -> bool:
        return True

    def export(self, region: Region) -> tuple[Any, ...]:
        with self._lock:
            if self._server is None:
                from orchestr.fabric._registry import settings  # the job's bind host, as it is now

                self._server = SideChannel((settings.bind_host, 0), _Handler)
                self._server.serve_in_thread("orchestr-buffers")
            return self._server.endpoint

    def unexport(self, region: Region) -> None:
        pass  # the region table refuses it from now on

    def close(self) -> None:
        with self._lock:
            server, self._server = self._server, None
            idle, self._idle = self._idle, {}
        if server is not None:
            server.stop()
        for socks in idle.values():
            for s in socks:
                s.close()

    # -- peer side -----------------------------------------------------------------------------
    async def _connect(self, addr: tuple[str, int]) -> tuple[socket.socket, bool]:
        """A connection to the owner at ``addr``, and whether it was a pooled one."""
        idle = self._idle.get(addr)
        if idle:
            return idle.pop(), True
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET6 if ":" in addr[0] else socket.AF_INET)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            async with asyncio.timeout(settings.stall_timeout):
                await loop.sock_connect(sock, addr)
        except (OSError, TimeoutError) as exc:
            sock.close()
            raise StaleDescriptorError(
                f"cannot reach the buffer owner at {addr[0]}:{addr[1]}: {exc!r} (it may have "
                f"exited)"
            ) from exc
        return sock, False

    async def _status(self, io: _Progress, desc: Descriptor) -> None:
        head = bytearray(_ERR.size)
        await io.recv(memoryview(head))
        status, n = _ERR.unpack(head)
        if status == _OK:
            return
        text = bytearray(n)
        await io.recv(memoryview(text))
        cls = StaleDescriptorError if status == _STALE else DescriptorError
        raise cls(f"owner {desc.owner} refused: {text.decode(errors='replace')}")

    async def move(self, write: bool, desc: Descriptor, offset: int, local: memoryview) -> None:
        desc.check_span(offset, local.nbytes)
        try:
            host, port = desc.where
        except ValueError:
            raise DescriptorError(f"malformed tcp descriptor {desc.where!r}") from None
        if not (isinstance(host, str) and isinstance(port, int)):
            raise DescriptorError(f"malformed tcp descriptor {desc.where!r}")
        while True:
            sock, pooled = await self._connect((host, port))
            io = _Progress(sock, settings.stall_timeout)
            reusable = False
            try:
                async with io.guard():
                    await self._transfer(io, write, desc, offset, local)
                reusable = True
                return
            except (ConnectionError, EOFError) as exc:
                if pooled and not io.moved:
                    continue  # the owner dropped the idle connection: on a fresh one
                raise TransportError(
                    f"the buffer owner {desc.owner} went away mid-transfer: {exc}"
                ) from exc
            except TimeoutError as exc:
                raise TransportError(
                    f"the buffer owner {desc.owner} made no progress for "
                    f"{settings.stall_timeout:g} s (it may be stopped, or its host silent): "
                    f"the transfer is abandoned (ORCHESTR_TRANSFER_STALL_TIMEOUT)"
                ) from exc
            finally:
                if reusable:
                    self._idle.setdefault((host, port), []).append(sock)
                else:
                    sock.close()

    async def _transfer(
        self, io: _Progress, write: bool, desc: Descriptor, offset: int, local: memoryview
    ) -> None:
        op = _WRITE if write else _READ
        await io.send(_REQ.pack(_MAGIC, op, desc.region, desc.key, offset, local.nbytes))
        await self._status(io, desc)
        if op == _READ:
            await io.recv(local)
        else:
            for start in range(0, local.nbytes, _PIECE):
                await io.send(local[start : start + _PIECE])
            await self._status(io, desc)


class _Progress:
    """One transfer's socket I/O under a deadline that moves on with every byte received or
    piece sent: it fails only when nothing moved for ``stall_s``."""

    def __init__(self, sock: socket.socket, stall_s: float) -> None:
        self.sock = sock
        self.stall_s = stall_s
        self.loop = asyncio.get_running_loop()
        self.moved = 0  # bytes received so far
        self._timeout: asyncio.Timeout | None = None

    def guard(self) -> asyncio.Timeout:
        self._timeout = asyncio.timeout(self.stall_s)
        return self._timeout

    def _progress(self) -> None:
        if self._timeout is not None:
            self._timeout.reschedule(self.loop.time() + self.stall_s)

    async def send(self, data: bytes | memoryview) -> None:
        await self.loop.sock_sendall(self.sock, data)
        self._progress()

    async def recv(self, view: memoryview) -> None:
        got = 0
        while got < view.nbytes:
            n = await self.loop.sock_recv_into(self.sock, view[got:])
            if n == 0:
                raise EOFError("connection closed")
            got += n
            self.moved += n
            self._progress()
