"""Setting up a ``shm://`` connection: the listener's accept loop and both sides of the handshake.

The listener binds an abstract Unix socket. A connecting process creates two sealed memfd rings,
one per direction (:data:`~orchestr.fabric._streams._shmring.RING_BYTES` each), and passes them in its
hello with ``SCM_RIGHTS``; the listener checks the seals and sizes, maps both and answers with
its pid. Each side checks with ``SO_PEERCRED`` that the other runs as the same user. What runs
over the connection afterwards is the caller's: the listener starts an end of the
:class:`~orchestr.fabric._streams._shmring.RingEnd` subclass it was given on each connection it accepts,
and :func:`dial` returns the connecting side's socket and rings.
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import struct

from orchestr.tasks import TaskOwner

from ._flow import ProtocolFactory
from ._shmring import RING_BYTES, Ring, RingEnd

__all__ = ["ShmListener", "dial"]

HANDSHAKE_TIMEOUT = 10.0
MAGIC = b"ORCSHMS1"
HELLO = struct.Struct("<8sQQ")  # magic, capacity of the client->server ring, of server->client
ACK = struct.Struct("<8sQ")  # magic, server pid
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end; refuses another user."""
    pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    if uid != os.getuid():
        raise PermissionError(f"shm:// peer (pid {pid}) runs as uid {uid}, not {os.getuid()}")
    return pid, uid


async def _ready(loop: asyncio.AbstractEventLoop, sock: socket.socket, *, write: bool) -> None:
    """Wait until ``sock`` is readable (or, with ``write``, writable)."""
    ready = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    if write:
        add, remove = loop.add_writer, loop.remove_writer
    else:
        add, remove = loop.add_reader, loop.remove_reader
    add(sock.fileno(), wake)
    try:
        await ready
    finally:
        remove(sock.fileno())


async def _recv_exact(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    got = b""
    while len(got) < n:
        more = await loop.sock_recv(sock, n - len(got))
        if not more:
            break
        got += more
    return got


class ShmListener:
    """Accepts on a bound, listening socket; each connection that completes the handshake gets a
    protocol from ``factory`` and an end of type ``end_type``."""

    def __init__(
        self, url: str, sock: socket.socket, factory: ProtocolFactory, end_type: type[RingEnd]
    ) -> None:
        self._url = url
        self._sock = sock
        self._factory = factory
        self._end_type = end_type
        self._loop = asyncio.get_running_loop()
        self._tasks = TaskOwner()  # the accept loop and the handshakes in progress
        self._tasks.start(self._serve())

    @property
    def url(self) -> str:
        return self._url

    async def aclose(self) -> None:
        """Stop accepting; connections already made stay up."""
        if self._sock.fileno() < 0:
            return
        await self._tasks.aclose()
        self._sock.close()

    async def _serve(self) -> None:
        while True:
            try:
                conn, _ = await self._loop.sock_accept(self._sock)
            except OSError as exc:  # out of descriptors and the like: keep listening
                self._loop.call_exception_handler(
                    {"message": f"shm:// accept failed on {self.url}", "exception": exc}
                )
                await asyncio.sleep(0.1)
                continue
            self._tasks.start(self._handshake(conn))

    async def _handshake(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        fds: list[int] = []
        rings: list[Ring] = []
        try:
            pid, _ = peer_credentials(conn)
            async with asyncio.timeout(HANDSHAKE_TIMEOUT):
                while True:
                    try:
                        msg, fds, _, _ = socket.recv_fds(
                            conn, HELLO.size, 2, socket.MSG_CMSG_CLOEXEC
                        )
                        break
                    except (BlockingIOError, InterruptedError):
                        await _ready(self._loop, conn, write=False)
            if len(msg) != HELLO.size or len(fds) != 2:
                raise ConnectionRefusedError(errno.ECONNREFUSED, "not an shm:// hello")
            magic, to_us, to_them = HELLO.unpack(msg)
            if magic != MAGIC:
                raise ConnectionRefusedError(errno.ECONNREFUSED, "not an shm:// hello")
            Ring.check_fd(fds[0], to_us)
            Ring.check_fd(fds[1], to_them)
            rings = [Ring(fds[0], to_us), Ring(fds[1], to_them)]
            conn.send(ACK.pack(MAGIC, os.getpid()))  # the first bytes on the socket: they fit
        except BaseException as exc:
            conn.close()
            for ring in rings:
                ring.close()
            if not isinstance(exc, Exception):
                raise
            return
        finally:
            for fd in fds:
                os.close(fd)
        try:
            protocol = self._factory()
        except Exception as exc:
            self._loop.call_exception_handler(
                {"message": f"shm:// protocol factory failed on {self.url}", "exception": exc}
            )
            conn.close()
            for ring in rings:
                ring.close()
            return
        extra = {"sockname": self.url, "peername": f"{self.url}#{pid}", "peer_pid": pid}
        self._end_type(self._loop, conn, rings[1], rings[0], protocol, extra).start()


async def dial(
    loop: asyncio.AbstractEventLoop, url: str, address: str
) -> tuple[socket.socket, Ring, Ring, int]:
    """Connect to the listener at ``address`` (serving ``url``) and hand it this connection's
    rings: returns the socket, the outgoing and incoming rings and the listener's pid."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    rings: list[Ring] = []
    try:
        async with asyncio.timeout(HANDSHAKE_TIMEOUT):
            try:
                await loop.sock_connect(sock, address)
            except (ConnectionRefusedError, FileNotFoundError):
                raise ConnectionRefusedError(
                    errno.ECONNREFUSED, f"nothing listens on {url}"
                ) from None
            pid, _ = peer_credentials(sock)
            fds = [Ring.create_fd(RING_BYTES, "up"), Ring.create_fd(RING_BYTES, "down")]
            try:
                rings = [Ring(fds[0], RING_BYTES), Ring(fds[1], RING_BYTES)]
                hello = HELLO.pack(MAGIC, RING_BYTES, RING_BYTES)
                while True:
                    try:
                        socket.send_fds(sock, [hello], fds)
                        break
                    except (BlockingIOError, InterruptedError):
                        await _ready(loop, sock, write=True)
            finally:
                for fd in fds:
                    os.close(fd)
            ack = await _recv_exact(loop, sock, ACK.size)
        if len(ack) != ACK.size or ack[: len(MAGIC)] != MAGIC:
            raise ConnectionRefusedError(errno.ECONNREFUSED, f"{url} refused the connection")
    except BaseException:
        sock.close()
        for ring in rings:
            ring.close()
        raise
    return sock, rings[0], rings[1], pid
