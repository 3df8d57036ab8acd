"""An RL run's config file and data, checked before any process starts: the loader's refusals
(each naming the file, the key and the fix), overrides, the data's rows, splits and order."""

from __future__ import annotations

import json
import pathlib
import re
import sys

import pytest

import orchestr as oc
from orchestr.roles.models import make_tiny
from orchestr.roles.rl import (
    DataSource,
    DigitSource,
    load_rl_config,
    plan_rl,
    read_rows,
    rl_config_from_dict,
)

ROOT = pathlib.Path(__file__).resolve().parents[3]
DIGITS = ROOT / "examples" / "rl" / "digits.toml"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny("llama", tmp_path_factory.mktemp("ckpt") / "model", hidden=32, heads=2)


def _rows(n: int = 40) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for i in range(n):
        if i % 2:
            rows.append({"prompt": f"Say {i % 10}:", "answer": str(i % 10), "id": i})
        else:
            chat = [{"role": "user", "content": f"Say {i % 10}"}]
            rows.append({"prompt": chat, "answer": str(i % 10), "id": i})
    return rows


def _write(folder: pathlib.Path, checkpoint: str, extra: str = "", rows: int = 40) -> pathlib.Path:
    with open(folder / "train.jsonl", "w", encoding="utf-8") as f:
        for row in _rows(rows):
            f.write(json.dumps(row) + "\n")
    config = folder / "run.toml"
    config.write_text(
        f'[model]\npath = "{checkpoint}"\n'
        '[data]\npath = "train.jsonl"\nheld_out_size = 8\nheld_out_fraction = 0.2\n'
        '[[reward]]\nfunction = "orchestr.roles.reward:exact_match"\n'
        "[schedule]\nsteps = 2\nprompts_per_step = 4\ngroup_size = 2\n" + extra
    )
    return config


def test_the_main_jobs_config_plans_the_digit_task() -> None:
    plan = plan_rl(load_rl_config(str(DIGITS)), run_dir="/tmp/unused-run")
    assert isinstance(plan.source, DigitSource)
    assert plan.job.mode == "stream+skew" and plan.job.train.steps == 120
    assert plan.job.train.task.name == "copy" and plan.job.train.task.field == 8
    assert plan.job.export_dir == "/tmp/unused-run/model"
    over = load_rl_config(str(DIGITS), ["schedule.steps=7", "layout.mode=sync", "run.name=x"])
    assert (over.schedule.steps, over.layout.mode, over.run.name) == (7, "sync", "x")


@pytest.mark.parametrize(
    ("table", "says"),
    [
        ({"modle": {}}, "unknown section 'modle'; did you mean 'model'?"),
        ({"data": {"path": "x"}}, "a run needs a [model] section"),
        ({"model": {"path": "m", "pth": 1}, "data": {}}, "unknown key 'pth'; did you mean 'path'?"),
        ({"model": {}, "data": {}}, "[model] needs one of path"),
        ({"model": {"path": "m"}, "data": {}, "schedule": {"steps": "ten"}}, "steps must be int"),
        ({"model": {"path": "m"}, "data": {}, "schedule": {"lr": True}}, "lr must be float"),
        ({"model": {"path": "m"}, "data": {}, "reward": {"function": "a:b"}}, "write [[reward]]"),
        (
            {"model": {"path": "m"}, "data": {}, "reward": [{"weight": 1}]},
            "one of function or model",
        ),
    ],
)
def test_a_bad_config_is_refused_naming_the_key(table: dict[str, object], says: str) -> None:
    with pytest.raises(oc.ConfigError) as info:
        rl_config_from_dict(table, "my.toml")
    assert says in str(info.value) and str(info.value).startswith("my.toml: ")


def test_sharding_is_checked_when_planned() -> None:
    for value, says in [
        ("'half'", "sharding must be one of none, full"),
        ("'full'", "two or more"),
    ]:
        config = load_rl_config(str(DIGITS), [f"trainer.sharding={value}"])
        with pytest.raises(oc.ConfigError, match=says):
            plan_rl(config, run_dir="/tmp/unused-run")
    sharded = load_rl_config(str(DIGITS), ["trainer.sharding='full'", "layout.trainers=2"])
    plan = plan_rl(sharded, run_dir="/tmp/unused-run")
    assert plan.job.trainer_options["sharding"] == "full" and plan.job.trainers == 2


