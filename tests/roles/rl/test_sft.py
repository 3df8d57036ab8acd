"""An SFT run's config and rows, checked before any process starts: the loader's refusals (each
naming the file, the section, the key or row and the fix), the rows as the trainer sees them
(a chat prompt rendered with the checkpoint's template, the response's tokens and the end
token), rows too long counted, the held-out split and the order of the steps."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

import orchestr as oc
from orchestr.roles.models import Tokenizer, make_tiny
from orchestr.roles.rl import SFTConfig, load_sft_config, plan_sft, sft_config_from_dict
from orchestr.roles.rl._sft_data import SFTOrder, shares

ROOT = pathlib.Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny("llama", tmp_path_factory.mktemp("ckpt") / "model", hidden=32, heads=2)


def _rows(n: int = 40) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for i in range(n):
        if i % 2:
            rows.append({"prompt": f"Say {i % 10}:", "response": str(i % 10), "id": i})
        else:
            chat = [{"role": "user", "content": f"Say {i % 10}"}]
            rows.append({"prompt": chat, "response": str(i % 10), "id": i})
    return rows


def _write_rows(path: pathlib.Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _config(folder: pathlib.Path, checkpoint: str, extra: str = "", data: str = "") -> pathlib.Path:
    if not (folder / "train.jsonl").exists():
        _write_rows(folder / "train.jsonl", _rows())
    config = folder / "sft.toml"
    config.write_text(
        f'[model]\npath = "{checkpoint}"\n'
        f'[data]\npath = "train.jsonl"\nheld_out_size = 8\nheld_out_fraction = 0.2\n{data}'
        "[schedule]\nsteps = 4\nbatch_size = 4\n" + extra
    )
    return config


def _refused(table: dict[str, Any], match: str) -> None:
    with pytest.raises(oc.ConfigError, match=match):
        sft_config_from_dict(table, "sft.toml")


def test_the_example_config_plans(tmp_path: pathlib.Path, checkpoint: str) -> None:
    example = ROOT / "examples" / "rl" / "sft.toml"
    config = load_sft_config(str(example), [f"model.path={checkpoint}"])
    assert config.data.path == str(ROOT / "examples" / "rl" / "data" / "sft.jsonl")
    assert config.data.chat and config.schedule.steps == 60
    plan = plan_sft(config, str(tmp_path / "run"))
    assert len(plan.train) + len(plan.held_out) == 48 and len(plan.held_out) == 6
    assert plan.train.too_long == plan.held_out.too_long == 0


def test_refusals_name_the_section_the_key_and_the_fix() -> None:
    ok = {"model": {"path": "m"}, "data": {"path": "d.jsonl"}}
    _refused(
        {**ok, "schedul": {}}, r"sft.toml: unknown section 'schedul'; did you mean 'schedule'\?"
    )
    _refused({"data": ok["data"]}, r"sft.toml: an SFT run needs a \[model\] section")
    _refused({**ok, "model": {}}, r"sft.toml: \[model\]: path must be given")
    _refused(
        {**ok, "data": {"path": "d.jsonl", "respons_field": "a"}},
        r"\[data\]: unknown key 'respons_field'; did you mean 'response_field'\?",
    )
    _refused({**ok, "schedule": {"steps": "ten"}}, r"\[schedule\]\.steps must be int")
    _refused({**ok, "schedule": {"steps": 0}}, r"\[schedule\] steps must be >= 1")
    _refused(
        {**ok, "schedule": {"steps": 3, "lr_schedule": "cosine", "warmup_steps": 3}},
        r"\[schedule\] warmup must be >= 0 and, for a decaying schedule, less than steps",
    )
    _refused({**ok, "schedule": {"betas": [0.9]}}, r"\[schedule\] betas must be two numbers")
    _refused({**ok, "trainer": {"dtype": "float16"}}, r"\[trainer\] dtype must be one of")
    _refused({**ok, "trainer": {"sharding": "half"}}, r"\[trainer\] sharding must be one of")
    _refused(
        {**ok, "trainer": {"sharding": "full"}},
        r"\[trainer\] sharding='full' shards over two or more layout.trainers",
    )
    _refused(
        {**ok, "layout": {"trainers": 4}, "schedule": {"batch_size": 2}},
        r"\[layout\] 4 trainers need at least as many rows a step; raise schedule.batch_size",
    )
    _refused(
        {**ok, "run": {"checkpoint_every": 5}},
        r"\[run\]: checkpoint_every is an RL run's; an SFT run takes dir, name, export, "
        "export_every: drop it",
    )
    _refused(
        {**ok, "data": {"path": "d.jsonl", "held_out_fraction": 1.0}},
        r"\[data\] held_out_fraction must be in \[0, 1\)",
    )
    config = sft_config_from_dict(ok, "sft.toml")
    assert isinstance(config, SFTConfig) and config.update_options() == {
        "max_grad_norm": 1.0,
        "micro_batch_tokens": None,
    }


def test_files_paths_and_overrides(tmp_path: pathlib.Path, checkpoint: str) -> None:
    path = _config(tmp_path, checkpoint)
    config = load_sft_config(str(path), ["schedule.steps=7", "data.max_tokens=64"])
    assert config.data.path == str(tmp_path / "train.jsonl")  # from the file's folder
    assert config.schedule.steps == 7 and config.data.max_tokens == 64
    with pytest.raises(oc.ConfigError, match="no such config file"):
        load_sft_config(str(tmp_path / "missing.toml"))
    with pytest.raises(oc.ConfigError, match=r"--set 'steps=3': write SECTION.KEY=VALUE"):
        load_sft_config(str(path), ["steps=3"])
    no_model = load_sft_config(str(path), [f"model.path={tmp_path}"])
    with pytest.raises(oc.ConfigError, match=r"\[model\] path .*: no config.json there"):
        plan_sft(no_model, str(tmp_path / "run"))
    no_data = load_sft_config(str(path), [f"data.path={tmp_path / 'none.jsonl'}"])
    with pytest.raises(oc.ConfigError, match=r"\[data\] .*none.jsonl: no such data file"):
        plan_sft(no_data, str(tmp_path / "run"))
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "metrics.jsonl").write_text("")
    with pytest.raises(oc.ConfigError, match=r"holds a run already \(metrics.jsonl\)"):
        plan_sft(config, str(tmp_path / "used"))
    assert not (tmp_path / "run").exists()


def test_a_reasoning_gym_task_gives_questions_and_answers(checkpoint: str) -> None:
    gym = {"reasoning_gym": "leg_counting", "size": 30, "seed": 3, "held_out_size": 5}
    gym["options"] = {"min_animals": 1, "max_animals": 1, "max_instances": 1}
    config = sft_config_from_dict({"model": {"path": checkpoint}, "data": gym}, "sft.toml")
    plan = plan_sft(config, "/nonexistent/run")
    assert (len(plan.train), len(plan.held_out)) == (27, 3)  # a tenth held out, at most 5
    tok = Tokenizer(checkpoint)
    question = tok.decode(plan.train.prompts[0])
    assert "how many legs are there in total if you have 1 " in question
    assert tok.decode(plan.train.responses[0][:-1]).isdigit()  # the answer, then the end token
    assert plan.train.responses[0][-1] == tok.eos_id
    _refused(
        {"model": {"path": checkpoint}, "data": {**gym, "path": "d.jsonl"}},
        r"\[data\] data needs one of path \(a JSONL or Parquet file\) or reasoning_gym",
    )
    bad = sft_config_from_dict(
        {"model": {"path": checkpoint}, "data": {"reasoning_gym": "leg_countin"}}, "sft.toml"
    )
    with pytest.raises(oc.ConfigError, match="reasoning_gym task 'leg_countin'"):
        plan_sft(bad, "/nonexistent/run")


@pytest.mark.parametrize(
    ("row", "match"),
    [
        (
            {"prompt": "Say 1:"},
            r"row 3 has no field 'response' \(it has prompt\); set data.response_field",
        ),
        (
            {"question": "Say 1:", "response": "1"},
            r"row 3 has no field 'prompt' .*set data.prompt_field",
        ),
        ({"prompt": "Say 1:", "response": 1}, r"row 3's 'response' must be text, got int"),
        ({"prompt": {"text": "hi"}, "response": "1"}, r"row 3's 'prompt' is text or chat messages"),
        (
            {"prompt": [{"content": "hi"}], "response": "1"},
            r"row 3's messages are objects with a role",
        ),
    ],
)
def test_a_bad_row_is_named_with_its_fix(
    tmp_path: pathlib.Path, checkpoint: str, row: dict[str, Any], match: str
) -> None:
    rows = _rows(10)
    rows[2] = row
    _write_rows(tmp_path / "train.jsonl", rows)
    # every row held out or trained on is rendered: row 3 is read wherever it falls
    config = load_sft_config(str(_config(tmp_path, checkpoint)))
    with pytest.raises(oc.ConfigError, match=r"sft.toml: \[data\] .*train.jsonl: " + match):
        plan_sft(config, str(tmp_path / "run"))


def test_rows_render_as_prompt_then_response_then_the_end_token(
    tmp_path: pathlib.Path, checkpoint: str
) -> None:
    tok = Tokenizer(checkpoint)
    eos = tok.token_id("<|im_end|>")
    assert eos is not None and tok.eos_id == eos
    rows: list[dict[str, Any]] = [
        {"prompt": [{"role": "user", "content": "Say 7"}], "response": "7"},
        {"prompt": "Say 3:", "response": "3"},
    ]
    _write_rows(tmp_path / "train.jsonl", rows)
    (tmp_path / "held.jsonl").write_text(json.dumps(rows[1]) + "\n")
    config = load_sft_config(str(_config(tmp_path, checkpoint, data='held_out = "held.jsonl"\n')))
    plan = plan_sft(config, str(tmp_path / "run"))
    chat = tok.apply_chat_template(rows[0]["prompt"], add_generation_prompt=True)
    assert chat.endswith("<|im_start|>assistant\n")
    assert plan.train.prompts[0] == tok.encode(chat)
    assert plan.train.responses[0] == [*tok.encode("7"), eos]
    assert plan.train.prompts[1] == tok.encode("Say 3:", special=True)  # plain text: as it is
    assert plan.held_out.samples() == [
        {"prompt": tok.encode("Say 3:", special=True), "tokens": [*tok.encode("3"), eos]}
    ]
    assert plan.eos_id == eos and plan.trainer_kwargs()["model_kwargs"] == {"folder": checkpoint}
    # chat = true renders text as a user turn, after the system turn
    config = load_sft_config(
        str(
            _config(
                tmp_path,
                checkpoint,
                data='held_out = "held.jsonl"\nchat = true\nsystem = "Be brief."\n',
            )
        )
    )
    plan = plan_sft(config, str(tmp_path / "run"))
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say 3:"}]
    assert plan.train.prompts[1] == tok.encode(
        tok.apply_chat_template(turns, add_generation_prompt=True)
    )


def test_rows_too_long_are_left_out_and_counted(tmp_path: pathlib.Path, checkpoint: str) -> None:
    rows = _rows(40)
    for i in range(0, 40, 4):
        rows[i]["response"] = " ".join(["the model"] * 20)  # ten rows far past 24 tokens
    _write_rows(tmp_path / "train.jsonl", rows)
    config = load_sft_config(str(_config(tmp_path, checkpoint)), ["data.max_tokens=24"])
    plan = plan_sft(config, str(tmp_path / "run"))
    assert plan.train.too_long + plan.held_out.too_long == 10
    assert len(plan.train) + len(plan.held_out) == 30
    assert all(
        len(p) + len(r) <= 24 for p, r in zip(plan.train.prompts, plan.train.responses, strict=True)
    )
    config = load_sft_config(str(_config(tmp_path, checkpoint)), ["data.max_tokens=2"])
    with pytest.raises(
        oc.ConfigError, match=r"every training row of .* is longer than max_tokens \(2\)"
    ):
        plan_sft(config, str(tmp_path / "run"))


def test_the_held_out_split_and_the_order_follow_the_seed(
    tmp_path: pathlib.Path, checkpoint: str
) -> None:
    path = _config(tmp_path, checkpoint)
    plans = [
        plan_sft(load_sft_config(str(path), [f"schedule.seed={s}"]), str(tmp_path / "r"))
        for s in (0, 0, 1)
    ]
    assert len(plans[0].held_out) == 8 and len(plans[0].train) == 32
    assert plans[0].held_out.prompts == plans[1].held_out.prompts
    assert plans[0].held_out.prompts != plans[2].held_out.prompts
    order = SFTOrder(10, 4, seed=0)
    first = [r for step in range(5) for r in order.step(step)]  # two epochs of ten rows
    assert sorted(first[:10]) == sorted(first[10:]) == list(range(10))
    assert first[:10] != first[10:20]  # each epoch its own permutation
    assert SFTOrder(10, 4, seed=0).step(3) == order.step(3)  # a step's rows: from the step
    assert shares(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
