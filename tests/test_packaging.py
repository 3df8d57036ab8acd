"""The distribution: a wheel maps the folders onto the orchestr package tree."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_wheel_installs_the_folders_as_the_orchestr_packages(tmp_path: pathlib.Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("orchestr-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in (
        "orchestr/__init__.py",
        "orchestr/py.typed",
        "orchestr/_cluster/_worker.py",
        "orchestr/fabric/__init__.py",
        "orchestr/fabric/_streams/_transport.py",
        "orchestr/fabric/_buffers/_handle.py",
        "orchestr/fabric/_optical/_manager.py",
        "orchestr/roles/__init__.py",
        "orchestr/sim/__init__.py",
        "orchestr/cli/__init__.py",
        "orchestr/protos/orchestr_pb2.py",
        "orchestr/protos/orchestr_pb2_grpc.py",
        "orchestr/protos/orchestr.proto",
    ):
        assert path in names, path
    assert not any(
        n.split("/")[0] in {"runtime", "fabric", "cli", "roles", "sim", "protos", "tests"}
        for n in names
    )
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "orchestr = orchestr.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_editable_install_resolves_to_the_folders() -> None:
    import orchestr
    import orchestr.fabric
    import orchestr.protos
    import orchestr.sim

    assert pathlib.Path(orchestr.__file__).parent == ROOT / "runtime"
    assert pathlib.Path(orchestr.fabric.__file__).parent == ROOT / "fabric"
    assert pathlib.Path(orchestr.protos.__file__).parent == ROOT / "protos"
    assert pathlib.Path(orchestr.sim.__file__).parent == ROOT / "sim"


def test_every_subpackage_is_in_the_wheel() -> None:
    """A new folder with an ``__init__.py`` must be listed in pyproject's ``packages`` too, or
    the editable install finds it and a wheel leaves it out."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = set()
    for name, folder in config["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            if "__pycache__" not in init.parts:
                rel = init.parent.relative_to(ROOT / folder).parts
                found.add(".".join((name, *rel)))
    assert found == listed
