"""Large tensors on the call path: shared memory between processes on one host.

A tensor or array of at least ``Config.inline_max_bytes`` sent to a process on this host goes
through a shared-memory segment (:func:`orchestr.fabric.lowlevel.pool`) instead of the stream: the
frame carries a descriptor and the receiver's actor gets a tensor that is the segment itself.
Across hosts, values stay in the frame on the stream transport.

Each connection negotiates this in its handshake. The caller's ``HELLO`` and the server's
``WELCOME`` each carry a probe (a tiny segment); each side maps the other's to prove it can.
The caller uses shared memory once the server has mapped the caller's probe (WELCOME says so),
and the server once the caller has mapped the server's (READY says so). Until then a message
that carries large values to a peer on this host waits for the handshake (one round trip, on a
new connection only) rather than going into the frame. A peer counts as local only when its
process key says so *and* the connection does (a Unix socket, or TCP from loopback or from our
own address), so a remote peer cannot talk its way into shared memory. A failed probe is a
fallback to the stream: an error under the policy ``error``, otherwise logged and counted.
``RELEASE`` messages hand segments back.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import structlog

from orchestr.config import Config
from orchestr.errors import DescriptorError, FallbackError, ProtocolError, TransportError
from orchestr.fabric import Buffer, host_id
from orchestr.fabric.lowlevel import (
    Counters,
    Segment,
    address_of,
    buffer_stats,
    copy,
    host_of,
    peers,
    pid_of,
    pool,
)

from . import _registry, _serde, _wire
from ._locality import is_u64

__all__ = ["BulkLink", "fanout"]

log = structlog.get_logger("orchestr.bulk")

#: While a call goes to several members at once: the values already copied into a segment,
#: by (address, size), so every member gets the same segment instead of a copy of its own.
_fanout: list[dict[tuple[int, int], tuple[Segment, int, int]]] = []


@contextlib.contextmanager
def fanout() -> Iterator[None]:
    """Within this block (no user code runs inside it), sending the same tensor to several
    actors on this host copies it once."""
    if _fanout:
        yield
        return
    _fanout.append({})
    try:
        yield
    finally:
        _fanout.clear()


class _Sink:
    """Collects the segments one message's encoding leased."""

    __slots__ = ("leases", "link", "policy", "threshold")

    def __init__(self, threshold: int, link: BulkLink | None = None, policy: str = "allow") -> None:
        self.threshold = threshold
        self.link = link
        self.policy = policy
        self.leases: list[tuple[int, int]] = []

    def _over_budget(self, nbytes: int) -> bool:
        """Whether lending ``nbytes`` more would pass ``shm_pool_bytes``; under the policy
        ``error`` that raises FallbackError, otherwise the value goes into the frame."""
        link = self.link
        if link is None or pool.lent_bytes() + nbytes <= link.pool_bytes:
            return False
        reason = (
            f"peers hold {pool.lent_bytes()} bytes of this process's shared memory, and "
            f"{nbytes} more would pass ORCHESTR_SHM_POOL_BYTES={link.pool_bytes}"
        )
        if self.policy == "error":
            raise FallbackError(f"{reason}; the fallback policy is 'error'")
        link.note_fallback(reason)
        return True

    def put(self, buf: memoryview) -> list[int] | None:
        nbytes = buf.nbytes
        address = address_of(buf)
        copied = _fanout[0].get((address, nbytes)) if _fanout else None
        if copied is not None and not pool.hold(copied[0].fd, copied[1]):
            copied = None  # that copy was given back (its message failed to encode)
        found = pool.find(address, nbytes) if copied is None else None
        if copied is not None:  # another member of this fan-out already has it copied
            segment, generation, offset = copied
        elif found is not None and pool.hold(found[0].fd, found[0].generation):
            segment, offset = found  # already in a segment: send it as it is
            generation = segment.generation
        else:
            if self._over_budget(nbytes):
                return None
            try:
                segment, generation = pool.lease(nbytes)
            except OSError as exc:
                stats = pool.stats()
                raise TransportError(
                    f"no shared memory for a {nbytes}-byte value: {exc}; this process lends "
                    f"{stats['held']} segments ({stats['bytes']} bytes in all) that peers still "
                    f"hold"
                ) from exc
            offset = 0
            try:
                copy(address_of(segment.data), address_of(buf), nbytes)
            except BaseException:
                pool.release(segment.fd, generation)
                raise
            if _fanout:
                _fanout[0][(address, nbytes)] = (segment, generation, offset)
        self.leases.append((segment.fd, generation))
        _wire.bulk.sent += nbytes
        _wire.bulk.ops += 1
        return [os.getpid(), segment.fd, segment.key, generation, offset]

    def abandon(self) -> None:
        for fd, generation in self.leases:
            pool.release(fd, generation)


