"""The kernels' build cache against another local user and against builds that were killed.

Rule: a library is loaded only from a folder no one else can have put it in. The build
folder and the library are this user's and writable by no one else, and so is every folder
above them (root's too, and open to all only with the sticky bit, as /tmp). Anything else
leaves the paged runner on torch's ops, with the reason in ``kernel_status()``. A build lock
whose holder is alive is waited on until a deadline; one whose holder died is not waited on.

Each test plants a library whose constructor writes a marker file, and runs the kernels'
lookup in a fresh interpreter, so a library loaded by mistake shows as the marker (and the
real kernels loaded by other tests cannot stand in for the planted one). The attacker's
steps run as ``nobody`` through ``setpriv``, since CI runs as root. No test builds the real
kernels: each leaves the lookup on a path that refuses, times out, or fails before the
compiler runs.
"""

from __future__ import annotations

import ast
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest

from orchestr.roles.generator._runner._kernels import (
    LOCK_FILE,
    TORCH_LOCK_FILE,
    _claim,
    _name_and_flags,
)

NOBODY = 65534
MARKER_ENV = "ORCHESTR_TEST_MARKER"
PLANTED_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

__attribute__((constructor)) static void planted(void) {
    const char *path = getenv("ORCHESTR_TEST_MARKER");
    FILE *f = path ? fopen(path, "w") : NULL;
    if (f) {
        fprintf(f, "loaded in pid %d uid %d\n", (int)getpid(), (int)getuid());
        fclose(f);
    }
}
"""
CHILD = """
import sys
from orchestr.roles.generator._runner import _kernels
_kernels.LOCK_WAIT_S = float(sys.argv[1])
print(repr(_kernels.kernel_status()))
"""

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="plays another user (nobody) through setpriv: run as root",
)


@pytest.fixture(scope="module")
def planted_library(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A shared library with no ops, whose constructor writes ``$ORCHESTR_TEST_MARKER``."""
    cc = shutil.which("cc")
    if cc is None:
        pytest.fail("the kernel cache's attacker tests need a C compiler (cc) to plant a library")
    folder = tmp_path_factory.mktemp("planted")
    (folder / "planted.c").write_text(PLANTED_C)
    subprocess.run(
        [cc, "-shared", "-fPIC", "-o", str(folder / "planted.so"), str(folder / "planted.c")],
        check=True,
        timeout=60,
    )
    return (folder / "planted.so").read_bytes()


