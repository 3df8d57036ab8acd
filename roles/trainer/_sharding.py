"""A trainer whose parameters, gradients and optimizer state are sharded over its mesh.

``Trainer(sharding="full")`` hands the model to torch's FSDP2 (``fully_shard``, decision record
``docs/decisions/0018-sharded-trainer-fsdp2.md``): each decoder layer is one unit, the root the
rest; every parameter is a ``DTensor`` split along its first dimension over the process
group, so a rank holds ``1 / world`` of the weights, of their gradients and of AdamW's two
moments. A forward pass gathers one unit's weights at a time and frees them after; the
backward reduce-scatters each unit's gradients. The gradients are *summed* across ranks
(:func:`summed` undoes FSDP's mean), as the replicated trainer's all-reduce sums them: every
loss inside is already divided by the whole batch's count.

FSDP's gathers and reduce-scatters are collectives, so every rank must call the model as often
as the others: :func:`plan_passes` makes the micro-batch counts and each micro-batch's forward
calls (one per prompt length) equal across ranks, the extra ones' outputs multiplied by zero.
The evaluation endpoints run collectives too: with sharding, call them on every member
together, and a step starts from the shards (:func:`reshard`).

Checkpoints are written from the shards with ``torch.distributed.checkpoint`` (each rank its
own pieces, into one folder); so are published versions (:func:`local_rows`: each rank its
rows of each tensor, which a loader lays into the whole, :class:`ShardedWeightsRef`). The
Hugging Face export gathers each tensor whole on the one rank that writes it. No I/O here but
through torch and the checkpoint reader (:func:`load_rows`).

A model from a Hugging Face checkpoint (``model_factory="orchestr.roles.models:load_model"``
with only ``folder``) is never whole on a rank: the trainer builds it on the meta device
(:func:`meta_model`), shards it, and each rank reads its rows of every tensor from the
safetensors files (:func:`load_rows`), as torchtitan's meta-device start does.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

import orchestr as oc
from orchestr.roles._common._weightplan import WeightSyncError, dtype_name
from orchestr.roles._common._weightref import ShardedWeightsRef, WeightsRef

__all__ = [
    "LOAD_MODEL",
    "SHARDING",
    "call_trainer",
    "full_tensors",
    "is_sharded",
    "load_rows",
    "load_sharded",
    "local_rows",
    "local_state_bytes",
    "meta_model",
    "plan_passes",
    "publish_weights",
    "reshard",
    "rows_folder",
    "save_sharded",
    "shard_model",
    "summed",
    "to_float",
    "units",
]

#: ``Trainer(sharding=)``: ``"none"``, a full replica per rank; ``"full"``, FSDP2.
SHARDING = ("none", "full")
#: orchestr's own Hugging Face loader, by the name roles take a model factory by.
LOAD_MODEL = "orchestr.roles.models:load_model"

T = TypeVar("T")


async def call_trainer(trainers: oc.Mesh, sharded: bool, endpoint: str, *args: Any) -> Any:
    """The answer of member 0 of ``trainers`` to ``endpoint(*args)``: asked of member 0 alone,
    or, ``sharded``, of every member together (each runs the collectives), as a sharded
    trainer needs."""
    if sharded:
        return (await getattr(trainers, endpoint).call(*args))[0]
    return await getattr(trainers[0], endpoint).call_one(*args)


async def publish_weights(trainers: oc.Mesh, sharded: bool) -> WeightsRef | ShardedWeightsRef:
    """Publish the trainers' weights: member 0's whole copy, or, ``sharded``, every member's
    rows, joined into one ref (no member gathers the whole model)."""
    if not sharded:
        ref: WeightsRef = await trainers[0].publish.call_one()
        return ref
    return ShardedWeightsRef.join(await trainers.publish.call())


def local_rows(
    model: nn.Module,
) -> tuple[dict[str, torch.Tensor], tuple[tuple[str, str, tuple[int, ...]], ...]]:
    """This rank's rows of each tensor a sync moves (a parameter sharded along dimension 0:
    its local shard, when it holds rows; a tensor not sharded: rank 0's alone), and the whole
    model's manifest. Tied tensors once, under their first name, as a loader's model lists
    them. Raises :class:`WeightSyncError` for a tensor sharded another way."""
    from torch import distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    rank = dist.get_rank()
    rows: dict[str, torch.Tensor] = {}
    manifest: list[tuple[str, str, tuple[int, ...]]] = []
    seen: set[int] = set()
    for name, value in model.state_dict(keep_vars=True).items():
        if id(value) in seen:
            continue
        seen.add(id(value))
        manifest.append((name, dtype_name(value.dtype), tuple(value.shape)))
        local: torch.Tensor | None = value if rank == 0 else None
        if isinstance(value, DTensor):
            if tuple(value.placements) != (Shard(0),):
                raise WeightSyncError(
                    f"{name} is sharded as {value.placements}; a sharded publish takes rows "
                    "(Shard(0)) only"
                )
            local = value.to_local()
        if local is not None and local.numel() > 0:
            rows[name] = local.detach()
    return rows, tuple(manifest)


def units(model: nn.Module) -> list[nn.Module]:
    """The modules sharded as units of their own: a model's decoder layers (a ``layers`` or
    ``blocks`` module list, at the top or under ``model``), in order; none for a model
    without one (then the whole model is one unit)."""
    for holder in (model, getattr(model, "model", None)):
        for name in ("layers", "blocks"):
            found = getattr(holder, name, None)
            if isinstance(found, nn.ModuleList):
                return list(found)
    return []


def rows_folder(factory: str, kwargs: dict[str, Any] | None) -> str | None:
    """The checkpoint folder a sharded trainer reads by rows: set when its model is
    :data:`LOAD_MODEL` given ``folder`` alone; ``None`` otherwise (the model is built whole,
    then sharded)."""
    if factory != LOAD_MODEL or not kwargs or set(kwargs) != {"folder"}:
        return None
    return str(os.fspath(kwargs["folder"]))


def meta_model(folder: str) -> nn.Module:
    """The checkpoint in ``folder``'s model on the meta device: every tensor's shape, no
    storage, the head tied where the config ties it. Raises :class:`~orchestr.ConfigError`
    for a config orchestr cannot run, or weight files missing a tensor or holding another."""
    from orchestr.roles._common._hf._config import read_config
    from orchestr.roles._common._hf._layers import CausalLM
    from orchestr.roles._common._hf._load import iter_weights, weight_names

    cfg = read_config(folder)
    # the files are checked now (every tensor there, no other), their shapes as each is read
    iter_weights(folder, weight_names(cfg), cfg.model_type)
    with torch.device("meta"):
        model = CausalLM(cfg)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def load_rows(model: nn.Module, folder: str, device: torch.device) -> None:
    """Give a sharded ``model`` built on the meta device (:func:`meta_model`) its storage on
    ``device`` and read each parameter's rows on this rank from the checkpoint in ``folder``
    (safetensors slices: no rank reads or holds a tensor whole). Raises
    :class:`~orchestr.ConfigError` for a checkpoint that does not match its config."""
    from torch import distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    from orchestr.roles._common._hf._config import read_config
    from orchestr.roles._common._hf._load import iter_weights, weight_names

    rank, world = dist.get_rank(), dist.get_world_size()
    model.to_empty(device=device)
    rows: dict[str, slice] = {}
    local: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():  # a tied tensor once
        if not isinstance(param, DTensor) or tuple(param.placements) != (Shard(0),):
            raise RuntimeError(f"{name} is not sharded by rows after fully_shard")
        local[name] = param.to_local()
        n = param.shape[0]
        start = min(rank * -(-n // world), n)  # torch.chunk's cut, as FSDP2's
        rows[name] = slice(start, start + local[name].shape[0])
    cfg = read_config(folder)
    want = weight_names(cfg)
    if set(want) != set(rows):
        odd = sorted(set(want) ^ set(rows))
        raise oc.ConfigError(f"{folder}: the model's parameters are not its tensors: {odd[:3]}")
    # one tensor's rows at a time, copied into the shard and let go
    with torch.no_grad():
        for name, tensor in iter_weights(folder, want, cfg.model_type, cut=lambda n: (rows[n],)):
            local[name].copy_(tensor)


def shard_model(model: nn.Module, device: torch.device | None = None) -> nn.Module:
    """Shard ``model`` in place over the default process group with FSDP2 and return it; its
    mesh is on ``device``'s kind (by default its parameters', which a model on the meta
    device has not). Raises :class:`~orchestr.ConfigError` without a process group."""
    from torch import distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise oc.ConfigError(
            "sharding='full' shards over the trainer mesh's process group: call "
            "ctx.init_distributed(trainers) before the first step"
        )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if device is None:
        device = next(iter(model.parameters()), torch.empty(0)).device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for unit in units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # a linear layer over [batch, time, width] returns a view of its 2-D product, which FSDP2
    # warns of at every forward: an in-place op on the output would skip its gradient hook.
    # Nothing here writes into a model's output (the losses read it: log_softmax, gather),
    # and the sharded pair's gradients equal the replicated pair's (tests/roles/trainer).
    warnings.filterwarnings(
        "ignore", message=r"FSDP2-wrapped module .* returned a view tensor", category=UserWarning
    )
    return model


def summed(params: Sequence[nn.Parameter], world: int) -> None:
    """A sharded model's gradients as the sum over the ranks, not FSDP's mean: every loss
    here is divided by the whole batch's count already (as the replicated trainer's
    all-reduce sums them). FSDP's own divide factor would say so, but it reduces with
    ``PREMUL_SUM``, which gloo lacks; multiplying the shards costs one pass over them."""
    for p in params:
        if p.grad is not None:
            p.grad.mul_(world)


def reshard(model: nn.Module) -> None:
    """Free the gathered weights of every unit of a sharded ``model``. A forward pass without
    gradients (an evaluation) leaves the root unit's weights gathered, and a training step that
    starts from there computes the root's gradients wrongly (seen with torch 2.13: the step
    after an evaluation had another gradient norm), so a step starts from the shards."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` is FSDP2-sharded. Free for a replicated trainer's steps: a sharded
    model has imported FSDP, so without it nothing is."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def plan_passes(
    parts: Sequence[T], model: nn.Module, calls_of: Callable[[T], int]
) -> list[tuple[T | None, int | None]]:
    """The passes over ``parts`` a sharded model's ranks can run together: as many as the most
    any rank has (the extra ones ``None``: run the first part again, counting nothing), each
    with the most forward calls any rank's pass at that place makes (``calls_of`` of the part
    that runs there), which every rank then makes. Unsharded: each part, calls ``None``."""
    if not is_sharded(model):
        return [(p, None) for p in parts]
    from torch import distributed as dist

    count = torch.tensor([len(parts)], dtype=torch.int64)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    n = int(count)
    calls = torch.tensor(
        [calls_of(parts[i] if i < len(parts) else parts[0]) for i in range(n)], dtype=torch.int64
    )
    dist.all_reduce(calls, op=dist.ReduceOp.MAX)
    return [(parts[i] if i < len(parts) else None, int(calls[i])) for i in range(n)]


