"""Matrix products with weights packed for the CPU: oneDNN's blocked layout.

In float32 on the CPU a weight reordered once into oneDNN's layout
(``torch.ops.mkldnn._reorder_linear_weight``, what ``torch.compile``'s CPU weight freezing
uses) is multiplied with ``torch.ops.mkldnn._linear_pointwise``. At the few rows of a decode
step the packed product reads its weight at about twice ``F.linear``'s speed (measured here
on one thread, 24 distinct 512x512 weights, 2 rows: 57 us a product against 122 us), and
concatenating weights that take the same input (q/k/v, gate/up) makes one product of several.
The paged runner (``roles/generator/_linears.py``) and the expert hosts pack this way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["can_pack", "check", "multiply", "pack"]


def can_pack(weight: torch.Tensor) -> str | None:
    """Why ``weight``'s products cannot be packed here, or ``None`` when they can."""
    if weight.device.type != "cpu":
        return f"the weights are on {weight.device}, not the CPU"
    if weight.dtype != torch.float32:
        return f"the weights are {weight.dtype}, not float32"
    if not (torch._C._has_mkldnn and torch.backends.mkldnn.enabled):
        return "this torch has oneDNN (mkldnn) off or missing"
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "this torch has no mkldnn._linear_pointwise"
    return None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (``[out, in]``, where :func:`can_pack` allows) in oneDNN's layout: a copy."""
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    return packed


def multiply(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``packed = pack(weight)``."""
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out


def check(weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor) -> None:
    """The packed product agrees with ``F.linear`` here (else a ``RuntimeError``, rather than
    wrong tokens later): call once per process that packs."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, weight.shape[1], generator=gen, dtype=weight.dtype)
    want = F.linear(x, weight, bias)
    got = multiply(x, packed, bias)
    scale = want.abs().max().clamp(min=1e-6)
    if not bool(((got - want).abs().max() / scale) < 1e-4):
        raise RuntimeError("oneDNN's packed linear disagrees with F.linear on this machine")
