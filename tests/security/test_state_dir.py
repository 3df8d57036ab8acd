"""Rule: the state directory and the daemons trust nothing they did not create: a directory or
file of another user's, or open to others, is refused; a pid is signalled only while it is the
daemon recorded; one head per state directory; logs are never read or written through a
link."""

from __future__ import annotations

import json
import os
import pathlib
import stat
import subprocess
import sys
import time

import pytest

from orchestr._log import RotatingFile, read_daemon_log
from orchestr.errors import ConfigError

from ..cli.test_cluster import ROOT, alive, cli, start_cluster, state_dir  # noqa: F401
from .conftest import ATTACKER_UID


def test_a_state_directory_another_user_made_is_refused(tmp_path: pathlib.Path) -> None:
    planted = tmp_path / "state"
    planted.mkdir(mode=0o700)
    (planted / "token").write_text("the-attackers-token\n")
    (planted / "token").chmod(0o600)
    for path in (planted, planted / "token"):
        os.chown(path, ATTACKER_UID, ATTACKER_UID)
    started = cli("start", "--head", "--state-dir", str(planted))
    assert started.returncode == 1 and f"owned by uid {ATTACKER_UID}" in started.stderr
    assert not (planted / "head.json").exists()
    # a token of the attacker's in a directory of ours is refused too
    os.chown(planted, 0, 0)
    ran = cli("start", "--address", "127.0.0.1:1", "--state-dir", str(planted))
    assert ran.returncode == 1 and "owned by uid" in ran.stderr


def test_a_state_directory_open_to_others_is_refused(tmp_path: pathlib.Path) -> None:
    folder = tmp_path / "state"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    started = cli("start", "--head", "--state-dir", str(folder))
    assert started.returncode == 1 and "open to other users" in started.stderr
    assert "chmod 700" in started.stderr


@pytest.mark.timeout(120)
def test_every_file_in_the_state_directory_is_private(
    state_dir: pathlib.Path,  # noqa: F811
) -> None:
    start_cluster(state_dir)
    assert cli("run", "--state-dir", str(state_dir), "examples/hello.py").returncode == 0
    seen = []
    for path in [state_dir, *state_dir.rglob("*")]:
        st = path.lstat()
        assert st.st_uid == os.geteuid(), path
        assert not st.st_mode & (stat.S_IRWXG | stat.S_IRWXO), (path, stat.filemode(st.st_mode))
        seen.append(path.name)
    assert {"head.sqlite", "head.sqlite-wal", "token", "head.json", "head.lock"} <= set(seen)
    assert any(name.endswith(".log") for name in seen)


@pytest.mark.timeout(120)
def test_stop_signals_only_the_daemons_recorded(
    state_dir: pathlib.Path,  # noqa: F811
) -> None:
    start_cluster(state_dir)
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        # records whose pid is now another process's (a recycled pid, or a planted number)
        head = json.loads((state_dir / "head.json").read_text())
        (state_dir / "nodes" / "1.json").write_text(json.dumps({"pid": bystander.pid}))
        (state_dir / "nodes" / "2.json").write_text(
            json.dumps({"pid": bystander.pid, "start_ticks": head["start_ticks"]})
        )
        for name in ("1.json", "2.json"):
            (state_dir / "nodes" / name).chmod(0o600)
        stopped = cli("stop", "--state-dir", str(state_dir))
        assert stopped.returncode == 0, stopped.stderr
        assert "stopped head" in stopped.stdout
        assert f"pid {bystander.pid}" in stopped.stderr and "left alone" in stopped.stderr
        time.sleep(0.5)
        assert bystander.poll() is None  # still running
        assert not alive(int(head["pid"]))
    finally:
        bystander.kill()
        bystander.wait()


@pytest.mark.timeout(120)
def test_one_head_per_state_directory(state_dir: pathlib.Path) -> None:  # noqa: F811
    state_dir.mkdir(mode=0o700)
    cmd = [sys.executable, "-m", "orchestr._cluster._daemon", "head", "--state-dir", str(state_dir)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHESTR_")}
    heads = [
        subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    deadline = time.monotonic() + 60
    while all(h.poll() is None for h in heads) and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        ended = [h for h in heads if h.poll() is not None]
        assert len(ended) == 1, "both heads ran, or neither ended"
        _, err = ended[0].communicate()
        assert ended[0].returncode != 0 and b"another head runs from" in err
        running = next(h for h in heads if h.poll() is None)
        for _ in range(100):
            if (state_dir / "head.json").exists():
                break
            time.sleep(0.1)
        assert json.loads((state_dir / "head.json").read_text())["pid"] == running.pid
    finally:
        for h in heads:
            h.terminate()
            h.communicate(timeout=30)


def test_logs_are_never_read_or_written_through_a_link(tmp_path: pathlib.Path) -> None:
    secret = tmp_path / "secret.jsonl"
    secret.write_text('{"secret": 1}\n')
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "node-1.jsonl").write_text('{"event": "x"}\n')
    (logs / "evil.jsonl").symlink_to(secret)
    names, _, _ = read_daemon_log(logs, "", 0, 0)
    assert names == ["node-1.jsonl"]
    with pytest.raises(ConfigError):
        read_daemon_log(logs, "evil.jsonl", 0, 1000)
    with pytest.raises(OSError):
        RotatingFile(str(logs / "evil.jsonl"))
    assert secret.read_text() == '{"secret": 1}\n'


def test_heads_made_at_once_agree_on_one_whole_token(tmp_path: pathlib.Path) -> None:
    """A token file appears whole: processes that make it at the same moment all read the one
    that won, never an empty one."""
    state = tmp_path / "state"
    code = (
        "import sys; from pathlib import Path; from orchestr._cluster._daemon import ensure_token;"
        " print(ensure_token(Path(sys.argv[1])))"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(state)], stdout=subprocess.PIPE)
        for _ in range(8)
    ]
    tokens = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(tokens) == 1 and len(tokens.pop()) >= 32
    assert sorted(p.name for p in state.iterdir()) == ["token"]  # no draft left behind
