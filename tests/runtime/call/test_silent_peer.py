"""A call connection whose peer host falls silent (its link set down: no reset ever comes) breaks
within the heartbeat budget, whether it was idle (keepalive probes) or held bytes the peer never
acknowledged (a call sent just before or after the link went down: keepalive does not probe such
a connection, and retransmission alone gives up only after about 15 minutes). Two hosts made of
network namespaces (tests/netns.py); the connection is a real asyncio one with the options
``probe_idle_peer`` sets on every call connection."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.netns import Topology, require_netns

#: The connecting side: connects, says CONNECTED, waits for a line on stdin (the link is down by
#: then), writes ``sys.argv[3]`` bytes, and says how the connection ended, or STILL_OPEN.
CLIENT = textwrap.dedent(
    """
    import asyncio, sys, time
    import orchestr as oc
    from orchestr._call._wire import probe_idle_peer

    class Watch(asyncio.Protocol):
        def __init__(self):
            self.lost = asyncio.get_running_loop().create_future()
        def connection_lost(self, exc):
            self.lost.set_result(exc)

    async def main():
        host, port, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
        loop = asyncio.get_running_loop()
        transport, watch = await loop.create_connection(Watch, host, port)
        probe_idle_peer(transport, oc.load_config(heartbeat_interval=1, heartbeat_timeout=2))
        print("CONNECTED", flush=True)
        await loop.run_in_executor(None, sys.stdin.readline)
        started = time.monotonic()
        if nbytes:
            transport.write(b"x" * nbytes)
        try:
            exc = await asyncio.wait_for(watch.lost, 90)
        except TimeoutError:
            print("STILL_OPEN", flush=True)
            return
        print("LOST", getattr(exc, "errno", None), round(time.monotonic() - started, 1), flush=True)

    asyncio.run(main())
    """
)

#: The far side: accepts one connection and holds it, reading nothing.
SERVER = textwrap.dedent(
    """
    import socket, sys, time
    s = socket.create_server((sys.argv[1], 0))
    print(s.getsockname()[1], flush=True)
    conn, _ = s.accept()
    time.sleep(600)
    """
)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("nbytes", [0, 4096], ids=["idle", "unacknowledged"])
def test_a_connection_to_a_silent_host_breaks_within_the_heartbeat_budget(nbytes: int) -> None:
    require_netns()
    with Topology(["near", "far"]) as net:
        far = net.address("far")
        with subprocess.Popen(
            [*net.exec_args("far"), sys.executable, "-c", SERVER, far],
            stdout=subprocess.PIPE,
            text=True,
        ) as server:
            try:
                assert server.stdout is not None
                port = server.stdout.readline().strip()
                with subprocess.Popen(
                    [*net.exec_args("near"), sys.executable, "-c", CLIENT, far, port, str(nbytes)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                ) as client:
                    try:
                        assert client.stdin is not None and client.stdout is not None
                        assert client.stdout.readline().split() == ["CONNECTED"]
                        net.link_down("far")
                        client.stdin.write("go\n")
                        client.stdin.flush()
                        said = client.stdout.readline().split()
                    finally:
                        client.kill()
            finally:
                server.kill()
    # ETIMEDOUT: the kernel gave the peer up (after about 1 + 4 probes of 1 s, or 5 s of
    # unacknowledged bytes); a connection left to retransmission would still be open.
    assert said[:2] == ["LOST", "110"], said
