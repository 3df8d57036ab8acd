"""Large tensors on the call path: shared memory between processes on one host.

A tensor or array of at least ``Config.inline_max_bytes`` sent to a process on this host goes
through a shared-memory segment (:mod:`orchestr.fabric._segments`) instead of the stream: the
frame carries a descriptor and the receiver's actor gets a tensor that is the segment itself.
Across hosts, values stay in the frame on the stream transport.

Each connection negotiates this in its handshake. The caller's ``HELLO`` and the server's
``WELCOME`` each carry a probe (a tiny segment); each side maps the other's to prove it can. The
caller uses shared memory from its first call when the address says the server is on this host,
and the server from its first answer once it has mapped the caller's probe; the caller's
``READY`` confirms that it can map the server's segments too, or withdraws it. A failed probe is a fallback to the stream: an error under the policy
``error``, otherwise logged and counted. ``RELEASE`` messages hand segments back.
"""

from __future__ import annotations

import asyncio
import os
import threading
import urllib.parse
from typing import Any

import structlog

from orchestr.fabric import Buffer, _buffers, _local
from orchestr.fabric._memfd import Segment, open_peer
from orchestr.fabric._segments import copy, peers, pool
from orchestr.fabric._shm import address_of

from . import _serde
from .config import Config
from .errors import DescriptorError, FallbackError, OrchestrError, ProtocolError

__all__ = [
    "BulkLink",
    "address_with_process",
    "local_url_of_address",
    "peer_of_address",
    "probe",
]

log = structlog.get_logger("orchestr.bulk")

_probe: Segment | None = None


def probe() -> list[int]:
    """This process's probe segment as ``[pid, fd, key]``."""
    global _probe
    if _probe is None or _probe.name.split(".")[1] != str(os.getpid()):
        _probe = Segment(64)
    return [os.getpid(), _probe.fd, _probe.key]


def check_probe(wire: Any, pid: int) -> str | None:
    """``None`` if this process can map the peer's probe, else why not."""
    try:
        p_pid, fd, key = wire
        if p_pid != pid:
            return "the probe names another process"
        open_peer(p_pid, fd, key).close()
    except (OrchestrError, TypeError, ValueError) as exc:
        return f"cannot map the peer's shared memory: {exc}"
    return None


def address_with_process(url: str, local: str | None = None) -> str:
    """A call address that also names the serving process (so callers know where it is) and,
    when given, the URL of a listener for callers on the same host."""
    address = f"{url}?proc={_local.process_key()}"
    return f"{address}&local={local}" if local else address


def _query(url: str) -> dict[str, str]:
    _, _, query = url.partition("?")
    return {k: v[0] for k, v in urllib.parse.parse_qs(query).items()}


def peer_of_address(url: str) -> str | None:
    return _query(url).get("proc")


def local_url_of_address(url: str) -> str | None:
    """The same-host listener an address offers (``shm://...``), if any."""
    return _query(url).get("local")


class _Sink:
    """Collects the segments one message's encoding leased."""

    __slots__ = ("leases", "threshold")

    def __init__(self, threshold: int) -> None:
        self.threshold = threshold
        self.leases: list[tuple[int, int]] = []

    def put(self, buf: memoryview) -> list[int]:
        nbytes = buf.nbytes
        found = pool.find(address_of(buf), nbytes)
        if found is not None:  # already in a segment: send it as it is
            segment, offset = found
            pool.hold(segment.fd)
            generation = segment.generation
        else:
            segment, generation = pool.lease(nbytes)
            offset = 0
            try:
                copy(address_of(segment.data), address_of(buf), nbytes)
            except BaseException:
                pool.release(segment.fd, generation)
                raise
        self.leases.append((segment.fd, generation))
        return [os.getpid(), segment.fd, segment.key, generation, offset]

    def abandon(self) -> None:
        for fd, generation in self.leases:
            pool.release(fd, generation)


