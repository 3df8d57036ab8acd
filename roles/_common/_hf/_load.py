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
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

import orchestr as oc

from ._config import ModelConfig, read_config
from ._layers import MLP, CausalLM

__all__ = ["expert_names", "load_experts", "load_model", "shards", "weight_names"]

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
    want = weight_names(cfg)
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
            f"{located[extra[0]]}: tensor {extra[0]!r} is not part of a {cfg.model_type} "
            f"model of this config"
        )
    state = dict(_read(want, located, dtype, device))
    with torch.device("meta"):
        model = CausalLM(cfg)
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def expert_names(layer: int, expert: int) -> list[str]:
    """The three tensors of one routed expert of a Qwen2-MoE layer."""
    prefix = f"model.layers.{layer}.mlp.experts.{expert}."
    return [f"{prefix}{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]


def load_experts(
    folder: str | os.PathLike[str],
    wanted: dict[int, list[int]],
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> dict[tuple[int, int], MLP]:
    """Only the routed experts ``wanted`` (layer -> experts) of the MoE checkpoint in
    ``folder``, each an :class:`MLP` keyed ``(layer, expert)``: no other tensor is read. Raises
    :class:`ConfigError` for a checkpoint without experts, a layer that does not route to
    experts, an expert it does not have, or a missing or misshapen tensor."""
    folder = os.fspath(folder)
    cfg = read_config(folder)
    moe = cfg.moe
    if moe is None:
        raise oc.ConfigError(f"{folder}: a {cfg.model_type} checkpoint has no experts")
    shapes: dict[str, tuple[int, ...]] = {}
    for layer, experts in wanted.items():
        if not (0 <= layer < cfg.num_hidden_layers and moe.sparse(layer)):
            raise oc.ConfigError(f"{folder}: layer {layer} does not route to experts")
        for e in experts:
            if not 0 <= e < moe.num_experts:
                raise oc.ConfigError(f"{folder}: no expert {e} (it has {moe.num_experts})")
            gate, up, down = expert_names(layer, e)
            width = moe.moe_intermediate_size
            shapes |= {gate: (width, cfg.hidden_size), up: (width, cfg.hidden_size)}
            shapes[down] = (cfg.hidden_size, width)
    located = shards(folder)
    for name in shapes:
        if name not in located:
            raise oc.ConfigError(f"{folder}: missing tensor {name!r}")
    state = dict(_read(shapes, located, dtype, device))
    out = {}
    for layer, experts in wanted.items():
        for e in experts:
            with torch.device("meta"):
                mlp = MLP(cfg, moe.moe_intermediate_size)
            parts = [state[n] for n in expert_names(layer, e)]
            keys = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
            mlp.load_state_dict(dict(zip(keys, parts, strict=True)), assign=True)
            out[layer, e] = mlp.eval()
    return out


def _read(
    want: dict[str, tuple[int, ...]],
    located: dict[str, str],
    dtype: torch.dtype,
    device: str | torch.device,
) -> Iterator[tuple[str, torch.Tensor]]:
    by_file: dict[str, list[str]] = {}
    for name in want:
        by_file.setdefault(located[name], []).append(name)
    for file, names in by_file.items():
        with _open(file) as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise oc.ConfigError(f"{file}: missing tensor {name!r} (the index lists it)")
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != want[name]:
                    raise oc.ConfigError(
                        f"{file}: tensor {name!r} has shape {tuple(tensor.shape)}, the config "
                        f"implies {want[name]}"
                    )
                if not tensor.is_floating_point():
                    raise oc.ConfigError(f"{file}: tensor {name!r} is {tensor.dtype}, not floats")
                yield name, tensor.to(device=device, dtype=dtype)


def _open(path: str) -> Any:
    try:
        return safe_open(path, framework="pt", device="cpu")
    except (OSError, SafetensorError) as exc:
        raise oc.ConfigError(f"{path}: not a readable safetensors file ({exc})") from None
