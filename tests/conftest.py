from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

import orchestr as oc
from tests.cluster import open_cluster


@pytest.fixture
async def ctx() -> AsyncIterator[oc.JobContext]:
    """An embedded cluster (head + one node) for one test. Its workers are stopped afterwards,
    and the test fails if the cluster left processes, connections, lent shared memory or
    threads behind (see :mod:`tests.cluster`)."""
    async with open_cluster() as job:
        yield job