def test_the_layout_policy_is_planned_from_its_table() -> None:
    costs = (
        "{base_s = 1e-3, decode_s = 0.0, attention_s = 0.0, layers = 2, row_bytes = 0.0, "
        "allreduce_alpha_s = 0.0, allreduce_byte_s = 0.0, device_bytes = 1e12, "
        "weight_bytes = 0.0, kv_bytes_per_token = 1.0, reshard_s = 0.0}"
    )
    sets = ["layout.mode='sync'", "layout.layout_degrees=[1, 2]"]
    plan = plan_rl(load_rl_config(str(DIGITS), [*sets, f"layout.layout_costs={costs}"]), "/tmp/r")
    assert plan.job.layout_degrees == (1, 2) and plan.job.layout_costs is not None
    assert plan.job.layout_costs.base_s == 1e-3
    for extra, says in [
        ("layout.layout_costs={base_s = 1.0}", "missing 10 required"),
        (costs.replace("layers = 2", "layers = -2").join(("layout.layout_costs=", "")), ">= 0"),
        ("layout.layout_costs={}", "its keys: base_s, decode_s"),
    ]:
        with pytest.raises(oc.ConfigError, match=says):
            plan_rl(load_rl_config(str(DIGITS), [*sets, extra]), "/tmp/r")
    with pytest.raises(oc.ConfigError, match="needs layout_costs"):
        plan_rl(load_rl_config(str(DIGITS), sets), "/tmp/r")


def test_overrides_are_checked(tmp_path: pathlib.Path) -> None:
    with pytest.raises(oc.ConfigError, match="SECTION.KEY=VALUE"):
        load_rl_config(str(DIGITS), ["steps=3"])
    with pytest.raises(oc.ConfigError, match="did you mean 'steps'"):
        load_rl_config(str(DIGITS), ["schedule.stesp=3"])
    with pytest.raises(oc.ConfigError, match="no such config file"):
        load_rl_config(str(tmp_path / "missing.toml"))
    (tmp_path / "bad.toml").write_text("[model\n")
    with pytest.raises(oc.ConfigError, match="bad.toml: not a readable TOML file"):
        load_rl_config(str(tmp_path / "bad.toml"))


def test_a_data_run_is_planned_from_its_files(tmp_path: pathlib.Path, checkpoint: str) -> None:
    plan = plan_rl(load_rl_config(str(_write(tmp_path, checkpoint))), run_dir=str(tmp_path / "r"))
    source = plan.source
    assert isinstance(source, DataSource)
    assert len(source.held) == 8 and len(source.train) == 32
    held_ids = {f["id"] for f in source.held.fields}
    assert held_ids.isdisjoint(f["id"] for f in source.train.fields)
    # a chat row is rendered with the checkpoint's template, a text row is as written
    texts = dict(zip((f["id"] for f in source.train.fields), source.train.texts, strict=True))
    chat_id = next(i for i in texts if i % 2 == 0)
    assert "<|im_start|>user" in texts[chat_id] and texts[chat_id].endswith("assistant\n")
    assert texts[next(i for i in texts if i % 2)].startswith("Say ")
    # the same step draws the same requests; an epoch visits every train row once
    assert [r.prompt for r in source.step_requests(3)] == [
        r.prompt for r in source.step_requests(3)
    ]
    first_epoch = [source.row(s, i) for s in range(8) for i in range(4)]
    assert sorted(first_epoch) == list(range(32))
    assert [source.row(s, i) for s in range(8, 16) for i in range(4)] != first_epoch
    requests = source.step_requests(0)
    assert [r.id for r in requests[:3]] == ["0/0/0", "0/0/1", "0/1/0"]
    assert all(r.max_new_tokens == 64 for r in requests)


@pytest.mark.parametrize(
    ("extra", "rows", "says"),
    [
        ('[data]\npath = "none.jsonl"\n', None, "none.jsonl: no such data file"),
        ('[data]\npath = "train.jsonl"\nprompt_field = "question"\n', None, "no field 'question'"),
        ("", "not json\n", "train.jsonl:1: not JSON"),
        ("", "[1, 2]\n", "a row is a JSON object"),
        (
            '[data]\npath = "train.jsonl"\nmax_prompt_tokens = 1\n',
            None,
            "longer than max_prompt_tokens",
        ),
    ],
)
def test_bad_data_is_refused_naming_the_file(
    tmp_path: pathlib.Path, checkpoint: str, extra: str, rows: str | None, says: str
) -> None:
    config = _write(tmp_path, checkpoint)
    if rows is not None:
        (tmp_path / "train.jsonl").write_text(rows)
    if extra:  # replace the data section
        text = config.read_text().split("[data]")
        rest = text[1].split("[[reward]]", 1)[1]
        config.write_text(text[0] + extra + "[[reward]]" + rest)
    with pytest.raises(oc.ConfigError) as info:
        plan_rl(load_rl_config(str(config)), run_dir=str(tmp_path / "r"))
    assert says in str(info.value)
    assert str(info.value).startswith(str(config))


