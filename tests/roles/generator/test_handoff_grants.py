"""What a prefill handoff lets its reader reach, tried by a reader that reaches past it: the
buffer of one request's handoff covers that request's blocks in every layer plane and nothing
else of the prefill generator's pool (not another request's blocks, not the whole pool), is
read-only, and is revoked when the lease ends; a streamed handoff's buffer starts with no block
and grows with the blocks its progress names. In place, the copy refuses blocks outside the
grant though the borrowed view spans the pool."""

from __future__ import annotations

import pathlib

import pytest
import torch

import orchestr as oc
from orchestr.fabric import Buffer
from orchestr.roles import Handoff, Request
from orchestr.roles.generator._kv._direct import Direct, copy_direct
from orchestr.roles.generator._runner._spans import block_spans
from tests.roles.generator.test_handoff import BLOCK, engine, spawn
from tests.roles.generator.test_kv_offload import folder, prompt
from tests.roles.generator.test_paged_engine import drain

__all__ = ["folder"]  # the fixture, used by name

pytestmark = pytest.mark.timeout(180)


def spans_of(h: Handoff, blocks: list[int]) -> list[tuple[int, int]]:
    return [(at, n) for at, n, _ in block_spans(blocks, h.planes, h.plane_bytes, h.row_bytes)]


def covered(spans: list[tuple[int, int]], at: int, n: int) -> bool:
    return any(s <= at and at + n <= s + m for s, m in spans)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_a_handoff_reaches_its_own_requests_blocks_only(
    ctx: oc.JobContext, folder: pathlib.Path, transport: str
) -> None:
    pre = await spawn(ctx, folder, "prefill")
    a = await pre.prefill.call_one(Request("a", prompt(70), 4, temperature=0.0))
    b = await pre.prefill.call_one(Request("b", prompt(90, salt=7), 4, temperature=0.0))
    mine, theirs = a.buffer, b.buffer
    assert set(a.blocks).isdisjoint(b.blocks) and len(a.blocks) == 69 // BLOCK
    granted = mine.spans
    assert granted is not None
    for at, n in spans_of(a, a.blocks):  # every plane of every block, and no more
        assert covered(granted, at, n)
    assert sum(n for _, n in granted) == len(a.blocks) * a.planes * a.row_bytes
    at, n = granted[0]
    got = torch.zeros(n, dtype=torch.uint8)
    assert await mine.read_into(got, offset=at, transport=transport) == transport
    other_at, other_n = spans_of(b, b.blocks)[0]
    tries = {
        "another request's blocks": mine.read_into(
            torch.zeros(other_n, dtype=torch.uint8), offset=other_at, transport=transport
        ),
        "the whole pool": mine.read_into(
            torch.zeros(mine.nbytes, dtype=torch.uint8), transport=transport
        ),
        "a write into its own blocks": mine.write_from(got, offset=at, transport=transport),
    }
    for what, move in tries.items():
        with pytest.raises(oc.DescriptorError):
            await move
            pytest.fail(f"{what} was not refused")
    assert await pre.release_handoff.call_one(a.lease)  # the lease ends: so does its reach
    with pytest.raises(oc.StaleDescriptorError):
        await mine.read_into(got, offset=at, transport=transport)
    # the other handoff is its own grant, untouched
    await theirs.read_into(torch.zeros(other_n, dtype=torch.uint8), offset=other_at)
    assert await pre.release_handoff.call_one(b.lease)


async def test_a_streamed_handoff_reaches_the_blocks_its_progress_names(
    ctx: oc.JobContext, folder: pathlib.Path
) -> None:
    pre = await spawn(ctx, folder, "prefill", kv={"token_budget": 32})
    h = await pre.prefill.call_one(Request("s", prompt(150), 4, temperature=0.0), stream=True)
    assert h.buffer.spans == [] and h.blocks == []
    with pytest.raises(oc.DescriptorError):  # nothing computed yet, nothing granted
        await h.buffer.read_into(torch.zeros(16, dtype=torch.uint8))
    cursor, seen = -1, 0
    while True:
        p = await pre.handoff_progress.call_one(h.lease, cursor)
        cursor = p["cursor"]
        spans = p["buffer"].spans
        assert spans is not None
        named = spans_of(h, p["blocks"])
        assert all(covered(spans, at, n) for at, n in named)
        assert sum(n for _, n in spans) == sum(n for _, n in named)  # those, and no more
        seen = max(seen, len(p["blocks"]))
        if p["state"] != "running":
            break
    assert p["state"] == "done" and seen == 149 // BLOCK
    await pre.end_handoff.call_one(h.lease)
    with pytest.raises(oc.StaleDescriptorError):
        await p["buffer"].read_into(torch.zeros(16, dtype=torch.uint8), offset=spans[0][0])


def test_an_in_place_copy_refuses_blocks_outside_the_grant(folder: pathlib.Path) -> None:
    pre, dec = engine(folder), engine(folder)
    p = prompt(100)
    pre.submit([Request("p", p, 1, temperature=0.0)])
    drain(pre)
    keys, blocks = pre.hold_prefix(p)
    planes, plane_bytes, row_bytes = pre.kv_layout
    h = Handoff(1, None, [], [], planes, plane_bytes, row_bytes, 0, 1.0, 0)
    granted = blocks[:-1]  # the grant leaves out the last block
    grant = Buffer(pre.kv_memory, spans=spans_of(h, granted), writable=False)
    try:
        for theirs, ok in ((blocks, False), (granted, True)):
            borrowed = grant.borrow()
            assert borrowed is not None and borrowed.view.nbytes == planes * plane_bytes
            d = Direct(
                Request("p", p, 4),
                h,
                keys[: len(theirs)],
                0,
                list(theirs),
                borrowed,
            )
            copy_direct(dec, [d])
            assert (d.error is None) is ok, d.error
            assert not borrowed.held
            if ok:
                assert d.reserved is not None
                dec.enter_reserved(p, d.keys, d.reserved, keep=True)
            else:
                assert isinstance(d.error, oc.DescriptorError) and d.reserved is None
        assert dec.prefix_plan(p)[1] == len(granted)  # only the granted blocks entered
    finally:
        grant.release()
        pre.release_blocks(blocks)
