"""``orchestr.fabric.testing.check_transport`` over every scheme this machine has."""

from __future__ import annotations

import pytest

from orchestr import fabric
from orchestr.errors import TransportUnavailableError
from orchestr.fabric.testing import check_transport


def _schemes() -> list[object]:
    params: list[object] = []
    for scheme in sorted(set(fabric.stream_transports()) | set(fabric.buffer_transports())):
        backend = fabric.buffer_transport(scheme)
        reason = backend.probe() if backend is not None else None
        marks = [pytest.mark.skip(reason=f"{scheme}: {reason}")] if reason else []
        params.append(pytest.param(scheme, marks=marks, id=scheme))
    return params


@pytest.mark.timeout(600)
@pytest.mark.parametrize("scheme", _schemes())
async def test_check_transport(scheme: str) -> None:
    passed = await check_transport(scheme)
    assert passed, scheme
    if scheme in fabric.stream_transports():
        assert len(passed["stream"]) == 6
    if fabric.buffer_transport(scheme) is not None:
        assert len(passed["buffer"]) >= 7


async def test_unknown_and_unavailable_schemes_say_why() -> None:
    with pytest.raises(TransportUnavailableError, match="no stream or buffer backend"):
        await check_transport("carrier-pigeon")
    with pytest.raises(TransportUnavailableError, match="rdma: .*(pyverbs|RDMA)"):
        if fabric.buffer_transport("rdma").probe() is None:  # type: ignore[union-attr]
            pytest.skip("this machine has an RDMA device")
        await check_transport("rdma")
