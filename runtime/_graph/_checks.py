"""The checks a graph's declarations make of their arguments: each raises
:class:`ConfigError` saying what is wrong."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from orchestr.errors import ConfigError

from ._channelstate import Staleness

if TYPE_CHECKING:
    from ._graph import GraphNode

__all__ = ["check_int", "check_name", "check_seconds", "check_staleness"]

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")


def check_name(name: Any, what: str) -> None:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(
            f"{what} name is 1-64 letters, digits, '_', '.' or '-', starting with a letter or "
            f"'_'; got {name!r}"
        )


def check_int(value: Any, what: str, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"{what} must be an integer >= {least}, got {value!r}")


def check_seconds(value: Any, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(f"{what} must be a positive number of seconds, got {value!r}")


def check_staleness(where: str, staleness: Any, source: GraphNode) -> None:
    if not isinstance(staleness, Staleness):
        raise ConfigError(
            f"{where}: staleness is an orchestr.Staleness(eta, policy), got {staleness!r}"
        )
    if staleness.policy == "requeue" and source.kind not in ("map", "fanout"):
        raise ConfigError(
            f"{where}: staleness policy 'requeue' sends a stale item back through the "
            f"stage that made it, but its input {source.name!r} is a {source.kind}; use "
            f"policy 'drop', or take the input straight from a map"
        )
