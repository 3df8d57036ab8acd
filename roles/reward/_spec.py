"""Reward functions named in a config: their specs, the check a config loader runs before any
process starts (:func:`check_functions`), and which of a row's fields each call receives.

A spec is a dict ``{"path": "package.module:function", "weight": 1.0, "name": ..., "args":
{...}}`` (``weight`` 1.0, ``name`` the function's own and ``args`` empty when left out). The
function is called as ``fn(prompt, completion, **kwargs)``: a function that names a
``completion`` parameter (and ``prompt``, if it wants it) gets them by those names, and one
that names neither takes them as its first two parameters (any names, positional). ``args``
are bound as keywords (``functools.partial``), and every other parameter it names is filled
from the row's field of that name; a ``**kwargs`` parameter takes all the fields. ``args`` win over a field of the same
name. No I/O here but importing the functions.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
from collections.abc import Mapping, Sequence, Set
from typing import Any

import msgpack

import orchestr as oc

__all__ = ["RESERVED", "FunctionSpec", "check_functions", "parse_specs", "resolve"]

#: What the row gives positionally: never the name of a field.
RESERVED = frozenset({"prompt", "completion"})

_KEYS = ("path", "weight", "name", "args")
_P = inspect.Parameter


@dataclasses.dataclass(frozen=True)
class FunctionSpec:
    """One reward function of a config, defaults filled in.

    ``fields``: the parameters a row's fields fill (in signature order), or None for a function
    with ``**kwargs``, which takes them all; ``by_name``: which of ``prompt`` and
    ``completion`` the function names as parameters, passed by keyword (empty: it takes them
    as its first two positional parameters, whatever their names); set by :func:`resolve`."""

    path: str
    weight: float
    name: str
    args: dict[str, Any]
    fields: tuple[str, ...] | None = None
    by_name: tuple[str, ...] = ()


def _fault(where: str, text: str) -> oc.ConfigError:
    return oc.ConfigError(f"{where}: {text}")


def parse_specs(specs: Sequence[Mapping[str, Any]]) -> list[FunctionSpec]:
    """The specs' shape checked and their defaults filled, nothing imported. Raises
    :class:`orchestr.ConfigError` naming the spec and what to change."""
    if isinstance(specs, str | bytes | Mapping) or not isinstance(specs, Sequence) or not specs:
        raise oc.ConfigError(
            "reward functions are a non-empty list of {'path': 'package.module:function', "
            f"'weight': 1.0}} dicts, got {specs!r}"
        )
    parsed: list[FunctionSpec] = []
    for i, spec in enumerate(specs):
        where = f"reward function {i}"
        if not isinstance(spec, Mapping):
            raise _fault(where, f"is a dict with keys {', '.join(_KEYS)}, got {spec!r}")
        unknown = sorted(set(spec) - set(_KEYS))
        if unknown:
            raise _fault(where, f"unknown keys {unknown} (a function has {', '.join(_KEYS)})")
        path = spec.get("path")
        if not isinstance(path, str) or ":" not in path:
            raise _fault(where, f"'path' is 'package.module:function', got {path!r}")
        where = f"reward function {path!r}"
        weight = spec.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise _fault(where, f"'weight' is a number, got {weight!r}")
        if not math.isfinite(weight):
            raise _fault(where, f"'weight' is a finite number, got {weight!r}")
        name = spec.get("name", path.rpartition(":")[2].rpartition(".")[2])
        if not isinstance(name, str) or not name:
            raise _fault(where, f"'name' is a non-empty string, got {name!r}")
        args = spec.get("args") or {}
        if not isinstance(args, Mapping) or not all(isinstance(k, str) for k in args):
            raise _fault(where, f"'args' is a dict of keyword arguments, got {args!r}")
        try:
            msgpack.packb(dict(args), use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as exc:
            raise _fault(where, f"'args' must be plain data (JSON-like): {exc}") from None
        if any(p.name == name for p in parsed):
            raise _fault(where, f"a second function is named {name!r}: give one a 'name'")
        parsed.append(FunctionSpec(path, float(weight), name, dict(args)))
    return parsed


def _import(path: str) -> Any:
    module_name, _, name = path.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _bind(
    fn: Any, spec: FunctionSpec, fields: Set[str] | None
) -> tuple[list[str], Any, tuple[str, ...]]:
    """``(problems, routed fields or None for all, by_name)`` of calling ``fn`` on rows with
    ``fields`` (None: not known, every parameter that is not an arg is taken to be a field).
    A function that names a ``prompt`` or ``completion`` parameter gets them by keyword
    (``def f(completion, answer)`` is not handed the prompt as its completion); one that names
    neither, as its first two positional parameters."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError) as exc:
        return [f"cannot read its signature ({exc}): define it with def"], None, ()
    problems = []
    positional = [p for p in params if p.kind in (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD)]
    by_name = tuple(
        name
        for name in ("prompt", "completion")
        if any(p.name == name and p.kind is not _P.POSITIONAL_ONLY for p in params)
    )
    if by_name:
        first_two = set(by_name)
        if "completion" not in by_name:
            problems.append(
                "names a 'prompt' parameter but no 'completion': a reward function is "
                "fn(prompt, completion, **fields), or names the ones it takes"
            )
    else:
        if len(positional) < 2 and not any(p.kind is _P.VAR_POSITIONAL for p in params):
            problems.append(
                "takes fewer than two positional parameters: a reward function is "
                "fn(prompt, completion, **fields)"
            )
        first_two = {p.name for p in positional[:2]}
    # by name, every positional-only parameter is one a row cannot fill; else past the two
    problems += [
        f"parameter {p.name!r} is positional-only: rows fill parameters by name"
        for p in positional[0 if by_name else 2 :]
        if p.kind is _P.POSITIONAL_ONLY and p.default is _P.empty
    ]
    named = [
        p
        for p in params
        if p.name not in first_two and p.kind in (_P.POSITIONAL_OR_KEYWORD, _P.KEYWORD_ONLY)
    ]
    takes_all = any(p.kind is _P.VAR_KEYWORD for p in params)
    names = {p.name for p in named}
    for key in spec.args:
        if key in first_two:
            problems.append(f"'args' sets {key!r}, which the row's prompt or completion fills")
        elif key not in names and not takes_all:
            problems.append(
                f"'args' sets {key!r}, which is not one of its parameters "
                f"({', '.join(sorted(names)) or 'none but prompt and completion'})"
            )
    routed = [p.name for p in named if p.name not in spec.args]
    if fields is not None:
        available = ", ".join(sorted(fields)) or "none"
        problems += [
            f"parameter {p.name!r} is neither a field of the dataset nor in its 'args'; the "
            f"dataset's fields are: {available} (rename it to one of them, give it a default, "
            f"or set it in 'args')"
            for p in named
            if p.name not in spec.args and p.name not in fields and p.default is _P.empty
        ]
    return problems, None if takes_all else tuple(routed), by_name


