"""Scoped buffers: the span arithmetic, and the handle's own surface (a grant of some spans of
memory registered elsewhere too, widened, revoked, refused where it does not reach). The
backends' part is in the conformance suite (``check_buffer_transport``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from orchestr import fabric
from orchestr.errors import DescriptorError, StaleDescriptorError
from orchestr.fabric import Buffer
from orchestr.fabric._buffers import _scope
from orchestr.fabric._buffers._transport import Descriptor


def test_spans_are_sorted_merged_and_checked() -> None:
    assert _scope.flatten([(100, 10), (0, 5), (5, 5), (108, 4), (50, 0)], 200) == (0, 10, 100, 112)
    for bad in ([(190, 20)], [(-1, 2)], [(1.5, 2)], [(1, 2, 3)], ["ab"]):
        with pytest.raises(DescriptorError):
            _scope.flatten(bad, 200)
    scope = (0, 10, 100, 112)
    assert _scope.covers(scope, 0, 10) and _scope.covers(scope, 104, 8)
    assert not _scope.covers(scope, 5, 6)  # across the first span's end
    assert not _scope.covers(scope, 10, 1) and not _scope.covers(scope, 99, 2)
    assert _scope.covers(scope, 10, 0) and not _scope.covers(scope, 50, 0)
    assert not _scope.covers((), 0, 0) and not _scope.covers((), 0, 1)
    assert _scope.bounds(scope) == (0, 112) and _scope.bounds(()) == (0, 0)


def test_widening_names_only_the_new_bytes() -> None:
    scope = (10, 20, 30, 40)
    added = _scope.widen(scope, [(0, 50)], 100)
    assert added == (0, 10, 20, 30, 40, 50)
    assert _scope.merge(scope, added) == (0, 50)
    assert _scope.widen(scope, [(12, 5), (30, 10)], 100) == ()
    assert _scope.widen(scope, [(15, 10)], 100) == (20, 25)
    assert _scope.widen((), [(3, 4)], 100) == (3, 7)


def test_a_descriptor_carries_its_scope_and_refuses_a_malformed_one() -> None:
    key = fabric.process_key()
    desc = Descriptor("tcp", key, 1, 2, 100, ("h", 1), (0, 10, 20, 30))
    assert Descriptor.from_wire(desc.to_wire()) == desc
    plain = Descriptor("tcp", key, 1, 2, 100, ("h", 1))
    assert len(plain.to_wire()) == 6 and Descriptor.from_wire(plain.to_wire()) == plain
    for scope in ([0, 10, 5, 30], [0, 10, 20], [0, 200], ["a", "b"], 7):
        with pytest.raises(DescriptorError):
            Descriptor.from_wire([*plain.to_wire(), scope])
    desc.check_span(22, 8)
    with pytest.raises(DescriptorError, match="outside the spans"):
        desc.check_span(8, 4)


async def test_a_grant_reaches_its_spans_of_memory_registered_as_a_whole_too() -> None:
    memory = fabric.empty(1 << 16, dtype=torch.uint8)
    memory.copy_(torch.arange(1 << 16, dtype=torch.int64).remainder(251).to(torch.uint8))
    whole = Buffer(memory)
    grant = Buffer(memory, spans=[(4096, 4096)], writable=False)
    try:
        assert whole.spans is None and grant.spans == [(4096, 4096)]
        assert "in 1 spans" in repr(grant)
        peer = Buffer.from_wire(grant.to_wire())
        assert peer.descriptors.keys() == grant.descriptors.keys()
        got = torch.zeros(16, dtype=torch.uint8)
        await peer.read_into(got, offset=4100)
        assert torch.equal(got, memory[4100:4116])
        with pytest.raises(DescriptorError, match="outside the spans"):
            await peer.read_into(got, offset=100)
        with pytest.raises(DescriptorError, match="read-only"):
            await peer.write_from(got, offset=4096)
        with pytest.raises(DescriptorError, match="only the owner"):
            peer.allow([(0, 10)])
        with pytest.raises(DescriptorError, match="only a scoped one"):
            whole.allow([(0, 10)])
        with pytest.raises(DescriptorError, match="outside the"):
            grant.allow([(1 << 16, 1)])
        grant.allow([(0, 16), (4096, 10)])  # the second is granted already
        assert grant.spans == [(0, 16), (4096, 4096)] and peer.spans == [(4096, 4096)]
        await Buffer.from_wire(grant.to_wire()).read_into(got)
        assert torch.equal(got, memory[:16])
        grant.release()
        with pytest.raises(StaleDescriptorError):
            await peer.read_into(got, offset=4100)
        await whole.read_into(got, offset=100)  # the memory's other registrations live on
        assert torch.equal(got, memory[100:116])
        with pytest.raises(DescriptorError, match="released"):
            grant.allow([(0, 10)])
    finally:
        grant.release()
        whole.release()


async def test_a_grant_of_no_span_reaches_nothing_until_widened() -> None:
    data = np.arange(256, dtype=np.uint8)
    grant = Buffer(data, spans=[])
    try:
        assert grant.spans == []
        dst = np.zeros(4, np.uint8)
        with pytest.raises(DescriptorError, match="outside the spans"):
            await grant.read_into(dst)
        grant.allow([(8, 4)])
        await Buffer.from_wire(grant.to_wire()).read_into(dst, offset=8)
        assert dst.tolist() == [8, 9, 10, 11]
    finally:
        grant.release()
