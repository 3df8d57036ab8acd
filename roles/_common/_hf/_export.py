"""A model's weights out as a Hugging Face folder: :func:`export_checkpoint`.

What a trainer learns leaves orchestr as a folder ``transformers`` and ``orchestr serve``
load: the model's weights as ``model.safetensors`` (under the checkpoint's own tensor names:
orchestr's modules are named as Hugging Face's are; a tied output head is left out, as
Hugging Face saves it), the source checkpoint's ``config.json`` (its ``torch_dtype`` the
weights'), its tokenizer files and chat template as they were, and a
``generation_config.json`` (the source's, else one with its special token ids). The folder
is written as :class:`~._folder.CheckpointFolder` writes one: never through a link, new files
only, a folder that is not empty refused unless ``force``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import torch
from safetensors.torch import save

import orchestr as oc

from ._config import read_config
from ._folder import CheckpointFolder
from ._layers import CausalLM

__all__ = ["export_checkpoint"]

#: Files of the source checkpoint copied as they are, where it has them.
COPIED = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def export_checkpoint(
    model: torch.nn.Module,
    source: str | os.PathLike[str],
    folder: str | os.PathLike[str],
    *,
    force: bool = False,
    state: Mapping[str, torch.Tensor] | None = None,
) -> str:
    """Write ``model`` (an orchestr :class:`CausalLM` of the checkpoint in ``source``, its
    weights changed by training) to ``folder`` as a Hugging Face checkpoint; returns the
    folder's path. Blocks on the writes (the weights once, in memory first). Raises
    :class:`ConfigError` for a model that is not ``source``'s architecture and shapes, a
    ``source`` that is not a checkpoint, and what :class:`CheckpointFolder` refuses (a folder
    that is not empty, unless ``force``; one another user owns or may write to); a failed
    export leaves no partial folder behind. Not idempotent without ``force``. ``state``, when
    given, is written instead of the model's own (a sharded model's tensors, gathered)."""
    source = os.fspath(source)
    if not isinstance(model, CausalLM):
        raise oc.ConfigError(
            f"only orchestr's Hugging Face format models export, not {type(model).__name__}"
        )
    cfg = read_config(source)
    if cfg != model.config:
        raise oc.ConfigError(
            f"the model is not the one {source} describes: its config differs; export from "
            f"the checkpoint the model was loaded from"
        )
    with open(os.path.join(source, "config.json"), "rb") as f:
        raw = json.load(f)
    own = model.state_dict() if state is None else state
    state = {k: v.detach().to("cpu").contiguous() for k, v in own.items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    dtypes = {t.dtype for t in state.values()}
    if len(dtypes) == 1:
        raw["torch_dtype"] = str(dtypes.pop()).removeprefix("torch.")
    generation = _generation_config(source, raw)
    parent = os.path.dirname(os.path.abspath(folder))
    os.makedirs(parent, exist_ok=True)  # the folder itself is made (and checked) below
    with CheckpointFolder(folder, force=force) as out:
        out.write("model.safetensors", save(state, metadata={"format": "pt"}))
        out.write("config.json", _json(raw))
        out.write("generation_config.json", _json(generation))
        for name in COPIED:
            path = os.path.join(source, name)
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    out.write(name, f.read())
    return out.path


def _generation_config(source: str, raw: dict[str, object]) -> dict[str, object]:
    path = os.path.join(source, "generation_config.json")
    if os.path.isfile(path):
        with open(path, "rb") as f:
            loaded: dict[str, object] = json.load(f)
            return loaded
    out: dict[str, object] = {"_from_model_config": True}
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if k in raw:
            out[k] = raw[k]
    return out


def _json(value: object) -> bytes:
    return json.dumps(value, indent=2, sort_keys=True).encode() + b"\n"
