"""``rdma://`` one-sided buffers over InfiniBand or RoCE verbs, through pyverbs (rdma-core).

The owner registers each region as a memory region (MR) over the memory where it lies and
publishes ``(host, port, address, rkey)``: where its TCP side channel listens, the region's
address and its remote key. A reader opens one reliable-connected queue pair (RC QP) per owner:
over the side channel each side sends its QP number, packet sequence number, LID, GID and MTU,
and both bring their QP to ready-to-send (the owner keeps its QP while that connection stays
open). The first time a reader uses a region it asks the owner, over that connection, to vouch
for the descriptor (region, key, length, address, rkey, writable) and remembers the answer, so a
forged descriptor is refused. A scoped region (:mod:`._scope`) has no MR over all of it: the
owner registers one MR per span (more as it widens), and its answer lists them, each with its
own rkey; the reader sends one work request per span a transfer touches, and asks again when
a transfer reaches past the spans it knows. The adapter refuses any access outside an MR, so a
reader cannot reach the bytes between the spans whatever it sends. Transfers are RDMA READ /
WRITE work requests the owner's CPU takes no part in; the reader polls its completion queue in a thread. An unexported region's MR is
deregistered, so its rkey stops working and the owner's adapter answers with a remote access
error, reported as :class:`StaleDescriptorError`.

pyverbs is imported on first probe. Debian's ``python3-pyverbs`` lives outside any virtualenv;
it is loaded from there (that package alone, nothing else on that path) when it was built for
this interpreter.
"""

from __future__ import annotations

import asyncio
import bisect
import socket
import socketserver
import threading
import time
from typing import Any

from orchestr.errors import (
    DescriptorError,
    StaleDescriptorError,
    TransportError,
    TransportUnavailableError,
)

from . import _rdma_devices as devices
from . import _scope, _transport
from ._rdma_link import (
    ASK,
    GID_INDEX_ENV,
    HELLO,
    MAX_SPANS,
    SCOPED,
    SPAN,
    VOUCH,
    WRITABLE,
    Conn,
    Verbs,
)
from ._scope import Scope
from ._sidechannel import SideChannel, recv_exactly
from ._transport import Descriptor, OneSided, Region

__all__ = ["GID_INDEX_ENV", "RdmaBuffers"]

#: Seconds one work request may wait for its completion.
COMPLETION_TIMEOUT = 30.0
_CHUNK = 1 << 30  # bytes per work request


class _Handler(socketserver.BaseRequestHandler):
    """Owner side of the side channel: one RC QP per reader, kept while it stays connected, and
    answers about the regions the reader names. The reader names a live region and its key
    first: no queue pair is made for a peer that has not shown one."""

    def handle(self) -> None:
        sock: socket.socket = self.request
        backend: RdmaBuffers = self.server.backend  # type: ignore[attr-defined]
        ask = recv_exactly(sock, ASK.size)
        if ask is None:
            return
        answer = backend._vouch(*ASK.unpack(ask))
        sock.sendall(answer)
        if not VOUCH.unpack_from(answer)[0]:
            return
        peer = recv_exactly(sock, HELLO.size)
        if peer is None:
            return
        sock.settimeout(None)  # a reader that showed a key keeps its QP while it is connected
        verbs = backend._open()
        qp, psn = verbs.new_qp(verbs.owner_cq)
        try:
            verbs.connect(qp, psn, peer)
            sock.sendall(verbs.hello(qp, psn))
            while (ask := recv_exactly(sock, ASK.size)) is not None:
                sock.sendall(backend._vouch(*ASK.unpack(ask)))
        except Exception:
            return  # the reader sees the hang-up and reports it
        finally:
            qp.close()


class _Registered:
    """An exported region's MRs: one over all of it, or one per span of a scoped region,
    as ``(start, end, MR)`` sorted by start."""

    __slots__ = ("addr", "closed", "mrs", "scoped", "writable")

    def __init__(self, addr: int, writable: bool, scoped: bool) -> None:
        self.addr, self.writable, self.scoped = addr, writable, scoped
        self.mrs: list[tuple[int, int, Any]] = []
        self.closed = False  # unexported: an MR registered after this is closed at once