@pytest.mark.parametrize(
    ("reward", "says"),
    [
        ('function = "no_such_module:f"', "no_such_module"),
        ('function = "orchestr.roles.reward:exact_match"\nargs = { answr = 1 }', "answr"),
        ('function = "orchestr.roles.reward:regex_match"\nargs = { pattern = "(" }', "pattern"),
        ('function = "orchestr.roles.reward:math_answer"', ""),  # fine: the rows have answer
    ],
)
def test_reward_functions_are_checked_against_the_data(
    tmp_path: pathlib.Path, checkpoint: str, reward: str, says: str
) -> None:
    config = _write(tmp_path, checkpoint)
    text = config.read_text().replace('function = "orchestr.roles.reward:exact_match"', reward)
    config.write_text(text)
    if not says:
        plan_rl(load_rl_config(str(config)), run_dir=str(tmp_path / "r"))
        return
    with pytest.raises(oc.ConfigError) as info:
        plan_rl(load_rl_config(str(config)), run_dir=str(tmp_path / "r"))
    assert says in str(info.value) and "[[reward]]" in str(info.value)


def test_a_reward_needing_a_field_the_data_lacks_is_refused(
    tmp_path: pathlib.Path, checkpoint: str
) -> None:
    config = _write(tmp_path, checkpoint)
    rows = [{k: v for k, v in r.items() if k != "answer"} for r in _rows()]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(oc.ConfigError, match="answer"):
        plan_rl(load_rl_config(str(config)), run_dir=str(tmp_path / "r"))


