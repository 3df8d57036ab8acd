"""A trained model out as a Hugging Face folder (``export_checkpoint``, ``Trainer.export_hf``):
``transformers`` loads it with logits equal to the model's, orchestr loads and serves it, and
a folder that is not the model's, or not empty, is refused."""

from __future__ import annotations

import asyncio
import json
import pathlib

import pytest
import torch

import orchestr as oc
from orchestr.roles import Generator, Request, Trainer, models

transformers = pytest.importorskip("transformers")


def _trained(folder: pathlib.Path) -> models.CausalLM:
    """The checkpoint's model with every weight moved, as training moves them."""
    model = models.load_model(folder)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: the output head tied
def test_transformers_loads_the_export_with_the_models_logits(
    tmp_path: pathlib.Path, arch: str
) -> None:
    source = pathlib.Path(models.make_tiny(arch, tmp_path / "src", layers=2, hidden=64))
    model = _trained(source)
    out = pathlib.Path(models.export_checkpoint(model, source, tmp_path / "out"))
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert {p.stat().st_mode & 0o777 for p in out.iterdir()} == {0o644}
    ref = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.tensor([[1, 5, 9, 17, 33, 2, 7]])
    with torch.no_grad():
        ours = model(tokens)
        theirs = ref(tokens).logits
    assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()
    before = models.load_model(source)(tokens)
    assert not torch.allclose(before, theirs, atol=1e-3)  # the training travelled
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == models.Tokenizer(source).chat_template
    gen_cfg = json.loads((out / "generation_config.json").read_text())
    assert (
        gen_cfg["eos_token_id"] == json.loads((source / "config.json").read_text())["eos_token_id"]
    )
    # orchestr loads it back to the same weights
    again = models.load_model(out)
    assert all(
        torch.equal(a, b)
        for a, b in zip(again.state_dict().values(), model.state_dict().values(), strict=True)
    )


def test_a_model_of_another_checkpoint_or_a_full_folder_is_refused(tmp_path: pathlib.Path) -> None:
    a = pathlib.Path(models.make_tiny("llama", tmp_path / "a", layers=1, hidden=32))
    b = pathlib.Path(models.make_tiny("llama", tmp_path / "b", layers=2, hidden=32))
    with pytest.raises(oc.ConfigError, match="config differs"):
        models.export_checkpoint(models.load_model(a), b, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(oc.ConfigError, match="only orchestr's Hugging Face format models"):
        models.export_checkpoint(torch.nn.Linear(2, 2), a, tmp_path / "out")
    models.export_checkpoint(models.load_model(a), a, tmp_path / "out")
    with pytest.raises(oc.ConfigError, match="already holds a checkpoint"):
        models.export_checkpoint(models.load_model(a), a, tmp_path / "out")
    models.export_checkpoint(models.load_model(a), a, tmp_path / "out", force=True)


async def test_a_trainers_export_is_served_by_a_generator(
    ctx: oc.JobContext, tmp_path: pathlib.Path
) -> None:
    source = models.make_tiny("llama", tmp_path / "src", layers=1, hidden=32)
    # (the generator of the source checkpoint, the reference below, starts beside the trainer)
    trainer, ref = await asyncio.gather(
        ctx.spawn(
            Trainer,
            model_factory="orchestr.roles.models:load_model",
            model_kwargs={"folder": source},
        ),
        ctx.spawn(Generator, checkpoint=source, torch_threads=1),
    )
    out = await trainer.export_hf.call_one(str(tmp_path / "out"))
    gen = await ctx.spawn(Generator, checkpoint=out, torch_threads=1)
    (done,) = await gen.generate.call_one([Request("r", [1, 5, 9], 4, temperature=0.0)])
    assert len(done.tokens) == 4
    # the same tokens as the checkpoint it came from: the trainer has not stepped yet
    (same,) = await ref.generate.call_one([Request("r", [1, 5, 9], 4, temperature=0.0)])
    assert done.tokens == same.tokens


async def test_a_sharded_pair_exports_from_its_shards(
    ctx: oc.JobContext, tmp_path: pathlib.Path
) -> None:
    # qwen2: biases and a tied output head. Rank 0 writes each tensor as it is gathered; the
    # file is the one a whole trainer writes, tensor for tensor
    source = models.make_tiny("qwen2", tmp_path / "src", layers=2, hidden=64)
    kwargs: dict[str, object] = {"model_factory": "orchestr.roles.models:load_model"}
    kwargs |= {"model_kwargs": {"folder": source}, "torch_threads": 1}
    pair = await ctx.spawn(Trainer, n=2, resources={"cpu": 0.5}, sharding="full", **kwargs)
    whole = await ctx.spawn(Trainer, **kwargs)
    await ctx.init_distributed(pair)
    out = str(tmp_path / "sharded")
    assert await pair.export_hf.call(out) == [out, out]
    want = await whole.export_hf.call_one(str(tmp_path / "whole"))
    from safetensors.torch import load_file

    got, ref = (load_file(f"{f}/model.safetensors") for f in (out, want))
    assert got.keys() == ref.keys() and "lm_head.weight" not in got
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.tensor([[1, 5, 9, 17]])
    with torch.no_grad():
        ours = models.load_model(source)(tokens)
        assert torch.allclose(loaded(tokens).logits, ours, atol=1e-5)
    # a refused folder on rank 0: the other member's gathers still end, and the group works
    with pytest.raises(oc.ActorError, match="already holds a checkpoint"):
        await pair.export_hf.call(out)
    digests = await pair.digest.call()  # a collective: both members are free
    assert digests[0]["digest"] == digests[1]["digest"]
