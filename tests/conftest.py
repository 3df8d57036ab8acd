from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

import orchestr as oc


@pytest.fixture
async def ctx() -> AsyncIterator[oc.JobContext]:
    """An embedded cluster (head + one node) for one test; workers are stopped afterwards."""
    async with oc.open_local_cluster() as job:
        yield job