class BulkLink:
    """The shared-memory state of one call-path connection (either end)."""

    def __init__(self, config: Config, loop: asyncio.AbstractEventLoop, send: Any) -> None:
        self.threshold = config.inline_max_bytes
        self.pool_bytes = config.shm_pool_bytes
        self.policy = config.transport_fallback
        self._noted = False
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
        #: Leases mapped by the message being decoded (reset by the connection per message).
        self.this_decode: list[tuple[int, int]] = []
        self._flush_scheduled = False

    # -- negotiation ---------------------------------------------------------------------------
    def set_peer(self, peer: str, *, reachable: bool = True) -> bool:
        """Record the peer's process key; whether it is on this host (its key says so and,
        when ``reachable`` is false, the connection says otherwise)."""
        self.peer = peer
        self.peer_pid = pid_of(peer)
        self.same_host = reachable and host_of(peer) == host_id()
        return self.same_host

    def note_fallback(self, reason: str) -> None:
        """One large value went into the frame instead of shared memory: count it, and log
        the first time per connection."""
        buffer_stats.setdefault("tcp", Counters()).fallbacks += 1
        if not self._noted:
            self._noted = True
            log.warning("transport fallback", wanted="shm", using="frame", reason=reason)

    def stream_fallback(self, reason: str) -> None:
        """The same-host stream could not be opened; the connection uses tcp instead."""
        self.stream = "tcp"
        self.refused_stream = reason
        buffer_stats.setdefault("tcp", Counters()).fallbacks += 1
        log.warning("transport fallback", wanted="shm", using="tcp", reason=reason, peer=self.peer)

    def refuse(self, reason: str) -> None:
        """Shared memory cannot be used with this peer: a fallback to the stream."""
        self.can_send = False
        if self.refused is None:
            self.refused = reason
            buffer_stats.setdefault("tcp", Counters()).fallbacks += 1
            log.warning(
                "transport fallback", wanted="shm", using="tcp", reason=reason, peer=self.peer
            )

    def report(self) -> dict[str, Any]:
        local = self.peer is not None and host_of(self.peer) == host_id()
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
            return _Sink(self.threshold, self, policy or self.policy)
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
            raise ProtocolError(
                "a shared-memory value arrived before this connection agreed to use shared memory"
            )
        if not all(is_u64(v) for v in wire):
            raise DescriptorError(f"malformed shared-memory descriptor {wire!r}")
        pid, fd, key, generation, offset = wire
        self.mapped += 1
        if pid != self.peer_pid:
            raise DescriptorError(f"a descriptor for process {pid} arrived from {self.peer}")
        lease = (fd, generation)
        self.this_decode.append(lease)
        _wire.bulk.received += nbytes
        _wire.bulk.ops += 1
        return peers.view(pid, fd, key, generation, offset, nbytes, lambda: self._release(lease))

    def release_unmapped(self, msg: bytes | memoryview) -> None:
        """A message failed to decode: give back the segments it named that we never mapped
        (those we did map come back when their views are freed)."""
        mapped = set(self.this_decode)
        for fd, generation in _serde.shared_leases(msg):
            if (fd, generation) not in mapped:
                self._queue((fd, generation))

    def _release(self, lease: tuple[int, int]) -> None:
        # runs wherever the last reference died, maybe another thread or a closed loop
        if self.loop.is_closed():
            return  # the owner reclaims what this process held when it exits
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
        super().__init__(threshold, None, "error")
        self.reason = reason
        self.peer = peer

    def put(self, buf: memoryview) -> list[int]:
        raise FallbackError(
            f"a {buf.nbytes}-byte value needs shared memory to {self.peer}, which cannot be "
            f"used ({self.reason}); the fallback policy is 'error' (allow it with "
            f"ORCHESTR_TRANSPORT_FALLBACK=allow, or per call with .options(fallback='allow'))"
        )


_registry.register_ext(Buffer, _registry.EXT_BUFFER, Buffer.to_wire, Buffer.from_wire)
