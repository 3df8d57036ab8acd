"""A job's handle on a reservation: resources held on nodes ahead of spawning."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._context import JobContext

__all__ = ["Reservation"]


@dataclasses.dataclass(eq=False)
class Reservation:
    """Bundles of resources the head holds on nodes for this job (what Ray calls a placement
    group): bundle ``i`` is on node ``node_ids[i]``. Made with :meth:`JobContext.reserve`;
    ``ctx.spawn(..., reservation=r)`` places members in its free bundles, one each, and
    :meth:`release` (or the job's end) gives the resources back and stops those members."""

    reservation_id: str
    name: str
    resources: dict[str, float]
    node_ids: list[str]
    _ctx: JobContext = dataclasses.field(repr=False)

    @property
    def bundles(self) -> int:
        return len(self.node_ids)

    async def release(self) -> None:
        """Stop the actors spawned in it and free its resources. Idempotent.

        Blocks and raises as :meth:`JobContext.release` does; cancel-safe."""
        await self._ctx.release(self)