class RdmaBuffers(OneSided):
    """The ``rdma`` buffer backend."""

    scheme = "rdma"
    scoped = "owner"  # the adapter: an MR per span, and none over the rest

    def __init__(self) -> None:
        self._info: dict[str, Any] | None = None
        self._reason: str | None = None
        self._verbs: Verbs | None = None
        self._server: SideChannel | None = None
        self._mrs: dict[int, _Registered] = {}  # by region id
        self._conns: dict[tuple[str, int], Conn] = {}
        self._lock = threading.Lock()

    def probe(self) -> str | None:
        if self._info is None:
            self._info = devices.discover()
            try:
                devices.select_port(self._info)
            except TransportUnavailableError as exc:
                self._reason = str(exc)
        return self._reason

    def details(self) -> dict[str, Any]:
        self.probe()
        info = self._info or {"devices": [], "pyverbs": None}
        return {"devices": [d["name"] for d in info["devices"]], "pyverbs": info["pyverbs"]}

    def reaches(self, owner: str) -> bool:
        return True

    def _open(self) -> Verbs:
        with self._lock:
            if self._verbs is None:
                if self.probe() is not None:
                    raise TransportUnavailableError(f"rdma cannot be used here: {self._reason}")
                self._verbs = Verbs(*devices.select_port(self._info or {}))
            return self._verbs

    def export(self, region: Region) -> tuple[Any, ...]:
        from orchestr.fabric._registry import settings

        from ._shm import address_of

        verbs = self._open()
        with self._lock:
            if self._server is None:
                self._server = SideChannel((settings.bind_host, 0), _Handler, self)
                self._server.serve_in_thread("orchestr-rdma")
            host, port = self._server.endpoint
        addr, writable = address_of(region.mem), not region.mem.readonly
        entry = _Registered(addr, writable, region.scope is not None)
        self._mrs[region.id] = entry
        try:
            if region.scope is None:
                if region.mem.nbytes:
                    self._register(verbs, entry, 0, region.mem.nbytes)
                return (host, port, addr, entry.mrs[0][2].rkey if entry.mrs else 0)
            self.widen(region, region.scope)
        except BaseException:
            self.unexport(region)
            raise
        return (host, port, addr, 0)  # a scoped region's rkeys come with the owner's answer

    def widen(self, region: Region, added: Scope) -> None:
        """Register an MR over each span of ``added`` (new bytes of a scoped region)."""
        entry = self._mrs.get(region.id)
        if entry is None:
            return
        if len(entry.mrs) + len(added) // 2 > MAX_SPANS:
            raise DescriptorError(
                f"a scoped buffer over rdma reaches at most {MAX_SPANS} spans; grant fewer, "
                f"larger ones"
            )
        verbs = self._open()
        for start, end in _scope.pairs(added):
            self._register(verbs, entry, start, end)

    def _register(self, verbs: Verbs, entry: _Registered, start: int, end: int) -> None:
        e = verbs.e
        access = e.IBV_ACCESS_REMOTE_READ
        if entry.writable:  # remote write needs local write too
            access |= e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
        mr = verbs.register(entry.addr + start, end - start, access)
        with self._lock:
            if not entry.closed:  # else the region was unexported meanwhile: no MR outlives it
                bisect.insort(entry.mrs, (start, end, mr), key=lambda m: m[0])
                return
        mr.close()

    def unexport(self, region: Region) -> None:
        with self._lock:
            entry = self._mrs.pop(region.id, None)
            if entry is None:
                return
            entry.closed = True
            mrs, entry.mrs = list(entry.mrs), []
        for _, _, mr in mrs:
            mr.close()  # the rkey dies with the MR

    def _vouch(self, region_id: int, key: int) -> bytes:
        try:
            region = _transport.lookup(region_id, key)
            entry = self._mrs[region_id]
        except (StaleDescriptorError, KeyError):
            return VOUCH.pack(0, 0, 0, 0, 0, 0)
        with self._lock:
            mrs = list(entry.mrs)
        flags = WRITABLE if entry.writable else 0
        if not entry.scoped:
            rkey = mrs[0][2].rkey if mrs else 0
            return VOUCH.pack(1, flags, entry.addr, region.mem.nbytes, rkey, 0)
        head = VOUCH.pack(1, flags | SCOPED, entry.addr, region.mem.nbytes, 0, len(mrs))
        return head + b"".join(SPAN.pack(start, end, mr.rkey) for start, end, mr in mrs)

    def close(self) -> None:
        with self._lock:
            server, self._server = self._server, None
            conns, self._conns = self._conns, {}
        if server is not None:
            server.stop()
        for conn in conns.values():
            conn.close()

    # -- reader side ---------------------------------------------------------------------------
    def _conn(self, host: str, port: int, first: Descriptor) -> Conn:
        verbs = self._open()
        with self._lock:
            conn = self._conns.get((host, port))
            if conn is None:
                try:
                    conn = Conn(verbs, host, port, first)
                except OSError as exc:
                    raise StaleDescriptorError(
                        f"cannot reach the RDMA owner at {host}:{port}: {exc} (it may have exited)"
                    ) from exc
                self._conns[(host, port)] = conn
            return conn

    def _drop(self, key: tuple[str, int], conn: Conn) -> None:
        with self._lock:
            if self._conns.get(key) is conn:
                del self._conns[key]
        conn.close()

    def _move_sync(self, write: bool, desc: Descriptor, offset: int, local: memoryview) -> None:
        from ._shm import address_of

        host, port = desc.where[0], desc.where[1]
        conn = self._conn(host, port, desc)
        verbs = self._open()
        e, wr_mod = verbs.e, devices.submodule("wr")
        opcode = e.IBV_WR_RDMA_WRITE if write else e.IBV_WR_RDMA_READ
        with conn.lock:  # one outstanding work request per QP; completions stay ours
            try:
                pieces = conn.route(desc, write, offset, local.nbytes)
            except OSError:
                self._drop((host, port), conn)
                raise
            laddr = address_of(local)
            mr = verbs.register(laddr, local.nbytes, 0 if write else e.IBV_ACCESS_LOCAL_WRITE)
            try:
                for at, nbytes, rkey, raddr in pieces:
                    for start in range(at, at + nbytes, _CHUNK):
                        n = min(_CHUNK, at + nbytes - start)
                        sge = wr_mod.SGE(laddr + start, n, mr.lkey)
                        wr = wr_mod.SendWR(
                            wr_id=start,
                            opcode=opcode,
                            num_sge=1,
                            sg=[sge],
                            send_flags=e.IBV_SEND_SIGNALED,
                        )
                        wr.set_wr_rdma(rkey, raddr + start - at)
                        conn.qp.post_send(wr)
                        self._complete(conn, desc)
            except BaseException:
                self._drop((host, port), conn)  # a failed QP is in the error state: start afresh
                raise
            finally:
                mr.close()

    def _complete(self, conn: Conn, desc: Descriptor) -> None:
        e = self._open().e
        deadline = time.monotonic() + COMPLETION_TIMEOUT
        npolled, wcs = conn.cq.poll()
        while npolled == 0:
            if time.monotonic() > deadline:
                raise TransportError(
                    f"no RDMA completion from {desc.owner} within {COMPLETION_TIMEOUT}s"
                )
            time.sleep(0.00005)
            npolled, wcs = conn.cq.poll()
        status = wcs[0].status
        if status == e.IBV_WC_REM_ACCESS_ERR:
            raise StaleDescriptorError(
                f"buffer region {desc.region} of {desc.owner} refused remote access (released, "
                f"or the descriptor is forged)"
            )
        if status != e.IBV_WC_SUCCESS:
            text = getattr(devices.submodule("cq"), "cqe_status_to_str", str)(status)
            raise TransportError(f"RDMA transfer with {desc.owner} failed: {text} ({status})")

    async def move(self, write: bool, desc: Descriptor, offset: int, local: memoryview) -> None:
        desc.check_span(offset, local.nbytes)
        w = desc.where
        if not (len(w) == 4 and isinstance(w[0], str) and all(isinstance(v, int) for v in w[1:])):
            raise DescriptorError(f"malformed rdma descriptor {w!r}")
        if local.nbytes:
            try:
                await asyncio.to_thread(self._move_sync, write, desc, offset, local)
            except TransportError:
                raise
            except Exception as exc:  # pyverbs and socket errors
                raise TransportError(f"RDMA transfer with {desc.owner} failed: {exc}") from exc
