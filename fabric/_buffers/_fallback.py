"""Choosing the backend for one transfer, and the fallback policy: a fallback from the backend
a transfer should use is either an error or logged and counted, never silent."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import structlog

from orchestr.errors import ConfigError, DescriptorError, FallbackError, TransportUnavailableError
from orchestr.fabric import _local

from ._transport import BufferTransport, Counters, Descriptor, stats

__all__ = ["FALLBACKS", "PREFERENCE", "Fallback", "check_fallback", "choose", "natural"]

log = structlog.get_logger("orchestr.fabric")

Fallback = Literal["allow", "error"]
FALLBACKS = ("allow", "error")
#: Backends in the order a reader prefers them when the owner offers several.
PREFERENCE = ("inproc", "shm", "rdma", "nixl", "tcp")
_warned: set[tuple[str, str, str]] = set()


def natural(owner: str) -> str:
    """The backend a transfer with ``owner`` should use, judged by where it is."""
    if owner == _local.process_key():
        return "inproc"
    if _local.host_of(owner) == _local.host_id():
        return "shm"
    return "rdma"


def check_fallback(fallback: str) -> Fallback:
    if fallback not in FALLBACKS:
        raise ConfigError(f"fallback policy must be one of {FALLBACKS}, got {fallback!r}")
    return fallback  # type: ignore[return-value]


def choose(
    offered: dict[str, Descriptor],
    transports: Callable[[str], BufferTransport | None],
    *,
    want: str | None,
    fallback: Fallback,
) -> tuple[BufferTransport, Descriptor]:
    """Pick the backend for one transfer.

    ``want`` is the backend asked for (``None``: the natural one for where the owner is). If it
    cannot be used, the next usable backend in :data:`PREFERENCE` is a fallback: under
    ``"error"`` that raises :class:`FallbackError`; under ``"allow"`` it is logged (once per
    reason) and counted in :data:`stats`. Raises :class:`TransportUnavailableError` when no
    backend can reach the owner at all.
    """
    if not offered:
        raise DescriptorError("the buffer offers no transport")
    owner = next(iter(offered.values())).owner
    target = want or natural(owner)
    reasons: dict[str, str] = {}
    usable: list[tuple[BufferTransport, Descriptor]] = []
    for scheme in sorted(offered, key=lambda s: PREFERENCE.index(s) if s in PREFERENCE else 99):
        t = transports(scheme)
        why = "not installed in this process" if t is None else t.probe()
        if t is not None and why is None and not t.reaches(owner):
            why = f"cannot reach {owner} from {_local.process_key()}"
        if why is None and t is not None:
            usable.append((t, offered[scheme]))
        else:
            reasons[scheme] = why or "unusable"
    for t, d in usable:
        if t.scheme == target:
            return t, d
    if want is None and target == "rdma" and "rdma" not in offered:
        target = "tcp"  # the owner has no RDMA device: TCP is the natural path, not a fallback
        for t, d in usable:
            if t.scheme == "tcp":
                return t, d
    if not usable:
        detail = "; ".join(f"{s}: {r}" for s, r in reasons.items())
        raise TransportUnavailableError(f"no transport reaches the buffer of {owner} ({detail})")
    t, d = usable[0]
    why = reasons.get(target, "the owner did not offer it")
    if fallback == "error":
        raise FallbackError(
            f"{target} was wanted for the buffer of {owner} but cannot be used ({why}); "
            f"{t.scheme} would work, but the fallback policy is 'error' "
            f"(allow it with fallback='allow' or ORCHESTR_TRANSPORT_FALLBACK=allow)"
        )
    stats.setdefault(t.scheme, Counters()).fallbacks += 1
    if (target, t.scheme, why) not in _warned:
        _warned.add((target, t.scheme, why))
        log.warning("transport fallback", wanted=target, using=t.scheme, reason=why, owner=owner)
    return t, d
