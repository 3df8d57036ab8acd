"""The paged runner's matrix products, packed for the CPU.

On the CPU in float32 each weight is reordered once into oneDNN's blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, what ``torch.compile``'s CPU weight freezing
uses) and multiplied with ``torch.ops.mkldnn._linear_pointwise``; the attention's q/k/v and
the MLP's gate/up weights are concatenated first, so each is one product. Measured here on an
8-layer, 512-wide Llama (two threads): the model's products at batch 32 took 28 ms a step
against 37 ms with ``F.linear``, and at 1,024 rows 403 against 559 ms. (In the one shape
checked, a row's packed result did not depend on the other rows; ``F.linear``'s did, by a
rounding. Nothing relies on it.)

The packed copies are the price: a second copy of the weights (the model's own tensors stay
what weight loads write into and what the trainer's names map to). A copy is made again when
its weights change: the engine calls :meth:`Linears.invalidate` on a new version, and each
product also checks its weights' storage and version counter, so an in-place update or a
double-buffered load (the tensor pointed at new memory) is never multiplied stale.
Repacking costs about a copy of the weights (about 3 GB/s here).

Elsewhere (a GPU, another dtype, a torch without oneDNN, ``packed=False``), and for a product
too small to gain (:data:`PACK_MIN`), the products are the modules' own calls.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from orchestr.roles._common._hf._layers import MLP, Attention, CausalLM, SparseMoE
from orchestr.roles._common._packed import can_pack, check, multiply, pack

__all__ = ["Linears", "can_pack"]

Stamp = tuple[tuple[int, int], ...]
Entry = tuple[Stamp, torch.Tensor, torch.Tensor | None]  # stamp, packed weight, bias


#: Products of fewer weights than this stay ``F.linear`` unless packing is forced: oneDNN's
#: call costs about 50 us more, which a small product never wins back (measured here: a
#: 64-wide model's products took 55-70 us packed against 8-30 us).
PACK_MIN = 1 << 18


class Linears:
    """The linear products of ``model``'s layers and head. ``packed``: ``None`` (the
    default) packs each product of at least :data:`PACK_MIN` weights wherever
    :func:`can_pack` allows; ``True`` packs every product (``ValueError`` where it cannot
    run); ``False`` packs none."""

    def __init__(self, model: CausalLM, packed: bool | None = None) -> None:
        why = can_pack(model.lm_head.weight)
        if packed and why:
            raise ValueError(f"packed linears cannot run here: {why}")
        self.packed = why is None if packed is None else packed
        self._min = 0 if packed else PACK_MIN
        self._cache: dict[int, Entry] = {}
        self._small: dict[int, bool] = {}  # per product: too small to pack
        self.packs = 0  # how many times a product's weights were packed

    def invalidate(self) -> None:
        """Forget every packed copy (the weights changed)."""
        self._cache.clear()

    def qkv(self, attn: Attention, x: torch.Tensor) -> torch.Tensor | None:
        """The q, k and v products of ``x`` side by side, or ``None`` when unpacked (then
        :meth:`Attention.project` makes them itself)."""
        entry = self._entry((attn.q_proj, attn.k_proj, attn.v_proj))
        return None if entry is None else _multiply(entry, x)

    def mlp(
        self,
        mlp: MLP | SparseMoE,
        x: torch.Tensor,
        activate: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The feed-forward part's output for ``x`` (a mixture of experts, or an MLP on expert
        hosts, runs as it is).
        ``activate``: what makes the down projection's input from the fused gate/up product
        (default :meth:`MLP.activate`)."""
        if (
            not isinstance(mlp, MLP)
            or mlp.remote is not None  # on expert hosts
            or (up := self._entry((mlp.gate_proj, mlp.up_proj))) is None
        ):
            out: torch.Tensor = mlp(x)
            return out
        return self.linear(mlp.down_proj, (activate or mlp.activate)(_multiply(up, x)))

    def linear(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        entry = self._entry((module,))
        if entry is None:
            out: torch.Tensor = module(x)
            return out
        return _multiply(entry, x)

    # -- internals ---------------------------------------------------------------------------
    def _entry(self, modules: tuple[nn.Linear, ...]) -> Entry | None:
        """The packed weights of ``modules``' product (packed again if they changed), or
        ``None`` when it is not packed."""
        if not self.packed:
            return None
        key = id(modules[0])
        small = self._small.get(key)
        if small is None:
            small = self._small[key] = sum(m.weight.numel() for m in modules) < self._min
        if small:
            return None
        stamp = _stamp(modules)
        entry = self._cache.get(key)
        if entry is None or entry[0] != stamp:
            entry = self._cache[key] = (stamp, *self._pack(modules))
        return entry

    def _pack(self, modules: tuple[nn.Linear, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        weight = torch.cat([m.weight.detach() for m in modules])
        bias = None
        if any(m.bias is not None for m in modules):
            bias = torch.cat(
                [
                    m.bias.detach() if m.bias is not None else weight.new_zeros(m.out_features)
                    for m in modules
                ]
            )
        packed = pack(weight)
        self.packs += 1
        if self.packs == 1:  # once per runner
            check(weight, bias, packed)
        return packed, bias


def _multiply(entry: Entry, x: torch.Tensor) -> torch.Tensor:
    return multiply(x, entry[1], entry[2])


def _stamp(modules: tuple[nn.Linear, ...]) -> Stamp:
    """Where each weight (and bias) lives and its version counter: any write or re-pointing
    changes it."""
    # read from each module's parameter table (what ``m.weight`` looks up, without
    # nn.Module's attribute machinery: this runs for every product of every step)
    return tuple(
        (t.data_ptr(), t._version) for m in modules for t in m._parameters.values() if t is not None
    )
