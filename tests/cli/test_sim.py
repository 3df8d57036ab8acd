"""``orchestr sim calibrate`` in a subprocess: it times the real engine on a checkpoint and
writes a step-time profile the simulator loads, and refuses what does not fit."""

from __future__ import annotations

import json
import pathlib
import subprocess

import pytest

from orchestr.roles import models
from orchestr.sim import StepTimeModel

from .test_run import ORCHESTR, ROOT


def calibrate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*ORCHESTR, "sim", "calibrate", *args],
        capture_output=True, text=True, timeout=180, cwd=ROOT,
    )  # fmt: skip


def test_calibrate_writes_a_profile_the_simulator_loads(tmp_path: pathlib.Path) -> None:
    folder = models.make_tiny("llama", tmp_path / "tiny", layers=2)
    out = tmp_path / "profile.json"
    small = ["--prefills", "16,64", "--decodes", "1x16,4x32", "--decode-steps", "3",
             "--repeats", "1", "--torch-threads", "1"]  # fmt: skip
    done = calibrate(str(folder), "--out", str(out), *small)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {out}: base ")
    profile = json.loads(out.read_text())
    model = StepTimeModel.from_json(profile["step_time"])
    assert model.machine and model.seconds(prefill_tokens=64, prefill_pairs=64 * 65 // 2) > 0
    assert len(profile["calibration"]["samples"]) == 2 + 2 * 4
    again = calibrate(str(folder), "--out", str(out), *small)
    assert again.returncode == 2 and "exists (--force to replace it)" in again.stderr


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--decodes", "8y3"], "expected BATCHxCONTEXT pairs"),
        (["--prefills", "0"], "expected prompt lengths"),
        (["--repeats", "0"], "expected a positive integer"),
        (["--decodes", "64x64"], "exceeds the step budget"),
    ],
)
def test_calibrate_refuses_bad_options(tmp_path: pathlib.Path, args: list[str], error: str) -> None:
    # each is refused before the folder is read
    done = calibrate(str(tmp_path / "missing"), "--out", str(tmp_path / "p.json"), *args)
    assert done.returncode == 2
    assert error in done.stderr
    assert not (tmp_path / "p.json").exists()


def test_calibrate_names_a_folder_that_is_no_model(tmp_path: pathlib.Path) -> None:
    done = calibrate(str(tmp_path), "--out", str(tmp_path / "p.json"))
    assert done.returncode == 2 and "config.json" in done.stderr
