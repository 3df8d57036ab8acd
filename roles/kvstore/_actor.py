"""The KV store actor: the block index's I/O shell. It owns the memory (``host_blocks`` slots
of host memory; a disk file of ``disk_blocks``), runs the index's housekeeping on a timer,
makes the copies between tiers, and hands writers and readers slots in its host memory, which
they write and read one-sided over the data plane: block bytes never ride an actor call.
:func:`~._client.put_blocks` and :func:`~._client.get_blocks` are the two sides' whole
exchanges.

Each put and each lease gets a :class:`~orchestr.Buffer` of its own over the slots it names
and nothing else (read-only for a lease), revoked when it ends, is aborted or expires: a
holder of one cannot reach another's blocks through it. A namespace belongs to its first
writer (:class:`BlockIndex`): writers name themselves with a secret key
(:class:`~._client.KVWriter`), kept here only as a digest."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

import structlog
import torch

import orchestr as oc
from orchestr import Buffer, fabric
from orchestr.tasks import TaskOwner

from ._index import BlockIndex
from ._types import KVNamespace, KVStoreError, Move, Tier

__all__ = ["MAX_KEY", "KVStore"]

log = structlog.get_logger("orchestr.roles.kvstore")

#: The longest writer key a store takes.
MAX_KEY = 256


class KVStore(oc.Actor):
    """Content-addressed KV blocks of ``block_bytes`` each, in ``host_blocks`` slots of host
    memory and, with ``disk_blocks``, as many more in a file under ``disk_dir`` (default: the
    temporary folder; the file is removed when the actor stops). Semantics are
    :class:`BlockIndex`'s; ``maintain_s`` is how often tiers are brought back between their
    watermarks and expired puts, leases and pins dropped.

    Endpoints answer from the index at once except where they wait on the disk (a lease that
    promotes blocks). A writer or reader that dies mid-way leaves at most an open put (reclaimed
    after ``put_timeout_s``) or a lease (expires after its ``ttl``)."""

    __module__ = "orchestr.roles"  # its name on the wire and in the head's store (pinned)

    def __init__(
        self,
        block_bytes: int,
        host_blocks: int,
        *,
        disk_blocks: int = 0,
        disk_dir: str | None = None,
        high_watermark: float = 0.9,
        low_watermark: float = 0.8,
        lease_s: float = 10.0,
        put_timeout_s: float = 30.0,
        maintain_s: float = 0.25,
    ) -> None:
        if block_bytes < 1 or host_blocks < 1 or disk_blocks < 0:
            raise oc.ConfigError(
                f"a store needs block_bytes >= 1 and host_blocks >= 1 (disk_blocks >= 0), got "
                f"{block_bytes}, {host_blocks}, {disk_blocks}"
            )
        if not maintain_s > 0:
            raise oc.ConfigError(f"maintain_s must be positive, got {maintain_s}")
        tiers = [Tier("host", host_blocks)] + ([Tier("disk", disk_blocks)] if disk_blocks else [])
        try:
            self._index = BlockIndex(
                tiers,
                high_watermark=high_watermark,
                low_watermark=low_watermark,
                lease_s=lease_s,
                put_timeout_s=put_timeout_s,
            )
        except ValueError as exc:
            raise oc.ConfigError(str(exc)) from exc
        self.block_bytes, self.maintain_s = block_bytes, maintain_s
        self._memory = fabric.empty(host_blocks * block_bytes, dtype=torch.uint8)
        #: each open put's and lease's buffer over its slots: ("put" | "lease", id)
        self._grants: dict[tuple[str, int], Buffer] = {}
        self._disk: int | None = None
        # held by each disk copy (in a thread) and by the close: a closed descriptor's number,
        # reused by another file, is never written
        self._disk_lock = threading.Lock()
        if disk_blocks:
            fd, path = tempfile.mkstemp(prefix="orchestr-kv-", dir=disk_dir)
            os.unlink(path)  # the blocks live as long as the descriptor: nothing left behind
            os.ftruncate(fd, disk_blocks * block_bytes)
            self._disk = fd
        self._tasks = TaskOwner()  # the housekeeping, once started
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._failures = 0  # housekeeping rounds whose disk copies failed

    # -- writers ---------------------------------------------------------------------------------

    @oc.endpoint
    def begin_put(
        self, namespace: KVNamespace, hashes: list[bytes], writer: str = ""
    ) -> dict[str, Any]:
        """Reserve slots for the blocks of ``hashes`` not stored yet: ``{"put", "buffer",
        "block_bytes", "writes": [[hash, offset], ...], "skipped", "dropped"}``. Write each
        block's ``block_bytes`` at its offset of ``buffer`` (a buffer over those slots only,
        ``None`` when there is nothing to write), then :meth:`end_put` (or :meth:`abort_put`).
        ``writer`` is the writer's key (:class:`~._client.KVWriter`). Raises :class:`KVStoreError` when
        the namespace belongs to another writer, and nothing else but for malformed
        arguments."""
        self._start()
        now = time.monotonic()
        self._revoke_ended(now)  # before any slot is given again: no grant outlives its own
        put = self._index.begin_put(namespace, hashes, now, _identity(writer))
        slots = [w.slot for w in put.writes]
        try:
            grant = self._grant(("put", put.id), slots, writable=True) if slots else None
        except BaseException:  # no buffer: no put either, rather than one left to time out
            self._index.abort_put(put.id)
            raise
        return {
            "put": put.id,
            "buffer": grant,
            "block_bytes": self.block_bytes,
            "writes": [[w.block_hash, w.slot * self.block_bytes] for w in put.writes],
            "skipped": put.skipped,
            "dropped": put.dropped,
        }

    @oc.endpoint
    def end_put(self, put: int) -> int:
        """Publish a put's blocks (its buffer is revoked first); returns how many. Raises
        :class:`KVStoreError` for a put that timed out, was aborted or ended."""
        self._revoke(("put", put))
        return self._index.end_put(put, time.monotonic())

    @oc.endpoint
    def abort_put(self, put: int) -> bool:
        """Drop a put's reservations and revoke its buffer. Idempotent."""
        self._revoke(("put", put))
        return self._index.abort_put(put)

    # -- readers ---------------------------------------------------------------------------------

    @oc.endpoint
    def match(self, namespace: KVNamespace, hashes: list[bytes]) -> dict[str, Any]:
        """``{"tokens", "by_tier"}``: the longest stored prefix of ``hashes``."""
        found = self._index.match(namespace, hashes, time.monotonic())
        return {"tokens": found.tokens, "by_tier": found.by_tier}

    @oc.endpoint(concurrent=True)
    async def lease(
        self,
        namespace: KVNamespace,
        hashes: list[bytes],
        ttl: float | None = None,
        writer: str = "",
    ) -> dict[str, Any]:
        """Lease the longest stored prefix of ``hashes`` in host memory, promoting blocks held
        only on disk first: ``{"lease", "buffer", "block_bytes", "offsets", "tokens",
        "ttl"}``. Read each block at its offset of ``buffer`` (read-only, over those blocks
        only, revoked when the lease ends; ``None`` when nothing is leased), then
        :meth:`check_lease` before using what was read, and :meth:`release`. ``writer`` is
        the reader's writer key: the blocks are read only as their own writer's.

        Blocks on the disk reads of a promotion; raises ``OSError`` if one failed (the lease
        is released then), :class:`KVStoreError` when the namespace belongs to another
        writer. Cancel-safe: cancelled, the lease is released and a promotion already begun
        completes on its own."""
        self._start()
        now = time.monotonic()
        self._revoke_ended(now)
        lease = self._index.lease(namespace, hashes, now, ttl, _identity(writer))
        if not lease.blocks:  # nothing to read: no lease to end
            self._index.release(lease.id)
            return {
                "lease": 0,
                "buffer": None,
                "block_bytes": self.block_bytes,
                "offsets": [],
                "tokens": 0,
                "ttl": 0.0,
            }
        try:
            await self._copy(lease.moves)
        except BaseException:
            self._index.release(lease.id)
            raise
        if not self._index.lease_open(lease.id, time.monotonic()):  # ran out while promoting
            self._index.release(lease.id)  # its blocks may be another's now: no grant
            return {
                "lease": 0,
                "buffer": None,
                "block_bytes": self.block_bytes,
                "offsets": [],
                "tokens": 0,
                "ttl": 0.0,
            }
        slots = [b.slot for b in lease.blocks]
        try:
            grant = self._grant(("lease", lease.id), slots, writable=False)
        except BaseException:
            self._index.release(lease.id)
            raise
        return {
            "lease": lease.id,
            "buffer": grant,
            "block_bytes": self.block_bytes,
            "offsets": [slot * self.block_bytes for slot in slots],
            "tokens": lease.tokens,
            "ttl": lease.expires - time.monotonic(),
        }

    @oc.endpoint
    def check_lease(self, lease: int) -> None:
        """Raise :class:`LeaseExpiredError` unless ``lease`` is still held."""
        self._index.check_lease(lease, time.monotonic())

    @oc.endpoint
    def end_read(self, lease: int) -> None:
        """:meth:`check_lease`, then :meth:`release` whatever it found: the one call after a
        read. Raises :class:`LeaseExpiredError` when the lease had run out (what was read
        must not be used)."""
        try:
            self._index.check_lease(lease, time.monotonic())
        finally:
            self._revoke(("lease", lease))
            self._index.release(lease)

    @oc.endpoint
    def release(self, lease: int) -> bool:
        """End a lease and revoke its buffer. Idempotent."""
        self._revoke(("lease", lease))
        return self._index.release(lease)

    # -- the rest of the index's surface ---------------------------------------------------------

    @oc.endpoint
    def pin(
        self,
        namespace: KVNamespace,
        hashes: list[bytes],
        hard: bool = False,
        ttl: float | None = None,
    ) -> int:
        """Pin stored blocks (see :meth:`BlockIndex.pin`); returns how many."""
        return self._index.pin(namespace, hashes, time.monotonic(), hard=hard, ttl=ttl)

    @oc.endpoint
    def unpin(self, namespace: KVNamespace, hashes: list[bytes]) -> int:
        return self._index.unpin(namespace, hashes)

    @oc.endpoint
    def remove(self, namespace: KVNamespace, hashes: list[bytes]) -> list[int]:
        """Remove stored blocks but leased ones: ``[removed, refused]``."""
        now = time.monotonic()
        self._revoke_ended(now)
        return list(self._index.remove(namespace, hashes, now))

    @oc.endpoint
    def clear(self, namespace: KVNamespace | None = None) -> int:
        """Remove every block (of ``namespace``) but leased ones; returns how many stayed."""
        now = time.monotonic()
        self._revoke_ended(now)
        return self._index.clear(now, namespace)

    @oc.endpoint
    def events(self, after: int = 0) -> dict[str, Any]:
        """``{"events": [[seq, kind, namespace | None, hashes, tier], ...], "last", "lost"}``
        (kinds ``stored``, ``removed``, ``cleared``); see :class:`EventPage`."""
        page = self._index.events(after)
        rows = [
            [
                seq,
                type(e).__name__.lower(),
                getattr(e, "namespace", None),
                list(getattr(e, "block_hashes", ())),
                e.tier,
            ]
            for seq, e in page.events
        ]
        return {"events": rows, "last": page.last, "lost": page.lost}

    @oc.endpoint
    def stats(self) -> dict[str, Any]:
        """The index's counts (:meth:`BlockIndex.stats`), ``block_bytes``, and
        ``failed_rounds`` (housekeeping rounds whose disk copies failed)."""
        return {
            **self._index.stats(time.monotonic()),
            "block_bytes": self.block_bytes,
            "failed_rounds": self._failures,
        }

    @oc.endpoint(concurrent=True)
    async def aclose(self) -> None:
        """Stop the housekeeping and close the disk file. Idempotent.

        Blocks on the disk copy in progress (a closed file is never written); raises
        nothing; cancel-safe."""
        self._closed = True
        self._task = None
        await self._tasks.aclose()
        for grant in list(self._grants):
            self._revoke(grant)
        await asyncio.to_thread(self._close_disk)

    def _close_disk(self) -> None:
        with self._disk_lock:
            if self._disk is not None:
                os.close(self._disk)
                self._disk = None

    # -- inside ----------------------------------------------------------------------------------

    def _start(self) -> None:
        if self._closed:
            raise oc.ClosedResourceError("the KV store was closed; spawn a new one")
        if self._task is None:
            self._task = self._tasks.start(self._maintain())

    def _grant(self, grant: tuple[str, int], slots: list[int], *, writable: bool) -> Buffer:
        """A buffer over ``slots`` of host memory only, kept under ``grant`` until revoked."""
        size = self.block_bytes
        buffer = Buffer(self._memory, spans=[(s * size, size) for s in slots], writable=writable)
        self._grants[grant] = buffer
        return buffer

    def _revoke(self, grant: tuple[str, int]) -> None:
        buffer = self._grants.pop(grant, None)
        if buffer is not None:
            buffer.release()

    def _revoke_ended(self, now: float) -> None:
        """Revoke the buffers of puts and leases that ended on their own (timed out)."""
        for kind, n in list(self._grants):
            open_ = self._index.put_open(n) if kind == "put" else self._index.lease_open(n, now)
            if not open_:
                self._revoke((kind, n))

    async def _maintain(self) -> None:
        while True:
            try:
                now = time.monotonic()
                self._revoke_ended(now)  # before maintain() may move their blocks
                moves = self._index.maintain(now)
                await self._copy(moves)
            except OSError as exc:  # the failed copies were reported: their blocks stay put
                self._failures += 1
                log.warning("kv store demotion failed; blocks stay in host memory", error=str(exc))
            await asyncio.sleep(self.maintain_s)

    async def _copy(self, moves: Sequence[Move]) -> None:
        """Make each move's copy between host memory and the disk file, in a thread that
        reports each to the index as it is made (or failed), so a cancelled caller leaves
        none in flight; raises the first failure after the rest are done."""
        if moves:
            loop = asyncio.get_running_loop()
            failed = await asyncio.to_thread(self._copy_all, moves, loop)
            if failed is not None:
                raise failed

    def _copy_all(self, moves: Sequence[Move], loop: asyncio.AbstractEventLoop) -> OSError | None:
        failed = None
        for move in moves:
            ok = True
            try:
                self._copy_one(move)
            except OSError as exc:
                failed, ok = failed or exc, False
            with contextlib.suppress(RuntimeError):  # the loop closed: the store is gone
                loop.call_soon_threadsafe(self._moved, move.id, ok)
        return failed

    def _moved(self, move_id: int, ok: bool) -> None:
        self._index.moved(move_id, time.monotonic(), ok=ok)

    def _copy_one(self, move: Move) -> None:
        size = self.block_bytes
        host = move.source if move.source.tier == "host" else move.target
        disk = move.target if host is move.source else move.source
        view = memoryview(self._memory.numpy())[host.slot * size : (host.slot + 1) * size]
        with self._disk_lock:
            if self._disk is None:
                raise OSError("the store's disk file is closed (or it has no disk tier)")
            if host is move.source:
                written = os.pwrite(self._disk, view, disk.slot * size)
            else:
                written = os.preadv(self._disk, [view], disk.slot * size)
        if written != size:
            raise OSError(f"moved {written} of a block's {size} bytes")


def _identity(key: str) -> str:
    """Who a writer key names, as the index keeps it: a digest, never the key itself."""
    if not isinstance(key, str) or len(key) > MAX_KEY:
        raise KVStoreError(f"a writer key is a string of at most {MAX_KEY} characters")
    return hashlib.sha256(key.encode()).hexdigest() if key else ""
