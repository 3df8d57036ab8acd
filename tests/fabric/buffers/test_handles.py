"""``Buffer`` handles in one process: wire form, validation, ownership, release."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from orchestr import fabric
from orchestr.errors import DescriptorError, OrchestrError, StaleDescriptorError


async def test_a_dropped_buffer_is_released_soon_after() -> None:
    owned = fabric.Buffer(np.arange(16, dtype=np.uint8))
    handle = fabric.Buffer.from_wire(owned.to_wire())
    dst = np.zeros(16, np.uint8)
    assert await handle.read_into(dst, transport="shm") == "shm"
    del owned
    gc.collect()
    fabric.Buffer(np.zeros(4, np.uint8)).release()  # the next registration does it
    with pytest.raises(StaleDescriptorError):
        await handle.read_into(dst, transport="shm")


async def test_handles_round_trip_and_say_what_they_hold() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    with fabric.Buffer(t) as buf:
        copy = fabric.Buffer.from_wire(buf.to_wire())
        assert (copy.nbytes, copy.dtype, copy.shape) == (48, "float32", [3, 4])
        assert copy.owner == fabric.process_key() and "live" in repr(buf)
        with pytest.raises(DescriptorError, match="only the owner"):
            copy.release()
        out = torch.empty(3, 4)
        assert await copy.read_into(out) == "inproc"  # same process: the natural path
        assert torch.equal(out, t)
    with pytest.raises(DescriptorError, match="released"):
        buf.to_wire()
    buf.release()  # idempotent


@pytest.mark.parametrize(
    "wire",
    [None, [], [1, "u1", [1], []], [1, "u1", [1], [["shm", "nohost", 1, 1, 1, []]]], "x"],
)
def test_malformed_handles_are_refused(wire: object) -> None:
    with pytest.raises(DescriptorError):
        fabric.Buffer.from_wire(wire)


def test_what_cannot_be_registered() -> None:
    with pytest.raises(OrchestrError, match="contiguous"):
        fabric.Buffer(torch.zeros(4, 4).t())
    with pytest.raises(OrchestrError, match="tensor, array or bytes-like"):
        fabric.Buffer(object())


async def test_read_into_needs_a_writable_destination() -> None:
    with fabric.Buffer(bytearray(8)) as buf:
        with pytest.raises(OrchestrError, match="read-only"):
            await buf.read_into(b"12345678")
