"""Nothing in orchestr unpickles bytes: no pickle-family module is imported, and every
``torch.load`` passes ``weights_only=True`` (tensors and plain containers only)."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("runtime", "fabric", "roles", "sim", "cli")
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve"}


def _sources() -> list[pathlib.Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _problems(path: pathlib.Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module.split(".")[0]]
        line = getattr(node, "lineno", 0)
        found += [f"{path}:{line} imports {n}" for n in names if n in UNSAFE_MODULES]
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "load"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "torch"
        ):
            safe = any(
                k.arg == "weights_only"
                and isinstance(k.value, ast.Constant)
                and k.value.value is True
                for k in node.keywords
            )
            if not safe:
                found.append(f"{path}:{node.lineno} calls torch.load without weights_only=True")
    return found


def test_no_source_unpickles() -> None:
    sources = _sources()
    assert len(sources) > 50  # the scan sees the package
    assert [p for path in sources for p in _problems(path)] == []


def test_the_scan_catches_what_it_looks_for(tmp_path: pathlib.Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import pickle\nfrom cloudpickle import loads\nimport torch\ntorch.load('x')\n")
    assert len(_problems(bad)) == 3
