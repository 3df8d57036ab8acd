"""Rule: ``make_tiny`` (``orchestr model make-tiny``) writes nothing into a folder another user
owns or may write to, force or not, and never writes through a link: a user who plants a
folder full of links where root will write a checkpoint gets a refusal, and the files the links
point at stay as they were."""

from __future__ import annotations

import os
import pathlib
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator

import pytest

import orchestr as oc
from orchestr.roles import models

from .conftest import ATTACKER_UID

TINY = {"layers": 1, "hidden": 32, "tokenizer": "digits", "max_positions": 64}


@pytest.fixture
def shared() -> Iterator[pathlib.Path]:
    """A folder any user may make things in (as ``/tmp`` is), outside pytest's private one."""
    if os.getuid() != 0:
        pytest.fail("the security suite plays another user against root: run as root")
    if shutil.which("setpriv") is None:
        pytest.fail("the security suite needs setpriv")
    path = pathlib.Path(tempfile.mkdtemp(prefix="orchestr-shared-"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def as_attacker(script: str) -> None:
    cmd = ["setpriv", f"--reuid={ATTACKER_UID}", f"--regid={ATTACKER_UID}", "--clear-groups"]
    done = subprocess.run([*cmd, "sh", "-c", script], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


@pytest.fixture
def precious(tmp_path: pathlib.Path) -> pathlib.Path:
    """A file of root's that only root may read or write."""
    path = tmp_path / "precious"
    path.write_text("root's precious file\n")
    path.chmod(0o600)
    return path


def unchanged(path: pathlib.Path) -> bool:
    st = path.lstat()
    return (
        path.read_text() == "root's precious file\n"
        and stat.S_IMODE(st.st_mode) == 0o600
        and st.st_uid == 0
    )


@pytest.mark.parametrize("force", [False, True])
def test_an_open_folder_of_links_another_user_made_is_refused(
    shared: pathlib.Path, precious: pathlib.Path, force: bool
) -> None:
    trap = shared / "tiny-llama"
    as_attacker(f"mkdir -m 0777 {trap} && ln -s {precious} {trap}/tokenizer.json")
    with pytest.raises(oc.ConfigError, match=f"owned by uid {ATTACKER_UID}, not by this user"):
        models.make_tiny("llama", trap, force=force, **TINY)
    assert unchanged(precious)
    assert [p.name for p in trap.iterdir()] == ["tokenizer.json"]


def test_a_closed_folder_another_user_owns_is_refused_with_force(
    shared: pathlib.Path, precious: pathlib.Path
) -> None:
    trap = shared / "tiny-llama"
    as_attacker(
        f"mkdir -m 0755 {trap} && ln -s {precious} {trap}/tokenizer.json "
        f"&& ln -s {precious} {trap}/config.json"
    )
    with pytest.raises(oc.ConfigError, match="use a folder of your own"):
        models.make_tiny("llama", trap, force=True, **TINY)
    assert unchanged(precious)
    assert sorted(p.name for p in trap.iterdir()) == ["config.json", "tokenizer.json"]


def test_a_folder_of_ours_another_user_may_write_to_is_refused(
    shared: pathlib.Path, precious: pathlib.Path
) -> None:
    folder = shared / "ours"
    folder.mkdir()
    folder.chmod(0o777)  # made by root, opened up: nobody can plant links in it
    as_attacker(f"ln -s {precious} {folder}/tokenizer.json")
    for force in (False, True):
        with pytest.raises(oc.ConfigError, match="writable by other users"):
            models.make_tiny("llama", folder, force=force, **TINY)
    assert unchanged(precious)


def test_a_link_another_user_put_where_the_folder_goes_is_refused(
    shared: pathlib.Path, precious: pathlib.Path
) -> None:
    ours = precious.parent / "ours"
    ours.mkdir(mode=0o755)
    (ours / "config.json").write_text("{}")
    trap = shared / "tiny-llama"
    as_attacker(f"ln -s {ours} {trap}")
    with pytest.raises(oc.ConfigError, match="is a symbolic link"):
        models.make_tiny("llama", trap, force=True, **TINY)
    assert (ours / "config.json").read_text() == "{}"
