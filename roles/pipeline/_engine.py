"""A schedule executed in virtual time: every rank runs its list in order, passing activations
and gradients to the neighbouring stages over links between ranks.

The execution model, shared by :func:`~orchestr.roles.pipeline.check` (does it finish?) and
:func:`~orchestr.roles.pipeline.run` (how long does it take?):

- An operation starts once the rank's previous operation is done and its input has arrived: a
  forward on stage ``s > 0`` takes the activation stage ``s - 1`` sent, a backward (``B`` or
  ``BI``) on a stage but the last takes the gradient stage ``s + 1`` sent. Inputs from the same
  rank (stages of one rank when there is a single rank, the forward a backward reads, the
  ``BI`` a ``BW`` follows) are read from memory: the order of the rank's list must provide them.
- When a forward (to stage ``s + 1``) or a backward (to stage ``s - 1``) has an output for
  another rank, the rank sends it on the link for that kind and pair of ranks: a FIFO channel,
  as the data plane's channels are. A send blocks while the link holds ``capacity`` items its
  receiver has not started on (``None``: never; ``0``: until the receiver takes it, a
  rendezvous). An item arrives ``latency`` after it entered the link.
- A receiver takes a link's items in the order they were sent; a schedule whose two ends of a
  link disagree on that order is refused before anything runs.

Times are found by evaluating these max-plus equations in dependency order, so the result does
not depend on how the ranks are interleaved here; when no rank can take a step and some have
not finished, the schedule deadlocks, and the error says where each rank waits. No I/O here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ._ops import Op, Pass, Schedule

__all__ = ["Ends", "Execution", "Link", "execute", "links"]

_BACKWARD = (Pass.B, Pass.BI)


@dataclasses.dataclass(frozen=True, slots=True)
class Link:
    """The channel from rank ``src`` to rank ``dst`` for activations (``"activation"``) or
    gradients (``"gradient"``)."""

    what: str
    src: int
    dst: int


@dataclasses.dataclass(frozen=True, slots=True)
class Execution:
    """Each operation's start and end, rank by rank, aligned with the schedule's lists."""

    starts: tuple[tuple[float, ...], ...]
    ends: tuple[tuple[float, ...], ...]


def _describe(op: Op) -> str:
    return f"{op.kind}(microbatch {op.microbatch}, chunk {op.chunk})"


def _input(s: Schedule, op: Op) -> tuple[Link, int] | None:
    """The link and the producing stage of ``op``'s input from another rank, if it has one."""
    stage = s.stage(op)
    if op.kind is Pass.F and stage > 0:
        src = stage - 1
    elif op.kind in _BACKWARD and stage < s.stages - 1:
        src = stage + 1
    else:
        return None
    rank = src % s.ranks
    if rank == op.rank:
        return None
    return Link("activation" if op.kind is Pass.F else "gradient", rank, op.rank), src


def _output(s: Schedule, op: Op) -> Link | None:
    """The link ``op`` sends its output on, if it has one for another rank."""
    stage = s.stage(op)
    if op.kind is Pass.F and stage < s.stages - 1:
        dst, what = stage + 1, "activation"
    elif op.kind in _BACKWARD and stage > 0:
        dst, what = stage - 1, "gradient"
    else:
        return None
    rank = dst % s.ranks
    return None if rank == op.rank else Link(what, op.rank, rank)


#: Per operation, keyed by ``(rank, index in its list)``: its link and its item's position.
Ends = dict[tuple[int, int], tuple[Link, int]]


