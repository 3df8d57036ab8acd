"""The order a run visits its train rows in: a seeded permutation per epoch, a step's positions
following from the step alone (so a resumed run needs no cursor). Pure."""

from __future__ import annotations

import random

from orchestr.roles._common._seeding import derive_seed

__all__ = ["EpochOrder"]


class EpochOrder:
    """Which of ``rows`` rows is at position ``index`` of ``step``: positions
    ``step * per_step ...`` of a run through epochs, each a permutation drawn from
    ``(seed, epoch)``, so the position follows from the step alone. Pure; keeps the last few
    epochs' permutations (a run looks a step or two ahead)."""

    KEEP = 4

    def __init__(self, rows: int, per_step: int, seed: int) -> None:
        if rows < 1 or per_step < 1:
            raise ValueError(f"rows and per_step must be >= 1, got {rows} and {per_step}")
        self.rows, self.per_step, self.seed = rows, per_step, seed
        self._orders: dict[int, list[int]] = {}

    def row(self, step: int, index: int) -> int:
        epoch, offset = divmod(step * self.per_step + index, self.rows)
        order = self._orders.get(epoch)
        if order is None:
            order = list(range(self.rows))
            random.Random(derive_seed("data", self.seed, epoch)).shuffle(order)
            if len(self._orders) >= self.KEEP:
                self._orders.pop(min(self._orders))
            self._orders[epoch] = order
        return order[offset]
