"""``orchestr serve`` end to end, in a subprocess: it serves OpenAI's API on an embedded
cluster behind an API key, stops cleanly on SIGINT, and refuses options that do not fit."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import uuid

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
        (["--host", "192.0.2.1", "--api-key", ""], "--api-key must not be empty"),
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


def test_serve_answers_openai_clients_and_stops_on_sigint(folder: pathlib.Path) -> None:
    marker = uuid.uuid4().hex
    env = dict(os.environ, ORCHESTR_TEST_MARKER=marker, ORCHESTR_API_KEY="sekrit")
    args = ["serve", str(folder), "--port", "0", "--served-model-name", "tiny", "--router", "kv",
            "--router-prefill-weight", "16", "--kv-store-blocks", "64"]  # fmt: skip
    proc = subprocess.Popen(
        [*ORCHESTR, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        found = re.search(r"serving tiny on (http://127\.0\.0\.1:\d+/v1) with 1 native", line)
        assert found, line + (proc.stderr.read() if proc.poll() is not None and proc.stderr else "")
        assert line.rstrip().endswith("router kv (prefill weight 16)"), line
        with openai.OpenAI(base_url=found[1], api_key="sekrit", max_retries=0) as client:
            r = client.completions.create(model="tiny", prompt="hello", max_tokens=5)
            assert r.usage is not None and r.usage.completion_tokens <= 5 and r.choices
            chunks = list(
                client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                    stream=True, stream_options={"include_usage": True},
                )
            )  # fmt: skip
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


def test_the_router_choices_are_the_routers_policies() -> None:
    from orchestr.cli._serve import ROUTERS
    from orchestr.roles.serving import POLICIES

    assert ROUTERS == POLICIES  # the CLI lists them without importing torch
