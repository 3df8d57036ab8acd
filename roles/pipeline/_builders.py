"""The schedules: GPipe, 1F1B, interleaved 1F1B and ZB-H1, each a pure function of its sizes.

- **GPipe** (Huang et al. 2019, "GPipe", arXiv:1811.06965): every rank runs all its forwards,
  then all its backwards. A rank holds the activations of every micro-batch at once.
- **1F1B** (PipeDream-Flush: Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN
  Training", arXiv:2006.09503; Megatron-LM's non-interleaved schedule): rank ``r`` warms up
  with ``ranks - r - 1`` forwards, then alternates one forward and one backward, then cools
  down with the backwards left. The bubble is GPipe's; rank ``r`` holds at most ``ranks - r``
  micro-batches' activations instead of all of them.
- **Interleaved 1F1B** (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training
  on GPU Clusters Using Megatron-LM", arXiv:2104.04473, section 2.2): each rank holds ``chunks``
  virtual stages; passes go round the ranks ``chunks`` times, in groups of ``ranks``
  micro-batches. The warm-up is ``2 * (ranks - r - 1) + (chunks - 1) * ranks`` passes, as in
  Megatron-LM; with as many micro-batches as ranks every forward comes first.
- **ZB-H1** (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", ICLR 2024, arXiv:2401.10241,
  section 3): 1F1B with the backward split into its input-gradient pass ``BI``, which the
  previous stage waits for, and its weight-gradient pass ``BW``, which nobody waits for. In the
  steady state rank ``r`` runs ``F(x)``, ``BI(x - (ranks - 1 - r))``, ``BW(x - (ranks - 1))``:
  the weight passes trail by ``ranks - 1`` micro-batches and fill the cool-down, while no rank
  holds more than ``ranks`` micro-batches in flight, 1F1B's peak.

Every builder returns micro-batches in increasing order per kind and chunk, so each pair of
neighbouring ranks sends and receives in the same order (what FIFO channels need). No I/O here.
"""

from __future__ import annotations

from ._ops import Op, Pass, Schedule

__all__ = [
    "SCHEDULES",
    "build",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "validate",
    "zb_h1",
]

#: The builders' names, as :func:`build` and :func:`~orchestr.roles.pipeline.bubble_theory`
#: take them.
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")


def _sizes(ranks: object, microbatches: object, chunks: object = 1) -> None:
    for name, value in (("ranks", ranks), ("microbatches", microbatches), ("chunks", chunks)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name} must be an integer, got {value!r:.40}")
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")


def gpipe(ranks: int, microbatches: int) -> Schedule:
    """GPipe: all forwards, then all backwards, on every rank. Pure; raises ``ValueError``
    for a count below 1."""
    _sizes(ranks, microbatches)
    ops = tuple(
        tuple(Op(Pass.F, r, m) for m in range(microbatches))
        + tuple(Op(Pass.B, r, m) for m in range(microbatches))
        for r in range(ranks)
    )
    return Schedule("gpipe", ranks, microbatches, 1, ops)


def one_f_one_b(ranks: int, microbatches: int) -> Schedule:
    """1F1B (PipeDream-Flush): warm-up forwards, one forward and one backward in turn, then the
    backwards left. Works for any number of micro-batches (below ``ranks`` it is GPipe's order
    on the first ranks). Pure; raises ``ValueError`` for a count below 1."""
    _sizes(ranks, microbatches)
    lists = []
    for r in range(ranks):
        warmup = min(ranks - r - 1, microbatches)
        ops = [Op(Pass.F, r, m) for m in range(warmup)]
        for k in range(microbatches - warmup):
            ops += [Op(Pass.F, r, warmup + k), Op(Pass.B, r, k)]
        ops += [Op(Pass.B, r, m) for m in range(microbatches - warmup, microbatches)]
        lists.append(tuple(ops))
    return Schedule("1f1b", ranks, microbatches, 1, tuple(lists))


