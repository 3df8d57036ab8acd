"""The event-rate workload every system runs in ``bench/sim_events.py``: ``chains`` chains of
timed waits, ``events`` waits in all; the ``k``-th wait of chain ``c`` lasts
``DELAYS[(c * 31 + k) % len(DELAYS)]`` seconds (exponential, mean 1 ms, drawn once with seed
0). Imported by the peers' scripts, so it must need nothing but the standard library."""

from __future__ import annotations

import random

_rng = random.Random(0)
DELAYS: list[float] = [round(_rng.expovariate(1000.0), 9) for _ in range(4096)]
MASK = len(DELAYS) - 1


def delay(chain: int, k: int) -> float:
    return DELAYS[(chain * 31 + k) & MASK]
