"""Which engine a Generator runs, and the errors for options that do not fit it; without vLLM
installed, ``engine="vllm"`` says how to install it (vLLM itself: ``test_vllm_engine.py``)."""

from __future__ import annotations

import pathlib
import sys

import pytest

import orchestr as oc
from orchestr.roles import models
from orchestr.roles._common._backend import choose_backend
from orchestr.roles.generator import Engine, KVOptions, PagedKV, RecomputeEngine
from orchestr.roles.generator._engines._build import build_engine
from orchestr.roles.generator._engines._paged import PagedEngine
from orchestr.roles.generator._engines._vllm import VllmEngine


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return pathlib.Path(models.make_tiny("llama", tmp_path_factory.mktemp("m") / "llama"))


def build(**options: object) -> object:
    args: dict[str, object] = {
        "engine": None,
        "checkpoint": None,
        "kv": None,
        "vllm": None,
        "model_kwargs": None,
        "version": 0,
        "eos_id": None,
        "pad_id": None,
        "max_seq_len": None,
        "vocab_size": None,
    }
    args.update(options)
    return build_engine(choose_backend("cpu"), "orchestr.roles:TinyLM", 0, 4, **args)[1]


def test_the_engine_follows_the_model_unless_named(folder: pathlib.Path) -> None:
    assert isinstance(build(), RecomputeEngine)
    assert isinstance(build(checkpoint=str(folder)), PagedEngine)
    assert isinstance(
        build(engine="paged", checkpoint=str(folder), kv=KVOptions(num_blocks=8)), PagedEngine
    )
    assert isinstance(build(engine="recompute"), RecomputeEngine)


def test_every_engine_keeps_the_contract_and_only_the_paged_one_lends_its_blocks(
    folder: pathlib.Path,
) -> None:
    recompute, paged = build(), build(checkpoint=str(folder))
    assert isinstance(recompute, Engine) and not isinstance(recompute, PagedKV)
    assert isinstance(paged, Engine) and isinstance(paged, PagedKV)
    for name in dir(PagedKV):  # nothing of the contract is left for a subclass to add
        if not name.startswith("_"):
            assert hasattr(PagedEngine, name), name
    for name in dir(Engine):
        if not name.startswith("_"):
            assert hasattr(RecomputeEngine, name) and hasattr(VllmEngine, name), name


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"engine": "sglang"}, "engine must be one of recompute, paged, vllm, sim, got 'sglang'"),
        ({"engine": "paged"}, "engine='paged' runs a checkpoint; give checkpoint=DIR"),
        ({"engine": "vllm"}, "engine='vllm' runs a checkpoint; give checkpoint=DIR"),
        ({"engine": "recompute", "checkpoint": "X"}, "drop checkpoint="),
        ({"kv": KVOptions(num_blocks=8)}, "kv options apply to a checkpoint's paged engine"),
        ({"engine": "vllm", "checkpoint": "X", "kv": KVOptions(num_blocks=8)}, "kv options apply"),
        ({"checkpoint": "X", "vllm": {"block_size": 32}}, "vllm options apply to engine='vllm'"),
    ],
)
def test_options_that_do_not_fit_the_engine_are_refused(
    options: dict[str, object], error: str
) -> None:
    with pytest.raises(oc.ConfigError, match=error.replace("(", r"\(").replace(")", r"\)")):
        build(**options)


def test_without_vllm_installed_the_error_says_how_to_get_it(
    folder: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # an import of it fails, as if absent
    with pytest.raises(oc.ConfigError, match=r"pip install 'orchestr\[vllm\]'"):
        VllmEngine(str(folder))
    with pytest.raises(oc.ConfigError, match=r"orchestr\[vllm\]"):
        build(engine="vllm", checkpoint=str(folder))
