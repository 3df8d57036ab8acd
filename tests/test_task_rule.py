"""Every background task has an owner: it is started on an :class:`asyncio.TaskGroup` or by an
:class:`orchestr.tasks.TaskOwner`, never by a bare ``create_task`` or ``ensure_future`` (whose
task nobody cancels, awaits or even holds). Checked over the syntax tree of the runtime, the
fabric, the roles, the CLI and the simulator.

A ``create_task`` is on a task group when its receiver is a name or attribute that the same
module binds to ``TaskGroup()`` (``async with asyncio.TaskGroup() as tg``, ``self._tg =
asyncio.TaskGroup()``) or annotates as one. The few exceptions are listed with their reasons;
an entry whose site is gone fails the test, so the list cannot go stale.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: The simulator moves from ``runtime/sim`` to ``sim``: whichever exists is scanned.
FOLDERS = ["runtime", "fabric", "roles", "cli", "sim"]
STARTERS = {"create_task", "ensure_future"}

#: (file, function) -> why a bare start stays there.
ALLOWED: dict[tuple[str, str], str] = {
    ("runtime/tasks.py", "TaskOwner.start"): "the owner itself",
}


def _task_groups(tree: ast.AST) -> set[str]:
    """The receivers (as source text) that ``tree`` binds to, or annotates as, a TaskGroup."""

    def is_group(node: ast.AST | None) -> bool:
        return node is not None and "TaskGroup" in ast.unparse(node)

    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.withitem) and node.optional_vars is not None:
            if isinstance(node.context_expr, ast.Call) and is_group(node.context_expr.func):
                found.add(ast.unparse(node.optional_vars))
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            if is_group(node.value.func):
                found.update(ast.unparse(t) for t in node.targets)
        elif isinstance(node, ast.AnnAssign) and is_group(node.annotation):
            found.add(ast.unparse(node.target))
        elif isinstance(node, ast.arg) and is_group(node.annotation):
            found.add(node.arg)
    return found


def bare_starts(source: str) -> list[tuple[int, str, str]]:
    """``(line, enclosing function, call)`` for each task ``source`` starts off a task group."""
    tree = ast.parse(source)
    groups = _task_groups(tree)
    out: list[tuple[int, str, str]] = []

    def visit(node: ast.AST, scope: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                inner = [*scope, child.name]
            if isinstance(child, ast.Call):
                func = child.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                on_group = isinstance(func, ast.Attribute) and ast.unparse(func.value) in groups
                if name in STARTERS and not (name == "create_task" and on_group):
                    out.append((child.lineno, ".".join(scope), ast.unparse(func)))
            visit(child, inner)

    visit(tree, [])
    return out


def _sites() -> dict[tuple[str, str], list[str]]:
    """Every bare start in the scanned folders, by (file, function): ``file:line: call``."""
    sites: dict[tuple[str, str], list[str]] = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            rel = path.relative_to(ROOT).as_posix()
            for line, scope, call in bare_starts(path.read_text()):
                sites.setdefault((rel, scope), []).append(f"{rel}:{line}: {call}")
    return sites


def test_every_task_is_started_on_a_task_group_or_an_owner() -> None:
    sites = _sites()
    bare = [where for key, found in sorted(sites.items()) if key not in ALLOWED for where in found]
    assert not bare, (
        "start these tasks on an asyncio.TaskGroup (one block's tasks) or an "
        "orchestr.tasks.TaskOwner (an object's):\n" + "\n".join(bare)
    )


def test_every_allowed_site_is_still_there() -> None:
    sites = _sites()
    gone = [f"{file} {scope}: {why}" for (file, scope), why in ALLOWED.items()]
    gone = [g for g, key in zip(gone, ALLOWED, strict=True) if key not in sites]
    assert not gone, "these allowed sites are gone; remove their entries:\n" + "\n".join(gone)


def test_the_rule_catches_what_it_forbids() -> None:
    source = """
import asyncio

async def bare(loop):
    asyncio.create_task(work())
    asyncio.ensure_future(work())
    loop.create_task(work())

async def grouped(tasks: asyncio.TaskGroup):
    async with asyncio.TaskGroup() as tg:
        tg.create_task(work())
    tasks.create_task(work())

class Holder:
    def __init__(self):
        self._tg = asyncio.TaskGroup()

    def go(self):
        self._tg.create_task(work())
        self._other.create_task(work())
"""
    found = [(line, scope) for line, scope, _ in bare_starts(source)]
    assert found == [(5, "bare"), (6, "bare"), (7, "bare"), (20, "Holder.go")]