def interleaved_1f1b(ranks: int, microbatches: int, chunks: int) -> Schedule:
    """Megatron-LM's interleaved 1F1B over ``chunks`` virtual stages per rank.

    Micro-batches go through in groups of ``ranks``: the ``k``-th forward of every rank is
    micro-batch ``(k // (ranks * chunks)) * ranks + k % ranks`` on chunk
    ``(k // ranks) % chunks``; the ``k``-th backward is the same micro-batch on the chunks in
    reverse. So ``microbatches`` must be a multiple of ``ranks`` (Megatron-LM's own
    constraint); with ``chunks == 1`` this is :func:`one_f_one_b`. Pure; raises ``ValueError``
    for a count below 1 or micro-batches that are not a multiple of ranks."""
    validate("interleaved_1f1b", ranks, microbatches, chunks)
    if chunks == 1:
        plain = one_f_one_b(ranks, microbatches)
        return Schedule("interleaved_1f1b", ranks, microbatches, 1, plain.ops)
    total = microbatches * chunks

    def which(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k // ranks) % chunks
        return (k // (ranks * chunks)) * ranks + k % ranks, chunk if forward else chunks - 1 - chunk

    lists = []
    for r in range(ranks):
        if microbatches == ranks:
            warmup = total
        else:
            warmup = min(2 * (ranks - r - 1) + (chunks - 1) * ranks, total)
        fwd = [Op(Pass.F, r, *which(k, True)) for k in range(total)]
        bwd = [Op(Pass.B, r, *which(k, False)) for k in range(total)]
        ops = fwd[:warmup]
        for k in range(total - warmup):
            ops += [fwd[warmup + k], bwd[k]]
        ops += bwd[total - warmup :]
        lists.append(tuple(ops))
    return Schedule("interleaved_1f1b", ranks, microbatches, chunks, tuple(lists))


def zb_h1(ranks: int, microbatches: int) -> Schedule:
    """ZB-H1: 1F1B with split backwards whose weight passes trail by ``ranks - 1``
    micro-batches. Rank ``r`` runs, for ``x`` from 0 to ``microbatches + ranks - 2``, the
    passes ``F(x)``, ``BI(x - (ranks - 1 - r))`` and ``BW(x - (ranks - 1))`` that exist.

    Needs ``microbatches >= ranks``: with fewer the steady state never forms, the list is not
    the paper's schedule and its closed form does not hold (use :func:`one_f_one_b`). Pure; raises ``ValueError`` for a count below 1 or
    fewer micro-batches than ranks."""
    validate("zb_h1", ranks, microbatches)
    lists = []
    for r in range(ranks):
        ops = []
        for x in range(microbatches + ranks - 1):
            for kind, m in (
                (Pass.F, x),
                (Pass.BI, x - (ranks - 1 - r)),
                (Pass.BW, x - (ranks - 1)),
            ):
                if 0 <= m < microbatches:
                    ops.append(Op(kind, r, m))
        lists.append(tuple(ops))
    return Schedule("zb_h1", ranks, microbatches, 1, tuple(lists))


def validate(kind: str, ranks: int, microbatches: int, chunks: int = 1) -> None:
    """Raise ``ValueError`` unless :func:`build` makes ``kind`` at these sizes. Pure."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule {kind!r}: one of {', '.join(SCHEDULES)}")
    _sizes(ranks, microbatches, chunks)
    if kind != "interleaved_1f1b" and chunks != 1:
        raise ValueError(f"only interleaved_1f1b has chunks; {kind} takes chunks=1, got {chunks}")
    if kind == "interleaved_1f1b" and chunks > 1 and microbatches % ranks:
        below = microbatches // ranks * ranks
        nearest = f"{below} or " if below else ""
        raise ValueError(
            f"interleaved 1F1B runs micro-batches in groups of one per rank: microbatches "
            f"({microbatches}) must be a multiple of ranks ({ranks}), such as {nearest}"
            f"{below + ranks}"
        )
    if kind == "zb_h1" and microbatches < ranks:
        raise ValueError(
            f"ZB-H1 needs at least one micro-batch per rank to fill its steady state: "
            f"microbatches ({microbatches}) < ranks ({ranks}); use 1f1b for fewer"
        )


def build(kind: str, ranks: int, microbatches: int, chunks: int = 1) -> Schedule:
    """The schedule named ``kind`` (one of :data:`SCHEDULES`); ``chunks`` only for
    ``interleaved_1f1b`` (the others take 1). Pure; raises ``ValueError`` for an unknown name
    or sizes the schedule cannot take (see each builder)."""
    validate(kind, ranks, microbatches, chunks)
    if kind == "interleaved_1f1b":
        return interleaved_1f1b(ranks, microbatches, chunks)
    builder = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb_h1": zb_h1}[kind]
    return builder(ranks, microbatches)
