"""Shared-memory segments: the pool, peer mappings and the descriptor checks, in real
processes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from orchestr.errors import DescriptorError, StaleDescriptorError
from orchestr.fabric._buffers._memfd import Segment, open_peer
from orchestr.fabric._buffers._segments import PeerSegments, SegmentPool, _capacity

MiB = 1 << 20

# A second process that maps our segments (peers must be other processes: /proc/PID/fd).
_PEER = """
import json, sys
from orchestr.fabric._buffers._segments import PeerSegments
peers = PeerSegments()
for line in sys.stdin:
    pid, fd, key, gen, offset, n = json.loads(line)
    try:
        a = peers.view(pid, fd, key, gen, offset, n, lambda: None)
        print(json.dumps(["ok", int(a.astype("u8").sum())]), flush=True)
    except Exception as exc:
        print(json.dumps([type(exc).__name__, str(exc)]), flush=True)
"""


@pytest.fixture
def peer() -> Iterator[Callable[..., list[object]]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _PEER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )

    def ask(*fields: int) -> list[object]:
        import json

        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(list(fields)) + "\n")
        proc.stdin.flush()
        return json.loads(proc.stdout.readline())

    yield ask
    proc.kill()
    proc.wait()
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.close()
    proc.stdout.close()


def test_capacity_classes() -> None:
    assert _capacity(1) == MiB
    assert _capacity(MiB + 1) == 2 * MiB
    assert _capacity(64 * MiB) == 64 * MiB
    assert _capacity(64 * MiB + 1) == 128 * MiB
    assert _capacity(1000 * MiB) == 1024 * MiB


def test_a_peer_maps_a_leased_segment_and_checks_it(peer: Callable[..., list[object]]) -> None:
    pool = SegmentPool()
    seg, gen = pool.lease(3 * MiB)
    np.frombuffer(seg.data, np.uint8)[: 3 * MiB] = 2
    me = os.getpid()
    assert peer(me, seg.fd, seg.key, gen, 0, 3 * MiB) == ["ok", 6 * MiB]
    assert peer(me, seg.fd, seg.key, gen, MiB, 10) == ["ok", 20]
    # beyond the segment, wrong key, older generation, an fd that is not a segment, no process
    assert peer(me, seg.fd, seg.key, gen, seg.capacity - 4, 8)[0] == "DescriptorError"
    assert peer(me, seg.fd, seg.key ^ 1, gen, 0, 8)[0] == "StaleDescriptorError"
    assert peer(me, seg.fd, seg.key, gen - 1, 0, 8)[0] == "StaleDescriptorError"
    assert peer(me, 1, seg.key, gen, 0, 8)[0] == "DescriptorError"
    assert peer(me, 987654, seg.key, gen, 0, 8)[0] == "StaleDescriptorError"
    assert peer(2**22 + 7, 3, 1, 1, 0, 8)[0] == "StaleDescriptorError"
    pool.release(seg.fd, gen)
    seg2, gen2 = pool.lease(MiB)  # reuses the free segment under a new generation
    assert seg2 is seg and gen2 == gen + 1
    assert peer(me, seg.fd, seg.key, gen, 0, 8)[0] == "StaleDescriptorError"
    pool.close()


def test_holders_and_stale_releases() -> None:
    pool = SegmentPool()
    seg, gen = pool.lease(MiB)
    assert pool.hold(seg.fd, gen)
    assert not pool.hold(seg.fd, gen - 1)  # not lent under that generation
    pool.release(seg.fd, gen - 1)  # an old generation's release changes nothing
    pool.release(seg.fd, gen)
    assert pool.stats()["held"] == 1
    pool.release(seg.fd, gen)
    assert pool.stats() == {"segments": 1, "bytes": MiB, "idle_bytes": MiB, "held": 0}
    pool.release(seg.fd, gen)  # one too many: ignored
    assert pool.stats()["held"] == 0
    assert not pool.hold(seg.fd, gen)  # a free segment cannot be lent again this way
    again, _ = pool.lease(MiB)
    assert again is seg and pool.stats()["segments"] == 1  # it was in the free list once
    pool.close()


def test_find_locates_memory_inside_held_segments() -> None:
    pool = SegmentPool()
    view, done = pool.empty(2 * MiB)
    addr = np.frombuffer(view, np.uint8).ctypes.data
    found = pool.find(addr + 100, 1000)
    assert found is not None and found[1] == 100
    assert pool.find(addr + 2 * MiB - 10, 100) is None  # runs past the segment
    assert pool.find(np.zeros(10).ctypes.data, 10) is None
    del view
    done()
    assert pool.find(addr, 10) is None  # free segments are not lendable
    pool.close()


def test_idle_segments_beyond_the_limit_are_closed() -> None:
    pool = SegmentPool(idle_bytes=2 * MiB)
    leases = [pool.lease(MiB) for _ in range(4)]
    for seg, gen in leases:
        pool.release(seg.fd, gen)
    assert pool.stats()["idle_bytes"] <= 2 * MiB and pool.stats()["segments"] == 2
    pool.close()


def test_leases_of_a_dead_peer_come_back() -> None:
    pool = SegmentPool()
    seg, gen = pool.lease(MiB)
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    pool.orphan(proc.pid, [(seg.fd, gen)])
    assert pool.stats()["held"] == 0
    alive = os.getpid()
    seg2, gen2 = pool.lease(MiB)
    pool.orphan(alive, [(seg2.fd, gen2)])  # still running: stays lent
    assert pool.stats()["held"] == 1
    pool.close()


def test_open_peer_refuses_non_segments() -> None:
    r, w = os.pipe()
    try:
        with pytest.raises(DescriptorError, match="not an orchestr segment"):
            open_peer(os.getpid(), r, 1)
    finally:
        os.close(r)
        os.close(w)
    seg = Segment(4096)
    with pytest.raises(StaleDescriptorError, match="key"):
        open_peer(os.getpid(), seg.fd, seg.key + 2)
    open_peer(os.getpid(), seg.fd, seg.key).close()
    seg.close()
    seg.close()  # idempotent


def test_peer_mappings_are_cached_and_forgotten() -> None:
    seg = Segment(MiB)
    peers = PeerSegments()
    released: list[int] = []
    a = peers.view(os.getpid(), seg.fd, seg.key, 0, 0, 16, lambda: released.append(1))
    b = peers.view(os.getpid(), seg.fd, seg.key, 0, 16, 16, lambda: released.append(2))
    assert len(peers._maps) == 1
    a[:] = 9
    assert np.frombuffer(seg.data, np.uint8)[0] == 9  # a view, not a copy
    del a, b
    assert sorted(released) == [1, 2]
    peers.forget(os.getpid())
    assert peers._maps == {}
    seg.close()


def test_finalizers_never_wait_for_the_pool_lock() -> None:
    """Garbage collection can free a pooled tensor while this thread holds the pool's lock."""
    from orchestr.fabric._buffers._segments import SegmentPool

    local = SegmentPool()
    _, done = local.empty(MiB)
    finished = threading.Event()

    def release_under_lock() -> None:
        with local._lock:
            done()  # what a finalizer does, run where the lock is already held
        finished.set()

    worker = threading.Thread(target=release_under_lock, daemon=True)
    worker.start()
    assert finished.wait(5), "a finalizer deadlocked on the pool lock"
    assert local.stats()["held"] == 0
    local.close()
