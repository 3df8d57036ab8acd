"""``orchestr sim calibrate`` in a subprocess: it times the real engine on a checkpoint and
writes a step-time profile the simulator loads, and refuses what does not fit."""

from __future__ import annotations

import json
import pathlib
import subprocess

import pytest

from orchestr.roles import models
from orchestr.sim import RLCosts, StepTimeModel

from .test_run import ORCHESTR, ROOT


def calibrate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*ORCHESTR, "sim", "calibrate", *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )


def test_calibrate_writes_a_profile_the_simulator_loads(tmp_path: pathlib.Path) -> None:
    folder = models.make_tiny("llama", tmp_path / "tiny", layers=2)
    out = tmp_path / "profile.json"
    small = [
        "--prefills",
        "16,64",
        "--decodes",
        "1x16,4x32",
        "--mixes",
        "2x16x32",
        "--decode-steps",
        "5",
        "--repeats",
        "1",
        "--torch-threads",
        "1",
    ]
    done = calibrate(str(folder), "--out", str(out), *small)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {out}: base ")
    profile = json.loads(out.read_text())
    model = StepTimeModel.from_json(profile["step_time"])
    assert model.machine and model.seconds(prefill_tokens=64, prefill_pairs=64 * 65 // 2) > 0
    assert len(profile["calibration"]["samples"]) == 2 + 3 * 6
    assert sum(x[4] for x in profile["calibration"]["samples"]) == 1  # one mixed step
    again = calibrate(str(folder), "--out", str(out), *small)
    assert again.returncode == 2 and "exists (--force to replace it)" in again.stderr


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--decodes", "8y3"], "expected BATCHxCONTEXT pairs"),
        (["--prefills", "0"], "expected prompt lengths"),
        (["--repeats", "0"], "expected a positive integer"),
        (["--decodes", "64x64"], "exceeds the step budget"),
        (["--mixes", "4x128"], "expected BATCHxCONTEXTxPROMPT triples"),
        (["--mixes", "4x0x5"], "expected BATCHxCONTEXTxPROMPT triples"),
        (["--decode-steps", "3"], "mixed runs need decode_steps >= 5"),
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


def sim_run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*ORCHESTR, "sim", "run", *args], capture_output=True, text=True, timeout=300, cwd=ROOT
    )


