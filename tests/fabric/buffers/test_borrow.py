"""Borrowing a buffer's memory in place (``Buffer.borrow``) against the owner's claims
(``Buffer.claim``), between real processes: the test process owns, an actor borrows."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import orchestr as oc
from orchestr import fabric
from orchestr.errors import DescriptorError, StaleDescriptorError

N = 1 << 18  # float32: 1 MiB


class Borrower(oc.Actor):
    def __init__(self) -> None:
        self.held: fabric.Borrowed | None = None

    @oc.endpoint
    def borrow(self, buf: oc.Buffer) -> float | None:
        """Borrow ``buf`` and keep it; the sum of its float32 values, or None."""
        self.held = buf.borrow()
        if self.held is None:
            return None
        return float(np.frombuffer(self.held.view, dtype=np.float32).sum(dtype=np.float64))

    @oc.endpoint
    def total(self) -> float:
        assert self.held is not None
        return float(np.frombuffer(self.held.view, dtype=np.float32).sum(dtype=np.float64))

    @oc.endpoint
    def write(self) -> str:
        """Try to change the borrowed bytes."""
        assert self.held is not None
        try:
            self.held.view[0] = 1
        except TypeError as exc:
            return f"refused: {exc}"
        return "written"

    @oc.endpoint
    def release(self) -> None:
        assert self.held is not None
        self.held.release()

    @oc.endpoint
    def pid(self) -> int:
        return os.getpid()


def shared(value: float) -> tuple[torch.Tensor, oc.Buffer]:
    t = fabric.empty(N)
    t.fill_(value)
    return t, oc.Buffer(t)


async def eventually(check: Callable[[], bool]) -> None:
    async with asyncio.timeout(30):
        while not check():  # noqa: ASYNC110
            await asyncio.sleep(0.05)


async def test_a_borrow_holds_the_owners_bytes_and_the_owner_waits_for_it(
    ctx: oc.JobContext,
) -> None:
    peer = await ctx.spawn(Borrower)
    t, buf = shared(2.0)
    assert await peer.borrow.call_one(buf) == 2.0 * N  # the owner's bytes, in place
    assert buf.claim() is None  # borrowed: the owner may not change them
    t.fill_(3.0)  # (the owner's own code can still write: the claim is how it asks first)
    assert await peer.total.call_one() == 3.0 * N  # same memory, no copy
    assert (await peer.write.call_one()).startswith("refused")  # read-only
    await peer.release.call_one()
    claim = buf.claim()
    assert claim is not None
    with claim:
        assert await peer.borrow.call_one(buf) is None  # claimed: no borrow starts
    assert await peer.borrow.call_one(buf) == 3.0 * N
    await peer.release.call_one()


async def test_a_borrower_killed_with_sigkill_lets_go(ctx: oc.JobContext) -> None:
    peer = await ctx.spawn(Borrower, supervise="handle")
    _, buf = shared(1.0)
    assert await peer.borrow.call_one(buf) == float(N)
    assert buf.claim() is None
    os.kill(await peer.pid.call_one(), signal.SIGKILL)
    claims: list[Any] = []
    await eventually(lambda: bool(claims.append(buf.claim()) or claims[-1] is not None))
    claims[-1].release()


async def test_freed_memory_a_peer_still_borrows_is_never_reused(ctx: oc.JobContext) -> None:
    """The owner drops a buffer a peer still borrows: the pool does not lend that memory out
    again (it would change under the borrower); the kernel frees it when the peer lets go."""
    peer = await ctx.spawn(Borrower)
    t, buf = shared(5.0)
    assert await peer.borrow.call_one(buf) == 5.0 * N
    buf.release()
    del t
    gc.collect()
    fresh = [fabric.empty(N) for _ in range(4)]  # same size: the freed segment's class
    for f in fresh:
        f.fill_(7.0)
    assert await peer.total.call_one() == 5.0 * N
    await peer.release.call_one()


async def test_what_cannot_be_borrowed_or_claimed() -> None:
    plain = oc.Buffer(torch.ones(16))  # not in shared memory: read it instead
    assert plain.borrow() is None
    claim = plain.claim()  # nothing can borrow it: the claim holds nothing
    assert claim is not None
    claim.release()
    _, buf = shared(1.0)
    handle = oc.Buffer.from_wire(buf.to_wire())
    with pytest.raises(DescriptorError, match="only the owner"):
        handle.claim()
    borrowed = handle.borrow()  # the owner's own process may borrow too (another open)
    assert borrowed is not None and buf.claim() is None
    borrowed.release()
    borrowed.release()  # idempotent
    assert buf.claim() is not None
    buf.release()
    with pytest.raises(StaleDescriptorError):
        handle.borrow()
    with pytest.raises(DescriptorError, match="released"):
        buf.claim()
