"""Hugging Face format checkpoints in orchestr's own modules, against ``transformers`` (the
reference implementation): logits, greedy tokens, the chat template, and the errors a bad
folder gets."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import orchestr as oc
from orchestr.roles import models
from orchestr.roles.rl import _task

TEXTS = [
    "reverse 1 2 3 -> 3 2 1",
    "it's 42, isn't it?\n\n  Caf\u00e9  ",
    "the model",
    "please answer the user: the first long token of the layer block cache",
    "a",
]


def make(tmp: pathlib.Path, arch: str, **kw: object) -> pathlib.Path:
    return pathlib.Path(models.make_tiny(arch, tmp / arch, **kw))


def reference(folder: pathlib.Path) -> Any:
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    model.train(False)
    return model


def batch(tok: models.Tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    ids = [tok.encode(t, special=True) for t in TEXTS]
    width = max(map(len, ids))
    tokens = torch.tensor([i + [0] * (width - len(i)) for i in ids])
    return tokens, torch.tensor([len(i) for i in ids])


@pytest.mark.parametrize(
    ("arch", "kw"),
    [
        ("llama", {"shards": 3}),  # sharded, with an index
        ("qwen2", {}),  # qkv bias, tied embeddings
        ("llama", {"kv_heads": 1, "layers": 3}),  # multi-query
        ("qwen2_moe", {"layers": 3, "experts": 6, "experts_per_token": 2}),  # experts
    ],
)
def test_logits_and_greedy_tokens_match_transformers(
    tmp_path: pathlib.Path, arch: str, kw: dict[str, object]
) -> None:
    folder = make(tmp_path, arch, **kw)
    ours, ref, tok = models.load_model(folder), reference(folder), models.Tokenizer(folder)
    assert ours.config.tie_word_embeddings == (arch == "qwen2")
    assert (ours.config.moe is not None) == (arch == "qwen2_moe")
    tokens, lengths = batch(tok)  # mixed lengths in one batch, right-padded
    mask = (torch.arange(tokens.shape[1])[None] < lengths[:, None]).long()
    with torch.no_grad():
        got = ours(tokens, lengths)
        want = ref(input_ids=tokens, attention_mask=mask).logits
    for row, n in enumerate(lengths.tolist()):
        assert (got[row, :n] - want[row, :n]).abs().max().item() < 1e-4
    # 64 greedy tokens, recomputing the whole sequence each step
    prompt = tok.encode(TEXTS[0], special=True)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(64):
            seq.append(int(ours(torch.tensor([seq]))[0, -1].argmax()))
        out = ref.generate(
            torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False
        )
    assert seq == out[0].tolist()


def test_experts_layouts_match_transformers(tmp_path: pathlib.Path) -> None:
    """Dense layers among sparse ones (mlp_only_layers, decoder_sparse_step), renormalised
    top-k weights, and each part of a sparse layer called on its own."""
    folder = make(tmp_path, "qwen2_moe", layers=4, experts=5, experts_per_token=3)
    _edit_config(folder, mlp_only_layers=[0], decoder_sparse_step=2, norm_topk_prob=True)
    torch.manual_seed(1)
    fresh = models.CausalLM(models.read_config(folder))  # weights for the new layout
    with torch.no_grad():
        for name, p in fresh.named_parameters():
            p.normal_(
                1.0 if name.endswith("norm.weight") else 0.0, 0.5 if ".gate." in name else 0.05
            )
    save_file(
        {k: v.contiguous() for k, v in fresh.state_dict().items()}, folder / "model.safetensors"
    )
    ours, ref = models.load_model(folder), reference(folder)
    kinds = [type(layer.mlp).__name__ for layer in ours.model.layers]
    assert kinds == ["MLP", "SparseMoE", "MLP", "SparseMoE"]
    tokens = torch.randint(0, 300, (2, 50))
    with torch.no_grad():
        assert (ours(tokens) - ref(input_ids=tokens).logits).abs().max().item() < 1e-4
        moe = ours.model.layers[1].mlp
        assert isinstance(moe, models.SparseMoE)
        x = torch.randn(7, ours.config.hidden_size)
        experts, weights = moe.route(x)
        assert experts.shape == (7, 3) and torch.allclose(weights.sum(-1), torch.ones(7))
        parts = moe.run_experts(x, experts, weights) + moe.shared(x)
        assert torch.equal(parts, moe(x))
        one = moe.run_experts(x[:1], experts[:1], weights[:1])
        by_hand = sum(
            w * moe.experts[e](x[:1]) for e, w in zip(experts[0], weights[0], strict=True)
        )
        assert torch.allclose(one, by_hand, atol=1e-6)
    for bad, match in [
        ({"num_experts_per_tok": 9}, r"num_experts_per_tok \(9\) exceeds num_experts \(5\)"),
        ({"mlp_only_layers": [7]}, r"mlp_only_layers must list layer numbers in \[0, 4\)"),
        ({"moe_intermediate_size": None}, "moe_intermediate_size is missing"),
    ]:
        _edit_config(folder, **bad)
        with pytest.raises(oc.ConfigError, match=match):
            models.load_model(folder)
        _edit_config(folder, num_experts_per_tok=3, mlp_only_layers=[0], moe_intermediate_size=64)


def test_rope_scaling_matches_transformers(tmp_path: pathlib.Path) -> None:
    for kind, extra in [
        ("linear", {"factor": 4.0}),
        (
            "llama3",
            {
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ]:
        folder = models.make_tiny("llama", tmp_path / kind, rope_theta=500000.0)
        config = json.loads((folder_path := pathlib.Path(folder) / "config.json").read_text())
        config["rope_scaling"] = {"rope_type": kind, **extra}
        folder_path.write_text(json.dumps(config))
        ours, ref = models.load_model(folder), reference(pathlib.Path(folder))
        assert ours.config.rope_scaling.type == kind
        tokens = torch.randint(0, 300, (2, 200))  # past the original context for llama3
        with torch.no_grad():
            diff = (ours(tokens) - ref(input_ids=tokens).logits).abs().max().item()
        assert diff < 1e-4, kind


@pytest.mark.parametrize("arch", models.ARCHS)
def test_tokenizer_and_chat_template_match_transformers(tmp_path: pathlib.Path, arch: str) -> None:
    folder = make(tmp_path, arch)
    ours, ref = models.Tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        assert ours.encode(text, special=True) == ref(text)["input_ids"]
        assert ours.decode(ours.encode(text)) == text
    messages = [
        {"role": "system", "content": "reverse the digits"},
        {"role": "user", "content": "1 2 3"},
        {"role": "assistant", "content": "3 2 1"},
    ]
    for prompt in (False, True):
        assert ours.apply_chat_template(
            messages, add_generation_prompt=prompt
        ) == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
    assert ours.eos_id == models.read_config(folder).eos_token_ids[0]


def _edit_config(folder: pathlib.Path, **changes: object) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_bad_checkpoints_get_clear_errors(tmp_path: pathlib.Path) -> None:
    folder = make(tmp_path, "llama")
    weights = folder / "model.safetensors"
    state = load_file(weights)
    with pytest.raises(oc.ConfigError, match="no config.json"):
        models.load_model(tmp_path)
    _edit_config(folder, model_type="gpt2")
    with pytest.raises(oc.ConfigError, match="model_type 'gpt2' is not supported"):
        models.load_model(folder)
    _edit_config(folder, model_type="llama", rope_scaling={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(oc.ConfigError, match="rope scaling 'yarn' is not supported"):
        models.load_model(folder)
    _edit_config(folder, rope_scaling=None, num_key_value_heads=3)
    with pytest.raises(oc.ConfigError, match=r"num_attention_heads \(4\) is not a multiple"):
        models.load_model(folder)
    _edit_config(folder, num_key_value_heads=2, hidden_size="64")
    with pytest.raises(oc.ConfigError, match="hidden_size must be a positive integer"):
        models.load_model(folder)
    _edit_config(folder, hidden_size=64)
    models.load_model(folder)  # whole again

    name = "model.layers.1.mlp.up_proj.weight"
    save_file({k: v for k, v in state.items() if k != name}, weights)
    with pytest.raises(oc.ConfigError, match=f"model.safetensors: missing tensor '{name}'"):
        models.load_model(folder)
    save_file({**state, name: state[name][:, :-1].contiguous()}, weights)
    with pytest.raises(oc.ConfigError, match=rf"'{name}' has shape \(160, 63\).*\(160, 64\)"):
        models.load_model(folder)
    save_file({**state, "model.layers.9.mlp.up_proj.weight": state[name].clone()}, weights)
    with pytest.raises(oc.ConfigError, match="'model.layers.9.mlp.up_proj.weight' is not part"):
        models.load_model(folder)
    weights.write_bytes(b"not safetensors")
    with pytest.raises(oc.ConfigError, match="not a readable safetensors file"):
        models.load_model(folder)

    sharded = make(tmp_path, "qwen2", shards=2)
    index = sharded / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["model.norm.weight"] = "../elsewhere.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(oc.ConfigError, match="names a bad file '../elsewhere.safetensors'"):
        models.load_model(sharded)
    index.write_text("{")
    with pytest.raises(oc.ConfigError, match="not a safetensors index"):
        models.load_model(sharded)
    (sharded / "tokenizer.json").write_text("{}")
    with pytest.raises(oc.ConfigError, match="tokenizer.json: not a readable tokenizer"):
        models.Tokenizer(sharded)


@pytest.mark.timeout(180)  # seven CLI processes, each importing torch
def test_make_tiny_command(tmp_path: pathlib.Path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "orchestr.cli", "model", "make-tiny", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)

    done = cli("--arch", "qwen2", str(tmp_path / "q"), "--layers", "3", "--hidden", "32")
    assert done.returncode == 0, done.stderr
    assert "qwen2, 3 layers, hidden 32" in done.stdout
    assert models.read_config(tmp_path / "q").num_hidden_layers == 3
    # the rest write folders of their own (or none): they run at once
    runs = [
        ("--arch", "qwen2_moe", str(tmp_path / "e"), "--experts", "3", "--intermediate", "16"),
        ("--arch", "qwen2", str(tmp_path / "q")),
        ("--arch", "gpt2", str(tmp_path / "g")),
        ("--arch", "llama", str(tmp_path / "z"), "--layers", "0"),
        ("--arch", "llama", str(tmp_path / "t"), "--tokenizer", "words"),
        ("--arch", "llama", str(tmp_path / "s"), "--init-std", "0"),
    ]
    with ThreadPoolExecutor(len(runs)) as pool:
        moe, again, arch, layers, tokenizer, init_std = pool.map(lambda a: cli(*a), runs)
    assert moe.returncode == 0, moe.stderr
    assert "3 experts" in moe.stdout
    assert models.read_config(tmp_path / "e").moe == models.MoEConfig(3, 2, 16, 128)
    assert again.returncode == 2 and "already holds a checkpoint" in again.stderr
    assert arch.returncode == 2 and "unknown arch 'gpt2'" in arch.stderr
    assert layers.returncode == 2
    assert tokenizer.returncode == 2 and "unknown tokenizer 'words'" in tokenizer.stderr
    assert init_std.returncode == 2 and "init_std must be in (0, 1)" in init_std.stderr


def test_digits_tokenizer_has_the_digit_tasks_ids(tmp_path: pathlib.Path) -> None:
    folder = models.make_tiny("llama", tmp_path / "d", tokenizer="digits", max_positions=64)
    ours, ref = models.Tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    prompt = [_task.BOS, 0, 1, 9, _task.FILL, _task.FILL, _task.SEP]
    text = "<s>019__<sep>"
    assert ours.encode(text, special=True) == ref(text, add_special_tokens=False)["input_ids"]
    assert ours.encode(text, special=True) == prompt
    assert ours.decode([9, 1, 0, _task.EOS]) == "910"  # the end marker is special: not shown
    cfg = models.read_config(folder)
    assert (cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_ids, cfg.pad_token_id) == (
        _task.FILL + 1,
        _task.BOS,
        (_task.EOS,),
        _task.PAD,
    )
    assert cfg.max_position_embeddings == 64
    with pytest.raises(ValueError, match="cannot encode '12a'"):  # no unknown token to map to
        ours.encode("12a")