def test_parquet_rows_and_a_held_out_file(tmp_path: pathlib.Path, checkpoint: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [r for r in _rows() if isinstance(r["prompt"], str)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    assert read_rows(str(tmp_path / "train.parquet")) == rows
    config = _write(tmp_path, checkpoint)
    (tmp_path / "held.jsonl").write_text(json.dumps(rows[0]) + "\n")
    text = config.read_text().replace(
        'path = "train.jsonl"', 'path = "train.parquet"\nheld_out = "held.jsonl"'
    )
    config.write_text(text)
    plan = plan_rl(load_rl_config(str(config)), run_dir=str(tmp_path / "r"))
    assert isinstance(plan.source, DataSource)
    assert len(plan.source.train) == len(rows) and len(plan.source.held) == 1


def test_a_reasoning_gym_task_is_a_source(tmp_path: pathlib.Path, checkpoint: str) -> None:
    config = tmp_path / "rg.toml"
    config.write_text(
        f'[model]\npath = "{checkpoint}"\n'
        '[data]\nreasoning_gym = "chain_sum"\nsize = 50\nseed = 3\nchat = true\n'
        '[[reward]]\nfunction = "orchestr.roles.reward:reasoning_gym_score"\n'
    )
    plan = plan_rl(load_rl_config(str(config)), run_dir=str(tmp_path / "r"))
    source = plan.source
    assert isinstance(source, DataSource)
    assert len(source.train) + len(source.held) == 50
    assert {"answer", "metadata"} <= set(source.train.fields[0])
    assert source.train.fields[0]["metadata"]["source_dataset"] == "chain_sum"


def test_dynamic_sampling_keeps_groups_whose_rewards_differ() -> None:
    from orchestr.roles.rl._modes import varied

    assert varied([(None, 0.0), (None, 1.0)])  # type: ignore[list-item]
    assert not varied([(None, 0.5), (None, 0.5), (None, 0.5)])  # type: ignore[list-item]
    with pytest.raises(oc.ConfigError, match="trainers=1"):
        plan_rl(
            load_rl_config(str(DIGITS), ["algorithm.dynamic_sampling=true", "layout.trainers=2"]),
            run_dir="/tmp/unused-run",
        )


@pytest.mark.parametrize(
    ("rewards", "says"),
    [
        ('[[reward]]\nfunction = "a:b"\nmodel = "m"\n', "needs one of function or model"),
        ("[[reward]]\nweight = 1.0\n", "needs one of function or model"),
        ('[[reward]]\nmodel = "m"\nargs = { x = 1 }\n', "args are a function's"),
        ('[[reward]]\nmodel = "m"\n[[reward]]\nmodel = "n"\n', "one [[reward]] model at most"),
    ],
)
def test_a_reward_is_a_function_or_a_model(tmp_path: pathlib.Path, rewards: str, says: str) -> None:
    config = tmp_path / "run.toml"
    config.write_text('[model]\npath = "m"\n[data]\npath = "d.jsonl"\n' + rewards)
    with pytest.raises(oc.ConfigError, match=re.escape(says)):
        load_rl_config(str(config))


def test_a_reward_model_goes_to_the_reward_mesh(tmp_path: pathlib.Path, checkpoint: str) -> None:
    config = _write(tmp_path, checkpoint)
    config.write_text(config.read_text() + '[[reward]]\nmodel = "rm"\nweight = 0.25\n')
    with pytest.raises(oc.ConfigError, match="rm: no checkpoint there"):
        plan_rl(load_rl_config(str(config)), run_dir=str(tmp_path / "r"))
    (tmp_path / "rm").mkdir()
    (tmp_path / "rm" / "config.json").write_text("{}")  # the workers load it; here, found
    plan = plan_rl(load_rl_config(str(config)), run_dir=str(tmp_path / "r"))
    _, kwargs = plan.source.reward_args
    assert kwargs["model"] == str(tmp_path / "rm") and kwargs["model_weight"] == 0.25
    assert [f["path"] for f in kwargs["functions"]] == ["orchestr.roles.reward:exact_match"]


def _mlflow(value: str) -> str:
    return f"run.mlflow={json.dumps(value)}"


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("http://127.0.0.1:5000", "a local MLflow store only"),
        ("https://mlflow.example.com", "a local MLflow store only"),
        ("databricks", "a local MLflow store only"),
        ("databricks://profile", "a local MLflow store only"),
        ("postgresql://user@db/mlflow", "a local MLflow store only"),
        ("sqlite://", "write sqlite:///FILE.db"),
        ("file://host/mlruns", "write file:FOLDER"),
        ("file:mlruns", "only with MLFLOW_ALLOW_FILE_STORE=true"),
        ("", "give a folder"),
    ],
)
def test_mlflow_logs_to_a_local_store_only(
    value: str, says: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    config = load_rl_config(str(DIGITS), [_mlflow(value)])
    with pytest.raises(oc.ConfigError, match=re.escape(says)) as info:
        plan_rl(config, run_dir=str(tmp_path / "r"))
    assert str(info.value).startswith(f"{DIGITS}: [run] mlflow ")
    assert not (tmp_path / "r").exists()


def test_mlflow_stores_are_taken_from_the_working_directory(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Relative stores are the working directory's, as ``run.dir`` is; nothing is made when
    the run is planned, and nothing is logged without ``run.mlflow``."""
    monkeypatch.chdir(tmp_path)
    run = str(tmp_path / "r")
    assert plan_rl(load_rl_config(str(DIGITS)), run_dir=run).mlflow is None
    store = plan_rl(load_rl_config(str(DIGITS), [_mlflow("mlruns")]), run_dir=run).mlflow
    assert store is not None and store.experiment == "orchestr-rl"
    assert store.tracking_uri == f"sqlite:///{tmp_path}/mlruns/mlflow.db"
    assert store.artifact_root == str(tmp_path / "mlruns" / "mlartifacts")
    config = load_rl_config(
        str(DIGITS), [_mlflow("sqlite:///db/x.db"), "run.mlflow_experiment='e'"]
    )
    store = plan_rl(config, run_dir=run).mlflow
    assert store is not None and store.experiment == "e"
    assert store.tracking_uri == f"sqlite:///{tmp_path}/db/x.db"
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    store = plan_rl(load_rl_config(str(DIGITS), [_mlflow("file:old")]), run_dir=run).mlflow
    assert store is not None and store.tracking_uri == (tmp_path / "old").as_uri()
    assert list(tmp_path.iterdir()) == []


def test_mlflow_without_its_package_is_refused_when_planned(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)  # not importable: find_spec says None
    config = load_rl_config(str(DIGITS), [_mlflow(str(tmp_path / "mlruns"))])
    with pytest.raises(oc.ConfigError, match=re.escape("pip install 'orchestr[rl]'")) as info:
        plan_rl(config, run_dir=str(tmp_path / "r"))
    assert "needs mlflow, not installed" in str(info.value)
