"""``orchestr serve`` end to end, in a subprocess: it serves OpenAI's API on an embedded
cluster behind an API key, stops cleanly on SIGINT, and refuses options that do not fit."""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import re
import signal
import subprocess
import uuid

import httpx2
import openai
import pytest

from orchestr.roles import models

from .test_run import ORCHESTR, ROOT, _listening_ports, _processes_with


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return pathlib.Path(models.make_tiny("llama", tmp_path_factory.mktemp("m") / "llama"))


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--host", "0.0.0.0"], "would open the model to the network without a key"),
        (["--host", "192.0.2.1", "--api-key", ""], "the API key must not be empty"),
        (["--api-key", "a", "--api-key-file", "f"], "give --api-key-file or --api-key, not both"),
        (["--api-key-file", "/nonexistent/key"], "--api-key-file /nonexistent/key: No such file"),
        (["--restarts", "-1"], "--restarts must be 0 or more"),
        (["--kv-store-blocks", "-1"], "--kv-store-blocks must be 0 or more"),
        (["--kv-store-blocks", "8", "--engine", "vllm"], "--engine vllm has its own"),
        (["--prefill", "-1"], "--prefill must be 0 or more"),
        (["--prefill", "1", "--engine", "vllm"], "--engine vllm cannot"),
        (["--prefill-min-tokens", "8"], "apply with --prefill P"),
        (["--no-prefill-overlap"], "apply with --prefill P"),
        (["--spill-at", "4"], "apply with --prefill P"),
        (["--kv-read", "staged"], "apply with --prefill P"),
        (["--prefill", "1", "--kv-read", "copy"], "invalid choice: 'copy'"),
        (["--prefill", "1", "--spill-at", "0"], "expected a positive integer, got 0"),
        (["--prefill", "1", "--prefill-labels", "gpu"], "--prefill-labels is K=V pairs"),
        (["--decode-labels", "a=b,"], "--decode-labels is K=V pairs"),
        (["--afd", "2"], "--afd is A:E"),
        (["--afd", "1:0"], "--afd is A:E"),
        (["--afd", "1:2", "--generators", "2"], "leave out --generators"),
        (["--micro-batches", "0"], "--micro-batches must be 1 or more"),
        (["--router-prefill-weight", "-1"], "--router-prefill-weight must be a number 0 or more"),
        (["--router-prefill-weight", "nan"], "--router-prefill-weight must be a number 0 or more"),
        (["--router-prefill-weight", "heavy"], "invalid float value: 'heavy'"),
        (["--router", "round_robin", "--router-prefill-weight", "4"], "--router is round_robin"),
        (["--afd", "1:1", "--engine", "vllm"], "--engine vllm cannot"),
        (["--tp", "0"], "--tp must be 1 or more"),
        (["--tp", "2", "--engine", "vllm"], "not --engine vllm's"),
        (["--engine", "sim"], "give --profile FILE"),
        (["--profile", "p.json"], "--profile is --engine sim's"),
        (["--engine", "sim", "--profile", "p.json", "--tp", "2"], "not --engine sim's"),
        (["--tp", "2", "--afd", "1:1"], "cannot be combined with --afd yet"),
    ],
)
def test_options_that_do_not_fit_are_refused(
    folder: pathlib.Path, args: list[str], error: str
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "ORCHESTR_API_KEY"}
    proc = subprocess.run(
        [*ORCHESTR, "serve", str(folder), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and error in proc.stderr, proc.stderr


def test_a_folder_that_is_no_model_is_refused(tmp_path: pathlib.Path) -> None:
    proc = subprocess.run(
        [*ORCHESTR, "serve", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "is not a model folder (no config.json)" in proc.stderr


def _start(args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    """``orchestr ARGS`` in a subprocess, and its first line: the startup line, or (when it
    exited instead) that line and what it said on stderr."""
    proc = subprocess.Popen(
        [*ORCHESTR, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    line = proc.stdout.readline()
    if proc.poll() is not None:
        line += proc.stderr.read()
    return proc, line


def test_serve_answers_openai_clients_and_stops_on_sigint(folder: pathlib.Path) -> None:
    marker = uuid.uuid4().hex
    env = dict(os.environ, ORCHESTR_TEST_MARKER=marker, ORCHESTR_API_KEY="sekrit")
    args = [
        "serve",
        str(folder),
        "--port",
        "0",
        "--served-model-name",
        "tiny",
        "--router",
        "kv",
        "--router-prefill-weight",
        "16",
        "--kv-store-blocks",
        "64",
    ]
    proc, line = _start(args, env)
    try:
        found = re.search(r"serving tiny on (http://127\.0\.0\.1:\d+/v1) with 1 native", line)
        assert found, line
        assert line.rstrip().endswith("router kv (prefill weight 16)"), line
        with openai.OpenAI(base_url=found[1], api_key="sekrit", max_retries=0) as client:
            r = client.completions.create(model="tiny", prompt="hello", max_tokens=5)
            assert r.usage is not None and r.usage.completion_tokens <= 5 and r.choices
            chunks = list(
                client.chat.completions.create(
                    model="tiny",
                    messages=[{"role": "user", "content": "hi"}],
                    max_tokens=4,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            assert chunks[0].choices[0].delta.role == "assistant"
            usage = chunks[-1].usage
            assert usage is not None and 1 <= usage.completion_tokens <= 4
        with (
            openai.OpenAI(base_url=found[1], api_key="wrong", max_retries=0) as client,
            pytest.raises(openai.AuthenticationError),
        ):
            client.models.list()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert "orchestr serve: stopped" in err and "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert _processes_with(marker) == [] and _listening_ports(marker) == set()


def test_serve_splits_each_generator_over_tp_processes(folder: pathlib.Path) -> None:
    """``--tp 2``: each generator is two processes, a tp=2 prefill pool handing off to tp=2
    decode; its greedy text is the whole model's (``--tp 1``), and every process (the ranks
    included) is gone after SIGINT. (A tp=2 pool without a prefill pool runs the same decode
    steps; the tensor-parallel tests check it apart.)"""
    prompt = list(range(20, 40))
    texts = []
    # (tp=2 hands each prompt's KV off whole: serve turns the layer-by-layer overlap off)
    for tp, more in ((1, []), (2, ["--prefill", "1"])):
        marker = uuid.uuid4().hex
        env = dict(os.environ, ORCHESTR_TEST_MARKER=marker, ORCHESTR_API_KEY="sekrit")
        proc, line = _start(["serve", str(folder), "--port", "0", "--tp", str(tp), *more], env)
        try:
            found = re.search(r"on (http://127\.0\.0\.1:\d+/v1) with 1 ", line)
            assert found, line
            assert line.count("of tp=2") == (tp == 2), line
            # the command, the generator's worker and (tp=2) the rank it started
            assert len(_processes_with(marker)) >= 1 + tp
            with openai.OpenAI(base_url=found[1], api_key="sekrit", max_retries=0) as client:
                r = client.completions.create(
                    model=str(folder), prompt=prompt, max_tokens=12, temperature=0,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                texts.append(r.choices[0].text)
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert _processes_with(marker) == [] and _listening_ports(marker) == set()
    assert texts[0] == texts[1] and texts[0]


def test_serve_runs_simulated_generators_with_prefill_pools_and_a_kv_store(
    folder: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """``--engine sim``: generators with no model, each step the profile's time, behind the
    same front door, prefill pool and KV store as the real engine's."""
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"base_s": 0.002, "prefill_token_s": 1e-5, "decode_s": 1e-4}))
    marker = uuid.uuid4().hex
    env = dict(os.environ, ORCHESTR_TEST_MARKER=marker, ORCHESTR_API_KEY="sekrit")
    args = ["serve", str(folder), "--port", "0", "--engine", "sim", "--profile", str(profile)]
    args += ["--generators", "3", "--prefill", "2", "--prefill-min-tokens", "16"]
    args += ["--kv-store-blocks", "64"]
    proc, line = _start(args, env)
    try:
        found = re.search(r"on (http://127\.0\.0\.1:\d+/v1) with 2 prefill \+ 3 decode", line)
        assert found, line
        with openai.OpenAI(base_url=found[1], api_key="sekrit", max_retries=0) as client:

            def complete(i: int) -> int:
                prompt = [*range(10, 50), 60 + i]  # a shared prefix, then its own
                r = client.completions.create(model=str(folder), prompt=prompt, max_tokens=7)
                assert r.usage is not None
                return r.usage.completion_tokens

            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                assert list(pool.map(complete, range(12))) == [7] * 12
            url = found[1].removesuffix("/v1") + "/metrics"
            metrics = httpx2.get(url, headers={"Authorization": "Bearer sekrit"}).text
            for counter in ("vllm:prefix_cache_hits_total", "orchestr:kv_transfers_total"):
                # prefixes cached, and prompts prefilled in the prefill pool and handed off
                assert re.search(rf"^{counter}{{[^}}]*}} [1-9]", metrics, re.M), counter
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert _processes_with(marker) == [] and _listening_ports(marker) == set()


def test_the_router_choices_are_the_routers_policies() -> None:
    from orchestr.cli._serve import ROUTERS
    from orchestr.roles.serving import POLICIES

    assert ROUTERS == POLICIES  # the CLI lists them without importing torch


def test_a_key_file_others_can_read_is_refused(
    folder: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    key = tmp_path / "key"
    for mode, content, error in (
        (0o644, "k3y\n", "other users can read or write it (mode 0644); chmod 600 it"),
        (0o600, "\n", "the file is empty"),
    ):
        key.write_text(content)
        key.chmod(mode)
        proc = subprocess.run(
            [*ORCHESTR, "serve", str(folder), "--api-key-file", str(key)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2 and error in proc.stderr, proc.stderr
    if os.getuid() != 0:
        pytest.fail("this test gives a key file to another user: run as root (as CI does)")
    key.write_text("k3y\n")
    key.chmod(0o600)
    os.chown(key, 65534, 65534)  # nobody's file: nobody could change the key at will
    proc = subprocess.run(
        [*ORCHESTR, "serve", str(folder), "--api-key-file", str(key)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "owned by uid 65534, not by this user" in proc.stderr
    os.chown(key, 0, 0)
    link = tmp_path / "link"
    link.symlink_to(key)
    proc = subprocess.run(
        [*ORCHESTR, "serve", str(folder), "--api-key-file", str(link)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--api-key-file" in proc.stderr, proc.stderr


def test_a_private_socket_and_a_key_file_keep_other_users_out(
    folder: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """``--uds`` serves on a socket of mode 0600: another user (``nobody``) cannot connect,
    nor read the key from the process list (it came from ``--api-key-file``)."""
    if os.getuid() != 0:
        pytest.fail("this test plays another user against root's server: run as root")
    key = f"k3y-{uuid.uuid4().hex}"
    key_file = tmp_path / "key"
    key_file.write_text(key + "\n")
    key_file.chmod(0o600)
    home = tmp_path / "run"
    home.mkdir(mode=0o755)
    sock = home / "orchestr.sock"
    args = [
        "serve",
        str(folder),
        "--uds",
        str(sock),
        "--api-key-file",
        str(key_file),
        "--served-model-name",
        "tiny",
    ]
    env = {k: v for k, v in os.environ.items() if k != "ORCHESTR_API_KEY"}
    proc, line = _start(args, env)
    try:
        assert f"serving tiny on unix:{sock} (mode 0600)" in line, line
        assert sock.stat().st_mode & 0o777 == 0o600
        request = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        attack = subprocess.run(
            [
                "setpriv",
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                "/usr/bin/python3",
                "-c",
                _UNIX_CLIENT,
                str(sock),
                request.hex(),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert attack.stdout.strip() == "PermissionError", attack.stdout + attack.stderr
        ps = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "ps", "-eo", "args"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert "orchestr" in ps.stdout and key not in ps.stdout
        # the owner connects, with the key
        transport = httpx2.HTTPTransport(uds=str(sock))
        with httpx2.Client(transport=transport, base_url="http://x", timeout=60) as client:
            assert client.get("/v1/models").status_code == 401
            r = client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert key not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert not sock.exists()


def test_a_key_on_the_command_line_is_warned_about(folder: pathlib.Path) -> None:
    proc = subprocess.run(
        [*ORCHESTR, "serve", str(folder), "--api-key", "k", "--restarts", "-1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "--api-key shows the key to every user of this host" in proc.stderr, proc.stderr


_UNIX_CLIENT = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1])
    s.sendall(bytes.fromhex(sys.argv[2]))
    print(s.recv(100))
except OSError as exc:
    print(type(exc).__name__)
"""
