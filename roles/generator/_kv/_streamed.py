"""The prefill side of a handoff streamed layer by layer: the decode side reads a prompt's KV
while the prefill side is still computing it (as DistServe and FlowKV overlap the transfer
with the prefill).

``prefill(..., stream=True)`` grants the handoff when the request is queued, before any of it
is computed (:class:`Streamed`, beside :class:`~._leases.Holds`). From then on, each time a
layer's keys and values of a step are in the pool (the engine's
:meth:`~.._core._contract.PagedKV.watch_layers` hook, in the stepping thread), the stream says
so: the full prompt blocks allocated so far (each held here from the moment it is reported, so
nothing frees or rewrites it whatever becomes of the request), how many of them are done in
every layer (``ready``) and how many layers of the rest are written (``written``), under a
cursor that only grows. When the prompt is done, the blocks' keys are added and the stream
becomes an ordinary lease of :class:`~._leases.Holds`: the reader ends it, or it expires
``hold_s`` after the prefill finished. A request that is preempted onto other blocks, computed
under weights that changed meanwhile, cancelled or failed ends its stream ``failed``, its
blocks released.

The handoff's buffer reaches no block at first: each block is added to it as it is held,
before any progress names it, and each progress carries the buffer as it is then. The decode
side's reader is :func:`~._receive.read_streamed`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from orchestr import clock as _clock
from orchestr.roles.kvstore import LeaseExpiredError

from .._core._contract import PagedKV
from .._core._scheduler import Step
from .._core._types import Completion, Request

if TYPE_CHECKING:
    from ._leases import Holds

__all__ = ["Stream", "Streamed"]


@dataclasses.dataclass(eq=False)
class Stream:
    """One streamed handoff on the prefill side: request ``request_id``'s first ``full``
    blocks (the full ones before its last token), computed under weights ``version``."""

    request_id: str
    lease: int
    full: int
    version: int
    hold_s: float
    changed: asyncio.Event
    blocks: list[int] = dataclasses.field(default_factory=list)  # held here, in order
    ready: int = 0  # of ``blocks``, those done in every layer
    written: int = 0  # layers done of ``blocks[ready:]``
    cursor: int = 0
    state: str = "running"  # then "done" or "failed"
    keys: list[bytes] = dataclasses.field(default_factory=list)
    error: str = ""
    expires: float = float("inf")  # for a record no reader ended

    def view(self, layers: int) -> dict[str, Any]:
        return {
            "cursor": self.cursor,
            "state": self.state,
            "blocks": list(self.blocks),
            "ready": self.ready,
            "written": self.written,
            "layers": layers,
            "keys": list(self.keys),
            "error": self.error,
        }


class Streamed:
    """The prefill side's streamed handoffs. ``holds`` takes a stream's blocks as a lease
    when its prompt is done. :meth:`open` and :meth:`wait` run on the event loop; the layer
    hook in the stepping thread; the rest between steps, under the generator's lock."""

    def __init__(self, holds: Holds, clock: Any = _clock.monotonic) -> None:
        self._holds = holds
        self._clock = clock
        self._lock = threading.Lock()  # the hook may run in several micro-batch threads
        self._running: dict[str, Stream] = {}  # by request id
        self._by_lease: dict[int, Stream] = {}  # every stream not ended nor forgotten
        self._loop: asyncio.AbstractEventLoop | None = None
        self._engine: PagedKV | None = None
        self._layers = 0
        self._size = 1

    @property
    def running(self) -> int:
        return len(self._running)

    def open(self, engine: PagedKV, request: Request, lease: int, hold_s: float) -> Stream:
        """Stream ``request``'s blocks (call before it is queued, on the loop)."""
        self._loop = asyncio.get_running_loop()
        self._engine = engine
        self._layers = engine.num_layers
        self._size = engine.cache_keys()[0]
        self.prune()
        s = Stream(
            request.id,
            lease,
            (len(request.prompt) - 1) // self._size,
            engine.version,
            hold_s,
            asyncio.Event(),
        )
        self._running[request.id] = s
        self._by_lease[lease] = s
        engine.watch_layers(self._on_layer)
        return s

    def _on_layer(self, step: Step, layer: int) -> None:
        """A layer of ``step`` is in the pool (the stepping thread)."""
        engine = self._engine  # set with the first stream
        if not self._running or engine is None:
            return
        for seq, n in step.scheduled:
            s = self._running.get(seq.id)
            if s is None:
                continue
            with self._lock:
                if s.error:
                    continue
                if seq.blocks[: len(s.blocks)] != s.blocks:
                    s.error = "its prompt moved to other blocks (preempted) mid-stream"
                    continue
                covered = min(s.full, (seq.num_computed + n) // self._size)
                if covered > len(s.blocks):
                    new = seq.blocks[len(s.blocks) : covered]
                    engine.hold_blocks(new)
                    # the handoff's buffer reaches them before any progress names them
                    self._holds.widen(engine, s.lease, new)
                    s.blocks += new
                s.ready = max(s.ready, min(s.full, seq.num_computed // self._size))
                s.written = layer + 1
                s.cursor += 1
            assert self._loop is not None
            self._loop.call_soon_threadsafe(s.changed.set)

    def after_step(self, engine: PagedKV, finished: Iterable[Completion]) -> None:
        """Bring the running streams up to the step that just ended."""
        if not self._running:
            return
        ended = {c.id: c for c in finished}
        for rid, s in list(self._running.items()):
            c = ended.get(rid)
            seq = engine.seq_of(rid)
            if s.error:
                self._fail(engine, s, s.error)
            elif engine.version != s.version:
                self._fail(engine, s, "the weights changed during the prefill")
            elif c is not None:
                if c.finish_reason not in ("stop", "length") or len(s.blocks) != s.full:
                    self._fail(engine, s, f"the prefill ended {c.finish_reason!r}")
                    continue
                with self._lock:
                    s.ready, s.written, s.state = s.full, 0, "done"
                    s.keys = engine.prefix_plan(c.prompt)[0][: s.full]
                    s.expires = self._clock() + s.hold_s
                    s.cursor += 1
                del self._running[rid]
                self._holds.adopt_lease(s.lease, s.blocks, s.expires)
                s.changed.set()
            elif seq is None:
                self._fail(engine, s, "the request ended before its prompt was computed")
            else:
                with self._lock:
                    s.ready = max(s.ready, min(s.full, seq.num_computed // self._size))
                    s.written = 0
                    s.cursor += 1
                s.changed.set()
        if not self._running:
            engine.watch_layers(None)

    def fail(self, engine: PagedKV, request_id: str, why: str) -> None:
        """End ``request_id``'s stream as failed, if it still runs (its request failed)."""
        s = self._running.get(request_id)
        if s is not None:
            self._fail(engine, s, why)

    def release(self, engine: PagedKV, lease: int) -> str | None:
        """The reader let ``lease`` go: forget it; if it still runs, end it and return its
        request's id (to cancel)."""
        s = self._by_lease.pop(lease, None)
        if s is None or s.state != "running":
            return None
        self._fail(engine, s, "released by its reader")
        return s.request_id

    def forget(self, lease: int) -> None:
        self._by_lease.pop(lease, None)

    async def wait(self, lease: int, after: int, until_done: bool = False) -> dict[str, Any]:
        """The progress of ``lease`` once its cursor is past ``after`` (or it ended; with
        ``until_done``, only once it ended). Raises
        :class:`LeaseExpiredError` for a stream not here (ended, expired, or never
        granted) and ``ValueError`` for a cursor that is not an int."""
        if isinstance(after, bool) or not isinstance(after, int):
            raise ValueError(f"after is a cursor (an int), got {after!r}")
        if not isinstance(until_done, bool):
            raise ValueError(f"until_done is a bool, got {until_done!r}")
        s = self._by_lease.get(lease)
        if s is None:
            raise LeaseExpiredError(f"no streamed handoff {lease} here (ended or expired)")
        while s.state == "running" and (until_done or s.cursor <= after):
            s.changed.clear()
            await s.changed.wait()
        with self._lock:  # the buffer reaches every block the view names (see _on_layer)
            return s.view(self._layers) | {"buffer": self._holds.grant(lease)}

    def _fail(self, engine: PagedKV, s: Stream, why: str) -> None:
        with self._lock:
            s.state, s.error = "failed", why
            s.expires = self._clock() + s.hold_s
            s.cursor += 1
            held, s.blocks = s.blocks, []
        self._running.pop(s.request_id, None)
        self._holds.revoke(s.lease)
        engine.release_blocks(held)
        s.changed.set()
        if not self._running:
            engine.watch_layers(None)

    def prune(self) -> None:
        """Forget the ended streams past their expiry that no reader ended."""
        now = self._clock()
        for lease in [k for k, s in self._by_lease.items() if s.expires <= now]:
            del self._by_lease[lease]
            self._holds.revoke(lease)  # expired: its buffer with it
