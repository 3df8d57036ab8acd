from __future__ import annotations

from collections.abc import AsyncIterator

import orchestr as oc
import pytest


@pytest.fixture
async def ctx() -> AsyncIterator[oc.JobContext]:
    """An embedded cluster (head + one node) for one test; workers are stopped afterwards."""
    async with oc.open_local_cluster() as job:
        yield job
