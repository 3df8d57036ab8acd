"""Calls wired ahead: one endpoint on a fixed list of actors, called again and again.

A compiled graph repeats the same fan-out every step, so what a dynamic call works out each
time is settled once here: the connections are opened (and their handshakes done) before the
first step, each member's message head is packed once, a step's arguments are packed once for
every member, and the step has one deadline and one future instead of one per member. The
replies land in slots of the step's result list. Failures take the ordinary path: a broken
connection asks the head what became of the actor, and a call under at-least-once retry goes
to the restarted incarnation.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import msgpack

from orchestr._call import _serde
from orchestr._call._bulk import fanout
from orchestr._call._client import CallClient
from orchestr._call._connection import Connection, Pending
from orchestr._call._frames import HEADER
from orchestr._call._wire import CALL
from orchestr.errors import CallTimeoutError, MessageTooLargeError

__all__ = ["FanoutPlan"]


class _Step:
    """One step in flight: the results so far and the future the caller awaits."""

    __slots__ = ("calls", "future", "left", "results", "timer")

    def __init__(self, future: asyncio.Future[list[Any]], n: int) -> None:
        self.future = future
        self.results: list[Any] = [None] * n
        self.left = n
        self.calls: list[tuple[Connection, int]] = []
        self.timer: asyncio.TimerHandle | None = None


class _Slot:
    """Stands where a call's future would: fills one place of its step's results."""

    __slots__ = ("index", "step")

    def __init__(self, step: _Step, index: int) -> None:
        self.step = step
        self.index = index

    def done(self) -> bool:
        return self.step.future.done()

    def set_result(self, value: Any) -> None:
        step = self.step
        step.results[self.index] = value
        step.left -= 1
        if not step.left:
            if step.timer is not None:
                step.timer.cancel()
            if not step.future.done():
                step.future.set_result(step.results)

    def set_exception(self, exc: BaseException) -> None:
        # The step's timer stays: at the deadline it drops the calls still out.
        step = self.step
        if not step.future.done():
            step.future.set_exception(exc)


class FanoutPlan:
    """``endpoint`` on every actor of ``members`` (``(address, actor_id, label)``), wired
    ahead. :meth:`submit` starts a step and returns its future at once, so the next step can
    be sent while this one runs."""

    def __init__(
        self,
        client: CallClient,
        members: Sequence[tuple[str, str, str]],
        endpoint: str,
        timeout: float | None = None,
        retry: bool = False,
    ) -> None:
        self.client = client
        self.members = list(members)
        self.endpoint = endpoint
        self.timeout = client.config.call_timeout if timeout is None else timeout
        self.retry = retry
        # Everything of a member's message before the call id, and from there to the args
        # (a CALL is 7 items: kind, id, actor, endpoint, args, kwargs, deadline).
        self._head = b"\x97" + msgpack.packb(CALL)
        self._tails = [
            msgpack.packb(actor_id) + msgpack.packb(endpoint) for _, actor_id, _ in self.members
        ]

    async def open(self) -> None:
        """Connect to every member and finish each handshake now, not in the first step.
        Blocks at most the plan's deadline; a member that cannot be reached fails its first
        step, as a dynamic call would."""
        conns = [self.client._connection(self._address(i)) for i in range(len(self.members))]
        async with asyncio.timeout(self.timeout):
            while not all(c.broken is not None or c.welcomed for c in conns):  # noqa: ASYNC110
                await asyncio.sleep(0.001)

    def _address(self, i: int) -> str:
        address, actor_id, _ = self.members[i]
        return self.client.moved.get(actor_id, address)

    def submit(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> asyncio.Future[list[Any]]:
        """Call every member with ``args``/``kwargs``; the future resolves to the results in
        member order, or to the first error. Raises at once when the arguments cannot be sent."""
        client = self.client
        loop = client.loop
        future: asyncio.Future[list[Any]] = loop.create_future()
        msg, buffers, _ = _serde.encode_parts([list(args), kwargs])
        if buffers:  # large values: the ordinary path copies them once for every member
            return self._submit_dynamic(future, args, kwargs)
        payload = msg[1:]  # the two elements of [args, kwargs], without the array's header
        limit = client.config.max_message_bytes
        if len(payload) + 64 > limit:
            raise MessageTooLargeError(len(payload), limit)
        step = _Step(future, len(self.members))
        deadline = loop.time() + self.timeout
        payload += msgpack.packb(time.time() + self.timeout)  # the deadline, as actors see it
        step.timer = loop.call_at(deadline, self._expire, step)
        ids = client._ids
        head = self._head
        pending_args = (args, kwargs)
        for i, (address, actor_id, label) in enumerate(self.members):
            address = client.moved.get(actor_id, address)
            conn = client._connection(address)
            call_id = next(ids)
            p = Pending(
                _Slot(step, i),  # type: ignore[arg-type]
                actor_id,
                label,
                self.endpoint,
                self.timeout,
                pending_args,
                None,
                self.retry,
            )
            p.deadline = deadline
            client._inflight[actor_id] = client._inflight.get(actor_id, 0) + 1
            if conn.broken is not None:
                client.done(p)
                client.report_broken([p], conn.broken, sent=conn.connected, address=address)
                continue
            body = head + msgpack.packb(call_id) + self._tails[i] + payload
            conn.pending[call_id] = p
            step.calls.append((conn, call_id))
            conn.submit([], [HEADER.pack(len(body), 0) + body], 0, None, None)
        return future

    def _submit_dynamic(
        self, future: asyncio.Future[list[Any]], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> asyncio.Future[list[Any]]:
        client = self.client
        with fanout():
            calls = [
                client.call(
                    self._address(i),
                    actor_id,
                    label,
                    self.endpoint,
                    args,
                    kwargs,
                    self.timeout,
                    None,
                    self.retry,
                )
                for i, (_, actor_id, label) in enumerate(self.members)
            ]
        gathered = asyncio.gather(*calls)

        def copy(done: asyncio.Future[list[Any]]) -> None:
            if future.done():
                return
            if done.cancelled():
                future.cancel()
            elif done.exception() is not None:
                future.set_exception(done.exception())  # type: ignore[arg-type]
            else:
                future.set_result(done.result())

        gathered.add_done_callback(copy)
        return future

    def _expire(self, step: _Step) -> None:
        step.timer = None
        for conn, call_id in step.calls:
            p = conn.pending.pop(call_id, None)
            if p is not None:
                self.client.done(p)
        if not step.future.done():
            _, _, label = self.members[0]
            step.future.set_exception(
                CallTimeoutError(f"{label.rpartition('[')[0]}[*]", self.endpoint, self.timeout)
            )
