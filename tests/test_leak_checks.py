"""The shared cluster fixture's leak checks see what they look for."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from tests.cluster import check_leaks, resources


async def test_a_child_process_left_running_is_a_leak() -> None:
    before = resources()
    child = await asyncio.create_subprocess_exec("sleep", "30")
    try:
        with pytest.raises(AssertionError, match="child processes"):
            await check_leaks(before, wait_s=0.3)
    finally:
        child.kill()
        await child.wait()
    await check_leaks(before, wait_s=0.3)


async def test_a_connection_its_peer_closed_and_a_thread_left_running_are_leaks() -> None:
    before = resources()
    listener = socket.create_server(("127.0.0.1", 0))
    ours = socket.create_connection(listener.getsockname())
    theirs, _ = listener.accept()
    theirs.close()  # the peer is gone; ``ours`` is never closed: CLOSE_WAIT
    listener.close()
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, name="left-running", daemon=True)
    worker.start()
    try:
        with pytest.raises(AssertionError, match="connections its peer closed.*threads"):
            await check_leaks(before, wait_s=0.3)
    finally:
        ours.close()
        stop.set()
        worker.join()
    await check_leaks(before, wait_s=0.3)
