"""The one-sided conformance suite against every buffer backend this machine has."""

from __future__ import annotations

import pytest

from orchestr import fabric
from orchestr.fabric._conformance_buffers import check_buffer_transport

EXPECTED = {
    "read sizes",
    "write",
    "out of bounds",
    "forged descriptors",
    "read-only",
    "stale after release",
}


def _backends() -> list[object]:
    params: list[object] = []
    for scheme in fabric.buffer_transports():
        backend = fabric.buffer_transport(scheme)
        reason = (
            None
            if backend is not None and backend.probe() is None
            else ("unknown backend" if backend is None else backend.probe())
        )
        marks = [pytest.mark.skip(reason=f"{scheme}: {reason}")] if reason else []
        params.append(pytest.param(scheme, marks=marks, id=scheme))
    return params


@pytest.mark.parametrize("scheme", _backends())
async def test_conformance(scheme: str) -> None:
    passed = await check_buffer_transport(scheme)
    assert EXPECTED <= set(passed)
    assert any(p.startswith("deadline") for p in passed)
    if scheme != "inproc":
        assert "owner killed mid-transfer" in passed
