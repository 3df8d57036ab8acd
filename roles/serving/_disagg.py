"""Prefill/decode disaggregation at the front door: which prompts are prefilled on a prefill
generator, and the handoff that lets the decode generator continue them.

A request whose prompt has at least ``min_tokens`` tokens goes first to a prefill generator,
chosen by the KV-aware router over the prefill pool (its own :class:`~._frontdoor.FrontDoor`
follows their block events and loads); that generator computes the prompt and holds its
blocks under a lease (:meth:`~orchestr.roles.Generator.prefill`), and the front door submits
the request to the decode generator with the handoff, which reads the blocks one-sided from
the prefill generator's memory (see :mod:`orchestr.roles.generator._kv._receive`). With
``overlap`` (the default) the handoff is granted as soon as the prompt is queued there and
the decode generator reads each layer's blocks as they are computed, so only the last of
them is left to read when the prefill ends (:mod:`orchestr.roles.generator._kv._streamed`); a
prefill generator that fails mid-prompt is then the decode side's to recompute. A shorter
prompt costs its decode generator less to compute than a handoff costs (a call, a read, a
lease), so it is prefilled there: the "conditional disaggregation" rule, with its threshold
in tokens. A prefill generator that fails is taken out of the prefill rotation and the
request is prefilled on its decode generator instead (counted), so a dead prefill side slows
requests down but never fails them.

A split pool has half the decode capacity of the same generators co-located, so a
decode-heavy load that two co-located generators carry can swamp one decode generator. With
``spill_at`` the front door spills: once every decode generator has ``spill_at`` requests
running or waiting (reported, plus those sent since its report), a request that would be
handed off is served whole (prefill and decode) on the least-busy prefill generator, if that
one has fewer requests than the least-busy decode generator. The prefill side then decodes
only the overflow beyond ``spill_at``, sharing it about evenly, and a prefill-heavy load,
whose decode side stays under ``spill_at``, is never spilled. Choose ``spill_at`` as a batch
a decode generator steps well within the TPOT SLO (``bench/disagg.py`` serves with 8: alone,
one of its decode generators held TPOT p50 at 19 ms with about 10 requests in flight, and
passed its 30 ms SLO at twice that load). With
every decode generator out of rotation the decode pool counts as full, so a spilling front
door serves long prompts whole on the prefill pool instead of refusing them.
"""

from __future__ import annotations

import contextlib
from typing import Any

import structlog

import orchestr as oc

from ..generator._core._types import Handoff, Request
from ._router import NoWorkerError

__all__ = ["Prefill", "should_spill"]

log = structlog.get_logger("orchestr.roles.serving")

#: Prompts shorter than this many tokens are prefilled on their decode generator.
MIN_TOKENS = 64


def should_spill(spill_at: int | None, decode_requests: int, prefill_requests: int) -> bool:
    """The spill rule (the module docstring): whether a request to be handed off is served
    whole on the prefill pool instead, its least-busy generators having ``decode_requests``
    and ``prefill_requests`` requests running or waiting (``spill_at`` ``None``: never).
    Pure, so the simulator runs the same rule."""
    return spill_at is not None and prefill_requests < decode_requests >= spill_at


class Prefill:
    """The prefill pool behind a front door: ``door``, a :class:`FrontDoor` over the prefill
    generators (for its readers and router). Prompts under ``min_tokens`` tokens stay on
    their decode generator; ``hold_s`` is each handoff's lease; ``overlap`` streams each
    handoff layer by layer; ``spill_at`` (``None``: never) is the decode pool's requests
    per generator beyond which requests are served whole on the prefill pool. Counts
    requests by path in :attr:`counts`. Raises ``ValueError`` for a bad threshold or
    ``hold_s``."""

    def __init__(
        self,
        door: Any,
        *,
        min_tokens: int = MIN_TOKENS,
        hold_s: float = 10.0,
        overlap: bool = True,
        spill_at: int | None = None,
    ) -> None:
        checked = {"min_tokens": min_tokens, **({} if spill_at is None else {"spill_at": spill_at})}
        for name, value in checked.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not hold_s > 0:
            raise ValueError(f"hold_s must be positive, got {hold_s!r}")
        self.door = door
        self.min_tokens = min_tokens
        self.hold_s = hold_s
        self.overlap = bool(overlap)
        self.spill_at = spill_at
        self.counts = dict.fromkeys(
            ("prefill_remote", "prefill_local", "prefill_fallback", "prefill_spilled"), 0
        )

    def spills(self, request: Request, decode_requests: int) -> bool:
        """Whether ``request`` is to be served whole on the prefill pool, the least-busy
        decode generator having ``decode_requests`` requests (counted when it is)."""
        if self.spill_at is None or len(request.prompt) < self.min_tokens:
            return False
        if not should_spill(self.spill_at, decode_requests, self.door.fewest_requests()):
            return False
        self.counts["prefill_spilled"] += 1
        return True

    async def handoff(self, request: Request) -> dict[str, Handoff] | None:
        """Prefill ``request`` on a prefill generator and return the decode side's
        ``kv_from``; ``None`` when it is to be prefilled on its decode generator (a short
        prompt, or no prefill generator could do it).

        Blocks on the prefill (with ``overlap``, until it is queued). Raises ``ValueError`` for a request the prefill generator
        refuses; cancel-safe (a lease granted meanwhile expires unread)."""
        if len(request.prompt) < self.min_tokens:
            self.counts["prefill_local"] += 1
            return None
        try:
            worker = self.door.route(request)
        except NoWorkerError:
            self.counts["prefill_fallback"] += 1
            return None
        member = self.door.member(worker)
        try:
            handoff = await member.prefill.call_one(
                request, hold_s=self.hold_s, stream=self.overlap
            )
        except oc.ActorError as exc:
            if exc.remote_type in ("ValueError", "TypeError"):
                raise ValueError(exc.remote_message) from None
            self.counts["prefill_fallback"] += 1  # its engine failed: the decode side can
            log.warning("prefill failed: prefilled on the decode side", error=repr(exc)[:200])
            return None
        except (oc.ActorDiedError, oc.CallError) as exc:
            self.door.lose(worker, exc)
            self.counts["prefill_fallback"] += 1
            log.warning("prefill failed: prefilled on the decode side", generator=worker)
            return None
        self.counts["prefill_remote"] += 1
        return {request.id: handoff.sent_from(member)}

    @staticmethod
    def release(kv_from: dict[str, Handoff] | None) -> None:
        """Let a handoff's lease go unread (the request never reached its decode side)."""
        for h in (kv_from or {}).values():
            if h.lease:
                with contextlib.suppress(Exception):
                    h.source.release_handoff.broadcast(h.lease)
