"""The attacker runs as ``nobody``: tests here play another local user against daemons that
run as root (how CI and most single-box installs run)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

ATTACKER_UID = 65534  # nobody
PYTHON = "/usr/bin/python3"  # the system's: the attacker cannot read root's interpreter


@pytest.fixture(scope="session")
def attacker_dir() -> Iterator[Path]:
    """A folder the attacker owns, holding its script."""
    if os.getuid() != 0:
        pytest.fail("the security suite plays another user against root's daemons: run as root")
    for tool in ("setpriv", PYTHON):
        if shutil.which(tool) is None:
            pytest.fail(f"the security suite needs {tool}")
    path = Path(tempfile.mkdtemp(prefix="orchestr-attacker-"))
    path.chmod(0o755)
    shutil.copy(Path(__file__).with_name("attacker.py"), path / "attacker.py")
    (path / "attacker.py").chmod(0o644)
    os.chown(path, ATTACKER_UID, ATTACKER_UID)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def attacker_command(attacker_dir: Path, mode: str, args: dict[str, Any]) -> list[str]:
    return [
        "setpriv",
        f"--reuid={ATTACKER_UID}",
        f"--regid={ATTACKER_UID}",
        "--clear-groups",
        PYTHON,
        "-I",
        str(attacker_dir / "attacker.py"),
        mode,
        json.dumps(args),
    ]


class Attacker:
    def __init__(self, folder: Path) -> None:
        self.folder = folder

    async def run(self, mode: str, **args: Any) -> dict[str, Any]:
        """Run one attack as ``nobody`` and return what it reports."""
        proc = await asyncio.create_subprocess_exec(
            *attacker_command(self.folder, mode, args),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=self.folder,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 0, err.decode()
        return json.loads(out.decode().splitlines()[-1])

    async def serving(self, port: int, seconds: float, **args: Any) -> asyncio.Task[dict[str, Any]]:
        """Start a fake server as ``nobody`` on ``port``; returns once it listens. Await the
        task for what it received."""
        proc = await asyncio.create_subprocess_exec(
            *attacker_command(self.folder, "serve", {"port": port, "seconds": seconds, **args}),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=self.folder,
        )
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        if line.strip() != b"listening":
            _, err = await proc.communicate()
            raise AssertionError(f"the fake server did not start: {line!r} {err.decode()}")

        async def finish() -> dict[str, Any]:
            out, err = await asyncio.wait_for(proc.communicate(), seconds + 30)
            assert proc.returncode == 0, err.decode()
            return json.loads(out.decode().splitlines()[-1])

        return asyncio.ensure_future(finish())


@pytest.fixture
async def attacker(attacker_dir: Path) -> AsyncIterator[Attacker]:
    yield Attacker(attacker_dir)