def to_float(value: torch.Tensor) -> float:
    """A scalar tensor's value; a ``DTensor``'s (a sharded model's gradient norm) whole."""
    full = getattr(value, "full_tensor", None)
    return float(full() if callable(full) else value)


def local_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """The bytes this rank holds of the parameters, their gradients and the optimizer's state
    (a sharded tensor counts its local shard; a tensor on the meta device, nothing)."""

    def local(t: torch.Tensor) -> int:
        inner = getattr(t, "to_local", None)
        t = inner() if callable(inner) else t
        return 0 if t.is_meta else t.numel() * t.element_size()

    params = sum(local(p) for p in model.parameters())
    grads = sum(local(p.grad) for p in model.parameters() if p.grad is not None)
    state = sum(
        local(v)
        for per_param in optimizer.state.values()
        for v in per_param.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    return {"params": params, "grads": grads, "optimizer": state}


def full_tensors(
    model: nn.Module, writer: int | None = None
) -> Iterator[tuple[str, torch.Tensor | None]]:
    """Each entry of ``model``'s state dict whole, on the CPU, one at a time: every rank must
    iterate together (each entry is a gather); rank ``writer`` gets the tensor, the others
    ``None`` (``writer`` None: every rank gets them)."""
    from torch import distributed as dist

    rank = dist.get_rank()
    for name, value in model.state_dict().items():
        full = getattr(value, "full_tensor", None)
        tensor = full() if callable(full) else value
        keep = writer is None or rank == writer
        yield name, (tensor.detach().to("cpu").clone() if keep else None)


def save_sharded(
    model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any], folder: str
) -> None:
    """Write the model's and the optimizer's shards and ``extra`` (small values, every rank
    the same) to ``folder`` with ``torch.distributed.checkpoint``: each rank its own pieces.
    Every rank calls this together."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save

    model_state, optim_state = get_state_dict(model, optimizer)
    save({"model": model_state, "optimizer": optim_state, "extra": extra}, checkpoint_id=folder)


def load_sharded(
    model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any], folder: str
) -> dict[str, Any]:
    """Read what :func:`save_sharded` wrote into ``model`` and ``optimizer`` (sharded as they
    were or not: the checkpoint reshards), returning ``extra`` as saved. Every rank calls this
    together."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    model_state, optim_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optimizer": optim_state, "extra": dict(extra)}
    load(state, checkpoint_id=folder)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )
    return dict(state["extra"])
