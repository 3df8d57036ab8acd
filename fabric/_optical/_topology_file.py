"""Reading and writing cabling plans: plain data, TOML files, and YAML files with PyYAML.

Ports are written ``element:index`` (0-based); bandwidths are in Gbit/s. Plan file schema
(TOML; YAML with the same keys when PyYAML is installed)::

    version = 1                                 # optional; 1 is the only version

    [[switches]]
    name = "tor0"
    tier = "tor"                                # "tor" | "agg" | "core"
    ports = 8

    [[hosts]]
    name = "h0"
    accelerators = 8
    nics = [{ name = "nic0", gbps = 400, port = "tor0:0" }]   # at least one, on ToR ports

    [[links]]                                   # switch port <-> switch port
    a = "tor0:4"
    b = "agg0:0"
    gbps = 400

    [[ocs]]
    name = "ocs0"
    radix = 16                                  # ports 0..15
    latency = { switch_ms = 25, settle_ms = 100, control_ms = 500, concurrency = 0 }

    [[wires]]                                   # OCS port <-> ToR/agg uplink port
    ocs = "ocs0:0"
    port = "tor0:6"
    gbps = 400                                  # line rate of the uplink's transceiver

``latency`` and each of its keys are optional (defaults of :class:`~._topology.ReconfigLatency`).
:func:`to_toml` (and :meth:`~._topology.Topology.to_toml`) writes the same schema with one inline
table per line. Validation is the topology's own (:mod:`._topology_check`).
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ._elements import (
    Host,
    Link,
    Nic,
    OcsSwitch,
    OcsWire,
    PortRef,
    ReconfigLatency,
    Switch,
    TopologyError,
)
from ._topology import Topology

__all__ = ["dump_topology", "load_topology", "to_dict", "to_toml", "topology_from_dict"]


def to_dict(topology: Topology) -> dict[str, Any]:
    """The plan as plain data in the file schema; :func:`topology_from_dict` inverts it."""
    return {
        "version": 1,
        "switches": [{"name": s.name, "tier": s.tier, "ports": s.ports} for s in topology.switches],
        "hosts": [
            {
                "name": h.name,
                "accelerators": h.accelerators,
                "nics": [{"name": n.name, "gbps": n.gbps, "port": str(n.port)} for n in h.nics],
            }
            for h in topology.hosts
        ],
        "links": [{"a": str(k.a), "b": str(k.b), "gbps": k.gbps} for k in topology.links],
        "ocs": [
            {"name": o.name, "radix": o.radix, "latency": dataclasses.asdict(o.latency)}
            for o in topology.ocs
        ],
        "wires": [
            {"ocs": str(w.ocs_port), "port": str(w.switch_port), "gbps": w.gbps}
            for w in topology.wires
        ],
    }


def to_toml(topology: Topology) -> str:
    """The plan as TOML text, one inline table per element and line."""
    lines = ["# orchestr fabric cabling plan"]
    for key, value in to_dict(topology).items():
        if isinstance(value, list) and value:
            lines.append(f"{key} = [")
            lines.extend(f"  {_toml(item)}," for item in value)
            lines.append("]")
        else:
            lines.append(f"{key} = {_toml(value)}")
    return "\n".join(lines) + "\n"


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)  # finite (validated); repr round-trips and is valid TOML
    if isinstance(value, str):
        body = "".join(
            "\\" + c if c in '"\\' else f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c
            for c in value
        )
        return f'"{body}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        items = (
            f"{k if _BARE_KEY.fullmatch(k) else _toml(k)} = {_toml(v)}" for k, v in value.items()
        )
        return "{ " + ", ".join(items) + " }"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def _table(obj: object, where: str, required: set[str], optional: set[str]) -> Mapping[str, Any]:
    if not isinstance(obj, Mapping):
        raise TopologyError(f"{where} must be a table, not {type(obj).__name__}")
    for key in obj:
        if key not in required | optional:
            expected = ", ".join(sorted(required | optional))
            raise TopologyError(f"{where}: unknown key {key!r}; expected {expected}")
    missing = sorted(required - obj.keys())
    if missing:
        raise TopologyError(f"{where}: missing key {missing[0]!r}")
    return obj


def _array(table: Mapping[str, Any], key: str, where: str) -> list[Any]:
    value = table.get(key, [])
    if not isinstance(value, list | tuple):
        raise TopologyError(
            f"{where}: {key!r} must be an array of tables, not {type(value).__name__}"
        )
    return list(value)


def _port(value: object, where: str) -> PortRef:
    if not isinstance(value, str):
        raise TopologyError(f"{where}: port {value!r} must be a string 'element:index'")
    try:
        return PortRef.parse(value)
    except TopologyError as exc:
        raise TopologyError(f"{where}: {exc}") from None


def _label(table: Mapping[str, Any], kind: str, key: str, i: int) -> str:
    name = table.get("name")
    return f"{kind} {name} ({key}[{i}])" if isinstance(name, str) else f"{key}[{i}]"


def topology_from_dict(data: Mapping[str, Any]) -> Topology:
    """Build and validate a :class:`Topology` from plain data in the file schema.

    Raises :class:`TopologyError` naming the element at fault.
    """
    plan = _table(data, "plan", set(), {"version", "hosts", "switches", "links", "ocs", "wires"})
    version = plan.get("version", 1)
    if isinstance(version, bool) or version != 1:
        raise TopologyError(f"plan: version {version!r} is not supported; this reader knows 1")
    switches = []
    for i, t in enumerate(_array(plan, "switches", "plan")):
        t = _table(t, f"switches[{i}]", {"name", "tier", "ports"}, set())
        switches.append(Switch(t["name"], t["tier"], t["ports"]))
    hosts = []
    for i, t in enumerate(_array(plan, "hosts", "plan")):
        t = _table(t, f"hosts[{i}]", {"name", "accelerators"}, {"nics"})
        where = _label(t, "host", "hosts", i)
        nics = []
        for j, n in enumerate(_array(t, "nics", where)):
            n = _table(n, f"{where} nics[{j}]", {"name", "gbps", "port"}, set())
            nics.append(Nic(n["name"], n["gbps"], _port(n["port"], f"{where} nics[{j}]")))
        hosts.append(Host(t["name"], t["accelerators"], tuple(nics)))
    links = []
    for i, t in enumerate(_array(plan, "links", "plan")):
        t = _table(t, f"links[{i}]", {"a", "b", "gbps"}, set())
        where = f"links[{i}]"
        links.append(Link(_port(t["a"], where), _port(t["b"], where), t["gbps"]))
    ocs = []
    for i, t in enumerate(_array(plan, "ocs", "plan")):
        t = _table(t, f"ocs[{i}]", {"name", "radix"}, {"latency"})
        lat = _table(
            t.get("latency", {}),
            f"{_label(t, 'OCS', 'ocs', i)} latency",
            set(),
            {f.name for f in dataclasses.fields(ReconfigLatency)},
        )
        ocs.append(OcsSwitch(t["name"], t["radix"], ReconfigLatency(**lat)))
    wires = []
    for i, t in enumerate(_array(plan, "wires", "plan")):
        t = _table(t, f"wires[{i}]", {"ocs", "port", "gbps"}, set())
        where = f"wires[{i}]"
        wires.append(OcsWire(_port(t["ocs"], where), _port(t["port"], where), t["gbps"]))
    return Topology(tuple(hosts), tuple(switches), tuple(links), tuple(ocs), tuple(wires))


def _yaml(path: Path) -> Any:
    try:
        return importlib.import_module("yaml")
    except ImportError:
        raise TopologyError(
            f"{path}: YAML plans need PyYAML (pip install pyyaml); or write the plan as TOML"
        ) from None


def load_topology(path: str | Path) -> Topology:
    """Read and validate a plan file: ``.toml``, or ``.yaml``/``.yml`` with PyYAML installed.

    Blocks on file I/O. Raises :class:`TopologyError` for a bad plan or unreadable syntax and
    ``OSError`` when the file cannot be read.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".toml":
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            raise TopologyError(f"{path}: not valid TOML: {exc}") from exc
    elif suffix in (".yaml", ".yml"):
        yaml = _yaml(path)
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            raise TopologyError(f"{path}: not valid YAML: {exc}") from exc
        data = {} if data is None else data
    else:
        raise TopologyError(f"{path}: plan files end in .toml, .yaml or .yml")
    try:
        return topology_from_dict(data)
    except TopologyError as exc:
        raise TopologyError(f"{path}: {exc}", element=exc.element, port=exc.port) from None


def dump_topology(topology: Topology, path: str | Path) -> None:
    """Write ``topology`` to ``path`` as TOML (or YAML for ``.yaml``/``.yml`` with PyYAML).

    Blocks on file I/O; overwrites the file.
    """
    path = Path(path)
    if path.suffix.lower() in (".yaml", ".yml"):
        text = _yaml(path).safe_dump(to_dict(topology), sort_keys=False)
    else:
        text = to_toml(topology)
    path.write_text(text, encoding="utf-8")
