"""A generator whose engine step raises when a request's prompt starts with :data:`POISON`:
the test's stand-in for a kernel fault, an out-of-memory or an assertion in a step. Workers
import :class:`FaultyGenerator` by path."""

from __future__ import annotations

from typing import Any

from orchestr.roles import Generator

#: A prompt that starts with these token ids fails the step it is in.
POISON = [7, 7, 7, 7, 7, 7, 7, 7]


class FaultyGenerator(Generator):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        engine: Any = self._engine  # the paged engine, its step replaced
        step = engine.step

        def faulty_step() -> Any:
            live = engine._live.values()  # the paged engine's requests: (Live, Seq)
            if any(entry[0].request.prompt[: len(POISON)] == POISON for entry in live):
                raise RuntimeError("an injected fault in the engine's step")
            return step()

        engine.step = faulty_step
