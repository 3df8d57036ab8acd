"""How the owner of a mesh treats its members' deaths: the restart policy, the failure a
``supervise`` hook sees, and the decisions it may return (see :mod:`._supervise`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from orchestr._call._mesh import Mesh
from orchestr.errors import ActorDiedError, ConfigError

__all__ = [
    "DECISIONS",
    "Decision",
    "Failure",
    "RestartPolicy",
    "SuperviseHook",
    "check_spawn_options",
]

Decision = Literal["restart", "handle", "escalate"]


DECISIONS = ("restart", "handle", "escalate")


@dataclasses.dataclass(frozen=True)
class RestartPolicy:
    """How a mesh's members are restarted when they die.

    ``max_restarts`` per member (0: a death is final); the wait before restart ``n`` is
    ``backoff_s * 2**n``, at most ``backoff_max_s``. ``retry`` says what happens to calls in
    flight when the actor dies: ``"at_most_once"`` (they fail with :class:`ActorDiedError`) or
    ``"at_least_once"`` (they are sent again to the restarted actor, so an endpoint may run
    twice for one call). ``checkpoint_s``: how often to save the state of actors that define
    ``save_state`` (``None``: only when the job calls ``ctx.checkpoint(mesh)``).
    """

    max_restarts: int = 0
    backoff_s: float = 0.2
    backoff_max_s: float = 10.0
    retry: Literal["at_most_once", "at_least_once"] = "at_most_once"
    checkpoint_s: float | None = None

    def __post_init__(self) -> None:
        n = self.max_restarts
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError(f"max_restarts must be a non-negative integer, got {n!r}")
        for name in ("backoff_s", "backoff_max_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
                raise ConfigError(f"{name} must be a non-negative number, got {value!r}")
        if self.retry not in ("at_most_once", "at_least_once"):
            raise ConfigError(
                f"retry must be 'at_most_once' or 'at_least_once', got {self.retry!r}"
            )
        c = self.checkpoint_s
        if c is not None and (isinstance(c, bool) or not isinstance(c, int | float) or c <= 0):
            raise ConfigError(f"checkpoint_s must be a positive number or None, got {c!r}")

    def backoff(self, restarts: int) -> float:
        return float(min(self.backoff_max_s, self.backoff_s * 2 ** min(restarts, 30)))


@dataclasses.dataclass(frozen=True)
class Failure:
    """A death the owner's ``supervise`` hook decides about."""

    #: The whole mesh the actor belongs to; ``failure.member`` is the dead one alone.
    mesh: Mesh
    rank: int
    #: The death, as the error calls to the actor raise (signal, exit code, last output).
    error: ActorDiedError
    #: How many times this member was restarted before.
    restarts: int
    #: Whether its restart policy allows one more restart.
    can_restart: bool

    @property
    def member(self) -> Mesh:
        return self.mesh[self.rank]


#: ``supervise=``: a decision for every failure, or a function of the failure returning one
#: (or ``None`` for the policy's default), sync or async.
SuperviseHook = Decision | Callable[[Failure], Decision | Awaitable[Decision | None] | None] | None


def check_spawn_options(restart: Any, supervise: Any, per_process: Any) -> RestartPolicy:
    """Checks ``ctx.spawn``'s supervision and packing options; returns the restart policy."""
    policy = restart if restart is not None else RestartPolicy()
    if not isinstance(policy, RestartPolicy):
        raise ConfigError(f"restart must be an orchestr.RestartPolicy, got {restart!r}")
    if not (supervise is None or callable(supervise) or supervise in DECISIONS):
        raise ConfigError(
            f"supervise must be one of {', '.join(DECISIONS)} or a function of the failure, "
            f"got {supervise!r}"
        )
    if isinstance(per_process, bool) or not isinstance(per_process, int) or per_process < 1:
        raise ConfigError(f"per_process must be a positive integer, got {per_process!r}")
    return policy