@pytest.mark.parametrize("example", ["rl_small", "rl_this_machine", "serving_small"])
def test_the_example_scenarios_run_and_write_a_perfetto_trace(
    example: str, tmp_path: pathlib.Path
) -> None:
    done = sim_run(f"examples/sim/{example}.toml", "--out", str(tmp_path), "--json")
    assert done.returncode == 0, done.stderr
    metrics = json.loads(done.stdout)
    assert metrics == json.loads((tmp_path / "metrics.json").read_text())
    trace = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    spans = [e for e in trace if e.get("ph") == "X"]
    assert spans and all(e["dur"] >= 0 for e in spans)
    if example == "rl_small":
        assert metrics["steps"] == 3 and metrics["accelerators"] == 256
        assert {e["name"] for e in spans} >= {"weight_sync", "training"}
        # the phases' spans are virtual seconds: the weight syncs alone outlast the wall run
        syncs = sum(e["dur"] for e in spans if e["name"] == "weight_sync") / 1e6
        assert syncs == pytest.approx(metrics["phase_s"]["weight_sync"], rel=1e-6)
        assert metrics["fabric"][0] == {"phase": "weight_sync", "status": "applied"}
    elif example == "rl_this_machine":  # the live demo's roles on two cores
        assert metrics["mode"] == "stream" and metrics["accelerators"] == 1
        assert metrics["steps"] == 20 and 0 < metrics["trainer_idle_frac"] < 1
        assert "fabric" not in metrics
    else:
        assert metrics["completed"] == metrics["requests"] == 5000
        assert sum(1 for e in spans if e["cat"] == "decode") == 5000


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("seed = 0\n[serving]\n", "kind is required"),
        ('kind = "batch"\n', "kind must be rl or serving"),
        (
            'kind = "serving"\n[profile]\nbuiltin = "h100-llama3-8b"\n[serving]\ngenerators = 0\n',
            "[serving]: generators must be a positive int, got 0",
        ),
        (
            'kind = "serving"\n[profile]\nbuiltin = "h100-llama3-8b"\n[serving]\ngpus = 8\n',
            "[serving]: unknown field(s) gpus",
        ),
        ('kind = "serving"\n[profile]\nbase_s = -1.0\n', "[profile]: base_s must be seconds >= 0"),
        ('kind = "serving"\n[profile]\n', "give a file, a builtin profile or the step-time terms"),
        (
            'kind = "rl"\n[profile]\nbuiltin = "h100-llama3-8b"\n[rl]\nmode = "async"\n',
            "[topology]: k is required",
        ),
        (
            'kind = "rl"\n[profile]\nbuiltin = "h100-llama3-8b"\n[topology]\nk = 4\n'
            '[rl]\nmode = "async"\n',
            "[rl]: mode must be sync or stream or stream+skew",
        ),
        (
            'kind = "rl"\n[profile]\nbuiltin = "h100-llama3-8b"\n[topology]\nk = 3\n',
            "[topology]: k must be an even int >= 2",
        ),
        (
            'kind = "rl"\n[profile]\nbuiltin = "h100-llama3-8b"\n[topology]\nk = 4\n[rl]\n',
            "[rl.costs]: weight_bytes is required",
        ),
        (
            'kind = "serving"\n[profile]\nbuiltin = "h100-llama3-8b"\n[serving.workload]\n'
            "prompt_tokens = [10, 2]\n",
            "[serving.workload]: prompt_tokens must be [low, high]",
        ),
        (
            'kind = "rl"\n[profile]\nbuiltin = "h100-llama3-8b"\n[topology]\nk = 4\n[rl]\n'
            "generators = 40\n[rl.costs]\nweight_bytes = 1e9\n",
            "[rl]: the roles do not fit [topology]: cannot place member 16 of 40",
        ),
        ("kind = [", "not TOML"),
        (
            'kind = "rl"\n[profile]\nbuiltin = "h100-llama3-8b"\n[topology]\nk = 4\n[rl.costs]\n'
            'file = "nowhere.json"\n',
            "[rl.costs]: file 'nowhere.json': ",
        ),
        (
            'kind = "rl"\n[profile]\nbuiltin = "h100-llama3-8b"\n[topology]\nk = 4\n[rl.costs]\n'
            'weight_bytes = 1e9\nengine = "eager"\n',
            "[rl.costs]: engine must be paged or recompute",
        ),
        (
            'kind = "rl"\n[profile]\nbuiltin = "h100-llama3-8b"\n[topology]\none_host = true\n'
            "[rl]\nhost_cpus = 0\n",
            "[rl]: host_cpus must be a positive float, got 0.0",
        ),
        (
            'kind = "rl"\n[profile]\nbuiltin = "h100-llama3-8b"\n[topology]\none_host = true\n'
            "k = 4\n",
            "[topology]: unknown field(s) k",
        ),
        (
            'kind = "rl"\n[profile]\nbuiltin = "h100-llama3-8b"\n[topology]\none_host = true\n'
            "[rl]\ngenerator_nice = 30\n",
            "[rl]: generator_nice must be an int in -20..19",
        ),
    ],
)
def test_bad_scenarios_are_refused_naming_the_field(
    text: str, message: str, tmp_path: pathlib.Path
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    done = sim_run(str(path), "--out", str(tmp_path / "out"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("orchestr sim run: ")
    assert message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_calibrate_rl_writes_the_roles_costs_a_scenario_runs_with(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "rl.json"
    done = subprocess.run(
        [*ORCHESTR, "sim", "calibrate-rl", "--out", str(out), "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {out}: a generation step ")
    profile = json.loads(out.read_text())
    costs = RLCosts.from_json(profile)
    assert costs.engine == "recompute" and costs.train_token_s + costs.train_step_s > 0
    assert profile["calibration"]["machine"] and profile["config"] == "small"
    # the profile's step_time is a [profile] file, the rest an [rl.costs] file
    scenario = tmp_path / "here.toml"
    scenario.write_text(
        'kind = "rl"\n[profile]\nfile = "rl.json"\n[topology]\nk = 4\n[rl]\nmode = "stream"\n'
        "generators = 2\nsteps = 2\nprompts_per_step = 8\ngroup_size = 4\n"
        "generator_resources = {gpu = 1}\ntrainer_resources = {gpu = 1}\n"
        '[rl.costs]\nfile = "rl.json"\neval_s = 0.5\n[rl.lengths]\nrequested = true\n'
    )
    ran = sim_run(str(scenario), "--out", str(tmp_path / "here"), "--json")
    assert ran.returncode == 0, ran.stderr
    metrics = json.loads(ran.stdout)
    assert metrics["mode"] == "stream" and metrics["steps"] == 2 and metrics["samples_per_s"] > 0
    again = subprocess.run(
        [*ORCHESTR, "sim", "calibrate-rl", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert again.returncode == 2 and "exists (--force to replace it)" in again.stderr
