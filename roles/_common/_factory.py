"""Models by name: ``"package.module:callable"`` plus keyword arguments, built under a seed.

Roles take their model this way so a mesh's members (and a restarted member) build the same
model from their constructor arguments alone, and replicas built with one seed start bitwise
equal. :class:`~._model.TinyLM` takes its :class:`~._model.TinyLMConfig` fields as keywords.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

import orchestr as oc

__all__ = ["DEFAULT_MODEL", "build_model", "import_object"]

DEFAULT_MODEL = "orchestr.roles:TinyLM"

#: Names of objects under the private modules they had before the layout moved: a head's
#: store keeps actors' constructor arguments (a scorer, a model factory) in this form.
_MOVED = {
    "orchestr.roles._model:TinyLM": "orchestr.roles:TinyLM",
    "orchestr.roles._task:reward": "orchestr.roles:reverse_task.reward",
}


def import_object(path: str, what: str) -> Any:
    """The callable named ``"package.module:name"`` (``name`` may be dotted). Raises
    :class:`orchestr.ConfigError` that names ``what`` was asked for and what failed."""
    module_name, sep, name = _MOVED.get(path, path).partition(":")
    if not (sep and module_name and name):
        raise oc.ConfigError(f"a {what} is named 'package.module:callable', got {path!r}")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise oc.ConfigError(f"cannot import {what} {path!r}: {type(exc).__name__}: {exc}") from exc
    if not callable(obj):
        raise oc.ConfigError(f"{what} {path!r} is not callable")
    return obj


def build_model(factory: str, kwargs: dict[str, Any] | None, seed: int) -> torch.nn.Module:
    """``factory`` called with ``kwargs`` after ``torch.manual_seed(seed)``.

    Raises :class:`orchestr.ConfigError` when the name does not import, the call fails on its
    arguments, or the result is not a ``torch.nn.Module``."""
    fn = import_object(factory, "model factory")
    from ._model import TinyLM, TinyLMConfig

    torch.manual_seed(seed)
    try:
        if fn is TinyLM:
            model = TinyLM(TinyLMConfig(**(kwargs or {})))
        else:
            model = fn(**(kwargs or {}))
    except (TypeError, ValueError) as exc:
        raise oc.ConfigError(f"model factory {factory!r} refused {kwargs!r}: {exc}") from exc
    if not isinstance(model, torch.nn.Module):
        raise oc.ConfigError(f"{factory} returned {type(model).__name__}, not a torch nn.Module")
    return model
