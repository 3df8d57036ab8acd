"""A neural reward model: ``...ForSequenceClassification`` checkpoints loaded into orchestr's
own decoder and scored against ``transformers`` (the reference), the checkpoints refused, and
the reward mesh scoring rows with a model beside a rule function, in process and on a
cluster. Tiny models (hidden 32, two layers) keep it quick; CPU only."""

from __future__ import annotations

import json
import pathlib
import shutil
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForSequenceClassification

import orchestr as oc
from orchestr.roles import models
from orchestr.roles.reward import Reward
from orchestr.roles.reward._model import BATCH_ROWS
from tests.reward_models import classifier

TEXTS = [
    "reverse 1 2 3 -> 3 2 1",
    "the model",
    "a",
    "please answer the user: the first long token of the layer block cache",
    "it's 42, isn't it?\n\n  Caf\u00e9  ",
]
LENGTH = "tests.roles.reward.functions:length"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    """Causal LMs (``llama``, ``qwen2``, ``digits``: a llama with the digit tokenizer) and a
    reward model made from each (``rm-<name>``)."""
    root = tmp_path_factory.mktemp("reward-models")
    out = {}
    for name, arch, kw in [
        ("llama", "llama", {}),
        ("qwen2", "qwen2", {}),
        ("digits", "llama", {"tokenizer": "digits"}),
    ]:
        lm = pathlib.Path(models.make_tiny(arch, root / name, hidden=32, heads=2, **kw))
        out[name] = lm
        out[f"rm-{name}"] = classifier(lm, root / f"rm-{name}", arch)
    return out


