"""One exception tree: every error class orchestr defines derives from OrchestrError and is
drawn in ``orchestr.errors``' docstring, under the parent it has."""

from __future__ import annotations

import importlib
import inspect
import re

import orchestr.errors
from tests.test_import_rules import MODULES

#: Not errors: signals that must not be caught as one.
# caught where raised, never seen by a caller (CallTimeout: a reward call's alarm, in the
# reward worker's child, a BaseException so that a function's `except Exception` lets it by)
SIGNALS = {"GraphCaptured", "_Failed", "_Gone", "CallTimeout"}


def _error_classes() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for name in MODULES:
        if (
            not name.startswith("orchestr")
            or name.startswith("orchestr.protos")
            or name.endswith("__main__")
        ):
            continue
        module = importlib.import_module(name)
        for obj in vars(module).values():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__.startswith("orchestr")
            ):
                found[obj.__name__] = obj
    return found


def _drawn() -> dict[str, str | None]:
    """Each class in the drawing with its parent (by indentation)."""
    tree = orchestr.errors.__doc__.split("::", 1)[1].split("\n\n")[1]
    parents: dict[str, str | None] = {}
    stack: list[tuple[int, str]] = []
    for line in tree.splitlines():
        m = re.match(r"^(\s*(?:[│ ]   )*(?:[├└]── )?)([A-Z]\w+Error)\b", line)
        if not m:
            continue
        depth = len(m.group(1))
        while stack and stack[-1][0] >= depth:
            stack.pop()
        parents[m.group(2)] = stack[-1][1] if stack else None
        stack.append((depth, m.group(2)))
    return parents


def test_every_error_is_an_orchestr_error_drawn_under_its_parent() -> None:
    classes = _error_classes()
    drawn = _drawn()
    assert len(classes) > 40
    for name, cls in classes.items():
        if name in SIGNALS:
            assert not issubclass(cls, orchestr.errors.OrchestrError), name
            continue
        assert issubclass(cls, orchestr.errors.OrchestrError), name
        assert name in drawn, f"{name} is not drawn in orchestr.errors"
        if name != "OrchestrError":
            parent = drawn[name]
            assert parent is not None and issubclass(cls, classes[parent]), (name, parent)
            direct = [b.__name__ for b in cls.__bases__]
            assert parent in direct, f"{name} is drawn under {parent}, derives from {direct}"
    assert set(drawn) <= set(classes), set(drawn) - set(classes)
