"""RDMA device discovery through pyverbs: which devices and ports this host has, and why the
``rdma`` backend cannot run when it cannot.

pyverbs is imported on first use. Debian's ``python3-pyverbs`` lives outside any virtualenv; it
is loaded from there (that package alone, nothing else on that path) when it was built for this
interpreter.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
from typing import Any

from orchestr.errors import TransportUnavailableError

__all__ = ["discover", "load_pyverbs", "select_port", "submodule"]

DEVICE_ENV = "ORCHESTR_RDMA_DEVICE"
SYSTEM_DIR = "/usr/lib/python3/dist-packages"
NOT_INSTALLED = "pyverbs is not installed (apt install python3-pyverbs or pip install pyverbs)"
PORT_STATES = {1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
LINK_LAYERS = {0: "unspecified", 1: "InfiniBand", 2: "Ethernet"}
MTUS = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}

load_problem: str | None = None


def submodule(name: str) -> Any:
    """A pyverbs submodule (after :func:`load_pyverbs` found the package)."""
    return importlib.import_module(f"pyverbs.{name}")


def load_pyverbs() -> Any | None:
    """The pyverbs package, or ``None`` when this interpreter has none it can import."""
    global load_problem
    if "pyverbs" in sys.modules:
        return sys.modules["pyverbs"]
    try:
        return importlib.import_module("pyverbs")
    except ImportError:
        pass
    pkg = os.path.join(SYSTEM_DIR, "pyverbs")
    try:
        natives = [f for f in os.listdir(pkg) if f.endswith(".so")]
    except OSError:
        return None
    tagged = [s for s in importlib.machinery.EXTENSION_SUFFIXES if s != ".so"]
    if not natives or not all(any(f.endswith(s) for s in tagged) for f in natives):
        load_problem = (
            f"pyverbs at {pkg} was built for another Python than {sys.version.split()[0]}"
        )
        return None
    spec = importlib.machinery.PathFinder.find_spec("pyverbs", [SYSTEM_DIR])
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    sys.modules["pyverbs"] = module
    try:
        spec.loader.exec_module(module)
        submodule("device")
    except Exception as exc:
        for name in [n for n in sys.modules if n == "pyverbs" or n.startswith("pyverbs.")]:
            del sys.modules[name]
        load_problem = f"pyverbs at {pkg} does not import: {exc}"
        return None
    return module


def discover() -> dict[str, Any]:
    """What this host offers: ``{"pyverbs", "devices": [{name, node_guid, ports}], "error"}``."""
    out: dict[str, Any] = {"pyverbs": None, "devices": [], "error": None}
    pv = load_pyverbs()
    if pv is None:
        out["error"] = load_problem or NOT_INSTALLED
        return out
    out["pyverbs"] = getattr(pv, "__version__", None) or os.path.dirname(pv.__file__ or "")
    d = submodule("device")
    try:
        devices = d.get_device_list()
    except Exception as exc:
        out["error"] = str(exc)
        return out
    for dev in devices:
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        entry: dict[str, Any] = {"name": name, "node_guid": None, "ports": []}
        try:
            ctx = d.Context(name=name)
            try:
                attr = ctx.query_device()
                entry["node_guid"] = str(attr.node_guid)
                for port in range(1, attr.phys_port_cnt + 1):
                    pa = ctx.query_port(port)
                    entry["ports"].append(
                        {
                            "port": port,
                            "state": PORT_STATES.get(pa.state, str(pa.state)),
                            "link_layer": LINK_LAYERS.get(pa.link_layer, str(pa.link_layer)),
                            "active_mtu": MTUS.get(pa.active_mtu, 0),
                            "gid0": str(ctx.query_gid(port, 0)) if pa.gid_tbl_len else None,
                        }
                    )
            finally:
                ctx.close()
        except Exception as exc:
            entry["error"] = str(exc)
        out["devices"].append(entry)
    if not out["devices"]:
        out["error"] = "the device list is empty"
    return out


def select_port(info: dict[str, Any]) -> tuple[str, int]:
    """The ``(device, port)`` to use: the first ACTIVE port of ORCHESTR_RDMA_DEVICE (else of any
    device). Raises :class:`TransportUnavailableError` saying why there is none."""
    if info["pyverbs"] is None:
        raise TransportUnavailableError(info["error"] or NOT_INSTALLED)
    wanted = os.environ.get(DEVICE_ENV) or None
    if not info["devices"]:
        asked = f" ({DEVICE_ENV}={wanted} was asked for)" if wanted else ""
        raise TransportUnavailableError(f"pyverbs found but no RDMA device: {info['error']}{asked}")
    names = [dev["name"] for dev in info["devices"]]
    if wanted is not None and wanted not in names:
        raise TransportUnavailableError(
            f"{DEVICE_ENV}={wanted} names a device that is not here (devices: {', '.join(names)})"
        )
    for dev in info["devices"]:
        if wanted in (None, dev["name"]):
            for port in dev["ports"]:
                if port["state"] == "ACTIVE":
                    return dev["name"], port["port"]
    raise TransportUnavailableError(
        f"no RDMA port is ACTIVE (devices: {wanted or ', '.join(names)})"
    )