def _check_args(fn: Any, spec: FunctionSpec) -> list[str]:
    hook = getattr(fn, "reward_check", None)
    if not callable(hook):
        return []
    try:
        hook(dict(spec.args))
    except (ValueError, TypeError) as exc:
        return [f"'args' refused: {exc}"]
    return []


def _problems(
    specs: Sequence[Mapping[str, Any]], fields: Set[str] | None
) -> tuple[list[FunctionSpec], list[str]]:
    known = None if fields is None else set(fields) - RESERVED
    resolved, problems = [], []
    for spec in parse_specs(specs):
        where = f"reward function {spec.name!r} ({spec.path})"
        try:
            fn = _import(spec.path)
        except Exception as exc:  # the module's own code may raise anything on import
            problems.append(f"{where}: cannot import {spec.path!r}: {type(exc).__name__}: {exc}")
            continue
        if not callable(fn):
            problems.append(f"{where}: {spec.path!r} is not callable")
            continue
        found, routed, by_name = _bind(fn, spec, known)
        found += _check_args(fn, spec) if not found else []
        problems += [f"{where}: {p}" for p in found]
        resolved.append(dataclasses.replace(spec, fields=routed, by_name=by_name))
    return resolved, problems


def _raise(problems: list[str]) -> None:
    if problems:
        head = "a reward function cannot be used" if len(problems) == 1 else "reward functions"
        raise oc.ConfigError(f"{head}:\n- " + "\n- ".join(problems))


def check_functions(specs: Sequence[Mapping[str, Any]], fields: Set[str]) -> list[str]:
    """Check reward function specs against a dataset's fields before any process starts:
    each path imports, its signature takes ``(prompt, completion)`` and every other parameter
    it requires is one of ``fields`` (``prompt`` and ``completion`` excluded) or set in its
    ``args``, its ``args`` name its parameters, and its ``reward_check`` hook (a regex that
    compiles) accepts them. Returns the functions' names, the keys of ``score_rows``'
    ``per_function``, in order.

    Raises :class:`orchestr.ConfigError` with one message listing every problem, each naming
    the function, what is wrong and the fix (an import error names the path and the
    exception). Blocks on importing the functions' modules; idempotent."""
    resolved, problems = _problems(specs, fields)
    _raise(problems)
    return [spec.name for spec in resolved]


def resolve(specs: Sequence[Mapping[str, Any]]) -> list[FunctionSpec]:
    """The specs parsed, imported and checked as :func:`check_functions` does with the fields
    not known, each with the parameters a row's fields fill. Raises ``ConfigError``."""
    resolved, problems = _problems(specs, None)
    _raise(problems)
    return resolved
