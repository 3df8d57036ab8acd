"""A model's weights out as a Hugging Face folder: :func:`export_checkpoint`.

What a trainer learns leaves orchestr as a folder ``transformers`` and ``orchestr serve``
load: the model's weights as ``model.safetensors`` (under the checkpoint's own tensor names:
orchestr's modules are named as Hugging Face's are; a tied output head is left out, as
Hugging Face saves it), the source checkpoint's ``config.json`` (its ``torch_dtype`` the
weights'), its tokenizer files and chat template as they were, and a
``generation_config.json`` (the source's, else one with its special token ids). The folder
is written as :class:`~._folder.CheckpointFolder` writes one: never through a link, new files
only, a folder that is not empty refused unless ``force``.

A sharded model exports with :func:`export_streamed`: its tensors arrive whole one at a time
(each gathered from the shards) and go into the file as they come, so the writer never holds
the whole model. The ``safetensors`` library writes only a whole dict of tensors held in
memory, so that file is laid out here, to the format's specification: an 8-byte
little-endian header length, the JSON header (each tensor's dtype, shape and byte range;
padded with spaces to 8 bytes), then the tensors' bytes in that order. Both ``safetensors``
and ``transformers`` read it (tested).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from safetensors.torch import save

import orchestr as oc

from ._config import read_config
from ._folder import CheckpointFolder
from ._layers import CausalLM

__all__ = ["export_checkpoint", "export_streamed"]

#: The safetensors format's dtype names.
_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}

#: A tensor of a streamed export: its name, dtype and shape.
Entry = tuple[str, torch.dtype, tuple[int, ...]]

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
    given, is written instead of the model's own (a sharded model streams instead:
    :func:`export_streamed`)."""
    raw, config = _source_config(model, source)
    own = model.state_dict() if state is None else state
    state = {k: v.detach().to("cpu").contiguous() for k, v in own.items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    dtypes = {t.dtype for t in state.values()}
    weights = (save(state, metadata={"format": "pt"}),)
    return _write_folder(os.fspath(source), folder, raw, dtypes, weights, force)


def export_streamed(
    model: torch.nn.Module,
    source: str | os.PathLike[str],
    folder: str | os.PathLike[str],
    entries: Sequence[Entry],
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    force: bool = False,
) -> str:
    """:func:`export_checkpoint` of a model whose tensors arrive whole one at a time:
    ``entries`` says each one's name, dtype and shape in the order ``tensors`` yields them
    (a tied output head among them is left out of the file). Each is written as it comes;
    the writer holds one tensor at a time. Raises what :func:`export_checkpoint` raises, and
    :class:`ConfigError` when a tensor is not the one ``entries`` announced (the folder is
    then left as a failed export leaves it). ``tensors`` may be left part-consumed when this
    raises: a caller whose tensors are collectives drains it."""
    raw, config = _source_config(model, source)
    tied = config.tie_word_embeddings
    kept = [e for e in entries if not (tied and e[0] == "lm_head.weight")]
    weights = _safetensors(kept, tensors)
    dtypes = {dtype for _, dtype, _ in kept}
    return _write_folder(os.fspath(source), folder, raw, dtypes, weights, force)


def _source_config(
    model: torch.nn.Module, source: str | os.PathLike[str]
) -> tuple[dict[str, object], Any]:
    """``source``'s ``config.json`` as read, and the model's config, once ``model`` is
    checked to be ``source``'s model."""
    source = os.fspath(source)
    if not isinstance(model, CausalLM):
        raise oc.ConfigError(
            f"only orchestr's Hugging Face format models export, not {type(model).__name__}"
        )
    if read_config(source) != model.config:
        raise oc.ConfigError(
            f"the model is not the one {source} describes: its config differs; export from "
            f"the checkpoint the model was loaded from"
        )
    with open(os.path.join(source, "config.json"), "rb") as f:
        raw: dict[str, object] = json.load(f)
    return raw, model.config


def _write_folder(
    source: str,
    folder: str | os.PathLike[str],
    raw: dict[str, object],
    dtypes: set[torch.dtype],
    weights: Iterable[bytes],
    force: bool,
) -> str:
    if len(dtypes) == 1:
        raw["torch_dtype"] = str(next(iter(dtypes))).removeprefix("torch.")
    generation = _generation_config(source, raw)
    parent = os.path.dirname(os.path.abspath(folder))
    os.makedirs(parent, exist_ok=True)  # the folder itself is made (and checked) below
    with CheckpointFolder(folder, force=force) as out:
        out.write_chunks("model.safetensors", weights)
        out.write("config.json", _json(raw))
        out.write("generation_config.json", _json(generation))
        for name in COPIED:
            path = os.path.join(source, name)
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    out.write(name, f.read())
    return out.path


def _safetensors(
    entries: Sequence[Entry], tensors: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[bytes]:
    """A safetensors file of ``entries``, in pieces: the header, then each tensor's bytes as
    ``tensors`` yields it (names not in ``entries`` are passed over)."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in entries:
        if dtype not in _DTYPES:
            raise oc.ConfigError(f"{name}: a {dtype} tensor has no safetensors dtype")
        size = dtype.itemsize
        for d in shape:
            size *= d
        header[name] = {
            "dtype": _DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    yield struct.pack("<Q", len(blob)) + blob
    wanted = {name: (dtype, shape) for name, dtype, shape in entries}
    order = iter(entries)
    for name, tensor in tensors:
        if name not in wanted:
            continue
        expected = next(order, None)
        if (
            expected is None
            or expected[0] != name
            or (tensor.dtype, tuple(tensor.shape)) != wanted[name]
        ):
            raise oc.ConfigError(
                f"the export announced {expected[0] if expected else 'no more tensors'}, got "
                f"{name} ({tensor.dtype}, {list(tensor.shape)})"
            )
        yield tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    left = next(order, None)
    if left is not None:
        raise oc.ConfigError(f"the export ended before {left[0]}: the tensors stopped early")


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