class BulkLink:
    """The shared-memory state of one call-path connection (either end)."""

    def __init__(self, config: Config, loop: asyncio.AbstractEventLoop, send: Any) -> None:
        self.threshold = config.inline_max_bytes
        self.policy = config.transport_fallback
        self.loop = loop
        self._send = send  # (message list) -> None, on the loop
        self.peer: str | None = None
        self.peer_pid = 0
        self.same_host = False
        self.refused_stream: str | None = None
        self.can_send = False  # the peer maps our segments
        self.can_receive = False  # we map the peer's
        self.refused: str | None = None  # why shared memory is not used, when the peer is local
        self.leases: dict[tuple[int, int], int] = {}
        self.stream = "tcp"  # the connection's stream scheme, set by its owner
        self._releases: list[tuple[int, int]] = []
        self._thread = threading.get_ident()
        #: Shared-memory values mapped so far (callers compare before and after a decode).
        self.mapped = 0
        self._flush_scheduled = False

    # -- negotiation ---------------------------------------------------------------------------
    def set_peer(self, peer: str) -> bool:
        """Record the peer's process key; whether it is on this host."""
        self.peer = peer
        self.peer_pid = _local.pid_of(peer)
        self.same_host = _local.host_of(peer) == _local.host_id()
        return self.same_host

    def stream_fallback(self, reason: str) -> None:
        """The same-host stream could not be opened; the connection uses tcp instead."""
        self.stream = "tcp"
        self.refused_stream = reason
        _buffers.stats.setdefault("tcp", _buffers.Counters()).fallbacks += 1
        log.warning("transport fallback", wanted="shm", using="tcp", reason=reason, peer=self.peer)

    def refuse(self, reason: str) -> None:
        """Shared memory cannot be used with this peer: a fallback to the stream."""
        self.can_send = False
        if self.refused is None:
            self.refused = reason
            _buffers.stats.setdefault("tcp", _buffers.Counters()).fallbacks += 1
            log.warning(
                "transport fallback", wanted="shm", using="tcp", reason=reason, peer=self.peer
            )

    def report(self) -> dict[str, Any]:
        local = self.peer is not None and _local.host_of(self.peer) == _local.host_id()
        bulk = "shm" if self.can_send else "inline"
        return {
            "peer": self.peer,
            "stream": self.stream,
            "bulk": bulk,
            "same_host": local,
            "fallback": self.refused or self.refused_stream,
        }

    # -- sending -------------------------------------------------------------------------------
    def sink(self, policy: str | None = None) -> _Sink | None:
        """Where this message's large values go: shared memory, the frame (``None``), or an
        error when shared memory was refused and the policy (the call's, else the job's) is
        ``error``."""
        if self.can_send:
            return _Sink(self.threshold)
        if self.refused is not None and (policy or self.policy) == "error":
            return _RefusingSink(self.threshold, self.refused, self.peer)
        return None

    def sent(self, sink: _Sink | None) -> None:
        if sink is not None:
            for lease in sink.leases:
                self.leases[lease] = self.leases.get(lease, 0) + 1

    # -- receiving -----------------------------------------------------------------------------
    def view(self, wire: list[Any], nbytes: int) -> Any:
        if not self.can_receive:
            raise ProtocolError("a shared-memory descriptor arrived on a connection without it")
        pid, fd, key, generation, offset = wire
        self.mapped += 1
        if pid != self.peer_pid:
            raise DescriptorError(f"a descriptor for process {pid} arrived from {self.peer}")
        lease = (fd, generation)
        return peers.view(pid, fd, key, generation, offset, nbytes, lambda: self._release(lease))

    def _release(self, lease: tuple[int, int]) -> None:
        # runs wherever the last reference died, maybe another thread or a closed loop
        if threading.get_ident() == self._thread:
            self._queue(lease)
            return
        try:
            self.loop.call_soon_threadsafe(self._queue, lease)
        except RuntimeError:
            pass  # the loop is closed: the owner reclaims when this process exits

    def _queue(self, lease: tuple[int, int]) -> None:
        self._releases.append(lease)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    def flush(self) -> None:
        """Send the releases queued so far now (before a reply, so the peer can reuse its
        segments for the next call)."""
        if self._releases:
            self._flush()

    def _flush(self) -> None:
        self._flush_scheduled = False
        releases, self._releases = self._releases, []
        if releases:
            self._send([[fd, gen] for fd, gen in releases])

    def released(self, items: Any) -> None:
        """The peer is done with these leases of ours."""
        if not isinstance(items, list):
            raise ProtocolError("a release carries a list of [fd, generation]")
        for item in items:
            lease = (item[0], item[1])
            held = self.leases.get(lease)
            if not held:
                continue  # not ours to release (a confused or hostile peer): ignore
            if held == 1:
                del self.leases[lease]
            else:
                self.leases[lease] = held - 1
            pool.release(*lease)

    def lost(self) -> None:
        """The connection is gone; leases the peer still holds come back once it exits."""
        leases = [lease for lease, n in self.leases.items() for _ in range(n)]
        self.leases.clear()
        if self.peer_pid:
            pool.orphan(self.peer_pid, leases)
            peers.forget(self.peer_pid)


class _RefusingSink(_Sink):
    __slots__ = ("peer", "reason")

    def __init__(self, threshold: int, reason: str, peer: str | None) -> None:
        super().__init__(threshold)
        self.reason = reason
        self.peer = peer

    def put(self, buf: memoryview) -> list[int]:
        raise FallbackError(
            f"a {buf.nbytes}-byte value needs shared memory to {self.peer}, which cannot be "
            f"used ({self.reason}); the fallback policy is 'error' (allow it with "
            f"ORCHESTR_TRANSPORT_FALLBACK=allow)"
        )


_serde.register_ext(Buffer, _serde.EXT_BUFFER, Buffer.to_wire, Buffer.from_wire)
