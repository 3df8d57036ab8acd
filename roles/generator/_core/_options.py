"""A :class:`~orchestr.roles.Generator`'s option groups, as frozen dataclasses: the paged
engine's KV cache (:class:`KVOptions`), how it hands KV over and reads it (:class:`HandoffOptions`),
expert hosts (:class:`ExpertOptions`) and attention servers (:class:`AttentionOptions`).

Each is registered, pinned to ``orchestr.roles`` on the wire, so a spawn's arguments (which the
head keeps to restart an actor) name it by a stable name. A dict of a group's fields is still
accepted in its place (:func:`as_options`), as configs and older callers give it; an unknown
field is a :class:`~orchestr.ConfigError` that names the known ones.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any, TypeVar

import orchestr as oc
from orchestr import register

__all__ = [
    "HANDOFF_FAILURES",
    "KV_READS",
    "AttentionOptions",
    "ExpertOptions",
    "HandoffOptions",
    "KVOptions",
    "as_options",
    "legacy_options",
]

#: What a failed handoff read does: compute the prompt here, or refuse the request.
HANDOFF_FAILURES = ("recompute", "fail")
#: How a decode generator reads a handoff: ``"direct"``, copied in place from the prefill
#: generator's pool where it can be borrowed (on its host), else staged; ``"staged"``, always
#: read into a copy first (streamed layer by layer when the prefill streams) and entered
#: between steps.
KV_READS = ("direct", "staged")

Opts = TypeVar("Opts")


@register
@dataclasses.dataclass(frozen=True)
class KVOptions:
    """The paged engine's KV cache and batching (``Generator(kv=...)``, a checkpoint's
    ``engine="paged"``): ``num_blocks`` blocks of ``block_size`` tokens, at most
    ``token_budget`` tokens a step, what new weights do to requests in flight
    (``on_new_weights``: ``"keep"`` or ``"recompute"``), weights ``packed`` for the CPU
    (``None``: wherever they can be), how decodes attend (``attention``: ``"auto"``,
    ``"kernel"`` or ``"torch"``) and ``micro_batches`` a step. The defaults are
    :class:`~orchestr.roles.PagedEngine`'s."""

    __module__ = "orchestr.roles"  # its name on the wire and in the head's store (pinned)

    num_blocks: int = 512
    block_size: int = 16
    token_budget: int = 512
    on_new_weights: str = "keep"
    packed: bool | None = None
    attention: str = "auto"
    micro_batches: int = 1


@register
@dataclasses.dataclass(frozen=True)
class HandoffOptions:
    """How a generator takes prompts' KV handed over from a prefill generator: a read that
    fails (or finds its lease expired) ``on_failure`` (:data:`HANDOFF_FAILURES`: compute the
    prompt here, or refuse the request with :class:`~orchestr.roles.HandoffError`), and how it
    ``read``\\ s (:data:`KV_READS`)."""

    __module__ = "orchestr.roles"  # its name on the wire and in the head's store (pinned)

    on_failure: str = "recompute"
    read: str = "direct"

    def __post_init__(self) -> None:
        if self.on_failure not in HANDOFF_FAILURES:
            raise oc.ConfigError(
                f"handoff on_failure is one of {', '.join(HANDOFF_FAILURES)}, "
                f"got {self.on_failure!r}"
            )
        if self.read not in KV_READS:
            raise oc.ConfigError(f"handoff read is one of {', '.join(KV_READS)}, got {self.read!r}")


@register
@dataclasses.dataclass(frozen=True)
class ExpertOptions:
    """Routed experts run on ``hosts`` (an :class:`~orchestr.roles.ExpertHost` mesh; a paged
    engine's MoE checkpoint, or a dense one's MLPs in ``ffn_shards`` slices): what a lost host
    does (``on_lost``: ``"fail"`` or ``"wait"`` up to ``wait_s``, polling every ``poll_s``), the
    calls in flight a layer (``window``) and ``router_bias`` (one value per expert, added to
    the routers' logits). See :func:`~orchestr.roles.experts.attach_experts`."""

    __module__ = "orchestr.roles"  # its name on the wire and in the head's store (pinned)

    hosts: Any
    on_lost: str = "fail"
    wait_s: float = 30.0
    poll_s: float = 0.2
    window: int = 64
    router_bias: Sequence[float] | None = None
    ffn_shards: int | None = None


@register
@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """The core attention of decodes of ``min_tokens`` or more goes to ``servers`` (an
    :class:`~orchestr.roles.AttentionServer` mesh; the paged kernel only)."""

    __module__ = "orchestr.roles"  # its name on the wire and in the head's store (pinned)

    servers: Any
    min_tokens: int = 1024


def as_options(cls: type[Opts], value: Opts | dict[str, Any] | None, what: str) -> Opts | None:
    """``value`` as a ``cls``: one already, a dict of its fields, or ``None``. Raises
    :class:`~orchestr.ConfigError` for another type or a field ``cls`` lacks (``what``: the
    keyword, for the message)."""
    if value is None or isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise oc.ConfigError(f"{what} is a {cls.__name__} or a dict of its fields, got {value!r}")
    known = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise oc.ConfigError(f"unknown {what} option(s) {unknown}; known: {known}")
    try:
        return cls(**value)
    except TypeError as exc:  # a field without a default left out
        raise oc.ConfigError(f"{what}: {exc}") from None


#: The keywords the option groups replaced, still read for one release: the group and the
#: field each gives (``None``: a dict of the group's other fields).
_DEPRECATED = {
    "on_handoff_failure": ("handoff", "on_failure"),
    "kv_read": ("handoff", "read"),
    "expert_hosts": ("experts", "hosts"),
    "expert_options": ("experts", None),
    "attention_servers": ("attention", "servers"),
    "attention_options": ("attention", None),
}

Group = Any  # an option group, a dict of its fields, or None


def legacy_options(
    deprecated: dict[str, Any], handoff: Group, experts: Group, attention: Group
) -> tuple[Group, Group, Group]:
    """``handoff``, ``experts`` and ``attention`` with the ``deprecated`` keywords folded in as
    dicts (a ``DeprecationWarning`` names them). Raises ``TypeError`` for a keyword that is
    none of them, as a call would, and :class:`~orchestr.ConfigError` for a group given both
    ways."""
    unknown = sorted(set(deprecated) - set(_DEPRECATED))
    if unknown:
        raise TypeError(f"Generator() got an unexpected keyword argument {unknown[0]!r}")
    given = {k: v for k, v in deprecated.items() if v is not None}
    groups = {"handoff": handoff, "experts": experts, "attention": attention}
    folded: dict[str, dict[str, Any]] = {}
    for key, value in given.items():
        group, field = _DEPRECATED[key]
        if groups[group] is not None:
            raise oc.ConfigError(f"give {group}= or {key}=, not both")
        if field is None and not isinstance(value, dict):
            raise oc.ConfigError(f"{key} is a dict of options, got {value!r}")
        folded.setdefault(group, {}).update(value if field is None else {field: value})
    if given:
        warnings.warn(
            f"Generator({', '.join(f'{k}=' for k in given)}) is deprecated: give "
            f"{', '.join(f'{g}=' for g in folded)} (HandoffOptions, ExpertOptions, "
            f"AttentionOptions, or dicts of their fields)",
            DeprecationWarning,
            stacklevel=3,
        )
    return tuple(folded.get(g, groups[g]) for g in ("handoff", "experts", "attention"))  # type: ignore[return-value]
