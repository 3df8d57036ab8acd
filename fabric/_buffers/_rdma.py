"""``rdma://`` one-sided buffers over InfiniBand or RoCE verbs, through pyverbs (rdma-core).

The owner registers each region as a memory region (MR) over the memory where it lies and
publishes ``(host, port, address, rkey)``: where its TCP side channel listens, the region's
address and its remote key. A reader opens one reliable-connected queue pair (RC QP) per owner:
over the side channel each side sends its QP number, packet sequence number, LID, GID and MTU,
and both bring their QP to ready-to-send (the owner keeps its QP while that connection stays
open). The first time a reader uses a region it asks the owner, over that connection, to vouch
for the descriptor (region, key, length, address, rkey, writable) and remembers the answer, so a
forged descriptor is refused. Transfers are RDMA READ / WRITE work requests the owner's CPU takes
no part in; the reader polls its completion queue in a thread. An unexported region's MR is
deregistered, so its rkey stops working and the owner's adapter answers with a remote access
error, reported as :class:`StaleDescriptorError`.

pyverbs is imported on first probe. Debian's ``python3-pyverbs`` lives outside any virtualenv;
it is loaded from there (that package alone, nothing else on that path) when it was built for
this interpreter.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import socketserver
import struct
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
from . import _transport
from ._sidechannel import SideChannel, recv_exactly
from ._transport import Descriptor, OneSided, Region

__all__ = ["RdmaBuffers"]

GID_INDEX_ENV = "ORCHESTR_RDMA_GID_INDEX"
#: Seconds one work request may wait for its completion.
COMPLETION_TIMEOUT = 30.0
_CHUNK = 1 << 30  # bytes per work request
_HELLO = struct.Struct("<4sIIHB39s")  # magic, QP number, PSN, LID, MTU enum, GID text
_ASK = struct.Struct("<QQ")  # region, key
_VOUCH = struct.Struct("<BBQQI")  # known, writable, address, length, rkey
_MAGIC = b"ORDM"


class _Verbs:
    """One opened device: context, protection domain, the port and GID in use."""

    def __init__(self, device: str, port: int) -> None:
        self.e: Any = devices.submodule("enums")
        self.port = port
        self.ctx = devices.submodule("device").Context(name=device)
        self.pd = devices.submodule("pd").PD(self.ctx)
        self.owner_cq = self.new_cq(256)
        self.port_attr = self.ctx.query_port(port)
        self.gid_index = self._gid_index()
        self.gid = str(self.ctx.query_gid(port, self.gid_index))

    def _gid_index(self) -> int:
        if os.environ.get(GID_INDEX_ENV):
            return int(os.environ[GID_INDEX_ENV])
        if self.port_attr.link_layer != self.e.IBV_LINK_LAYER_ETHERNET:
            return 0
        for i in range(self.port_attr.gid_tbl_len):  # RoCE: the first RoCE v2 GID with an address
            try:
                gid = str(self.ctx.query_gid(self.port, i))
                v2 = self.ctx.query_gid_type(self.port, i) == self.e.IBV_GID_TYPE_SYSFS_ROCE_V2
            except Exception:
                continue
            if v2 and gid.replace(":", "").strip("0"):
                return i
        return 0

    def new_cq(self, depth: int) -> Any:
        return devices.submodule("cq").CQ(self.ctx, depth, None, None, 0)

    def register(self, addr: int, length: int, access: int) -> Any:
        """An MR over memory pyverbs did not allocate."""
        try:
            return devices.submodule("mr").MR(self.pd, length, access, address=addr)
        except TypeError as exc:
            raise TransportUnavailableError(
                f"this pyverbs cannot register memory it did not allocate ({exc}); pyverbs "
                f"from rdma-core v28 or newer has MR(pd, length, access, address=...)"
            ) from exc

    def new_qp(self, cq: Any) -> tuple[Any, int]:
        qp = devices.submodule("qp")
        cap = qp.QPCap(max_send_wr=16, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = qp.QPInitAttr(qp_type=self.e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=1)
        return qp.QP(self.pd, init), secrets.randbits(24)

    def hello(self, qp: Any, psn: int) -> bytes:
        pa = self.port_attr
        return _HELLO.pack(_MAGIC, qp.qp_num, psn, pa.lid, pa.active_mtu, self.gid.encode())

    def connect(self, qp: Any, psn: int, peer: bytes) -> None:
        """Bring ``qp`` through INIT and RTR to RTS, facing the peer whose hello is ``peer``."""
        magic, qpn, peer_psn, lid, mtu, gid = _HELLO.unpack(peer)
        if magic != _MAGIC:
            raise TransportError("the RDMA side channel answered with something else")
        e, addr = self.e, devices.submodule("addr")
        attr = devices.submodule("qp").QPAttr(port_num=self.port)
        attr.pkey_index = 0
        attr.qp_access_flags = (
            e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
        )
        attr.path_mtu = min(mtu, self.port_attr.active_mtu)
        attr.dest_qp_num, attr.rq_psn, attr.sq_psn = qpn, peer_psn, psn
        attr.max_dest_rd_atomic = attr.max_rd_atomic = 1
        attr.min_rnr_timer, attr.timeout, attr.retry_cnt, attr.rnr_retry = 12, 14, 7, 7
        route = addr.GlobalRoute(dgid=addr.GID(gid.decode()), sgid_index=self.gid_index)
        attr.ah_attr = addr.AHAttr(port_num=self.port, dlid=lid, is_global=1, gr=route)
        qp.to_rts(attr)  # RESET -> INIT -> RTR -> RTS, each with its attribute mask


class _Handler(socketserver.BaseRequestHandler):
    """Owner side of the side channel: one RC QP per reader, kept while it stays connected, and
    answers about the regions the reader names. The reader names a live region and its key
    first: no queue pair is made for a peer that has not shown one."""

    def handle(self) -> None:
        sock: socket.socket = self.request
        backend: RdmaBuffers = self.server.backend  # type: ignore[attr-defined]
        ask = recv_exactly(sock, _ASK.size)
        if ask is None:
            return
        answer = backend._vouch(*_ASK.unpack(ask))
        sock.sendall(answer)
        if not _VOUCH.unpack(answer)[0]:
            return
        peer = recv_exactly(sock, _HELLO.size)
        if peer is None:
            return
        sock.settimeout(None)  # a reader that showed a key keeps its QP while it is connected
        verbs = backend._open()
        qp, psn = verbs.new_qp(verbs.owner_cq)
        try:
            verbs.connect(qp, psn, peer)
            sock.sendall(verbs.hello(qp, psn))
            while (ask := recv_exactly(sock, _ASK.size)) is not None:
                sock.sendall(backend._vouch(*_ASK.unpack(ask)))
        except Exception:
            return  # the reader sees the hang-up and reports it
        finally:
            qp.close()


class _Conn:
    """Reader side: the QP, CQ and side-channel socket towards one owner, opened by naming the
    region of ``first`` (the owner makes a QP only for a reader that knows a key)."""

    def __init__(self, verbs: _Verbs, host: str, port: int, first: Descriptor) -> None:
        self.lock = threading.Lock()
        self.known: dict[tuple[int, int], tuple[int, int, int, bool]] = {}
        self.sock: socket.socket | None = None
        self.cq = verbs.new_cq(32)
        self.qp, psn = verbs.new_qp(self.cq)
        try:
            self.sock = socket.create_connection((host, port), timeout=10)
            self.sock.sendall(_ASK.pack(first.region, first.key))
            self._vouched(first, recv_exactly(self.sock, _VOUCH.size))
            self.sock.sendall(verbs.hello(self.qp, psn))
            peer = recv_exactly(self.sock, _HELLO.size)
            if peer is None:
                raise TransportError(f"the RDMA owner at {host}:{port} hung up while connecting")
            verbs.connect(self.qp, psn, peer)
        except BaseException:
            self.close()
            raise

    def check(self, desc: Descriptor, write: bool) -> None:
        """Have the owner vouch for ``desc`` (once per region and key)."""
        known = self.known.get((desc.region, desc.key))
        if known is None:
            assert self.sock is not None
            self.sock.sendall(_ASK.pack(desc.region, desc.key))
            known = self._vouched(desc, recv_exactly(self.sock, _VOUCH.size))
        addr, length, rkey, writable = known
        if (length, addr, rkey) != (desc.length, desc.where[2], desc.where[3]):
            raise DescriptorError(
                f"descriptor of region {desc.region} says {desc.length} bytes at "
                f"{desc.where[2]:#x} (rkey {desc.where[3]:#x}); the owner registered {length} "
                f"bytes at {addr:#x} (rkey {rkey:#x})"
            )
        if write and not writable:
            raise DescriptorError(f"buffer region {desc.region} of {desc.owner} is read-only")

    def _vouched(self, desc: Descriptor, answer: bytes | None) -> tuple[int, int, int, bool]:
        if answer is None:
            raise ConnectionError("the RDMA owner closed its side channel")
        ok, writable, addr, length, rkey = _VOUCH.unpack(answer)
        if not ok:
            raise StaleDescriptorError(
                f"buffer region {desc.region} of {desc.owner} is not registered there "
                f"(released, or the descriptor is forged)"
            )
        known = self.known[(desc.region, desc.key)] = (addr, length, rkey, bool(writable))
        return known

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.qp.close()
        self.cq.close()


class RdmaBuffers(OneSided):
    """The ``rdma`` buffer backend."""

    scheme = "rdma"

    def __init__(self) -> None:
        self._info: dict[str, Any] | None = None
        self._reason: str | None = None
        self._verbs: _Verbs | None = None
        self._server: SideChannel | None = None
        self._mrs: dict[int, tuple[Any, int, bool]] = {}  # region id -> (MR, address, writable)
        self._conns: dict[tuple[str, int], _Conn] = {}
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

    def _open(self) -> _Verbs:
        with self._lock:
            if self._verbs is None:
                if self.probe() is not None:
                    raise TransportUnavailableError(f"rdma cannot be used here: {self._reason}")
                self._verbs = _Verbs(*devices.select_port(self._info or {}))
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
        addr, rkey, e = address_of(region.mem), 0, verbs.e
        if region.mem.nbytes:
            access = e.IBV_ACCESS_REMOTE_READ
            if not region.mem.readonly:  # remote write needs local write too
                access |= e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
            mr = verbs.register(addr, region.mem.nbytes, access)
            self._mrs[region.id] = (mr, addr, not region.mem.readonly)
            rkey = mr.rkey
        return (host, port, addr, rkey)

    def unexport(self, region: Region) -> None:
        entry = self._mrs.pop(region.id, None)
        if entry is not None:
            entry[0].close()  # the rkey dies with the MR

    def _vouch(self, region_id: int, key: int) -> bytes:
        try:
            region = _transport.lookup(region_id, key)
            mr, addr, writable = self._mrs[region_id]
        except (StaleDescriptorError, KeyError):
            return _VOUCH.pack(0, 0, 0, 0, 0)
        return _VOUCH.pack(1, int(writable), addr, region.mem.nbytes, mr.rkey)

    def close(self) -> None:
        with self._lock:
            server, self._server = self._server, None
            conns, self._conns = self._conns, {}
        if server is not None:
            server.stop()
        for conn in conns.values():
            conn.close()

    # -- reader side ---------------------------------------------------------------------------
    def _conn(self, host: str, port: int, first: Descriptor) -> _Conn:
        verbs = self._open()
        with self._lock:
            conn = self._conns.get((host, port))
            if conn is None:
                try:
                    conn = _Conn(verbs, host, port, first)
                except OSError as exc:
                    raise StaleDescriptorError(
                        f"cannot reach the RDMA owner at {host}:{port}: {exc} (it may have exited)"
                    ) from exc
                self._conns[(host, port)] = conn
            return conn

    def _drop(self, key: tuple[str, int], conn: _Conn) -> None:
        with self._lock:
            if self._conns.get(key) is conn:
                del self._conns[key]
        conn.close()

    def _move_sync(self, write: bool, desc: Descriptor, offset: int, local: memoryview) -> None:
        from ._shm import address_of

        host, port, raddr, rkey = desc.where
        conn = self._conn(host, port, desc)
        verbs = self._open()
        e, wr_mod = verbs.e, devices.submodule("wr")
        opcode = e.IBV_WR_RDMA_WRITE if write else e.IBV_WR_RDMA_READ
        with conn.lock:  # one outstanding work request per QP; completions stay ours
            try:
                conn.check(desc, write)
            except OSError:
                self._drop((host, port), conn)
                raise
            laddr = address_of(local)
            mr = verbs.register(laddr, local.nbytes, 0 if write else e.IBV_ACCESS_LOCAL_WRITE)
            try:
                for start in range(0, local.nbytes, _CHUNK):
                    n = min(_CHUNK, local.nbytes - start)
                    sge = wr_mod.SGE(laddr + start, n, mr.lkey)
                    wr = wr_mod.SendWR(
                        wr_id=start,
                        opcode=opcode,
                        num_sge=1,
                        sg=[sge],
                        send_flags=e.IBV_SEND_SIGNALED,
                    )
                    wr.set_wr_rdma(rkey, raddr + offset + start)
                    conn.qp.post_send(wr)
                    self._complete(conn, desc)
            except BaseException:
                self._drop((host, port), conn)  # a failed QP is in the error state: start afresh
                raise
            finally:
                mr.close()

    def _complete(self, conn: _Conn, desc: Descriptor) -> None:
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
