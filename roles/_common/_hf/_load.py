"""Loading a Hugging Face format checkpoint folder into :class:`~._layers.CausalLM`.

The module is built on the meta device and its parameters are then the tensors read with
``safetensors`` (memory-mapped by ``safe_open``; assigned, not copied into a second set of
parameters), converted only when the file's dtype is not the one asked for. One
``model.safetensors`` or shards listed by ``model.safetensors.index.json``. Every tensor the
model needs must be there with the shape its config implies, and nothing else may be: a
missing, extra or misshapen tensor is a :class:`ConfigError` naming the file and the tensor.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any, TypeVar

import torch
from safetensors import SafetensorError, safe_open

import orchestr as oc

from ._config import ModelConfig, read_config
from ._layers import MLP, CausalLM

__all__ = [
    "expert_names",
    "ffn_units",
    "iter_weights",
    "load_experts",
    "load_model",
    "read_weights",
    "shards",
    "weight_names",
]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
#: Tensors some checkpoints carry that the model computes itself.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def weight_names(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of ``cfg`` holds, with its shape."""
    with torch.device("meta"):
        model = CausalLM(cfg)
    names = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        names.pop("lm_head.weight")
    return names


def shards(folder: str | os.PathLike[str]) -> dict[str, str]:
    """Tensor name -> the safetensors file in ``folder`` that holds it."""
    index = os.path.join(folder, INDEX)
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise oc.ConfigError(f"{index}: not a safetensors index ({exc})") from None
        if not isinstance(weight_map, dict):
            raise oc.ConfigError(f"{index}: weight_map must be an object")
        out = {}
        for name, file in weight_map.items():
            if not isinstance(file, str) or os.path.basename(file) != file:
                raise oc.ConfigError(f"{index}: tensor {name!r} names a bad file {file!r}")
            out[name] = os.path.join(folder, file)
        return out
    single = os.path.join(folder, SINGLE)
    if not os.path.exists(single):
        raise oc.ConfigError(f"{folder}: no {SINGLE} and no {INDEX}")
    with _open(single) as f:
        return dict.fromkeys(f.keys(), single)