def links(s: Schedule) -> tuple[Ends, Ends]:
    """Where each operation receives and sends: ``(recv, send)``, both keyed by ``(rank,
    index)`` and giving the link and the item's position on it. Raises ``ValueError`` when the
    two ends of a link would order its items differently."""
    sent: dict[Link, list[tuple[int, Op]]] = {}
    taken: dict[Link, list[tuple[int, Op]]] = {}
    recv: Ends = {}
    send: Ends = {}
    for r, ops in enumerate(s.ops):
        for i, op in enumerate(ops):
            out = _output(s, op)
            if out is not None:
                send[r, i] = out, len(sent.setdefault(out, []))
                sent[out].append((s.stage(op), op))
            inp = _input(s, op)
            if inp is not None:
                link, src = inp
                recv[r, i] = link, len(taken.setdefault(link, []))
                taken[link].append((src, op))
    for link in sorted(set(sent) | set(taken), key=dataclasses.astuple):
        out_order = [(stage, op.microbatch) for stage, op in sent.get(link, [])]
        in_order = [(stage, op.microbatch) for stage, op in taken.get(link, [])]
        if out_order != in_order:
            k = next(
                (k for k, (a, b) in enumerate(zip(out_order, in_order, strict=False)) if a != b),
                min(len(out_order), len(in_order)),
            )
            said, wants = (
                "stage {} micro-batch {}".format(*order[k]) if k < len(order) else "nothing"
                for order in (out_order, in_order)
            )
            raise ValueError(
                f"the {link.what}s from rank {link.src} to rank {link.dst} are out of order: "
                f"item {k} sent is {said}'s, the one taken is {wants}'s; a link is a FIFO "
                f"channel, so order both ranks' lists alike"
            )
    return recv, send


def execute(
    s: Schedule,
    duration: Callable[[Op], float],
    *,
    latency: float = 0.0,
    capacity: int | None = None,
) -> Execution:
    """Run ``s`` in virtual time: ``duration(op)`` is how long ``op`` computes, ``latency`` how
    long an item takes over a link, ``capacity`` how many untaken items a link holds before its
    sender blocks (``None``: unbounded). Pure; raises ``ValueError`` on a deadlock or links
    whose ends disagree on order (see the module's docstring)."""
    recv, send = links(s)
    ready: dict[Link, dict[int, float]] = {}  # when each item entered its link
    taken: dict[Link, dict[int, float]] = {}  # when its receiver started on it
    starts: list[list[float]] = [[] for _ in s.ops]
    ends: list[list[float]] = [[] for _ in s.ops]
    free = [0.0] * s.ranks  # when each rank can start its next operation
    sending = [False] * s.ranks  # computed its current operation, its send still pending
    pc = [0] * s.ranks
    progress = True
    while progress:
        progress = False
        for r, ops in enumerate(s.ops):
            while pc[r] < len(ops):
                i = pc[r]
                if not sending[r]:
                    start = free[r]
                    if (r, i) in recv:
                        link, k = recv[r, i]
                        at = ready.get(link, {}).get(k)
                        if at is None:
                            break
                        start = max(start, at + latency)
                        taken.setdefault(link, {})[k] = start
                    starts[r].append(start)
                    ends[r].append(start + duration(ops[i]))
                    sending[r] = (r, i) in send
                    progress = True
                    if not sending[r]:
                        free[r] = ends[r][-1]
                        pc[r] += 1
                    continue
                link, k = send[r, i]
                end = ends[r][-1]
                items = ready.setdefault(link, {})
                if capacity is None or k < capacity:
                    items[k] = end
                    release: float | None = end
                elif capacity == 0:
                    items[k] = end
                    release = taken.get(link, {}).get(k)
                else:
                    room = taken.get(link, {}).get(k - capacity)
                    release = None if room is None else max(end, room)
                    if release is not None:
                        items[k] = release
                if release is None:
                    break
                free[r], sending[r] = release, False
                pc[r] += 1
                progress = True
    stuck = [r for r in range(s.ranks) if pc[r] < len(s.ops[r])]
    if stuck:
        raise ValueError(f"the schedule deadlocks: {_waits(s, stuck, pc, sending, recv, send)}")
    return Execution(tuple(map(tuple, starts)), tuple(map(tuple, ends)))


def _waits(
    s: Schedule,
    stuck: list[int],
    pc: list[int],
    sending: list[bool],
    recv: Ends,
    send: Ends,
) -> str:
    parts = []
    for r in stuck:
        op = s.ops[r][pc[r]]
        if sending[r]:
            link, _ = send[r, pc[r]]
            parts.append(
                f"rank {r} blocks sending {_describe(op)}'s {link.what} to rank {link.dst}"
            )
        else:
            link, _ = recv[r, pc[r]]
            parts.append(
                f"rank {r} waits for the {link.what} of {_describe(op)} from rank {link.src}"
            )
    return "; ".join(parts)
