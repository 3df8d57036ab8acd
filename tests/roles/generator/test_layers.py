"""The generator's folders stack up as ``docs/architecture.md`` draws them: the sans-IO core,
the torch runner, the engines, the KV movers, then the actor. A module imports only its own
folder and those below it, at import time or inside a function (an import under
``if TYPE_CHECKING:`` never runs, so it cannot load a higher layer); the core imports no torch
at all; and no two modules import each other."""

from __future__ import annotations

import ast
import pathlib

import orchestr.roles.generator as generator

ROOT = pathlib.Path(generator.__file__).parent
LAYERS = ["_core", "_runner", "_engines", "_kv", ""]  # "": the actor's modules at the top


def _layer(module: str) -> int:
    """The layer of ``module`` (dotted, relative to the generator package)."""
    first = module.split(".")[0]
    return LAYERS.index(first) if first in LAYERS[:-1] else len(LAYERS) - 1


def _imports(path: pathlib.Path) -> list[tuple[str, int]]:
    """The generator modules ``path`` imports outside ``if TYPE_CHECKING:``, and where."""
    package = path.parent.relative_to(ROOT).parts
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            for branch in node.orelse:
                visit(branch)
            return
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(package)[: len(package) - node.level + 1]
            target = ".".join([*base, *(node.module or "").split(".")]).strip(".")
            found.append((target, node.lineno))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            for name in names:
                prefix = "orchestr.roles.generator."
                if name and name.startswith(prefix):
                    found.append((name.removeprefix(prefix), node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(p for p in parts if p != "__init__")] = path
    return out


def test_each_folder_imports_only_its_own_layer_and_those_below() -> None:
    upward = []
    for module, path in _modules().items():
        for target, line in _imports(path):
            if _layer(target) > _layer(module):
                upward.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert upward == []


def test_the_core_imports_no_torch() -> None:
    for path in (ROOT / "_core").glob("*.py"):
        tree = ast.parse(path.read_text())
        runtime = [
            n
            for n in ast.walk(tree)
            if isinstance(n, (ast.Import, ast.ImportFrom)) and not _under_type_checking(tree, n)
        ]
        names = [a.name for n in runtime if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in runtime if isinstance(n, ast.ImportFrom)]
        assert not [n for n in names if n == "torch" or n.startswith("torch.")], path.name


def _under_type_checking(tree: ast.AST, target: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            if any(target is child for body in node.body for child in ast.walk(body)):
                return True
    return False


def test_no_two_modules_import_each_other() -> None:
    modules = _modules()
    edges = {
        (module, target)
        for module, path in modules.items()
        for target, _ in _imports(path)
        if target in modules and target != module
    }
    assert sorted((a, b) for a, b in edges if (b, a) in edges and a < b) == []