def load_model(
    folder: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> CausalLM:
    """The checkpoint in ``folder`` as a :class:`CausalLM` in ``dtype`` on ``device``, in
    eval mode. Raises :class:`ConfigError` for a config orchestr cannot run or a weight file
    that does not match it."""
    folder = os.fspath(folder)
    cfg = read_config(folder)
    state = read_weights(folder, weight_names(cfg), cfg.model_type, dtype=dtype, device=device)
    with torch.device("meta"):
        model = CausalLM(cfg)
    return assemble(model, state)


def assemble(model: CausalLM, state: dict[str, torch.Tensor]) -> CausalLM:
    """``model`` (built on the meta device) holding ``state``'s tensors themselves (no
    copy), its head tied to its embedding again where its config ties them; in eval mode."""
    model.load_state_dict(state, strict=False, assign=True)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def read_weights(
    folder: str | os.PathLike[str],
    want: Mapping[str, tuple[int, ...]],
    kind: str,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    cut: Callable[[str], tuple[slice, ...] | None] | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of ``want`` (name -> shape) from the checkpoint in ``folder``, in ``dtype``
    on ``device``; no other may be there. ``cut`` (a name to the part of it to read, ``None``:
    all) reads slices only (a tensor-parallel rank's). Raises :class:`ConfigError` for a
    missing, extra (not part of a ``kind`` model of this config) or misshapen tensor."""
    return dict(iter_weights(folder, want, kind, dtype=dtype, device=device, cut=cut))


def iter_weights(
    folder: str | os.PathLike[str],
    want: Mapping[str, tuple[int, ...]],
    kind: str,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    cut: Callable[[str], tuple[slice, ...] | None] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`read_weights`'s tensors one at a time, as each is read (a caller that copies
    each away holds one at a time); its checks come before the first."""
    folder = os.fspath(folder)
    located = shards(folder)
    missing = [n for n in want if n not in located]
    if missing:
        where = sorted({located[n] for n in located}) or [folder]
        raise oc.ConfigError(
            f"{', '.join(where)}: missing tensor {missing[0]!r}"
            + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
        )
    extra = [n for n in located if n not in want and not n.endswith(IGNORED_SUFFIXES)]
    if extra:
        raise oc.ConfigError(
            f"{located[extra[0]]}: tensor {extra[0]!r} is not part of a {kind} model of this config"
        )
    parts = {n: (n, shape, None if cut is None else cut(n)) for n, shape in want.items()}
    return _read(parts, located, dtype, device)


def expert_names(layer: int, expert: int, *, dense: bool = False) -> list[str]:
    """The three tensors of one routed expert of a Qwen2-MoE layer; ``dense``: of the layer's
    MLP (each FFN shard is a slice of them)."""
    prefix = f"model.layers.{layer}.mlp." + ("" if dense else f"experts.{expert}.")
    return [f"{prefix}{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]


def ffn_units(
    cfg: ModelConfig, ffn_shards: int | None = None, where: str = "the model"
) -> tuple[list[int], int]:
    """The layers whose feed-forward part expert hosts hold, and the units each is cut into:
    a MoE model's sparse layers and their routed experts; a dense model's every layer, its MLP
    cut into ``ffn_shards`` slices of the intermediate width (unit ``s`` holds rows
    ``[s * width // ffn_shards, (s + 1) * width // ffn_shards)`` of the gate and up
    projections and those columns of the down projection, so a token's output is the sum of
    its units' outputs). Raises :class:`ConfigError` for ``ffn_shards`` with a MoE model, or
    without it (or out of range) with a dense one."""
    moe = cfg.moe
    if moe is not None:
        if ffn_shards is not None:
            raise oc.ConfigError(
                f"{where}: ffn_shards cuts a dense model's FFN; this one has experts"
            )
        return [i for i in range(cfg.num_hidden_layers) if moe.sparse(i)], moe.num_experts
    width = cfg.intermediate_size
    if (
        not isinstance(ffn_shards, int)
        or isinstance(ffn_shards, bool)
        or not 1 <= ffn_shards <= width
    ):
        raise oc.ConfigError(
            f"{where}: a dense model's FFN goes to expert hosts in ffn_shards slices (1 to its "
            f"intermediate width {width}), got {ffn_shards!r}"
        )
    return list(range(cfg.num_hidden_layers)), ffn_shards


def load_experts(
    folder: str | os.PathLike[str],
    wanted: dict[int, list[int]],
    *,
    ffn_shards: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> dict[tuple[int, int], MLP]:
    """Only the units ``wanted`` (layer -> units, :func:`ffn_units`) of the checkpoint in
    ``folder``, each an :class:`MLP` keyed ``(layer, unit)``: a MoE checkpoint's routed
    experts, or (with ``ffn_shards``) slices of a dense checkpoint's MLPs. No other tensor is
    read, and of a dense MLP only the slice. Raises :class:`ConfigError` for a layer without
    such units, a unit it does not have, or a missing or misshapen tensor."""
    folder = os.fspath(folder)
    cfg = read_config(folder)
    layers, units = ffn_units(cfg, ffn_shards, folder)
    dense = cfg.moe is None
    width = cfg.intermediate_size if cfg.moe is None else cfg.moe.moe_intermediate_size
    hidden = cfg.hidden_size
    noun = "FFN shard" if dense else "expert"
    located = shards(folder)
    pieces: dict[tuple[int, int, int], Piece] = {}  # (layer, unit, tensor) -> what to read
    widths: dict[tuple[int, int], int] = {}
    for layer, held in wanted.items():
        if layer not in layers:
            raise oc.ConfigError(
                f"{folder}: layer {layer} does not route to experts"
                if not dense
                else f"{folder}: no layer {layer} (it has {cfg.num_hidden_layers})"
            )
        for e in held:
            if not 0 <= e < units:
                raise oc.ConfigError(f"{folder}: no {noun} {e} (it has {units})")
            names = expert_names(layer, e, dense=dense)
            for name in names:
                if name not in located:
                    raise oc.ConfigError(f"{folder}: missing tensor {name!r}")
            rows = slice(e * width // units, (e + 1) * width // units) if dense else None
            cuts = [None] * 3 if rows is None else [(rows,), (rows,), (slice(None), rows)]
            shapes = ((width, hidden), (width, hidden), (hidden, width))
            for i, piece in enumerate(zip(names, shapes, cuts, strict=True)):
                pieces[layer, e, i] = piece
            widths[layer, e] = width if rows is None else rows.stop - rows.start
    state = dict(_read(pieces, located, dtype, device))  # each file opened once
    out = {}
    for (layer, e), unit_width in widths.items():
        with torch.device("meta"):
            mlp = MLP(cfg, unit_width)
        keys = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
        parts = {k: state[layer, e, i] for i, k in enumerate(keys)}
        mlp.load_state_dict(parts, assign=True)
        out[layer, e] = mlp.eval()
    return out


#: A tensor to read: its name, its shape in the file, and the part read (``None``: all of it).
Piece = tuple[str, tuple[int, ...], tuple[slice, ...] | None]
K = TypeVar("K", bound=Hashable)


def _read(
    want: Mapping[K, Piece],
    located: dict[str, str],
    dtype: torch.dtype,
    device: str | torch.device,
) -> Iterator[tuple[K, torch.Tensor]]:
    """Each piece of ``want``, keyed as there, each file opened once; a part is read as a
    slice (the rest of the tensor is never read)."""
    by_file: dict[str, list[K]] = {}
    for key, (name, _, _) in want.items():
        by_file.setdefault(located[name], []).append(key)
    for file, keys in by_file.items():
        with _open(file) as f:
            present = set(f.keys())
            for key in keys:
                name, expected, part = want[key]
                if name not in present:
                    raise oc.ConfigError(f"{file}: missing tensor {name!r} (the index lists it)")
                if part is None:
                    tensor = f.get_tensor(name)
                    shape = tuple(tensor.shape)
                else:
                    piece = f.get_slice(name)
                    shape = tuple(piece.get_shape())
                if shape != expected:
                    raise oc.ConfigError(
                        f"{file}: tensor {name!r} has shape {shape}, the config implies {expected}"
                    )
                if part is not None:
                    tensor = piece[part]
                if not tensor.is_floating_point():
                    raise oc.ConfigError(f"{file}: tensor {name!r} is {tensor.dtype}, not floats")
                yield key, tensor.to(device=device, dtype=dtype)


def _open(path: str) -> Any:
    try:
        return safe_open(path, framework="pt", device="cpu")
    except (OSError, SafetensorError) as exc:
        raise oc.ConfigError(f"{path}: not a readable safetensors file ({exc})") from None
