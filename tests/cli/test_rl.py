"""``orchestr rl train`` end to end, in a subprocess: the main job's config and a run on a
checkpoint, rows and reward functions of one's own, with what each writes."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest

from orchestr.roles.models import make_tiny

ROOT = pathlib.Path(__file__).resolve().parents[2]
ORCHESTR = [sys.executable, "-m", "orchestr.cli"]


def _rl(*args: str, cwd: pathlib.Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # the workers import tests.cli.rl_rewards
    return subprocess.run(
        [*ORCHESTR, "rl", "train", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_help_documents_every_section() -> None:
    proc = subprocess.run(
        [*ORCHESTR, "rl", "train", "--help"], capture_output=True, text=True, check=True
    )
    for title in ("[model]", "[data]", "[[reward]]", "[algorithm]", "[schedule]", "[layout]"):
        assert title in proc.stdout
    assert "clip_eps_high = (unset)" in proc.stdout and 'loss_agg = "token_mean"' in proc.stdout
    assert "mlflow = (unset)" in proc.stdout and "sqlite:///FILE.db" in proc.stdout


def test_a_bad_config_fails_before_any_process(tmp_path: pathlib.Path) -> None:
    proc = _rl(
        "examples/rl/digits.toml", "--set", "schedule.stesp=3", "--run-dir", str(tmp_path / "r")
    )
    assert proc.returncode == 2
    assert "digits.toml: [schedule]: unknown key 'stesp'; did you mean 'steps'?" in proc.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.timeout(300)
def test_a_run_on_your_own_checkpoint_data_and_rewards(tmp_path: pathlib.Path) -> None:
    """Stream mode on a checkpoint and JSONL rows of one's own, two weighted reward functions
    (one failing on half the rows: counted, scored as the default, the run goes on) and a
    reward model (a sequence classifier scoring the prompt and completion as text), a KL
    penalty to the starting policy and dynamic sampling (groups whose rewards are all equal,
    most of them for a random policy, are left out and counted); the exported folder loads in
    ``transformers``. The run is logged to MLflow too, in a store the working directory holds."""
    import transformers
    from mlflow.tracking import MlflowClient

    from tests.reward_models import classifier

    make_tiny("llama", tmp_path / "model", hidden=32, heads=2, seed=1)
    classifier(tmp_path / "model", tmp_path / "rm", "llama")
    rows = [{"prompt": f"Say {i % 10}:", "answer": str(i % 10), "id": i} for i in range(60)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "run.toml").write_text(
        '[model]\npath = "model"\n'
        '[data]\npath = "rows.jsonl"\nheld_out_size = 6\n'
        '[[reward]]\nfunction = "tests.cli.rl_rewards:first_digit"\n'
        '[[reward]]\nfunction = "tests.cli.rl_rewards:flaky"\nweight = 0.5\n'
        # weight 0: scored and logged, not summed (its scores differ in every group, and the
        # dynamic sampling below needs groups whose rewards are all equal)
        '[[reward]]\nmodel = "rm"\nweight = 0.0\n'
        "[scoring]\ndefault = -1.0\n"
        "[algorithm]\nmax_new_tokens = 6\nkl_coef = 0.1\ndynamic_sampling = true\n"
        "[schedule]\nsteps = 3\nprompts_per_step = 4\ngroup_size = 4\nlr = 1e-3\neval_every = 3\n"
        '[layout]\nmode = "stream"\n'
        '[run]\nmlflow = "mlruns"\n'
    )
    run = tmp_path / "out"
    proc = _rl(str(tmp_path / "run.toml"), "--run-dir", str(run), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "reward calls failed" in proc.stdout
    summary = json.loads((run / "summary.json").read_text())
    failures = summary["reward_failures"]
    assert set(failures) == {"flaky"} and failures["flaky"]["error"] > 0
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in steps if r["kind"] == "step"]
    assert set(trained[0]["rewards"]) == {"first_digit", "flaky", "reward_model"}
    assert all(r["rewards"]["reward_model"] != 0.0 for r in trained)
    assert len(trained) == 3
    # the KL to the reference role's policy, measured at each batch's last update
    assert all(r["kl"] > 0 for r in trained)
    skipped = [r["skipped"] for r in trained]
    assert summary["skipped_groups"] == sum(skipped) > 0
    # odd rows fail: the default (-1) on those, 0.5 on the others
    assert min(r["rewards"]["flaky"] for r in trained) < 0.5
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert samples and {"prompt", "completion", "reward", "rewards"} <= set(samples[0])
    model = transformers.AutoModelForCausalLM.from_pretrained(run / "model")
    assert model.config.num_hidden_layers == 2
    client = MlflowClient(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    (logged,) = client.search_runs([_experiment_id(client)])
    assert logged.info.run_id == json.loads((run / "mlflow.json").read_text())["run_id"]
    assert logged.info.status == "FINISHED" and logged.data.tags["mode"] == "stream"
    assert logged.data.params["schedule.steps"] == "3"
    assert logged.data.params["reward.1.function"] == "tests.cli.rl_rewards:flaky"
    history = client.get_metric_history(logged.info.run_id, "reward")
    assert sorted((m.step, m.value) for m in history) == [
        (r["step"] + 1, r["reward"]) for r in trained
    ]
    assert len(client.get_metric_history(logged.info.run_id, "rewards/flaky")) == 3
    assert logged.data.metrics["summary/skipped_groups"] == summary["skipped_groups"]
    artifacts = {a.path for a in client.list_artifacts(logged.info.run_id)}
    assert {"config.json", "summary.json"} <= artifacts
    assert ("reward.png" in artifacts) == (run / "reward.png").is_file()


def _experiment_id(client: Any, name: str = "orchestr-rl") -> str:
    experiment = client.get_experiment_by_name(name)
    assert experiment is not None, f"no MLflow experiment {name!r}"
    return str(experiment.experiment_id)


def _check_folder(run: pathlib.Path, stdout: str) -> None:
    assert stdout.splitlines()[-1].startswith(f"wrote {run}/ (checkpoints, config.json")
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if r["kind"] == "step"] == list(range(10))
    assert all(r["kl"] == 0.0 for r in steps if r["kind"] == "step")  # no penalty, no reference
    assert [r["version"] for r in steps if r["kind"] == "eval"] == [0, 5, 10]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["mode"] == "sync" and len(summary["held_out"]) == 3
    events = list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0
    for folder in ("model", "model-00002", "model-00004", "model-00008"):
        assert (run / folder / "model.safetensors").is_file()
        assert (run / folder / "config.json").is_file()


@pytest.mark.timeout(600)
def test_a_killed_run_resumes_to_the_same_weights(tmp_path: pathlib.Path) -> None:
    """The main job's config in sync mode, one generator and one trainer: a run whose
    controller is SIGKILLed after its fourth batch, resumed from its last checkpoint, ends with
    the weights of a run never stopped, bit for bit (the position in the data and every sample
    follow from the batch). Six batches are left when it is killed, far more than one poll's
    worth, so the kill always lands mid-run. The run never stopped writes its folder as it
    should; the killed one logs to MLflow, and its resumption to the same MLflow run."""
    from mlflow.tracking import MlflowClient

    sets = [
        "--set",
        "schedule.steps=10",
        "--set",
        "schedule.eval_every=5",
        "--set",
        "layout.mode=sync",
        "--set",
        "layout.generators=1",
        "--set",
        "run.checkpoint_every=2",
        "--set",
        "run.export_every=2",
    ]
    whole = _rl("examples/rl/digits.toml", "--run-dir", str(tmp_path / "whole"), *sets)
    assert whole.returncode == 0, whole.stderr
    _check_folder(tmp_path / "whole", whole.stdout)
    run = tmp_path / "killed"
    store = json.dumps(str(tmp_path / "mlruns"))  # an absolute folder: the cwd is the repo's
    logged = ["--set", f"run.mlflow={store}", "--set", "run.mlflow_experiment='resumed'"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [
            *ORCHESTR,
            "rl",
            "train",
            "examples/rl/digits.toml",
            "--run-dir",
            str(run),
            *sets,
            *logged,
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        metrics = run / "metrics.jsonl"
        # polls until the fourth batch is written, however slow the machine (the test's own
        # timeout bounds it); a run that ends first fails here rather than testing nothing
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 4):
            assert proc.poll() is None, "the run ended before it could be killed"
            subprocess.run(["sleep", "0.25"], check=True)
    finally:
        os.killpg(proc.pid, 9)  # the controller and its embedded cluster, at once
        proc.wait()
    assert json.loads((run / "checkpoints" / "controller.json").read_text())["version"] >= 2
    resumed = _rl("examples/rl/digits.toml", "--resume", str(run), *sets, *logged)
    assert resumed.returncode == 0, resumed.stderr
    final = json.loads((run / "summary.json").read_text())
    assert (
        final["final_digest"]
        == json.loads((tmp_path / "whole" / "summary.json").read_text())["final_digest"]
    )
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if r["kind"] == "step"] == list(range(10))
    # one MLflow run, the killed one's, reopened by the resumed one: its batches' rewards are
    # those in metrics.jsonl (the batches redone after the checkpoint logged twice)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    (mlflow_run,) = client.search_runs([_experiment_id(client, "resumed")])
    assert mlflow_run.info.status == "FINISHED"
    history = client.get_metric_history(mlflow_run.info.run_id, "reward")
    last = {m.step: m.value for m in sorted(history, key=lambda m: m.timestamp)}
    assert last == {r["step"] + 1: r["reward"] for r in steps if r["kind"] == "step"}
    other = _rl("examples/rl/digits.toml", "--resume", str(run), *sets, "--set", "schedule.lr=1")
    assert other.returncode == 2 and "schedule.lr" in other.stderr
    done = _rl("examples/rl/digits.toml", "--resume", str(run), *sets)
    assert done.returncode == 2 and "has trained all 10 batches already; raise" in done.stderr
    # more batches: the run goes on from its last checkpoint and replaces its model/
    before = (run / "model" / "model.safetensors").stat().st_mtime_ns
    more = _rl("examples/rl/digits.toml", "--resume", str(run), *sets, "--set", "schedule.steps=11")
    assert more.returncode == 0, more.stderr
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if r["kind"] == "step"] == list(range(11))
    assert (run / "model" / "model.safetensors").stat().st_mtime_ns > before


def test_the_command_line_imports_no_torch_until_a_command_needs_it() -> None:
    """The configs' help (which imports the RL package, and torch) is made only when printed:
    every ``orchestr`` command would otherwise pay seconds for torch's import."""
    code = (
        "import sys\nfrom orchestr.cli._main import build_parser\nbuild_parser()\n"
        "print('torch' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "False"
