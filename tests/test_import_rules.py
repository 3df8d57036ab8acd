"""The rules between packages and the order of the layers, checked over the import graph of
every module and test.

A module is public when no part of its name after ``orchestr`` starts with ``_``. The packages
are the runtime (``orchestr`` and its private subpackages), ``orchestr.fabric``,
``orchestr.roles``, ``orchestr.sim``, ``orchestr.cli`` and ``orchestr.protos``.

- the runtime reaches the data plane only through ``orchestr.fabric`` and
  ``orchestr.fabric.lowlevel``, and the fabric manager through ``orchestr.fabric.optical``; it
  never imports the roles, the simulator or the CLI;
- the fabric imports nothing of the runtime but ``orchestr.errors``, ``orchestr.clock``
  (the one seam for time, which the simulator points at virtual time) and ``orchestr.tasks``
  (the owner of background tasks);
- the roles use only public names of the runtime and of ``orchestr.fabric`` (not ``lowlevel``);
- the simulator runs the runtime's own control code and the roles' sans-IO cores on virtual
  time: it may use the runtime's private modules, but only public names of the fabric and the
  roles;
- the CLI is the runtime's own front end and may use its private modules and the simulator's,
  but only public names of the fabric and the roles;
- a test of a package (``tests/runtime``, ``tests/fabric``, ``tests/roles``, ``tests/sim``,
  ``tests/cli``) uses public modules and its own package's private ones; ``tests/security``
  plays an attacker and may reach anything; the shared helpers at the top of ``tests/`` use
  public modules only.

The layers (drawn in ``docs/architecture.md``): the folders stack up as ``FOLDER_LAYERS`` and
the runtime's own modules as ``RUNTIME_LAYERS``; a module imports only its own layer and those
below, at import time or inside a function. An import under ``if TYPE_CHECKING:`` does not
count: it never runs, so it can neither close an import ring nor load a higher layer; it names
the type of a value that a higher layer hands down (the ``JobContext`` a worker joins
``torch.distributed`` with, the head's records that ``_control._convert`` turns into protobuf).

Two rules of shape ride along (``docs/architecture.md``, "Modules and classes"): a module past
400 lines names its one concept in ``LONG_MODULES``, and none passes 600; no class annotates an
attribute that neither it nor a base class it inherits sets (a mixin sharing another class's
state): compose a part instead.
"""

from __future__ import annotations

import ast
import pathlib
import textwrap
from typing import NamedTuple

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = {
    "runtime": "orchestr",
    "fabric": "orchestr.fabric",
    "roles": "orchestr.roles",
    "sim": "orchestr.sim",
    "cli": "orchestr.cli",
    "protos": "orchestr.protos",
    "tests": "tests",
}


