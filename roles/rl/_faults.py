"""What the GRPO job's controller knows of its roles' deaths, and a fault injector to test it.

A role's member can die at any moment (SIGKILL, OOM, a lost node); its restart policy brings it
back under the same actor id. The controller must then tell work done by the dead incarnation
from work of the new one. :class:`MemberWatch` counts a member's incarnations: the
``supervise`` hook bumps :attr:`~MemberWatch.epoch` as the death is heard, which is always
before the new incarnation exists (the hook runs before the restart is asked for), so a call
that began under one epoch and ended under another may have been answered by either and its
result is thrown away. :func:`lost_during` turns "this call failed" into "a member it needed
was lost" (the work is done again) or "a real error" (raised).

:class:`FaultInjector` SIGKILLs a role's worker at a chosen step of the job, at a random moment
of it or at (or a delay after) the start of a named phase: ``--kill generator@12 --kill
trainer@40:train``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal
from collections.abc import Sequence
from typing import Any

import structlog

import orchestr as oc
from orchestr.tasks import TaskOwner

__all__ = ["ROLES", "FaultInjector", "Kill", "MemberWatch", "lost_during", "parse_kill"]

log = structlog.get_logger("orchestr.roles.faults")

ROLES = ("generator", "reward", "trainer")
PHASES = ("generate", "score", "train", "sync", "eval", "wait")

#: How long a failed call waits to hear that a member it needed died, before it counts as a
#: real error. The head hears of a worker's exit at once; this covers a loaded machine.
SETTLE_S = 15.0


class MemberWatch:
    """One member of a role: its incarnation count (``epoch``), whether it is ready for work
    (``up``: cleared on a death until the controller has brought the new incarnation up to
    date) and a lock that orders the controller's calls that change it."""

    def __init__(self) -> None:
        self.epoch = 0
        self.up = asyncio.Event()
        self.up.set()
        self.lock = asyncio.Lock()
        self._changed = asyncio.Event()

    def lost(self) -> int:
        """Record a death (or a rollback that voids its work); returns the new epoch."""
        self.epoch += 1
        self.up.clear()
        self._changed.set()
        self._changed = asyncio.Event()
        return self.epoch

    async def changed(self, epoch: int) -> None:
        """Return once the epoch has moved past ``epoch``."""
        while self.epoch == epoch:
            await self._changed.wait()


async def lost_during(
    watches: Sequence[MemberWatch], epochs: Sequence[int], error: BaseException | None
) -> bool:
    """Whether a member of ``watches`` was lost since ``epochs`` were read. With ``error`` (the
    call failed), wait up to :data:`SETTLE_S` for the death to be heard: a call to a dead
    worker can fail before the head reports the death."""
    if any(w.epoch != e for w, e in zip(watches, epochs, strict=True)):
        return True
    if error is None or isinstance(error, asyncio.CancelledError):
        return False
    pairs = zip(watches, epochs, strict=True)
    async with TaskOwner() as tasks:  # the waits left are cancelled on the way out
        waits = [tasks.start(w.changed(e)) for w, e in pairs]
        await asyncio.wait(waits, timeout=SETTLE_S, return_when=asyncio.FIRST_COMPLETED)
    return any(w.epoch != e for w, e in zip(watches, epochs, strict=True))


@dataclasses.dataclass(frozen=True)
class Kill:
    """SIGKILL ``role``'s worker (member ``rank``, or a random one) during batch ``step``:
    ``delay`` s after the start of ``phase`` when given, else at a random moment of the
    batch."""

    role: str
    step: int
    phase: str | None = None
    rank: int | None = None
    delay: float = 0.0

    def __str__(self) -> str:
        who = self.role if self.rank is None else f"{self.role}{self.rank}"
        when = f":{self.phase}" if self.phase else ""
        return f"{who}@{self.step}{when}" + (f"+{self.delay:g}" if self.delay else "")


def parse_kill(text: str) -> Kill:
    """``ROLE[RANK]@STEP[:PHASE[+SECONDS]]``, e.g. ``generator@12``, ``generator1@12:generate``,
    ``reward@30:score+0.05``; raises :class:`orchestr.ConfigError` saying what is wrong."""
    who, sep, when = text.partition("@")
    step_text, _, phase = when.partition(":")
    phase, _, delay_text = phase.partition("+")
    role = who.rstrip("0123456789")
    rank = int(who[len(role) :]) if who[len(role) :] else None
    if not sep or role not in ROLES or not step_text.isdigit() or int(step_text) < 1:
        raise oc.ConfigError(
            f"a kill is ROLE[RANK]@STEP[:PHASE[+SECONDS]] with ROLE one of {', '.join(ROLES)} "
            f"and STEP >= 1 (e.g. generator@12, reward@30:score+0.05); got {text!r}"
        )
    if phase and phase not in PHASES:
        raise oc.ConfigError(f"unknown phase {phase!r} in {text!r}; say one of {', '.join(PHASES)}")
    try:
        delay = float(delay_text) if delay_text else 0.0
    except ValueError:
        delay = -1.0
    if not 0 <= delay < 3600:
        raise oc.ConfigError(f"the delay in {text!r} is not a number of seconds below 3600")
    return Kill(role, int(step_text), phase or None, rank, delay)


