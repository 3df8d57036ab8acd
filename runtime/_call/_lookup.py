"""What a caller learns of an actor whose connection broke: the head's view of it, and the
error a call that cannot be sent again fails with."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable

from orchestr.errors import (
    ActorDiedError,
)

from ._connection import Pending

__all__ = ["ActorLookup", "ActorView", "death_of", "restarting"]


@dataclasses.dataclass(frozen=True)
class ActorView:
    """What the head says about an actor whose connection broke."""

    #: ``alive``, ``starting``, ``restarting``, ``dead`` or ``stopped``.
    state: str
    #: Where it serves calls now (its new incarnation's address after a restart).
    address: str
    #: Why it (last) went away, as the error to raise; ``None`` when it never died.
    died: ActorDiedError | None


#: Asks the head about an actor: ``(actor_id, address the caller knew, restart wait in s)``.
ActorLookup = Callable[[str, str, float], Awaitable[ActorView]]


def restarting(view: ActorView | None) -> bool:
    return view is not None and view.state in ("restarting", "starting")


def death_of(p: Pending, view: ActorView | None, exc: BaseException, moved: bool) -> ActorDiedError:
    """The error of a call whose actor went away, saying what became of the actor."""
    where = f"{p.label}.{p.endpoint} failed: "
    died = view.died if view is not None else None
    if died is None:
        text = f"lost the connection to the actor's worker ({exc})"
    else:
        text = str(died)
    if moved:
        text += "; it was restarted, but the call is not retried (the mesh's retry is at-most-once)"
    elif restarting(view):
        text += "; it is being restarted"
    err = ActorDiedError(
        where + text,
        actor=p.label,
        exit_code=died.exit_code if died else None,
        signal=died.signal if died else None,
    )
    err.__cause__ = exc
    return err