class Import(NamedTuple):
    target: str
    line: int
    type_only: bool  # under ``if TYPE_CHECKING:``: read by the type checker, never run


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
    ("tests.sim.test_rl", "orchestr._job._events"): (
        "turns a simulated job's event log into its trace, as a real job's end does"
    ),
    ("orchestr", "orchestr.sim"): (
        "the face names oc.sim for the type checker only (if TYPE_CHECKING); at run time the "
        "attribute loads the subpackage on first use"
    ),
}


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and (
        (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
        or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")
    )


def _imports(module: str) -> list[Import]:
    """Every import in ``module``, at any depth (inside functions too); ``from P import name``
    counts as importing ``P.name`` when that is a module."""
    path, is_package = MODULES[module]
    package = module if is_package else module.rpartition(".")[0]
    out: list[Import] = []

    def visit(node: ast.AST, type_only: bool) -> None:
        if isinstance(node, ast.Import):
            out.extend(Import(a.name, node.lineno, type_only) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                out.append(Import(full if full in MODULES else base, node.lineno, type_only))
        elif isinstance(node, ast.If) and _type_checking(node):
            for statement in node.body:
                visit(statement, True)
            for statement in node.orelse:
                visit(statement, type_only)
        else:
            for child in ast.iter_child_nodes(node):
                visit(child, type_only)

    visit(ast.parse(path.read_text()), False)
    return out


def _package(module: str) -> str:
    for name in (
        "orchestr.fabric",
        "orchestr.roles",
        "orchestr.sim",
        "orchestr.cli",
        "orchestr.protos",
    ):
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
        own = {"runtime": "orchestr"}
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
        if dest == "orchestr.fabric":
            return "the runtime reaches the fabric only through its public faces and lowlevel"
        return "the runtime never imports the roles, the simulator or the CLI"
    if source == "orchestr.fabric":
        if target in ("orchestr.errors", "orchestr.clock", "orchestr.tasks"):
            return None
        return "the fabric imports only orchestr.errors, orchestr.clock and orchestr.tasks"
    if source == "orchestr.roles":
        if _public(target) and target != "orchestr.fabric.lowlevel":
            return None
        return "the roles use only public names of the runtime and the fabric"
    if source == "orchestr.sim":
        if dest == "orchestr" or (_public(target) and target != "orchestr.fabric.lowlevel"):
            return None
        return "the simulator uses only public names of the fabric and the roles"
    if source == "orchestr.cli":
        return (
            None
            if dest in ("orchestr", "orchestr.sim", "orchestr.protos") or _public(target)
            else ("the CLI uses only public names of the fabric and the roles")
        )
    return None if dest == "orchestr.protos" else "the generated protos import nothing else"


def test_the_rules_hold_over_the_import_graph() -> None:
    broken = [
        f"{MODULES[m][0].relative_to(ROOT)}:{line}: {m} imports {t}: {why}"
        for m in sorted(MODULES)
        for t, line, _ in _imports(m)
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
        ("orchestr.roles.rl._grpo", "orchestr.roles.generator._engines._recompute"),
        ("tests.fabric.buffers.test_segments", "orchestr.fabric._buffers._memfd"),
        ("tests.security.test_bind", "orchestr._cluster._head"),
        ("orchestr.cli._daemons", "orchestr._cluster._daemon"),
    ]:
        assert _broken(*fine) is None, fine
    # relative imports resolve: a subpackage's own modules import each other so
    assert "orchestr._cluster._head" in {t for t, _, _ in _imports("orchestr._cluster._daemon")}
    # the simulator runs the roles' cores through their public names, never their insides
    assert _broken("orchestr.sim._generation", "orchestr.roles.generator") is None
    assert _broken("orchestr.sim._generation", "orchestr.roles.generator._core._scheduler")
    assert _broken("orchestr.sim._cluster", "orchestr._cluster._headstate") is None
    assert _broken("orchestr._job._context", "orchestr.sim")  # the simulator sits above
    assert _broken("orchestr.cli._sim", "orchestr.sim._scenario") is None
    assert _broken("tests.sim.test_cpu", "orchestr.sim._cpu") is None
    assert _broken("tests.sim.test_cpu", "orchestr._call._serde")
    assert _broken("orchestr.fabric._optical._manager", "orchestr.clock") is None
    assert _broken("orchestr.fabric._streams._shmsetup", "orchestr.tasks") is None
    assert _broken("orchestr.fabric._optical._manager", "orchestr.config")


#: The modules past 400 lines, each with the one concept it holds. Most modules are 150-300
#: lines; one past 400 is let be when it holds one concept, named here, and none passes 600. An
#: entry for a module that is 400 lines or fewer again, or gone, fails: the list says what is
#: long now.
LONG_MODULES = {
    "cli/_daemons.py": "the daemons' commands: start (in the background or the foreground), "
    "stop and status of a host's head and nodes",
    "roles/_common/_weights.py": "versioned weight sync: the publisher and the loader (of a "
    "whole publisher's buckets, borrowed or read, or of a sharded one's parts)",
    "roles/generator/_actor.py": "the Generator actor: its endpoints over the engine and the "
    "parts it owns, and the engine loop",
    "roles/generator/_core/_scheduler.py": "the paged scheduler: continuous batching over the "
    "block pool, and blocks adopted from elsewhere into its prefix cache",
    "roles/generator/_engines/_paged.py": "the paged engine: the engine contract over a paged "
    "KV cache",
    "roles/trainer/_actor.py": "the Trainer actor: the policy, its optimizer and the endpoints "
    "over them, replicated or sharded",
    "roles/kvstore/_actor.py": "the KV store actor: the block index's I/O shell",
    "roles/serving/_router.py": "the KV-aware router's sans-IO core",
    "runtime/_cluster/_head.py": "the head service: the gRPC shell over the head's state, "
    "serving each RPC of the Head service",
    "runtime/_cluster/_headstate.py": "the head's state, sans-IO: nodes, actors, reservations "
    "and every transition of them",
    "runtime/_graph/_graph.py": "declaring a dataflow graph: its stages and edges",
    "sim/_cluster.py": "a cluster on virtual time and the job context real job code runs against",
    "sim/_scenario.py": "a scenario file: reading and checking it, and running it",
}

#: No module passes this many lines, named or not.
MAX_LINES = 600


def _lengths() -> dict[str, int]:
    """The lines of every module of the packages (not the tests, not the generated protos)."""
    return {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for name, (path, _) in MODULES.items()
        if not name.startswith(("tests", "orchestr.protos"))
    }


def test_a_long_module_names_its_one_concept() -> None:
    """Past 400 lines a module names its one concept in ``LONG_MODULES``; past 600 it holds
    more than one, and the second wants a module (a part the first composes) of its own."""
    lengths = _lengths()
    over = {p: n for p, n in lengths.items() if n > MAX_LINES}
    assert not over, f"modules past {MAX_LINES} lines: split out a concept: {over}"
    unnamed = {p: n for p, n in lengths.items() if n > 400 and p not in LONG_MODULES}
    assert not unnamed, f"name each one's one concept in LONG_MODULES: {unnamed}"
    stale = {p: lengths.get(p) for p in LONG_MODULES if lengths.get(p, 0) <= 400}
    assert not stale, f"no longer past 400 lines (or gone): drop from LONG_MODULES: {stale}"
    vague = [p for p, concept in LONG_MODULES.items() if not concept or "\n" in concept]
    assert not vague, f"one line each: {vague}"


#: The folders from the bottom up; each layer imports only its own and those below. The
#: runtime's error tree, its seam for time and its task owner sit under the fabric, which takes
#: nothing else of the runtime.
FOLDER_LAYERS = [
    ("orchestr.protos",),
    ("orchestr.errors", "orchestr.clock", "orchestr.tasks"),
    ("orchestr.fabric",),
    ("orchestr",),
    ("orchestr.roles",),
    ("orchestr.sim",),
    ("orchestr.cli",),
]

#: The runtime's own modules from the bottom up, by top-level module or private subpackage
#: (``""`` is the package's ``__init__``: the public face); a layer imports only its own and
#: those below. Written out, with what each layer owns, in docs/architecture.md.
RUNTIME_LAYERS = [
    ("errors", "clock", "tasks"),
    ("config", "metrics", "_log", "_loop", "_stats"),
    ("_actor",),
    ("_call",),
    ("_control",),
    ("_cluster",),
    ("_job",),
    ("_graph",),
    ("",),
]
RUNTIME = FOLDER_LAYERS.index(("orchestr",))


def _folder_layer(module: str) -> int:
    """Where ``module`` sits in ``FOLDER_LAYERS``: under the longest name that holds it."""
    holders = [
        (len(name), i)
        for i, layer in enumerate(FOLDER_LAYERS)
        for name in layer
        if module == name or module.startswith(name + ".")
    ]
    return max(holders)[1]


def _runtime_part(module: str) -> str | None:
    """The runtime's top-level module or subpackage that ``module`` belongs to (``""`` for the
    face), or None outside the runtime."""
    if module.split(".")[0] != "orchestr" or _package(module) != "orchestr":
        return None
    return module.split(".")[1] if "." in module else ""


def _runtime_layer(part: str) -> int:
    return next(i for i, layer in enumerate(RUNTIME_LAYERS) if part in layer)


def _climbs(module: str, target: str) -> str | None:
    """Why ``module`` may not import ``target`` (it sits in a lower layer), or None."""
    if module.split(".")[0] != "orchestr" or target.split(".")[0] != "orchestr":
        return None
    low, high = _folder_layer(module), _folder_layer(target)
    if high > low:
        return f"{FOLDER_LAYERS[low][0]} sits below {FOLDER_LAYERS[high][0]}"
    part, other = _runtime_part(module), _runtime_part(target)
    if part is None or other is None or _runtime_layer(other) <= _runtime_layer(part):
        return None
    return f"orchestr.{part or '__init__'} sits below orchestr.{other or '__init__'}"


def test_every_runtime_module_has_a_layer() -> None:
    """A new top-level module or subpackage of the runtime is placed in RUNTIME_LAYERS (and in
    docs/architecture.md) before it is used."""
    listed = {part for layer in RUNTIME_LAYERS for part in layer}
    parts = {_runtime_part(m) for m in MODULES}
    assert not parts - listed - {None}, parts - listed - {None}


def test_no_import_climbs_the_layers() -> None:
    """Every import that runs, at import time or inside a function (a lazy one), points down
    the layers or stays in its own."""
    climbs = [
        f"{MODULES[m][0].relative_to(ROOT)}:{line}: {m} imports {t}: {why}"
        for m in sorted(MODULES)
        for t, line, type_only in _imports(m)
        if not type_only and (why := _climbs(m, t))
    ]
    assert not climbs, "\n".join(climbs)


def test_the_layers_catch_a_climb() -> None:
    assert _climbs("orchestr._cluster._daemon", "orchestr._job._session")
    assert _climbs("orchestr._control._convert_stats", "orchestr._cluster._records")
    assert _climbs("orchestr._actor._host", "orchestr._call._wire")
    assert _climbs("orchestr.errors", "orchestr.config")
    assert _climbs("orchestr._graph._dry", "orchestr")  # the face is the top
    assert _climbs("orchestr._job._context", "orchestr.sim")
    assert _climbs("orchestr.roles.rl._grpo", "orchestr.sim")
    assert _climbs("orchestr.sim._run", "orchestr.cli._sim")
    assert _climbs("orchestr.fabric._registry", "orchestr.config")
    assert _climbs("orchestr.clock", "orchestr.fabric")
    for fine in [
        ("orchestr._job._session", "orchestr._cluster._head"),
        ("orchestr._actor._host", "orchestr._stats"),
        ("orchestr._control._convert_stats", "orchestr._stats"),
        ("orchestr._cluster._worker", "orchestr._call._wire"),
        ("orchestr._call._wire", "orchestr.fabric.lowlevel"),
        ("orchestr.fabric._registry", "orchestr.errors"),
        ("orchestr.sim._cluster", "orchestr._cluster._headstate"),
        ("orchestr.cli._sim", "orchestr.sim._scenario"),
        ("tests.sim.test_rl", "orchestr.cli"),
    ]:
        assert _climbs(*fine) is None, fine
    # a lazy import counts, and a type-only one is told apart
    host = _imports("orchestr._actor._host")
    assert any(t == "orchestr._stats" and not type_only for t, _, type_only in host)
    assert any(t == "orchestr._stats" and type_only for t, _, type_only in host)


#: Classes that declare attributes another class sets, each with its reason. An entry for a
#: class that no longer does (or is gone) fails.
UNSET_ALLOWED: dict[str, str] = {}

#: Bases whose subclasses' annotations are fields or the shape of a type, not attributes
#: declared for another class to set.
_FIELD_BASES = ("Protocol", "NamedTuple", "TypedDict")


class Unset(NamedTuple):
    where: str  # the module's path
    line: int
    cls: str
    attribute: str


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Subscript):
        return _dotted(node.value)
    if isinstance(node, ast.Call):
        return _dotted(node.func)
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return head and f"{head}.{node.attr}"
    return None


def _bound(target: ast.expr) -> list[ast.expr]:
    """What an assignment to ``target`` binds: names and attributes, through tuples (an item
    assigned into ``self.x[k]`` leaves ``self.x`` as it was)."""
    if isinstance(target, (ast.Tuple, ast.List)):
        return [b for t in target.elts for b in _bound(t)]
    if isinstance(target, ast.Starred):
        return _bound(target.value)
    return [target]


def _unset_attributes(sources: dict[str, tuple[str, bool, str]]) -> list[Unset]:
    """The attributes a class annotates in its body (``x: T``, no value) that neither it nor
    a base class it inherits assigns: through ``self.x =`` (or ``setattr(self, "x", ...)``) in
    any method, in the class body, or as a field of a dataclass, NamedTuple or TypedDict.
    Such a class counts on a sibling or a subclass to set them (a mixin sharing state).
    Protocols, dataclasses, NamedTuples and TypedDicts declare fields, which do not count. (A
    base that needs each subclass to name a constant says so with a property the subclass
    overrides.)

    ``sources``: module name -> (path, whether it is a package's ``__init__``, its text)."""
    trees = {m: ast.parse(text) for m, (_, _, text) in sources.items()}
    names: dict[str, dict[str, str]] = {}  # module -> local name -> the dotted name it binds
    classes: dict[str, tuple[str, ast.ClassDef]] = {}  # dotted name -> (module, class)
    for module, tree in trees.items():
        package = module if sources[module][1] else module.rpartition(".")[0]
        local = names[module] = {}
        for top in tree.body:
            if isinstance(top, ast.ClassDef):
                local[top.name] = f"{module}.{top.name}"
                classes[local[top.name]] = (module, top)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                for a in node.names:
                    local.setdefault(a.asname or a.name, f"{base}.{a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    local.setdefault(a.asname or a.name, a.name)

    def resolve(module: str, expr: ast.expr) -> str | None:
        dotted = _dotted(expr)
        if dotted is None:
            return None
        head, _, rest = dotted.partition(".")
        target = names[module].get(head, head) + (f".{rest}" if rest else "")
        for _ in range(10):  # through the packages that re-export it
            owner, _, name = target.rpartition(".")
            if target in classes or owner not in names or name not in names[owner]:
                break
            target = names[owner][name]
        return target

    def fields_only(module: str, node: ast.ClassDef) -> bool:
        bases = [_dotted(b) or "" for b in node.bases]
        decorators = [_dotted(d) or "" for d in node.decorator_list]
        return any(b.rpartition(".")[2] in _FIELD_BASES for b in bases) or any(
            d.rpartition(".")[2] == "dataclass" for d in decorators
        )

    def assigned(module: str, node: ast.ClassDef, seen: frozenset[str]) -> set[str]:
        out: set[str] = set()
        for statement in node.body:
            if isinstance(statement, ast.Assign):
                out.update(
                    n.id for t in statement.targets for n in _bound(t) if isinstance(n, ast.Name)
                )
            elif isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
                if statement.value is not None or fields_only(module, node):
                    out.add(statement.target.id)
        for n in ast.walk(node):
            targets: list[ast.expr] = []
            if isinstance(n, ast.Assign):
                targets = n.targets
            elif isinstance(n, ast.AnnAssign) and n.value is not None:
                targets = [n.target]
            elif (
                isinstance(n, ast.Call)
                and _dotted(n.func) in ("setattr", "object.__setattr__")
                and len(n.args) > 1
                and isinstance(n.args[0], ast.Name)
                and n.args[0].id == "self"
                and isinstance(n.args[1], ast.Constant)
            ):
                out.add(str(n.args[1].value))
            out.update(
                a.attr
                for t in targets
                for a in _bound(t)
                if isinstance(a, ast.Attribute)
                and isinstance(a.value, ast.Name)
                and a.value.id == "self"
            )
        for base in node.bases:
            target = resolve(module, base)
            if target in classes and target not in seen:
                out |= assigned(*classes[target], seen | {target})
        return out

    found = []
    for module, tree in trees.items():
        for cls in ast.walk(tree):
            if not isinstance(cls, ast.ClassDef) or fields_only(module, cls):
                continue
            declared = [
                s
                for s in cls.body
                if isinstance(s, ast.AnnAssign)
                and s.value is None
                and isinstance(s.target, ast.Name)
            ]
            if not declared:
                continue
            have = assigned(module, cls, frozenset())
            found += [
                Unset(sources[module][0], s.lineno, cls.name, s.target.id)
                for s in declared
                if isinstance(s.target, ast.Name) and s.target.id not in have
            ]
    return found


def test_no_class_declares_attributes_another_sets() -> None:
    """A class that needs state owns it, or is given it: no mixin annotates attributes that a
    sibling or a subclass sets (compose a part instead). Runtime, fabric, roles, simulator and
    CLI."""
    sources = {
        name: (str(path.relative_to(ROOT)), is_package, path.read_text())
        for name, (path, is_package) in MODULES.items()
        if not name.startswith(("tests", "orchestr.protos"))
    }
    unset = _unset_attributes(sources)
    broken = [
        f"{u.where}:{u.line}: {u.cls}.{u.attribute} is declared, and set by no method of "
        f"{u.cls} or of a base it inherits"
        for u in unset
        if f"{u.where}:{u.cls}" not in UNSET_ALLOWED
    ]
    assert not broken, "\n".join(broken)
    stale = set(UNSET_ALLOWED) - {f"{u.where}:{u.cls}" for u in unset}
    assert not stale, f"these declare nothing another class sets now: drop them: {stale}"


def test_the_attribute_rule_catches_a_mixin() -> None:
    base = "class Base:\n    def __init__(self) -> None:\n        self.pool = []\n"
    mixin = textwrap.dedent(
        """\
        import dataclasses
        from typing import Protocol
        from pkg import Base
        class Mixin:  # counts on a sibling for both
            pool: list[int]
            keys: tuple[int, ...]
            def take(self) -> int:
                return self.pool.pop()
        class Whole(Mixin, Base):  # its base sets pool; nobody sets keys
            keys: tuple[int, ...]
        class Sets(Base):
            pool: list[int]
        class Slot(Protocol):
            pool: list[int]
        @dataclasses.dataclass
        class Fields:
            pool: list[int]
        class More(Fields):
            pool: list[int]
        class Named:  # a constant each subclass names: a property, not an annotation
            @property
            def kind(self) -> str:
                raise NotImplementedError
        class Indexed:  # an item set into self.items leaves self.items unset
            items: list[int]
            def put(self) -> None:
                self.items[0] = 1
        """
    )
    sources = {
        "pkg": ("pkg/__init__.py", True, "from ._base import Base as Base\n"),
        "pkg._base": ("pkg/_base.py", False, base),
        "pkg._mixin": ("pkg/_mixin.py", False, mixin),
    }
    found = {(u.cls, u.attribute, u.line) for u in _unset_attributes(sources)}
    assert found == {
        ("Mixin", "pool", 5),
        ("Mixin", "keys", 6),
        ("Whole", "keys", 10),
        ("Indexed", "items", 25),
    }
