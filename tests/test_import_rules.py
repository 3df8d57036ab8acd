"""The rules between packages, checked over the import graph of every module and test.

A module is public when no part of its name after ``orchestr`` starts with ``_``. The packages
are the runtime (``orchestr`` and its private subpackages), ``orchestr.fabric``,
``orchestr.roles``, ``orchestr.cli`` and ``orchestr.protos``.

- the runtime reaches the data plane only through ``orchestr.fabric`` and
  ``orchestr.fabric.lowlevel``, and the fabric manager through ``orchestr.fabric.optical``; it
  never imports the roles or the CLI, but for the simulator (``orchestr.sim``), which runs the
  roles' own sans-IO cores through their public names;
- the fabric imports nothing of the runtime but ``orchestr.errors`` and ``orchestr.clock``
  (the one seam for time, which the simulator points at virtual time);
- the roles use only public names of the runtime and of ``orchestr.fabric`` (not ``lowlevel``);
- the CLI is the runtime's own front end and may use its private modules, but only public
  names of the fabric and the roles;
- a test of a package (``tests/runtime``, ``tests/fabric``, ``tests/roles``, ``tests/cli``) uses
  public modules and its own package's private ones; ``tests/security`` plays an attacker and
  may reach anything; the shared helpers at the top of ``tests/`` use public modules only.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = {
    "runtime": "orchestr",
    "fabric": "orchestr.fabric",
    "roles": "orchestr.roles",
    "cli": "orchestr.cli",
    "protos": "orchestr.protos",
    "tests": "tests",
}


def _modules() -> dict[str, tuple[pathlib.Path, bool]]:
    found = {}
    for folder, name in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            parts = [*name.split("."), *path.relative_to(ROOT / folder).with_suffix("").parts]
            is_package = parts[-1] == "__init__"
            found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


MODULES = _modules()

#: The only crossings of the rules, each with its reason.
ALLOWED = {
    ("tests.roles.weight_actors", "orchestr._call._wire"): (
        "counts the call-path bytes one worker received, to show weights never ride it: no "
        "public counter is per process"
    ),
    ("tests.roles.common.test_weights", "orchestr._call._serde"): (
        "the encoded size of a WeightsRef, and a BackendSpec after the wire"
    ),
}


def _imports(module: str) -> list[tuple[str, int]]:
    """``(imported module, line)`` for every import in ``module``, at any depth; ``from P
    import name`` counts as importing ``P.name`` when that is a module."""
    path, is_package = MODULES[module]
    package = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                out.append((full if full in MODULES else base, node.lineno))
    return out


def _package(module: str) -> str:
    for name in ("orchestr.fabric", "orchestr.roles", "orchestr.cli", "orchestr.protos"):
        if module == name or module.startswith(name + "."):
            return name
    return "orchestr"


def _public(module: str) -> bool:
    return not any(part.startswith("_") for part in module.split(".")[1:])


def _broken(module: str, target: str) -> str | None:
    """Why ``module`` may not import ``target``, or None."""
    source, dest = _package(module), _package(target)
    if module.startswith("tests"):
        area = module.split(".")[1] if module.count(".") >= 2 else None
        if area == "security" or _public(target):
            return None
        own = {"runtime": "orchestr", "fabric": "orchestr.fabric", "roles": "orchestr.roles"}
        if own.get(area or "", f"orchestr.{area}") == dest:
            return None
        return "a test uses public modules and its own package's private ones"
    if source == dest:
        return None
    if source == "orchestr":
        if dest == "orchestr.fabric" and target in (
            "orchestr.fabric",
            "orchestr.fabric.lowlevel",
            "orchestr.fabric.optical",
        ):
            return None
        if dest == "orchestr.protos":
            return None
        if dest == "orchestr.roles" and module.startswith("orchestr.sim") and _public(target):
            return None
        return "the runtime reaches the fabric only through its public faces and lowlevel"
    if source == "orchestr.fabric":
        if target in ("orchestr.errors", "orchestr.clock"):
            return None
        return "the fabric imports only orchestr.errors and orchestr.clock"
    if source == "orchestr.roles":
        if _public(target) and target != "orchestr.fabric.lowlevel":
            return None
        return "the roles use only public names of the runtime and the fabric"
    if source == "orchestr.cli":
        return (
            None
            if dest in ("orchestr", "orchestr.protos") or _public(target)
            else ("the CLI uses only public names of the fabric and the roles")
        )
    return None if dest == "orchestr.protos" else "the generated protos import nothing else"


def test_the_rules_hold_over_the_import_graph() -> None:
    broken = [
        f"{MODULES[m][0].relative_to(ROOT)}:{line}: {m} imports {t}: {why}"
        for m in sorted(MODULES)
        for t, line in _imports(m)
        if t.startswith("orchestr") and (m, t) not in ALLOWED and (why := _broken(m, t))
    ]
    assert not broken, "\n".join(broken)


def test_the_rules_catch_what_they_forbid() -> None:
    assert _broken("orchestr.roles.rl._grpo", "orchestr._call._serde")
    assert _broken("orchestr.roles.rl._grpo", "orchestr.fabric.lowlevel")
    assert _broken("orchestr._call._bulk", "orchestr.fabric._buffers._segments")
    assert _broken("orchestr._job._context", "orchestr.roles")
    assert _broken("orchestr.fabric._registry", "orchestr._call._serde")
    assert _broken("tests.roles.common.test_weights", "orchestr._call._serde")
    assert _broken("tests.netns", "orchestr.fabric._optical._netns_kernel")
    assert _broken("orchestr.cli._main", "orchestr.roles._common._model")
    for fine in [
        ("orchestr._call._bulk", "orchestr.fabric.lowlevel"),
        ("orchestr.roles.rl._grpo", "orchestr.roles.generator._engine"),
        ("tests.fabric.buffers.test_segments", "orchestr.fabric._buffers._memfd"),
        ("tests.security.test_bind", "orchestr._cluster._head"),
        ("orchestr.cli._daemons", "orchestr._cluster._daemon"),
    ]:
        assert _broken(*fine) is None, fine
    # relative imports resolve: the roles package's own modules import each other so
    assert ("orchestr.roles.generator._actor", 6) in _imports("orchestr.roles.generator")
    # the simulator runs the roles' cores through their public names, never their insides
    assert _broken("orchestr.sim._generation", "orchestr.roles.generator") is None
    assert _broken("orchestr.sim._generation", "orchestr.roles.generator._scheduler")
    assert _broken("orchestr._job._context", "orchestr.sim") is None  # the runtime's own
    assert _broken("orchestr.fabric._optical._manager", "orchestr.clock") is None
    assert _broken("orchestr.fabric._optical._manager", "orchestr.config")


def test_no_module_is_over_400_lines() -> None:
    """A module that grows past 400 lines holds more than one concept: split it."""
    long = {
        str(path.relative_to(ROOT)): n
        for name, (path, _) in MODULES.items()
        if not name.startswith(("tests", "orchestr.protos"))
        and (n := len(path.read_text().splitlines())) > 400
    }
    assert not long, long
