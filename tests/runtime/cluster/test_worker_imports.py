"""What a worker process imports: a node starts one per actor, so a module it loads for nothing
slows every spawn. These pin which modules stay out, not a time (that is ``bench/``'s job)."""

from __future__ import annotations

import subprocess
import sys

from orchestr._call import _registry, _serde
from orchestr._call._mesh import EXT_MESH, Member, Mesh


def run_fresh(code: str) -> list[str]:
    """Run ``code`` in a new interpreter; its stdout lines."""
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60
    )
    return out.stdout.split()


def test_a_worker_loads_neither_the_driver_nor_torch() -> None:
    loaded = set(run_fresh("import sys, orchestr._cluster._worker; print(*sys.modules)"))
    assert "orchestr._call._server" in loaded
    unwanted = {
        "torch",
        "numpy",
        "importlib.metadata",
        "orchestr._job._context",
        "orchestr._cluster._head",
        "orchestr._cluster._node",
        "orchestr._graph._graph",
        "orchestr._graph._run",
        "orchestr._job._supervise",
    }
    assert not loaded & unwanted


def test_import_orchestr_loads_the_rest_on_first_use() -> None:
    code = (
        "import sys, orchestr; print('driver' if 'orchestr._job._context' in sys.modules else 'lazy'); "
        "print(orchestr.run.__module__, orchestr.fabric.__name__, 'run' in dir(orchestr))"
    )
    assert run_fresh(code) == ["lazy", "orchestr._job._session", "orchestr.fabric", "True"]


def test_extension_types_travel_before_their_module_is_imported() -> None:
    # A Mesh and a Buffer register their wire form when their modules load; a fresh process
    # that has imported neither still rebuilds the one and sends the other.
    assert _registry._REGISTERED_BY[EXT_MESH] == "orchestr._call._mesh"
    mesh = Mesh("m-1", "counters", "pkg.mod:Counter", [Member("a-1", "tcp://h:1", 0)], ["add"])
    msg, _ = _serde.encode(mesh)
    code = (
        "import sys; from orchestr._call import _serde; from orchestr.fabric import Buffer\n"
        "assert 'orchestr._call._mesh' not in sys.modules and 'orchestr._call._bulk' not in sys.modules\n"
        f"mesh = _serde.decode(bytes.fromhex({msg.hex()!r}))\n"
        "print(type(mesh).__name__, mesh.name, mesh.endpoints[0])\n"
        "with Buffer(bytearray(64)) as buf:\n"
        "    print(type(_serde.decode(_serde.encode(buf)[0])).__name__)\n"
    )
    assert run_fresh(code) == ["Mesh", "counters", "add", "Buffer"]
