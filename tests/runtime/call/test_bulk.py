"""Large call values through shared memory, buffer handles through actors, and cleanup."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import sys
import zlib
from collections.abc import Callable

import numpy as np
import pytest
import torch

import orchestr as oc
from orchestr import fabric
from orchestr._call._wire import traffic
from orchestr.errors import DescriptorError, ProtocolError
from orchestr.fabric.lowlevel import pool
from tests.cluster import open_cluster
from tests.runtime.call.bulk_actors import Owner, Reader, Router, Sink

MiB = 1 << 20


async def eventually(check: Callable[[], bool]) -> None:
    """Wait until ``check()`` holds (it reads another process's state: nothing to await)."""
    async with asyncio.timeout(10):
        while not check():  # noqa: ASYNC110
            await asyncio.sleep(0.02)


async def test_large_tensor_arrives_as_shared_memory(ctx: oc.JobContext) -> None:
    sink = await ctx.spawn(Sink)
    await sink.pid.call_one()  # the handshake settles on the first call
    x = torch.arange(4 * MiB, dtype=torch.float32)  # 16 MiB
    mapping, total, shape = await sink.where.call_one(x)
    assert mapping.startswith(f"/memfd:orchestr.{os.getpid()}.")  # no copy on the receiver
    assert total == float(x.double().sum()) and shape == [4 * MiB]
    [row] = [r for r in fabric.connections() if r["direction"] == "out"]
    assert row["bulk"] == "shm" and row["same_host"] and row["fallback"] is None


async def test_small_tensor_stays_in_the_frame(ctx: oc.JobContext) -> None:
    sink = await ctx.spawn(Sink)
    await sink.pid.call_one()  # the handshake settles on the first call
    mapping, total, _ = await sink.where.call_one(torch.ones(1000))
    assert not (mapping or "").startswith(f"/memfd:orchestr.{os.getpid()}.")
    assert total == 1000.0


async def test_results_and_arrays_come_back_through_shared_memory(ctx: oc.JobContext) -> None:
    sink = await ctx.spawn(Sink)
    await sink.pid.call_one()  # the handshake settles on the first call
    x = torch.randn(MiB)
    y = await sink.echo.call_one(x)
    assert torch.equal(x, y)
    from tests.runtime.call.bulk_actors import shared_mapping_of

    worker_pid = await sink.pid.call_one()
    assert str(shared_mapping_of(y.data_ptr())).startswith(f"/memfd:orchestr.{worker_pid}.")
    a = np.arange(MiB, dtype=np.float64)
    mapping, total, dtype = await sink.where_array.call_one(a)
    assert mapping.startswith("/memfd:orchestr.") and total == a.sum() and dtype == "float64"
    b = await sink.echo.call_one(a)
    assert isinstance(b, np.ndarray) and np.array_equal(a, b)


async def test_segments_return_to_the_pool_and_are_reused(ctx: oc.JobContext) -> None:
    sink = await ctx.spawn(Sink)
    await sink.pid.call_one()  # the handshake settles on the first call
    x = torch.zeros(2 * MiB)
    for i in range(5):
        x.fill_(i)
        _, total, _ = await sink.where.call_one(x)
        assert total == i * 2 * MiB  # fresh data every time, never a stale segment
    await eventually(lambda: pool.stats()["held"] == 0)
    assert pool.stats()["segments"] <= 2
    await sink.where.call_one(x, keep=True)  # the actor keeps it: the segment stays lent
    assert pool.stats()["held"] == 1
    assert await sink.drop.call_one() == 1
    await eventually(lambda: pool.stats()["held"] == 0)


async def test_results_held_by_the_caller_pin_the_actors_segment(ctx: oc.JobContext) -> None:
    sink = await ctx.spawn(Sink)
    await sink.pid.call_one()  # the handshake settles on the first call
    y = await sink.make.call_one(MiB, 3.0)
    assert (await sink.pool_stats.call_one())["held"] == 1
    del y
    gc.collect()
    async with asyncio.timeout(10):
        while (await sink.pool_stats.call_one())["held"]:  # noqa: ASYNC110
            await asyncio.sleep(0.02)


async def test_registered_memory_moves_with_no_copy(ctx: oc.JobContext) -> None:
    sink = await ctx.spawn(Sink)
    await sink.pid.call_one()  # the handshake settles on the first call
    x = fabric.empty((MiB,), torch.float32)
    x.fill_(1.0)
    await sink.fill.call_one(x, 5.0)  # the actor writes into the very memory we sent
    assert float(x[0]) == 5.0 and float(x[-1]) == 5.0
    await sink.drop.call_one()
    del x
    gc.collect()
    await eventually(lambda: pool.stats()["held"] == 0)


async def test_buffer_handle_read_and_write_across_actors(ctx: oc.JobContext) -> None:
    owner, reader = await asyncio.gather(ctx.spawn(Owner), ctx.spawn(Reader))
    buf = await owner.share.call_one(MiB, 2.0)
    assert isinstance(buf, oc.Buffer) and buf.nbytes == 4 * MiB
    used, total = await reader.pull.call_one(buf)
    assert used == "shm" and total == 2.0 * MiB
    assert await reader.push.call_one(buf, 7.0) == "shm"
    assert await owner.value_at.call_one(0, MiB - 1) == 7.0
    dst = torch.empty(MiB)
    assert await buf.read_into(dst) == "shm"  # the driver reads it too
    assert float(dst.sum()) == 7.0 * MiB


async def test_a_buffer_in_shared_memory_is_read_from_a_mapping_in_verified_pieces(
    ctx: oc.JobContext,
) -> None:
    """A region in one of the owner's segments is read by memmove from a read-only mapping
    (``read_pieces`` calls ``fn`` on each piece as it lands); writes still go through the
    kernel copy; a released region is stale on either path."""
    owner, reader = await asyncio.gather(ctx.spawn(Owner), ctx.spawn(Reader))
    n, piece = 3 * MiB + 5, 1 << 20  # 12 MiB and 20 bytes: the last piece is short
    buf = await owner.share_shared.call_one(n)
    plain = await owner.share.call_one(MiB, 1.0)
    raw = torch.arange(n, dtype=torch.float32).numpy().tobytes()
    want = [zlib.crc32(raw[at : at + piece]) for at in range(0, len(raw), piece)]
    total = float(torch.arange(n, dtype=torch.float64).sum())
    for _ in range(2):  # the second read finds its mapping cached
        assert await reader.pull_pieces.call_one(buf, piece) == ["shm", want, total]
        assert await reader.pull.call_one(buf) == ["shm", total]
    assert await reader.mapped_bytes.call_one() == 4 * buf.nbytes
    used, sums, got = await reader.pull_pieces.call_one(plain, piece)  # not in a segment
    assert (used, len(sums), got) == ("shm", 4, float(MiB))
    assert await reader.mapped_bytes.call_one() == 4 * buf.nbytes  # a kernel copy, that one
    assert await reader.push.call_one(buf, 3.0) == "shm"
    assert await owner.value_at.call_one(0, n - 1) == 3.0
    await owner.release.call_one(0)
    for call in (reader.pull.call_one(buf), reader.pull_pieces.call_one(buf, piece)):
        with pytest.raises(oc.ActorError, match="StaleDescriptorError|released"):
            await call


async def test_spans_of_a_buffer_are_read_at_once_on_every_path(ctx: oc.JobContext) -> None:
    """``read_spans``: from the owner's shared memory (one hop, two threads), by kernel copies
    (a region not in a segment), and over tcp; a span out of bounds is refused before any is
    copied."""
    owner, reader = await asyncio.gather(ctx.spawn(Owner), ctx.spawn(Reader))
    n = 3 * MiB  # floats 0 .. n-1
    shared = await owner.share_shared.call_one(n)
    plain = await owner.share.call_one(1024, 1.0)
    spans = [[4 * (n - 8), 8], [0, 3], [4 * MiB, MiB], [400, 0]]  # a MiB: over the thread size
    want = [[float(i) for i in range(o // 4, o // 4 + c)] for o, c in spans]
    before = await reader.mapped_bytes.call_one()
    assert await reader.pull_spans.call_one(shared, spans) == ["shm", want]
    assert await reader.mapped_bytes.call_one() == before + 4 * (8 + 3 + MiB)  # one mapping
    assert await reader.pull_spans.call_one(shared, spans, None, True) == ["shm", want]
    assert await reader.pull_spans.call_one(shared, spans, "tcp") == ["tcp", want]
    assert await reader.pull_spans.call_one(plain, [[0, 2], [4092, 1]]) == [
        "shm",
        [[1.0, 1.0], [1.0]],
    ]
    with pytest.raises(oc.ActorError, match="DescriptorError"):
        await reader.pull_spans.call_one(shared, [[0, 4], [4 * n - 4, 2]])
    # and written at once: two spans, a MiB and one float, then read back
    assert (
        await reader.push_spans.call_one(shared, [[0, MiB, -1.0], [4 * (n - 1), 1, -2.0]]) == "shm"
    )
    assert [await owner.value_at.call_one(0, i) for i in (0, MiB - 1, MiB, n - 1)] == [
        -1.0,
        -1.0,
        float(MiB),
        -2.0,
    ]
    with pytest.raises(oc.ActorError, match="DescriptorError"):
        await reader.push_spans.call_one(shared, [[4 * n, 1, 0.0]])


async def test_a_router_forwards_handles_without_the_bytes(ctx: oc.JobContext) -> None:
    owner, reader, router = await asyncio.gather(
        ctx.spawn(Owner), ctx.spawn(Reader), ctx.spawn(Router)
    )
    buf = await owner.share.call_one(8 * MiB, 1.0)  # 32 MiB
    before = await router.received.call_one()
    used, total = await router.forward.call_one(reader, buf)
    through_router = await router.received.call_one() - before
    assert used == "shm" and total == 8.0 * MiB
    assert through_router < 64 * 1024, f"{through_router} bytes went through the router"
    assert (await reader.counters.call_one())["shm"]["bytes_read"] == 32 * MiB


async def test_buffers_are_released_when_the_owner_releases_or_stops(
    ctx: oc.JobContext,
) -> None:
    owner = await ctx.spawn(Owner)
    first = await owner.share.call_one(1024, 1.0)
    second = await owner.share.call_one(1024, 2.0)
    await owner.release.call_one(0)
    with pytest.raises(oc.StaleDescriptorError):
        await first.read_into(torch.empty(1024))
    await second.read_into(torch.empty(1024))
    await ctx.stop(owner)
    with pytest.raises(oc.StaleDescriptorError):
        await second.read_into(torch.empty(1024))


def _mapped_segments_of(pid: int) -> list[str]:
    """Every mapping or open fd, in any process, of a segment made by process ``pid``."""
    needle = f"memfd:orchestr.{pid}."
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/maps") as f:
                found += [f"{entry}: {line.strip()}" for line in f if needle in line]
        except OSError:
            continue
    return found


async def test_sigkill_of_the_owner_leaves_no_segment_behind(ctx: oc.JobContext) -> None:
    sink = await ctx.spawn(Sink, supervise="handle")  # its death is expected
    await sink.pid.call_one()  # the handshake settles on the first call
    pid = await sink.pid.call_one()
    y = await sink.make.call_one(MiB, 4.0)  # a view of the actor's segment, held here
    assert _mapped_segments_of(pid)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(oc.ActorDiedError):
        await sink.pid.call_one()
    assert float(y.sum()) == 4.0 * MiB  # what we hold stays valid after the owner died
    del y
    gc.collect()
    assert _mapped_segments_of(pid) == []
    assert not [n for n in os.listdir("/dev/shm") if "orchestr" in n]


async def test_fallback_policy_for_buffers(ctx: oc.JobContext) -> None:
    owner = await ctx.spawn(Owner)
    buf = await owner.share.call_one(1024, 1.0)
    with pytest.raises(oc.FallbackError, match="rdma.*fallback policy is 'error'"):
        await buf.read_into(torch.empty(1024), transport="rdma", fallback="error")
    from orchestr.fabric.lowlevel import buffer_stats as stats

    before = stats["shm"].fallbacks if "shm" in stats else 0
    assert await buf.read_into(torch.empty(1024), transport="rdma", fallback="allow") == "shm"
    assert stats["shm"].fallbacks == before + 1
    with pytest.raises(oc.ConfigError):
        await buf.read_into(torch.empty(1024), fallback="sometimes")


async def test_a_failed_shared_memory_handshake_falls_back_loudly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from orchestr._call import _locality

    # a probe the worker cannot map: the handshake must notice and say why
    monkeypatch.setattr(_locality, "probe", lambda: [os.getpid(), 987654, 1])
    async with open_cluster() as ctx:
        sink = await ctx.spawn(Sink)
        worker = await sink.pid.call_one()
        x = torch.ones(2 * MiB)
        mapping, total, _ = await sink.where.call_one(x)
        # it came in the frame, straight into the worker's reused receive memory
        assert mapping.startswith(f"/memfd:orchestr.{worker}.")
        assert total == 2.0 * MiB and not (mapping or "").startswith(
            f"/memfd:orchestr.{os.getpid()}."
        )
        [row] = [r for r in fabric.connections() if r["direction"] == "out"]
        assert row["bulk"] == "inline" and "cannot map" in row["fallback"]
        strict = sink.where.options(fallback="error")  # a per-call policy
        with pytest.raises(oc.FallbackError, match="cannot map"):
            await strict.call_one(x)
        assert (await strict.call_one(torch.ones(10)))[1] == 10.0
        with pytest.raises(oc.ConfigError):
            sink.where.options(fallback="never")
        # past the 64 MiB message limit: bulk values in a frame count against max_bulk_bytes
        big = torch.ones(20 * MiB)
        assert (await sink.where.call_one(big))[1] == 20.0 * MiB
    config = oc.load_config(transport_fallback="error")
    async with open_cluster(config) as ctx:
        sink = await ctx.spawn(Sink)
        await sink.pid.call_one()
        with pytest.raises(oc.FallbackError, match="fallback policy is 'error'"):
            await sink.where.call_one(torch.ones(2 * MiB))
        assert (await sink.where.call_one(torch.ones(10)))[1] == 10.0  # small calls still work


async def test_received_bytes_are_counted() -> None:
    before = traffic["received"]
    async with open_cluster() as ctx:
        sink = await ctx.spawn(Sink)
        await sink.pid.call_one()  # the handshake settles on the first call
        await sink.echo.call_one(b"x" * 100_000)
    assert traffic["received"] - before >= 100_000


async def test_calls_on_one_host_can_ride_shared_memory_streams() -> None:
    config = oc.load_config(local_call_transport="shm")
    async with open_cluster(config) as ctx:
        sink = await ctx.spawn(Sink)
        await sink.pid.call_one()  # the handshake settles on the first call
        for n in (10, 100_000, 2 * MiB):  # inline, out of band, and a shared-memory value
            assert (await sink.where.call_one(torch.ones(n)))[1] == float(n)
        [row] = [r for r in fabric.connections() if r["direction"] == "out"]
        assert row["stream"] == "shm" and row["bulk"] == "shm" and row["fallback"] is None
        inbound = [r for r in await sink.connections.call_one() if r["direction"] == "in"]
        assert [r["stream"] for r in inbound] == ["shm"]
    async with open_cluster() as ctx:  # the default: tcp
        sink = await ctx.spawn(Sink)
        await sink.pid.call_one()
        [row] = [r for r in fabric.connections() if r["direction"] == "out"]
        assert row["stream"] == "tcp"


async def test_bulk_values_have_a_limit_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    from orchestr._call import _locality

    monkeypatch.setattr(_locality, "probe", lambda: [os.getpid(), 987654, 1])  # keep it inline
    config = oc.load_config(max_bulk_bytes=4 * MiB, inline_max_bytes=MiB)
    async with open_cluster(config) as ctx:
        sink = await ctx.spawn(Sink)
        await sink.pid.call_one()
        assert (await sink.where.call_one(torch.ones(MiB // 2)))[1] == MiB / 2
        with pytest.raises(oc.MessageTooLargeError, match="ORCHESTR_MAX_BULK_BYTES"):
            await sink.where.call_one(torch.ones(2 * MiB))


async def test_async_endpoints_let_go_of_their_arguments(ctx: oc.JobContext) -> None:
    sink = await ctx.spawn(Sink)
    await sink.pid.call_one()  # the handshake settles on the first call
    x = torch.zeros(2 * MiB)
    for i in range(4):
        x.fill_(i)
        assert await sink.where_async.call_one(x) == i
    await eventually(lambda: pool.stats()["held"] == 0)  # not pinned until the next call
    assert pool.stats()["segments"] == 1  # each call reused the segment the last one freed


class _Opaque:
    """Has an extension code here but not in the worker, so the worker cannot decode it."""


async def test_a_message_that_fails_to_decode_gives_its_segments_back(
    ctx: oc.JobContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    from orchestr._call import _registry

    monkeypatch.setitem(_registry._ext_encoders, _Opaque, (99, lambda o: 0))  # this process only
    sink = await ctx.spawn(Sink)
    await sink.pid.call_one()  # the handshake settles on the first call
    for _ in range(3):
        with pytest.raises(oc.TransportError, match="unknown extension type 99"):
            await sink.echo.call_one([_Opaque(), torch.ones(MiB)])
    await eventually(lambda: pool.stats()["held"] == 0)
    assert (await sink.where.call_one(torch.ones(MiB)))[1] == MiB  # the connection lives on


async def test_a_peer_cannot_claim_to_be_the_server_itself(ctx: oc.JobContext) -> None:
    """A connection that claims the server's own process key and shows the server's own probe
    (learned from an honest handshake) must not get shared memory."""
    import json

    sink = await ctx.spawn(Sink)
    address = sink.members[0].address
    server_key = address.split("?proc=")[1].split("&")[0]
    code = f"""
import json
from orchestr._call import _locality
from orchestr.fabric import process_key
from tests import rawcall
def hello(info):
    with rawcall.connect({address!r}) as sock:
        return rawcall.handshake(sock, {ctx.token!r}, {address!r}, info)[2]
honest = hello({{"process": process_key(), "probe": _locality.probe()}})
forged = hello({{"process": {server_key!r}, "probe": honest["probe"]}})
print(json.dumps([honest, forged]))
"""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    honest, forged = json.loads(out)
    assert honest["shm"] is True and honest["probe"] is not None
    assert forged["shm"] is False and forged["probe"] is None


async def test_the_first_calls_on_a_connection_already_use_shared_memory(
    ctx: oc.JobContext,
) -> None:
    from tests.runtime.call.bulk_actors import shared_mapping_of

    sinks = await ctx.spawn(Sink, n=2)
    first, second = sinks[0], sinks[1]
    # the very first message to this actor carries a large value: it waits for the handshake
    mapping, total, _ = await first.where.call_one(torch.ones(MiB))
    assert mapping.startswith(f"/memfd:orchestr.{os.getpid()}.") and total == MiB
    # the very first answer from that actor is large: it waits for the caller's READY
    y = await second.make.call_one(MiB, 2.0)
    worker = await second.pid.call_one()
    assert str(shared_mapping_of(y.data_ptr())).startswith(f"/memfd:orchestr.{worker}.")
    assert float(y.sum()) == 2.0 * MiB


async def test_a_call_to_many_members_copies_a_large_argument_once(ctx: oc.JobContext) -> None:
    sinks = await ctx.spawn(Sink, n=3)
    await sinks.pid.call()  # the handshakes settle on the first calls
    await eventually(lambda: pool.stats()["held"] == 0)
    before = pool.stats()["segments"]
    x = torch.arange(MiB, dtype=torch.float32)
    results = await sinks.where.call(x, keep=True)
    assert [r[1] for r in results] == [float(x.double().sum())] * 3
    assert pool.stats()["segments"] - before <= 1  # one copy, lent to all three
    assert pool.stats()["held"] == 1
    assert await sinks.drop.call() == [1, 1, 1]
    await eventually(lambda: pool.stats()["held"] == 0)
    with pytest.raises(oc.SerializationError):  # copied, then refused: the copy is given back
        sinks.where.call(x, {1, 2})
    assert pool.stats()["held"] == 0


async def test_past_the_pool_budget_large_values_go_into_the_frame() -> None:
    from orchestr.fabric.lowlevel import buffer_stats as stats

    config = oc.load_config(shm_pool_bytes=2 * MiB)
    async with open_cluster(config) as ctx:
        sink = await ctx.spawn(Sink)
        worker = await sink.pid.call_one()
        me = f"/memfd:orchestr.{os.getpid()}."
        for _ in range(2):  # the actor keeps both: 2 MiB lent, the whole budget
            mapping, _, _ = await sink.where.call_one(torch.ones(MiB // 4), keep=True)
            assert mapping.startswith(me)
        before = stats["tcp"].fallbacks if "tcp" in stats else 0
        mapping, total, _ = await sink.where.call_one(torch.ones(MiB // 4), keep=True)
        assert total == MiB // 4 and mapping.startswith(f"/memfd:orchestr.{worker}.")
        assert stats["tcp"].fallbacks == before + 1
        with pytest.raises(oc.FallbackError, match="ORCHESTR_SHM_POOL_BYTES"):
            await sink.where.options(fallback="error").call_one(torch.ones(MiB // 4))
        await sink.drop.call_one()
        await eventually(lambda: pool.stats()["held"] == 0)
        mapping, _, _ = await sink.where.call_one(torch.ones(MiB // 4))
        assert mapping.startswith(me)  # the budget is free again


async def test_descriptors_from_the_wrong_process_are_refused() -> None:
    from orchestr._call._bulk import BulkLink
    from orchestr.config import Config

    link = BulkLink(Config(), asyncio.get_running_loop(), lambda items: None)
    with pytest.raises(ProtocolError, match="before this connection agreed"):
        link.view([os.getpid(), 3, 1, 1, 0], 8)
    link.set_peer("aaaa:1:beef")
    link.can_receive = True
    with pytest.raises(DescriptorError, match="arrived from"):
        link.view([os.getpid(), 3, 1, 1, 0], 8)
    with pytest.raises(ProtocolError):
        link.released("not a list")
    link.released([[3, 1]])  # not a lease we made: ignored, not a crash
