"""One exception tree: every error class orchestr defines derives from OrchestrError and is
drawn in ``orchestr.errors``' docstring, under the parent it has. Checked twice: over the
classes the modules hold once imported, and over every class statement in the source (nested
ones and those under ``if`` too), where a public exception class outside the tree fails with
its file and line. An internal signal is private (its name starts with ``_``) or listed in
``OUTSIDE`` with its reason."""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import re
from typing import NamedTuple

import orchestr.errors
from tests.test_import_rules import MODULES, ROOT

#: Public exception classes that stay outside the tree, by file and name, each with its reason.
OUTSIDE = {
    ("runtime/_graph/_items.py", "GraphCaptured"): (
        "not an error: a BaseException so that a job's `except Exception` does not swallow it, "
        "carrying a dry run's graph from Graph.run/compile (_graph.py) to capture_graph "
        "(_dry.py), which catches it"
    ),
}
#: Not errors: signals that must not be caught as one.
SIGNALS = {name for _, name in OUTSIDE}


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
        if name.startswith("_") and not issubclass(cls, orchestr.errors.OrchestrError):
            continue  # a private signal, caught in its own module
        assert issubclass(cls, orchestr.errors.OrchestrError), name
        assert name in drawn, f"{name} is not drawn in orchestr.errors"
        if name != "OrchestrError":
            parent = drawn[name]
            assert parent is not None and issubclass(cls, classes[parent]), (name, parent)
            direct = [b.__name__ for b in cls.__bases__]
            assert parent in direct, f"{name} is drawn under {parent}, derives from {direct}"
    assert set(drawn) <= set(classes), set(drawn) - set(classes)


class _Statement(NamedTuple):
    name: str
    where: str  # file:line
    path: str
    bases: list[str]


def _base_name(node: ast.expr) -> str:
    """The name a base is written with: ``OrchestrError`` for ``oc.OrchestrError``."""
    if isinstance(node, ast.Subscript):
        return _base_name(node.value)
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def _class_statements() -> dict[str, list[_Statement]]:
    """Every class statement of orchestr's source (not the generated protobuf), by name."""
    found: dict[str, list[_Statement]] = {}
    for name, (path, _) in MODULES.items():
        if not name.startswith("orchestr") or name.startswith("orchestr.protos"):
            continue
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.ClassDef):
                bases = [_base_name(b) for b in node.bases]
                statement = _Statement(node.name, f"{rel}:{node.lineno}", rel, bases)
                found.setdefault(node.name, []).append(statement)
    return found


_BUILTIN_EXCEPTIONS = {
    n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)
}


def _derives(
    base: str, classes: dict[str, list[_Statement]], goal: str, seen: frozenset[str]
) -> bool:
    """Whether a class named ``base`` is ``goal`` or derives from it, by name through the
    source's class statements. ``goal`` ``"BaseException"`` also accepts a builtin exception,
    and a base from another library whose name says it is one (``grpc.RpcError``)."""
    if base == goal:
        return True
    if goal == "BaseException" and base in _BUILTIN_EXCEPTIONS:
        return True
    if base not in classes:
        return goal == "BaseException" and re.search(r"(Error|Exception)$", base) is not None
    if base in seen:
        return False
    return any(_derives(b, classes, goal, seen | {base}) for s in classes[base] for b in s.bases)


def test_every_public_exception_class_in_the_source_is_in_the_tree() -> None:
    classes = _class_statements()
    drawn = _drawn()
    problems: list[str] = []
    allowed: set[tuple[str, str]] = set()
    for name, statements in classes.items():
        for s in statements:
            if not any(_derives(b, classes, "BaseException", frozenset()) for b in s.bases):
                continue
            in_tree = name == "OrchestrError" or any(
                _derives(b, classes, "OrchestrError", frozenset()) for b in s.bases
            )
            if (s.path, name) in OUTSIDE:
                allowed.add((s.path, name))
                if in_tree:
                    problems.append(f"{s.where}: {name} joined the tree; drop it from OUTSIDE")
            elif name.startswith("_"):
                continue  # a private signal, caught in its own module
            elif not in_tree:
                problems.append(
                    f"{s.where}: {name}({', '.join(s.bases)}) is public and not an "
                    f"OrchestrError: derive it from one (keeping its other bases), make it "
                    f"private, or list it in OUTSIDE with the reason"
                )
            elif name not in drawn:
                problems.append(f"{s.where}: {name} is not drawn in orchestr.errors")
    assert not problems, "\n".join(problems)
    assert allowed == set(OUTSIDE), f"OUTSIDE names classes that are gone: {set(OUTSIDE) - allowed}"
