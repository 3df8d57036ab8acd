"""Supervision: what the owner of a mesh does when one of its actors dies.

The head notices a death (the node reports the worker's exit) and tells the job controller,
which owns every mesh it spawned. The controller asks the mesh's ``supervise`` hook, or its
restart policy when there is none, and then:

- ``"restart"``: after a backoff, the head re-creates the actor with the same constructor
  arguments (and the state it last saved, when it has a ``save_state``/``load_state`` pair) on
  the same node or another; callers reach the new incarnation under the same actor id.
- ``"handle"``: the death is accepted; calls to that member fail, the rest of the mesh serves.
- ``"escalate"``: the failure reaches the root of the job, which fails loudly: the job's main
  is cancelled and :class:`SupervisionError` is raised with the root cause (the signal or exit
  code and the worker's last output, e.g. a fatal-error stack dump).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, cast

import structlog

from orchestr._call import _serde
from orchestr._call._client import CallClient
from orchestr._call._mesh import Member, Mesh
from orchestr._control._convert import ActorInfo
from orchestr._control._grpc import ControlChannel
from orchestr._control._head_client import HeadClient, death_error
from orchestr.errors import ActorDiedError, ConfigError, OrchestrError, SupervisionError
from orchestr.tasks import TaskOwner

from ._events import EventLog
from ._policy import DECISIONS, Decision, Failure, RestartPolicy, SuperviseHook

__all__ = ["Supervisor"]

log = structlog.get_logger("orchestr.supervise")


#: The name of the endpoint every actor with a ``save_state`` method answers.
SAVE_ENDPOINT = "__save_state__"


@dataclasses.dataclass
class _Owned:
    mesh: Mesh
    policy: RestartPolicy
    hook: SuperviseHook
    saves_state: bool
    saver: asyncio.Task[None] | None = None


class Supervisor:
    """The job controller's side of supervision: hears of deaths from the head and restarts,
    accepts or escalates them. ``async with`` starts and stops its tasks."""

    def __init__(
        self,
        head: ControlChannel,
        client: CallClient,
        events: EventLog,
        on_escalate: Callable[[SupervisionError], None],
        *,
        reconnect_s: float = 60.0,
    ) -> None:
        self.head = head
        #: How long a lost supervision stream is tried again (the head restarting) before the
        #: job fails.
        self.reconnect_s = reconnect_s
        self.client = client
        self.events = events
        self.on_escalate = on_escalate
        self._head = HeadClient(head)
        self._owned: dict[str, _Owned] = {}  # mesh id -> what we know of it
        self._saved: dict[str, bytes] = {}  # actor id -> its last saved state, encoded
        #: The watch, the savers and the deaths being taken up; ended by aclose().
        self._tasks = TaskOwner()
        #: Deaths taken up, as (actor id, restarts): one heard twice (the stream, then the
        #: reconciliation after a reconnect) is handled once.
        self._handled: set[tuple[str, int]] = set()
        self._watching = asyncio.Event()
        self._start_error: OrchestrError | None = None
        self.escalated: SupervisionError | None = None
        self.closing = False

    async def __aenter__(self) -> Supervisor:
        self._tasks.start(self._serve_watch())
        async with asyncio.timeout(10):  # the head answers at once, or something is wrong
            await self._watching.wait()
        if self._start_error is not None:
            await self.aclose()
            raise self._start_error
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop watching; deaths after this (the job's own teardown) are not failures."""
        self.closing = True
        await self._tasks.aclose()

    def adopt(self, mesh: Mesh, policy: RestartPolicy, hook: SuperviseHook, saves: bool) -> None:
        owned = _Owned(mesh, policy, hook, saves)
        self._owned[mesh.mesh_id] = owned
        if saves and policy.checkpoint_s is not None and not self._tasks.closed:
            owned.saver = self._tasks.start(self._save_every(owned, policy.checkpoint_s))

    def forget(self, mesh: Mesh) -> None:
        owned = self._owned.pop(mesh.mesh_id, None)
        if owned is not None and owned.saver is not None:
            owned.saver.cancel()

    # -- state ---------------------------------------------------------------------------
    async def checkpoint(self, mesh: Mesh) -> int:
        """Save the state of every live member of ``mesh`` that defines ``save_state``; a
        restarted member gets the last one back. Returns how many were saved."""
        owned = self._owned.get(mesh.mesh_id)
        if owned is None or not owned.saves_state:
            raise ConfigError(
                f"{mesh.name} cannot be checkpointed: its class defines no save_state method"
            )
        results = await asyncio.gather(
            *(self._save(mesh, m) for m in mesh.members), return_exceptions=True
        )
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, ActorDiedError):
                raise r
        return sum(1 for r in results if r is True)

    async def _save(self, mesh: Mesh, member: Member) -> bool:
        state = await self.client.call(
            member.address, member.actor_id, mesh.label(member), SAVE_ENDPOINT, (), {}
        )
        encoded, buffers = _serde.encode(state)
        if buffers:
            raise ConfigError(
                f"{mesh.label(member)}.save_state returned tensors or arrays; return plain "
                f"values (save large state to a file or an orchestr.Buffer and return its name)"
            )
        self._saved[member.actor_id] = encoded
        return True

    async def _save_every(self, owned: _Owned, period: float) -> None:
        while True:
            await asyncio.sleep(period)
            try:
                await self.checkpoint(owned.mesh)
            except OrchestrError as exc:
                log.warning("checkpoint failed", mesh=owned.mesh.name, error=str(exc))

    # -- deaths --------------------------------------------------------------------------
    async def _serve_watch(self) -> None:
        """Hear of deaths from the head. When the stream breaks (the head went away), watch
        again for up to ``reconnect_s`` s: a head daemon that restarts keeps its state, and
        the deaths it recorded meanwhile are taken from its actor list. Past that the job
        fails."""
        lost_at: float | None = None
        error: Exception | None = None
        loop = asyncio.get_running_loop()
        while not self.closing:
            watch = self._head.watch()
            try:
                await watch.connected()
                if lost_at is not None:
                    await self._reconcile()
                    log.warning(
                        "the head's supervision stream is back",
                        after_s=round(loop.time() - lost_at, 2),
                    )
                    self.events.record("head_reconnected", after_s=loop.time() - lost_at)
                    lost_at = None
                self._watching.set()
                async for kind, actor in watch:
                    if kind == "died" and not self.closing:
                        self._spawn(self._on_death(actor))
                error = None
            except asyncio.CancelledError:
                watch.cancel()
                raise
            except Exception as exc:
                error = exc
            watch.cancel()
            if not self._watching.is_set():  # never connected: the job does not start
                self._start_error = (
                    error
                    if isinstance(error, OrchestrError)
                    else SupervisionError(f"cannot watch the head's actors ({error})", actor="")
                )
                self._watching.set()
                return
            if self.closing:
                return
            if lost_at is None:
                lost_at = loop.time()
                log.warning("lost the head's supervision stream; watching again", error=str(error))
                self.events.record("head_lost", error=str(error))
            if loop.time() - lost_at > self.reconnect_s:
                self._escalate(
                    SupervisionError(
                        f"lost the head's supervision stream ({error}) and it did not come back "
                        f"within {self.reconnect_s:g} s (ORCHESTR_HEAD_RECONNECT_TIMEOUT); the "
                        "job cannot go on without its head",
                        actor="",
                    )
                )
                return
            await asyncio.sleep(0.5)

    async def _reconcile(self) -> None:
        """Take up the deaths of owned actors the head recorded while the stream was down."""
        for info in await self._head.actors():
            if info.mesh_id in self._owned and info.state in ("restarting", "dead"):
                self._spawn(self._on_death(info))

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = self._tasks.start(coro)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        log.error("supervision failed", error=repr(exc))
        root = SupervisionError(f"supervising the job's actors failed: {exc!r}", actor="")
        root.__cause__ = exc
        self._escalate(root)

    async def _on_death(self, info: ActorInfo) -> None:
        # Calls in flight to the dead worker are settled now: one on a host cut off by a
        # partition gets no reset, and would wait for its deadline.
        self.client.worker_gone(info.call_address, f"{info.name}[{info.rank}] is {info.state}")
        owned = self._owned.get(info.mesh_id)
        key = (info.actor_id, info.restarts)
        if owned is None or key in self._handled:
            return
        self._handled.add(key)
        error = death_error(info)
        can_restart = info.state == "restarting"
        failure = Failure(owned.mesh, info.rank, error, info.restarts, can_restart)
        self.events.record(
            "actor_died",
            actor=error.actor,
            signal=error.signal,
            exit_code=error.exit_code,
            restarts=info.restarts,
        )
        try:
            decision = await self._decide(owned, failure)
        except Exception as exc:
            await self._abandon(info.actor_id)
            root = SupervisionError(
                f"the supervise hook of {owned.mesh.name} raised {type(exc).__name__}: {exc} "
                f"while handling: {error}",
                actor=error.actor,
            )
            root.__cause__ = exc
            self._escalate(root)
            return
        log.warning("actor died", actor=error.actor, decision=decision, error=str(error))
        if decision == "restart" and can_restart:
            await self._restart(owned, info, failure)
            return
        await self._abandon(info.actor_id)
        self.events.record("supervision", actor=error.actor, decision=decision)
        if decision == "handle":
            return
        why = "the supervise hook escalated it"
        if decision == "restart":
            why = f"it has no restarts left (max_restarts={owned.policy.max_restarts})"
        elif owned.hook is None and owned.policy.max_restarts == 0:
            why = (
                "its mesh restarts nothing; pass restart=orchestr.RestartPolicy(max_restarts=N) "
                "or supervise='handle' (or a function) to ctx.spawn"
            )
        elif owned.hook is None:
            why = f"its restarts are used up (max_restarts={owned.policy.max_restarts})"
        root = SupervisionError(f"{error}\n(the job fails: {why})", actor=error.actor)
        root.signal, root.exit_code = error.signal, error.exit_code
        root.__cause__ = error
        self._escalate(root)

    async def _decide(self, owned: _Owned, failure: Failure) -> Decision:
        hook = owned.hook
        decision: Any = None
        if isinstance(hook, str):
            decision = hook
        elif hook is not None:
            decision = hook(failure)
            if inspect.isawaitable(decision):
                decision = await decision
        if decision is None:
            decision = "restart" if failure.can_restart else "escalate"
        if decision not in DECISIONS:
            raise ConfigError(f"a supervise hook returns one of {DECISIONS}, got {decision!r}")
        return cast(Decision, decision)

    async def _restart(self, owned: _Owned, info: ActorInfo, failure: Failure) -> None:
        delay = owned.policy.backoff(info.restarts)
        label = failure.error.actor
        await asyncio.sleep(delay)
        state = self._saved.get(info.actor_id, b"")
        try:
            new = await self._head.restart_actor(
                info.actor_id, state if info.actor_id in self._saved else None
            )
        except OrchestrError as exc:
            await self._abandon(info.actor_id)
            root = SupervisionError(
                f"restarting {label} failed: {exc}\n(it had died: {failure.error})", actor=label
            )
            root.__cause__ = exc
            self._escalate(root)
            return
        self.client.moved[info.actor_id] = new.call_address
        mesh = owned.mesh
        mesh.members = tuple(
            Member(m.actor_id, new.call_address, m.rank) if m.actor_id == info.actor_id else m
            for m in mesh.members
        )
        self.events.record(
            "restart", actor=label, restarts=new.restarts, backoff_s=delay, node=new.node_id
        )
        log.info("actor restarted", actor=label, restarts=new.restarts)

    async def _abandon(self, actor_id: str) -> None:
        with contextlib.suppress(OrchestrError):
            await self._head.abandon_actor(actor_id)

    def _escalate(self, error: SupervisionError) -> None:
        self.events.record("error", source="supervision", message=str(error).splitlines()[0])
        if self.escalated is None and not self.closing:
            self.escalated = error
            log.error("the job fails", error=str(error))
            self.on_escalate(error)
