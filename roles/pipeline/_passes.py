"""One stage's passes with autograd: the forward, the whole backward, and the backward split
into its input-gradient half (``BI``) and its weight-gradient half (``BW``).

``BI`` asks autograd for the stage input's gradient and for the gradient of every output of a
module holding parameters of its own, keeping the graph; ``BW`` then takes each such module's
weight gradients from its output's gradient alone, so it runs only the modules' own backward
nodes, not the whole chain again. A stage whose parametrised modules return anything but one
tensor falls back to a ``BW`` that runs the stage's backward to its weights again (correct,
slower). No I/O here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Saved", "backward", "backward_input", "backward_weights", "forward"]


@dataclasses.dataclass
class Saved:
    """What a forward keeps until its backward: the stage's input and output (the loss, on the
    last stage), and the parametrised modules' outputs for a split backward."""

    x: torch.Tensor
    out: torch.Tensor
    leaves: list[tuple[torch.Tensor, list[torch.nn.Parameter]]] | None
    grad_out: torch.Tensor | None = None
    leaf_grads: list[torch.Tensor | None] | None = None


def forward(
    module: torch.nn.Module,
    x: torch.Tensor,
    loss: Callable[[torch.Tensor], torch.Tensor] | None,
    *,
    split: bool,
) -> Saved:
    """``module(x)`` (then ``loss`` of it, on the last stage), keeping what the backward needs;
    with ``split``, the parametrised modules' outputs too."""
    leaves: list[tuple[torch.Tensor, list[torch.nn.Parameter]]] | None = None
    hooks = []
    if split:
        leaves = []
        for sub in module.modules():
            own = [p for p in sub.parameters(recurse=False) if p.requires_grad]
            if own:
                hooks.append(sub.register_forward_hook(_collect(leaves, own)))
    try:
        out = module(x)
    finally:
        for hook in hooks:
            hook.remove()
    if leaves is not None and any(t is None for t, _ in leaves):
        leaves = None  # a module gave something but one tensor: BW runs the stage again
    return Saved(x, out if loss is None else loss(out), leaves)


def backward(item: Saved) -> torch.Tensor | None:
    """The whole backward: the weights' gradients accumulated, the input's returned."""
    torch.autograd.backward(item.out, item.grad_out)
    return item.x.grad if item.x.requires_grad else None


def backward_input(item: Saved) -> torch.Tensor | None:
    """``BI``: the input's gradient, returned, and the parametrised modules' outputs', kept."""
    wanted: list[torch.Tensor] = [item.x] if item.x.requires_grad else []
    leaves = item.leaves or []
    wanted += [t for t, _ in leaves]
    if not wanted:
        return None
    grads = torch.autograd.grad(
        item.out, wanted, item.grad_out, retain_graph=True, allow_unused=True
    )
    grad_x = grads[0] if item.x.requires_grad else None
    item.leaf_grads = list(grads[1:] if item.x.requires_grad else grads)
    return grad_x


def backward_weights(item: Saved, params: list[torch.nn.Parameter]) -> None:
    """``BW``: the weights' gradients accumulated, from the kept outputs' gradients (or, for a
    stage without them, by the stage's backward again, to ``params``)."""
    pairs: list[tuple[torch.Tensor, list[torch.nn.Parameter], torch.Tensor | None]]
    if item.leaves is not None and item.leaf_grads is not None:
        pairs = [
            (t, own, g)
            for (t, own), g in zip(item.leaves, item.leaf_grads, strict=True)
            if g is not None
        ]
    else:
        pairs = [(item.out, params, item.grad_out)]
    for out, own, grad in pairs:
        got = torch.autograd.grad(out, own, grad, retain_graph=True, allow_unused=True)
        for p, g in zip(own, got, strict=True):
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g


def _collect(
    leaves: list[tuple[torch.Tensor, list[torch.nn.Parameter]]],
    params: list[torch.nn.Parameter],
) -> Callable[..., None]:
    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        tensor = output if isinstance(output, torch.Tensor) and output.requires_grad else None
        leaves.append((tensor, params))  # type: ignore[arg-type]

    return hook