def edited(source: pathlib.Path, dest: pathlib.Path, **changes: Any) -> pathlib.Path:
    """A copy of the checkpoint ``source`` with ``changes`` to its config (None removes)."""
    shutil.copytree(source, dest)
    raw = json.loads((dest / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    (dest / "config.json").write_text(json.dumps(raw))
    return dest


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_scores_match_transformers(folders: dict[str, pathlib.Path], arch: str) -> None:
    folder = folders[f"rm-{arch}"]
    ours = models.load_reward_model(folder)
    ref = AutoModelForSequenceClassification.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    ref.train(False)
    tok = models.Tokenizer(folder)
    ids = [tok.encode(t, special=True) for t in TEXTS]
    assert len({len(i) for i in ids}) >= 4  # lengths differ: rows are padded
    pad = ref.config.pad_token_id
    width = max(map(len, ids))
    tokens = torch.tensor([i + [pad] * (width - len(i)) for i in ids])
    with torch.no_grad():
        want = ref(input_ids=tokens, attention_mask=(tokens != pad).long()).logits[:, 0]
    got = ours.score(ids)
    assert all(isinstance(x, float) for x in got)
    torch.testing.assert_close(torch.tensor(got), want, atol=1e-5, rtol=1e-5)
    assert min(abs(a - b) for a in got for b in got if a is not b) > 1e-3  # not a constant
    # one at a time: padding changes nothing
    alone = [ours.score([i])[0] for i in ids]
    torch.testing.assert_close(torch.tensor(alone), torch.tensor(got), atol=1e-5, rtol=1e-5)
    assert ours.score([]) == []


def test_checkpoints_that_are_not_one_label_reward_models_are_refused(
    folders: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    rm = folders["rm-llama"]
    cases = [
        (
            folders["llama"],
            "LlamaForCausalLM.*a causal LM .*not a reward model.*one of "
            "LlamaForSequenceClassification, Qwen2ForSequenceClassification",
        ),
        (
            edited(rm, tmp_path / "mistral", architectures=["MistralForSequenceClassification"]),
            "MistralForSequenceClassification.*not a reward model orchestr loads",
        ),
        (edited(rm, tmp_path / "none", architectures=None), "architectures is None"),
        (
            edited(rm, tmp_path / "type", model_type="qwen2"),
            "architectures is LlamaForSequenceClassification but model_type is 'qwen2'",
        ),
        (
            edited(rm, tmp_path / "two", id2label={"0": "bad", "1": "good"}, label2id=None),
            "a reward model has one label .*got 2",
        ),
        (
            edited(rm, tmp_path / "unsaid", id2label=None, label2id=None),
            "got no num_labels or id2label \\(transformers takes 2\\)",
        ),
        (edited(rm, tmp_path / "three", num_labels=3), "got 3"),
    ]
    for folder, message in cases:
        with pytest.raises(oc.ConfigError, match=message):
            models.load_reward_model(folder)
    # weights that do not match: an LM head beside the score head, or no score head
    extra = edited(rm, tmp_path / "extra")
    state = load_file(extra / "model.safetensors")
    save_file(
        state | {"lm_head.weight": state["model.embed_tokens.weight"].clone()},
        extra / "model.safetensors",
    )
    with pytest.raises(oc.ConfigError, match="'lm_head.weight' is not part of a Llama"):
        models.load_reward_model(extra)
    del state["score.weight"]
    save_file(state, extra / "model.safetensors")
    with pytest.raises(oc.ConfigError, match="missing tensor 'score.weight'"):
        models.load_reward_model(extra)
    # what score refuses, by sequence
    model = models.load_reward_model(rm)
    vocab, most = model.config.vocab_size, model.max_length
    for ids, message in [
        ([], "sequence 1: nothing to score"),
        ([1, vocab], f"sequence 1: token id {vocab} is outside the model's vocabulary"),
        ([1] * (most + 1), f"sequence 1: {most + 1} tokens, over the model's {most} positions"),
    ]:
        with pytest.raises(ValueError, match=message):
            model.score([[1, 2], ids])


def test_the_reward_constructor_refuses_a_bad_model(folders: dict[str, pathlib.Path]) -> None:
    rm = str(folders["rm-llama"])
    with pytest.raises(oc.ConfigError, match="a causal LM"):
        Reward(model=str(folders["llama"]))
    with pytest.raises(oc.ConfigError, match="no config.json"):
        Reward(model="/nowhere")
    with pytest.raises(oc.ConfigError, match="a scorer or a model, not both"):
        Reward("tests.roles.scorers:length_ratio", model=rm)
    with pytest.raises(oc.ConfigError, match="model_name 'length' is also a reward function"):
        Reward(functions=[{"path": LENGTH}], model=rm, model_name="length")
    with pytest.raises(oc.ConfigError, match="model_name is a non-empty string"):
        Reward(model=rm, model_name="")
    with pytest.raises(oc.ConfigError, match="model_weight is a finite number"):
        Reward(model=rm, model_weight=float("inf"))
    with pytest.raises(oc.ConfigError, match="torch_threads is above 0"):
        Reward(model=rm, torch_threads=0)


async def test_a_model_alone_scores_text_cuts_long_rows_and_counts_failures(
    folders: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    # a model of 8 positions: a longer text keeps its last 8 tokens
    rm = edited(folders["rm-llama"], tmp_path / "short", max_position_embeddings=8)
    model, tok = models.load_reward_model(rm), models.Tokenizer(rm)
    actor = Reward(model=str(rm), model_weight=-2.0, default=-9.0, torch_threads=1)
    long_text = "please answer the user: the first long token of the layer block cache"
    rows = [{"prompt": "the ", "completion": "model"}, {"prompt": long_text, "completion": "!"}]
    rows += [{"prompt": "a", "completion": f" {i}"} for i in range(BATCH_ROWS)]  # two batches
    result = await actor.score_rows(rows)
    ids = [tok.encode(r["prompt"] + r["completion"], special=True) for r in rows]
    assert len(ids[1]) > 8 and all(len(i) <= 8 for i in ids[:1] + ids[2:])
    want = model.score([i[-8:] for i in ids])
    torch.testing.assert_close(
        torch.tensor(result["per_function"]["reward_model"]), torch.tensor(want)
    )
    torch.testing.assert_close(torch.tensor(result["rewards"]), -2.0 * torch.tensor(want))
    assert result["failures"] == {"reward_model": {"error": 0, "timeout": 0}}
    stats = actor.stats()
    assert stats["functions"] == [] and stats["model"] == "reward_model"
    assert stats["truncated"] == 1 and stats["scored"] == len(rows) and stats["starts"] == 0
    # text the reward model's tokenizer cannot spell (digits only) scores the default
    digits = Reward(model=str(folders["rm-digits"]), default=-9.0)
    result = await digits.score_rows(
        [{"prompt": "12", "completion": "3"}, {"prompt": "12", "completion": "abc"}]
    )
    assert result["per_function"]["reward_model"][1] == -9.0
    assert result["per_function"]["reward_model"][0] != -9.0
    assert result["failures"]["reward_model"] == {"error": 1, "timeout": 0}
    assert "row 1: this tokenizer cannot encode" in digits.stats()["last_error"]["reward_model"]
    await actor.aclose()
    await digits.aclose()


async def test_the_reward_mesh_adds_the_model_to_a_function_on_a_cluster(
    ctx: oc.JobContext, folders: dict[str, pathlib.Path]
) -> None:
    """The policy (digits) and the reward model (BPE) have different vocabularies: the model
    scores the text, completion_ids decoded with the policy's tokenizer."""
    rm, policy = folders["rm-llama"], folders["digits"]
    mesh = await ctx.spawn(
        Reward,
        functions=[{"path": LENGTH, "weight": 0.25}],
        tokenizer=str(policy),
        model=str(rm),
        model_weight=0.5,
        model_name="rm",
        torch_threads=1,
        resources={"cpu": 0.25},
    )
    digit_tok = models.Tokenizer(policy)
    rows: list[dict[str, Any]] = [
        {"prompt": "reverse 1 2 3 -> ", "completion": "3 2 1"},
        {"prompt": "the model", "completion": ""},
        {"prompt": "12 -> ", "completion_ids": digit_tok.encode("21")},
    ]
    result = await mesh[0].score_rows.call_one(rows)
    texts = [(r["prompt"], r.get("completion", "21")) for r in rows]
    model, tok = models.load_reward_model(rm), models.Tokenizer(rm)
    own = model.score([tok.encode(p + c, special=True) for p, c in texts])
    torch.testing.assert_close(torch.tensor(result["per_function"]["rm"]), torch.tensor(own))
    assert result["per_function"]["length"] == [5.0, 0.0, 2.0]
    want = [0.5 * s + 0.25 * len(c) for s, (_, c) in zip(own, texts, strict=True)]
    torch.testing.assert_close(torch.tensor(result["rewards"]), torch.tensor(want))
    assert result["failures"] == {
        "length": {"error": 0, "timeout": 0},
        "rm": {"error": 0, "timeout": 0},
    }
    stats = await mesh[0].stats.call_one()
    assert stats["functions"] == ["length"] and stats["model"] == "rm" and stats["scored"] == 3