class FaultInjector:
    """Carries out :class:`Kill` s on a cluster on this machine. The job tells it each batch
    it starts (:meth:`on_step`) and each phase (:meth:`on_phase`); as a kill's batch starts
    it finds the worker of the role's member in the head's actor list, and at the kill's
    moment sends it SIGKILL. ``seed`` draws the random moments and members. Each kill done
    is in :attr:`done` (what, which member, its pid, the batch and phase it hit)."""

    def __init__(self, ctx: oc.JobContext, kills: Sequence[Kill], seed: int = 0) -> None:
        self.ctx = ctx
        self.kills = list(kills)
        self.rng = random.Random(seed)
        self.meshes: dict[str, oc.Mesh] = {}
        self.done: list[dict[str, Any]] = []
        #: A kill that could not be carried out; the job raises it at its end.
        self.error: Exception | None = None
        self.step = -1
        self.phase = ""
        self.step_s = 1.0  # a batch's duration, measured as the job goes
        self._step_started = 0.0
        self._phases: dict[str, asyncio.Event] = {}
        self._pending: dict[asyncio.Task[None], str] = {}  # kills started and not yet done
        self._kills = TaskOwner()

    def on_step(self, step: int) -> None:
        loop = asyncio.get_running_loop()
        if self.step >= 0:
            took = loop.time() - self._step_started
            self.step_s = took if self.step == 0 else 0.8 * self.step_s + 0.2 * took
        self.step, self._step_started = step, loop.time()
        self._phases = {p: asyncio.Event() for p in PHASES}
        for k in [k for k in self.kills if k.step == step]:
            self.kills.remove(k)
            task = self._kills.start(self._kill(k, self._phases))
            self._pending[task] = str(k)
            task.add_done_callback(self._pending.pop)

    def on_phase(self, phase: str) -> None:
        self.phase = phase
        if phase in self._phases:
            self._phases[phase].set()

    async def _kill(self, kill: Kill, phases: dict[str, asyncio.Event]) -> None:
        try:
            mesh = self.meshes[kill.role]
            rank = kill.rank if kill.rank is not None else self.rng.randrange(len(mesh))
            if not 0 <= rank < len(mesh):
                raise oc.ConfigError(f"{kill}: the {kill.role} mesh has {len(mesh)} members")
            actor_id = mesh.members[rank].actor_id
            info = next(a for a in await self.ctx.actors() if a.actor_id == actor_id)
            if kill.phase is None:
                await asyncio.sleep(self.rng.uniform(0, self.step_s))
            else:
                await phases[kill.phase].wait()
                await asyncio.sleep(kill.delay)
            pid = _local_worker_pid(info)
            os.kill(pid, signal.SIGKILL)
        except Exception as exc:
            log.error("a kill failed", kill=str(kill), error=str(exc))
            self.error = self.error or exc
            return
        record = {"kill": str(kill), "rank": rank, "pid": pid, "step": self.step}
        record["phase"] = self.phase
        self.done.append(record)
        log.warning("killed a worker", **record)

    def check(self) -> None:
        """At the job's end: raise the error of a kill that failed, or one that never
        happened (its batch or phase never came)."""
        if self.error is not None:
            raise self.error
        left = [str(k) for k in self.kills] + list(self._pending.values())
        if left:
            raise oc.ConfigError(f"kills that never happened (their moment never came): {left}")

    async def aclose(self) -> None:
        await self._kills.aclose()


def _local_worker_pid(info: Any) -> int:
    """The pid of the worker hosting ``info``'s actor, checked to be that worker on this
    machine (its environment names the worker id), so a pid of another host is never hit."""
    want = f"ORCHESTR_WORKER_ID={info.worker_id}".encode()
    try:
        with open(f"/proc/{info.pid}/environ", "rb") as f:
            environ = f.read().split(b"\0")
    except OSError:
        environ = []
    if info.state != "alive" or want not in environ:
        raise oc.ConfigError(
            f"cannot kill {info.name}[{info.rank}]: its worker (pid {info.pid}, state "
            f"{info.state}) is not a live process on this machine; kills need a cluster on "
            "this host"
        )
    return int(info.pid)
