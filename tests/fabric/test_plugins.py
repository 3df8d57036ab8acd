"""Out-of-tree transports register through the ``orchestr.transports`` entry-point group."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from orchestr import fabric
from orchestr.fabric import _registry


@pytest.fixture
def installed_plugin(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A distribution on sys.path whose metadata declares two transports, one broken."""
    dist = tmp_path / "orchestr_carrier-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: orchestr-carrier\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[orchestr.transports]\n"
        "carrier = tests.fabric.plugin:CarrierBuffers\n"
        "broken = tests.fabric.no_such_module:Nothing\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(_registry, "_entry_points_loaded", False)
    monkeypatch.setattr(_registry, "_factories", dict(_registry._factories))
    monkeypatch.setattr(_registry, "_instances", dict(_registry._instances))


async def test_an_entry_point_backend_is_found_and_used(installed_plugin: None) -> None:
    assert "carrier" in fabric.buffer_transports()
    assert "broken" not in fabric.buffer_transports()  # logged and left out, not fatal
    backend = fabric.buffer_transport("carrier")
    assert backend is not None and backend.scheme == "carrier"
    row = next(r for r in fabric.transport_report() if r["scheme"] == "carrier")
    assert row["available"] and row["kind"] == "buffer"
    src = np.arange(100, dtype=np.uint8)
    buf = fabric.Buffer(src)
    assert "carrier" in buf.descriptors
    dst = np.zeros(100, np.uint8)
    assert await buf.read_into(dst, transport="carrier", fallback="error") == "carrier"
    assert np.array_equal(src, dst)
    buf.release()


def test_unknown_schemes_are_none() -> None:
    assert fabric.buffer_transport("no-such-scheme") is None