@pytest.fixture
def shared_root() -> Iterator[pathlib.Path]:
    """A build root every user may write to, with the sticky bit, as /tmp is."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="orchestr-shared-extensions-"))
    try:
        path.chmod(0o1777)
        yield path
    finally:
        shutil.rmtree(path)


def folder_name() -> str:
    # the same torch and environment as the child's: the folder it will look in
    return _name_and_flags()[0]


def private(path: pathlib.Path) -> pathlib.Path:
    path.mkdir()
    path.chmod(0o700)
    return path


def plant(folder: pathlib.Path, library: bytes, mode: int = 0o755) -> pathlib.Path:
    """The library, in ``folder`` (made with mode 0755 when missing), where a build puts it."""
    if not folder.exists():
        folder.mkdir()
        folder.chmod(0o755)
    path = folder / f"{folder.name}.so"
    path.write_bytes(library)
    path.chmod(mode)
    return path


def status_in_child(
    root: pathlib.Path, marker: pathlib.Path, wait_s: float = 20.0, path: str | None = None
) -> str | None:
    """``kernel_status()`` in a fresh interpreter building under ``root``."""
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(root), **{MARKER_ENV: str(marker)})
    env.pop("ORCHESTR_KERNELS", None)
    if path is not None:
        env["PATH"] = path
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(wait_s)],
        env=env,
        capture_output=True,
        text=True,
        timeout=45,
    )
    assert done.returncode == 0, done.stderr
    status = ast.literal_eval(done.stdout.splitlines()[-1])
    assert status is None or isinstance(status, str)
    return status


def as_nobody(script: str, *args: str, stdin: bytes = b"") -> None:
    """Run ``sh -c script`` as ``nobody``, with ``args`` as ``$1``, ``$2``..."""
    drop = ["setpriv", f"--reuid={NOBODY}", "--regid=nogroup", "--clear-groups"]
    shell = ["sh", "-c", f"umask 022; {script}", "sh", *args]
    subprocess.run([*drop, *shell], input=stdin, check=True, capture_output=True, timeout=30)


@needs_root
@pytest.mark.parametrize("planted_as", ["folder", "link"])
def test_a_folder_another_user_made_in_a_shared_root_is_not_loaded_from(
    shared_root: pathlib.Path,
    planted_library: bytes,
    tmp_path: pathlib.Path,
    planted_as: str,
) -> None:
    # nobody predicts the folder's name (every input to it is public) and puts a library
    # there before this user's first build: as the folder itself, or as a link to its own
    name, marker = folder_name(), tmp_path / "marker"
    target = name if planted_as == "folder" else "decoy"
    as_nobody(
        'mkdir "$1/$2" && cat > "$1/$2/$3.so"',
        str(shared_root),
        target,
        name,
        stdin=planted_library,
    )
    if planted_as == "link":
        as_nobody('ln -s decoy "$1/$2"', str(shared_root), name)
    assert (shared_root / name / f"{name}.so").is_file()  # as a build would have left it
    status = status_in_child(shared_root, marker)
    assert not marker.exists(), marker.read_text()
    assert status is not None and str(shared_root / name) in status
    if planted_as == "folder":
        assert f"owned by uid {NOBODY}" in status
    else:
        assert "not a folder (a link" in status


@pytest.mark.parametrize(
    ("where", "mode", "says"),
    [
        ("root", 0o777, "writable by other users"),
        ("root", 0o775, "writable by other users"),  # a group is other users too
        ("above", 0o777, "writable by other users"),  # any folder on the way, not just the root
        ("folder", 0o1777, "writable by other users"),  # the sticky bit only helps above it
        ("folder", 0o775, "writable by other users"),
    ],
)
def test_a_build_folder_others_can_write_to_is_not_loaded_from(
    tmp_path: pathlib.Path, planted_library: bytes, where: str, mode: int, says: str
) -> None:
    above = tmp_path / "above"
    root = above / "extensions"
    folder = root / folder_name()
    private(above)
    private(root)
    plant(folder, planted_library)
    opened = {"above": above, "root": root, "folder": folder}[where]
    opened.chmod(mode)
    marker = tmp_path / "marker"
    status = status_in_child(root, marker)
    assert not marker.exists(), marker.read_text()
    assert status is not None and f"{opened} is {says}" in status
    assert "TORCH_EXTENSIONS_DIR" in status  # what to do about it


def test_new_folders_in_a_shared_root_are_made_private(shared_root: pathlib.Path) -> None:
    folder = shared_root / "extensions" / folder_name()
    # /tmp-like: others cannot remove or rename what is ours there
    assert _claim(folder) is None
    for path in (folder.parent, folder):
        st = path.lstat()
        assert st.st_uid == os.geteuid() and st.st_mode & 0o7777 == 0o700, path
    assert _claim(folder) is None  # and used again


@pytest.mark.parametrize("how", ["owner", "mode", "link"])
def test_a_library_that_is_not_ours_alone_is_not_loaded(
    tmp_path: pathlib.Path, planted_library: bytes, how: str
) -> None:
    root = private(tmp_path / "extensions")
    folder = root / folder_name()
    if how == "owner":
        if os.geteuid() != 0:
            pytest.fail("this test gives a file to another user: run as root (as CI does)")
        library = plant(folder, planted_library)
        os.chown(library, NOBODY, NOBODY)
        says = f"owned by uid {NOBODY}"
    elif how == "mode":
        plant(folder, planted_library, mode=0o757)
        says = "writable by other users"
    else:
        elsewhere = plant(tmp_path / folder.name, planted_library)
        private(folder)
        (folder / elsewhere.name).symlink_to(elsewhere)
        says = "not a regular file (a link"
    marker = tmp_path / "marker"
    status = status_in_child(root, marker)
    assert not marker.exists(), marker.read_text()
    assert status is not None and f"{folder / folder.name}.so is {says}" in status


def test_a_library_without_the_ops_leaves_torchs_ops_in_use(
    tmp_path: pathlib.Path, planted_library: bytes
) -> None:
    root = private(tmp_path / "extensions")
    folder = root / folder_name()
    plant(folder, planted_library)  # ours and private: it is loaded, and has no ops
    marker = tmp_path / "marker"
    status = status_in_child(root, marker)
    assert marker.exists()  # it was loaded: the fall back below comes from its missing ops
    assert status is not None and "lacks the kernels' ops" in status
    assert "decode_attention" in status
    # the build lock it took: no one else can open it to hold builds off
    lock = (folder / LOCK_FILE).lstat()
    assert lock.st_uid == os.geteuid() and lock.st_mode & 0o077 == 0


def test_a_build_lock_a_live_process_holds_is_waited_on_until_the_deadline(
    tmp_path: pathlib.Path, planted_library: bytes
) -> None:
    root = private(tmp_path / "extensions")
    folder = root / folder_name()
    plant(folder, planted_library)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "print('held', flush=True)\n"
            "time.sleep(600)\n",
            str(folder / LOCK_FILE),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        marker = tmp_path / "marker"
        # a build may be writing the library: it is not loaded while the build runs
        status = status_in_child(root, marker, wait_s=0.5)
        assert not marker.exists()
        assert status is not None and f"another process held {folder / LOCK_FILE}" in status
        # the holder dies (a build killed mid-way): its lock goes with it
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        status = status_in_child(root, marker, wait_s=20)
        assert marker.exists()
        assert status is not None and "lacks the kernels' ops" in status
    finally:
        holder.kill()
        holder.wait(timeout=30)
        if holder.stdout is not None:
            holder.stdout.close()


def test_lock_files_a_killed_build_left_are_not_waited_on(
    tmp_path: pathlib.Path, planted_library: bytes
) -> None:
    root = private(tmp_path / "extensions")
    folder = root / folder_name()
    plant(folder, planted_library)
    # a build killed mid-way left both locks (fresh) and maybe a library cut short
    (folder / LOCK_FILE).touch()
    (folder / TORCH_LOCK_FILE).touch()
    # without ninja on PATH the rebuild fails at once, before the compiler runs: torch's
    # builder gets that far only if it did not wait on its lock file
    no_tools = tmp_path / "no-tools"
    no_tools.mkdir()
    marker = tmp_path / "marker"
    status = status_in_child(root, marker, wait_s=20, path=str(no_tools))
    assert status is not None and status.startswith("building kernels.cpp failed")
    assert not (folder / TORCH_LOCK_FILE).exists()
    assert not marker.exists()  # a library whose build was cut short is not loaded as it is
