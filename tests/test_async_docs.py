"""Every public async method and function says what it blocks on, what it raises and whether
it is cancel-safe."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

PUBLIC = ["orchestr", "orchestr.fabric", "orchestr.fabric.optical", "orchestr.fabric.testing"]
PUBLIC += ["orchestr.roles"]
#: Async special methods that are part of a public class's face.
FACES = {"__aenter__", "__aexit__"}


def _public_async() -> Iterator[tuple[str, Callable[..., Any]]]:
    seen = set()
    for module_name in PUBLIC:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            found = []
            if inspect.isclass(obj):
                for attr, value in inspect.getmembers(obj):
                    if attr.startswith("_") and attr not in FACES:
                        continue
                    found.append((f"{module_name}.{name}.{attr}", inspect.unwrap(value)))
            else:
                found.append((f"{module_name}.{name}", obj))
            for label, fn in found:
                if not (inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)):
                    continue
                if (fn.__module__, fn.__qualname__) not in seen:
                    seen.add((fn.__module__, fn.__qualname__))
                    yield label, fn


def test_every_public_async_method_says_what_it_blocks_on_raises_and_if_cancel_safe() -> None:
    missing = []
    checked = 0
    for label, fn in _public_async():
        checked += 1
        doc = (inspect.getdoc(fn) or "").lower()
        lacks = [w for w in ("block", "raise", "cancel") if w not in doc]
        if lacks:
            missing.append(f"{label}: no word of {', '.join(lacks)}")
    assert checked > 60
    assert not missing, "\n".join(missing)
