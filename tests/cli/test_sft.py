"""``orchestr rl sft`` in a subprocess: its help, a bad config refused before any process
starts, ``--check``, and a short run's progress and last line.

The subcommand is run through :func:`orchestr.cli._sft.add_parser` on a parser of its own, as
``orchestr rl`` adds it."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from orchestr.roles.models import make_tiny

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _sft(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestr.cli", "rl", "sft", *args],
        cwd=ROOT,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    folder = tmp_path_factory.mktemp("sft")
    make_tiny("llama", folder / "model", hidden=32, heads=2)
    rows = [{"prompt": f"Say {i % 10}:", "response": str(i % 10)} for i in range(24)]
    rows += [{"prompt": "Say it all:", "response": " ".join(["the model"] * 10)}] * 3
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "sft.toml").write_text(
        '[model]\npath = "model"\n[data]\npath = "rows.jsonl"\nheld_out_size = 4\n'
        "held_out_fraction = 0.2\nmax_tokens = 16\n"
        "[schedule]\nsteps = 4\nbatch_size = 4\nlr = 1e-2\neval_every = 2\n"
    )
    return folder / "sft.toml"


def test_help_documents_every_section() -> None:
    proc = _sft("--help")
    assert proc.returncode == 0, proc.stderr
    for title in ("[model]", "[data]", "[schedule]", "[trainer]", "[layout]", "[run]"):
        assert title in proc.stdout
    assert "reasoning_gym = (unset)" in proc.stdout and "batch_size = 16" in proc.stdout
    assert "checkpoint_every" not in proc.stdout  # an RL run's, refused here


def test_a_bad_config_fails_before_any_process(
    tmp_path: pathlib.Path, config: pathlib.Path
) -> None:
    run = tmp_path / "run"
    proc = _sft(str(config), "--set", "schedule.stesp=3", "--run-dir", str(run))
    assert proc.returncode == 2
    assert "sft.toml: [schedule]: unknown key 'stesp'; did you mean 'steps'?" in proc.stderr
    proc = _sft(str(config), "--set", "data.response_field=answer", "--run-dir", str(run))
    assert proc.returncode == 2
    assert "rows.jsonl: row 1 has no field 'answer' (it has prompt, response); set " in (
        proc.stderr
    )
    assert not run.exists()


@pytest.mark.timeout(120)
def test_check_then_a_short_run(tmp_path: pathlib.Path, config: pathlib.Path) -> None:
    run = tmp_path / "run"
    check = _sft(str(config), "--run-dir", str(run), "--check")
    assert check.returncode == 0, check.stderr
    assert check.stdout.startswith(f"{config}: ok; ")
    assert "4 held out; 3 rows longer than data.max_tokens left out" in check.stdout
    assert not run.exists()
    proc = _sft(str(config), "--run-dir", str(run))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"SFT on {config.parent / 'model'}: 1 trainer(s), 4 steps of 4 rows")
    assert [line.split("|")[0].strip() for line in lines if line.startswith("step")] == [
        "step    1/4",
        "step    2/4",
        "step    4/4",
    ]
    assert lines[-2].startswith("done in ") and "held-out loss" in lines[-2]
    assert lines[-1] == (
        f"wrote {run}/ (config.json, events.jsonl, metrics.jsonl, model, summary.json, trace.json)"
    )
