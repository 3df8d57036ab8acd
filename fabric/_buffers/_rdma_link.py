"""The RDMA backend's plumbing: one device's pyverbs objects (:class:`Verbs`: context,
protection domain, queue pairs brought to ready-to-send), the messages of the owner's side
channel, and a reader's connection to one owner (:class:`Conn`: its queue pair, and what the
owner vouched for about each region it named, a scoped region's spans with their rkeys
included). :mod:`._rdma` is the backend built on them.
"""

from __future__ import annotations

import bisect
import os
import secrets
import socket
import struct
import threading
from typing import Any

from orchestr.errors import (
    DescriptorError,
    StaleDescriptorError,
    TransportError,
    TransportUnavailableError,
)

from . import _rdma_devices as devices
from . import _transport
from ._sidechannel import recv_exactly
from ._transport import Descriptor

__all__ = [
    "ASK",
    "GID_INDEX_ENV",
    "HELLO",
    "MAX_SPANS",
    "SCOPED",
    "SPAN",
    "VOUCH",
    "WRITABLE",
    "Conn",
    "Known",
    "Verbs",
    "pieces",
]

#: Which GID of the port to use (default: the first RoCE v2 GID with an address, or 0).
GID_INDEX_ENV = "ORCHESTR_RDMA_GID_INDEX"
HELLO = struct.Struct("<4sIIHB39s")  # magic, QP number, PSN, LID, MTU enum, GID text
ASK = struct.Struct("<QQ")  # region, key
#: known, flags (writable, scoped), address, length, rkey (0 for a scoped region), and how
#: many spans follow
VOUCH = struct.Struct("<BBQQII")
WRITABLE, SCOPED = 1, 2
SPAN = struct.Struct("<QQI")  # a scoped region's span: start, end (offsets), its MR's rkey
#: Most spans one answer lists (a scope wider than this is refused at registration).
MAX_SPANS = 1 << 16
MAGIC = b"ORDM"
#: What a reader knows of a region: address, length, rkey, writable, and for a scoped one its
#: spans as (start, end, rkey), sorted
Known = tuple[int, int, int, bool, tuple[tuple[int, int, int], ...] | None]


class Verbs:
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
        return HELLO.pack(MAGIC, qp.qp_num, psn, pa.lid, pa.active_mtu, self.gid.encode())

    def connect(self, qp: Any, psn: int, peer: bytes) -> None:
        """Bring ``qp`` through INIT and RTR to RTS, facing the peer whose hello is ``peer``."""
        magic, qpn, peer_psn, lid, mtu, gid = HELLO.unpack(peer)
        if magic != MAGIC:
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


class Conn:
    """Reader side: the QP, CQ and side-channel socket towards one owner, opened by naming the
    region of ``first`` (the owner makes a QP only for a reader that knows a key)."""

    def __init__(self, verbs: Verbs, host: str, port: int, first: Descriptor) -> None:
        self.lock = threading.Lock()
        self.known: dict[tuple[int, int], Known] = {}
        self.sock: socket.socket | None = None
        self.cq = verbs.new_cq(32)
        self.qp, psn = verbs.new_qp(self.cq)
        try:
            self.sock = socket.create_connection((host, port), timeout=10)
            self.sock.sendall(ASK.pack(first.region, first.key))
            self._vouched(first, recv_exactly(self.sock, VOUCH.size))
            self.sock.sendall(verbs.hello(self.qp, psn))
            peer = recv_exactly(self.sock, HELLO.size)
            if peer is None:
                raise TransportError(f"the RDMA owner at {host}:{port} hung up while connecting")
            verbs.connect(self.qp, psn, peer)
        except BaseException:
            self.close()
            raise

    def check(self, desc: Descriptor, write: bool) -> Known:
        """Have the owner vouch for ``desc`` (once per region and key); what it said."""
        known = self.known.get((desc.region, desc.key))
        if known is None:
            known = self._ask(desc)
        addr, length, rkey, writable, spans = known
        if (length, addr, rkey) != (desc.length, desc.where[2], desc.where[3]):
            raise DescriptorError(
                f"descriptor of region {desc.region} says {desc.length} bytes at "
                f"{desc.where[2]:#x} (rkey {desc.where[3]:#x}); the owner registered {length} "
                f"bytes at {addr:#x} (rkey {rkey:#x})"
            )
        if spans is not None and desc.scope is None:
            raise DescriptorError(
                f"buffer region {desc.region} of {desc.owner} grants some spans only; this "
                f"descriptor claims all of it (forged)"
            )
        if write and not writable:
            raise DescriptorError(f"buffer region {desc.region} of {desc.owner} is read-only")
        return known

    def route(
        self, desc: Descriptor, write: bool, offset: int, nbytes: int
    ) -> list[tuple[int, int, int, int]]:
        """Where ``[offset, offset + nbytes)`` of the region lies, as ``(at, nbytes, rkey,
        remote address)`` pieces, ``at`` counting from ``offset``: one piece for a whole
        region, one per MR touched for a scoped one (asking the owner again once when the
        spans known here do not cover it: it may have widened). Raises
        :class:`DescriptorError` for bytes outside the owner's spans."""
        addr, _, rkey, _, spans = self.check(desc, write)
        if spans is None:
            return [(0, nbytes, rkey, addr + offset)]
        cut = pieces(spans, addr, offset, nbytes)
        if cut is None:
            addr, _, _, _, spans = self._ask(desc)
            cut = pieces(spans or (), addr, offset, nbytes)
        if cut is None:
            raise DescriptorError(_transport.outside_scope(offset, nbytes, desc.region, desc.owner))
        return cut

    def _ask(self, desc: Descriptor) -> Known:
        assert self.sock is not None
        self.sock.sendall(ASK.pack(desc.region, desc.key))
        return self._vouched(desc, recv_exactly(self.sock, VOUCH.size))

    def _vouched(self, desc: Descriptor, answer: bytes | None) -> Known:
        if answer is None:
            raise ConnectionError("the RDMA owner closed its side channel")
        ok, flags, addr, length, rkey, count = VOUCH.unpack(answer)
        if not ok:
            raise StaleDescriptorError(
                f"buffer region {desc.region} of {desc.owner} is not registered there "
                f"(released, or the descriptor is forged)"
            )
        spans: tuple[tuple[int, int, int], ...] | None = None
        if flags & SCOPED:
            raw = b""
            if count:
                assert self.sock is not None
                got = recv_exactly(self.sock, count * SPAN.size)
                if got is None:
                    raise ConnectionError("the RDMA owner closed its side channel")
                raw = got
            spans = tuple(SPAN.iter_unpack(raw))
        writable = bool(flags & WRITABLE)
        known = self.known[(desc.region, desc.key)] = (addr, length, rkey, writable, spans)
        return known

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.qp.close()
        self.cq.close()


def pieces(
    spans: tuple[tuple[int, int, int], ...], addr: int, offset: int, nbytes: int
) -> list[tuple[int, int, int, int]] | None:
    """``[offset, offset + nbytes)`` cut along ``spans`` (start, end, rkey; sorted, each an
    MR), as :meth:`Conn.route` gives it; ``None`` when some of it lies in no span."""
    pieces: list[tuple[int, int, int, int]] = []
    at, end = offset, offset + nbytes
    i = bisect.bisect_right(spans, (offset, 1 << 64)) - 1
    while at < end:
        if i < 0 or i >= len(spans) or not spans[i][0] <= at < spans[i][1]:
            return None
        stop = min(end, spans[i][1])
        pieces.append((at - offset, stop - at, spans[i][2], addr + at))
        at, i = stop, i + 1
    return pieces
