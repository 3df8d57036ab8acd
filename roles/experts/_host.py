"""The expert host: an actor holding some routed experts of some MoE layers of a checkpoint.

A generator sends it, per MoE layer and decode step, one call with the tokens it needs and
the (token, expert, weight) pairs to run (:class:`~._dispatch.Send`); it answers each token's
weighted sum over its experts. On one host the call and its tensors ride shared memory (the
actor call path's local transport); across hosts, the call's stream. ``forward`` is a plain
(sync) endpoint: it runs on the actor's loop without a thread hop, one call at a time, which
is what keeps a placement change (:meth:`ExpertHost.load` / :meth:`ExpertHost.drop`) atomic
between two calls.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import torch

import orchestr as oc
from orchestr.roles._common._hf._config import read_config
from orchestr.roles._common._hf._load import ffn_units, load_experts

from ._dispatch import Expert, packed_experts, run_experts

__all__ = ["ExpertHost", "ExpertUnavailableError"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ExpertUnavailableError(oc.OrchestrError):
    """An expert a MoE layer routed tokens to is held by no live expert host."""

    __module__ = "orchestr.roles"


class ExpertHost(oc.Actor):
    """Holds routed experts of ``checkpoint`` (a Qwen2-MoE folder), or with ``ffn_shards``
    slices of a dense checkpoint's MLPs (each layer's cut into that many: "experts" every
    token passes through, with weight 1; :func:`~orchestr.roles._common._hf._load.ffn_units`):
    ``experts`` maps a layer to the experts to load now, or ``placement[rank]`` does for the
    mesh member of that rank (:func:`host_experts` makes it from a :class:`Placement`); more
    come with :meth:`load`. Only those tensors are read (of a dense MLP, only the slices). ``torch_threads`` sets the threads its expert products use.
    Its state (what it holds) is saved with ``ctx.checkpoint(mesh)``, so a host restarted
    after a rebalance comes back holding what it held then. Raises
    :class:`orchestr.ConfigError` (as a spawn error) for a bad checkpoint, layer or expert."""

    __module__ = "orchestr.roles"  # its name on the wire and in the head's store (pinned)

    def __init__(
        self,
        checkpoint: str,
        experts: Mapping[int, Sequence[int]] | None = None,
        *,
        placement: Sequence[Mapping[int, Sequence[int]]] | None = None,
        ffn_shards: int | None = None,
        dtype: str = "float32",
        torch_threads: int | None = None,
    ) -> None:
        if dtype not in DTYPES:
            raise oc.ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        self._checkpoint, self._dtype = checkpoint, DTYPES[dtype]
        self._shards = ffn_shards
        cfg = read_config(checkpoint)
        self._units = ffn_units(cfg, ffn_shards, checkpoint)[1]
        self._noun = "expert" if cfg.moe is not None else "FFN shard"
        self._modules: dict[int, dict[int, Expert]] = {}
        self._tokens: dict[int, dict[int, int]] = {}
        self._calls = 0
        if placement is not None:
            if experts is not None or not 0 <= self.rank < len(placement):
                raise oc.ConfigError(
                    f"give experts or a placement with an entry for each of the mesh's hosts "
                    f"(this is rank {self.rank}; the placement has {len(placement)})"
                )
            experts = placement[self.rank]
        if experts:
            self._install(self._read(_wanted(experts)))

    def save_state(self) -> dict[int, list[int]]:
        return self.hosted()

    def load_state(self, state: Any) -> None:
        self._modules.clear()
        if state:
            self._install(self._read(_wanted(state)))

    @oc.endpoint
    def hosted(self) -> dict[int, list[int]]:
        """``{layer: experts}`` this host holds now. Never blocks."""
        return {layer: sorted(m) for layer, m in sorted(self._modules.items()) if m}

    @oc.endpoint
    def forward(
        self,
        layer: int,
        x: torch.Tensor,
        slot: torch.Tensor,
        experts: torch.Tensor,
        weights: torch.Tensor,
        units: int | None = None,
    ) -> torch.Tensor:
        """Per row of ``x`` (``[m, hidden]``), the sum over pairs ``j`` with ``slot[j]`` = row
        of ``weights[j]`` times expert ``experts[j]``'s output. ``units``: how many experts
        (or FFN shards) the caller cuts a layer into, checked against this host's. Raises
        ``ValueError`` for tensors that do not fit together or units that differ, and
        :class:`ExpertUnavailableError` for an expert this host does not hold. Runs on the
        loop, one call at a time; nothing to cancel."""
        _check(x, slot, experts, weights)
        if units is not None and units != self._units:
            raise ValueError(
                f"the caller cuts layer {layer} into {units} {self._noun}s; this host's "
                f"checkpoint is cut into {self._units} (give both the same ffn_shards)"
            )
        modules = self._modules.get(layer, {})
        try:
            out = run_experts(modules, x.to(self._dtype), slot, experts, weights.to(self._dtype))
        except KeyError as exc:
            raise ExpertUnavailableError(
                f"this expert host ({self.actor_id}) holds no {self._noun} {exc.args[0]} of layer "
                f"{layer}; it holds {sorted(modules)}"
            ) from None
        self._calls += 1
        served = self._tokens.setdefault(layer, {})
        for e, n in zip(*torch.unique(experts, return_counts=True), strict=True):
            served[int(e)] = served.get(int(e), 0) + int(n)
        return out.to(x.dtype)

    @oc.endpoint(concurrent=True)
    async def load(self, experts: Mapping[int, Sequence[int]]) -> dict[int, list[int]]:
        """Read ``experts`` (layer -> experts) from the checkpoint, in a thread while
        ``forward`` goes on, then hold them from the next call on. Returns :meth:`hosted`.
        Blocks on the read.
        Idempotent; raises :class:`orchestr.ConfigError` for a layer or expert the checkpoint
        does not have (nothing is loaded then). Cancelling it before it returns loads nothing."""
        wanted = _wanted(experts)
        modules = await asyncio.to_thread(self._read, wanted)
        self._install(modules)
        return self.hosted()

    @oc.endpoint
    def drop(self, experts: Mapping[int, Sequence[int]]) -> dict[int, list[int]]:
        """Stop holding ``experts`` (layer -> experts; ones it does not hold are ignored),
        from the next ``forward`` on. Returns :meth:`hosted`. Idempotent; never blocks."""
        for layer, held in _wanted(experts).items():
            for e in held:
                self._modules.get(layer, {}).pop(e, None)
        return self.hosted()

    @oc.endpoint
    def stats(self) -> dict[str, Any]:
        """What it holds, the ``forward`` calls it served and the tokens each expert ran
        (``tokens[layer][expert]``) since it started."""
        return {"hosted": self.hosted(), "calls": self._calls, "tokens": self._tokens}

    def _read(self, wanted: dict[int, list[int]]) -> dict[tuple[int, int], Expert]:
        """The experts ``wanted``, read and packed (:func:`~._dispatch.packed_experts`)."""
        loaded = load_experts(self._checkpoint, wanted, ffn_shards=self._shards, dtype=self._dtype)
        return packed_experts(dict(loaded))

    def _install(self, modules: Mapping[tuple[int, int], Expert]) -> None:
        for (layer, e), module in modules.items():
            self._modules.setdefault(layer, {})[e] = module


def _wanted(experts: Mapping[int, Sequence[int]]) -> dict[int, list[int]]:
    if not isinstance(experts, Mapping):
        raise oc.ConfigError(f"experts maps a layer to its experts, got {experts!r}")
    out = {}
    for layer, held in experts.items():
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise oc.ConfigError(f"a layer is an int, got {layer!r}")
        if not isinstance(held, Sequence) or not all(
            isinstance(e, int) and not isinstance(e, bool) for e in held
        ):
            raise oc.ConfigError(f"layer {layer}'s experts are a list of ints, got {held!r}")
        out[layer] = sorted(set(held))
    return out


def _check(x: Any, slot: Any, experts: Any, weights: Any) -> None:
    if not all(isinstance(t, torch.Tensor) for t in (x, slot, experts, weights)):
        raise ValueError("forward takes tensors: x, slot, experts, weights")
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"x is [tokens, hidden] floats, got {tuple(x.shape)} {x.dtype}")
    n = slot.numel()
    if any(t.dim() != 1 or t.numel() != n for t in (slot, experts, weights)):
        raise ValueError("slot, experts and weights are 1-D and of one length")
    if slot.dtype != torch.int64 or experts.dtype != torch.int64:
        raise ValueError("slot and experts are int64")
    if n and (int(slot.min()) < 0 or int(slot.max()) >= x.shape[0]):
        raise ValueError(f"a slot points outside x's {x.shape[0]} rows")
