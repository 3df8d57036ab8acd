"""A worker's output reaches the node's log line by line, however long a line is: one over the
relay's limit is cut with a marker, and nothing wedges (a relay that gave up would leave the
worker blocked on a full pipe, its actor hung)."""

from __future__ import annotations

import pytest

import orchestr as oc
from orchestr._log import LineCutter
from tests.cluster import open_cluster
from tests.runtime.actors import Chatty, Environ


def test_lines_are_split_and_long_ones_cut_with_a_marker() -> None:
    cut = LineCutter(max_bytes=8)
    assert cut.feed(b"ab\ncd") == ["ab"]
    assert cut.feed(b"ef\n" + b"z" * 20) == ["cdef"]
    assert cut.feed(b"zz\nlast") == ["zzzzzzzz ... [line cut: 14 more bytes dropped]"]
    assert cut.end() == ["last"]
    assert cut.end() == []
    assert LineCutter().feed("é\n".encode()[:1] + b"\n") == ["\ufffd"]


async def test_a_line_over_64_kib_does_not_wedge_the_worker(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with open_cluster(oc.load_config(call_timeout=30)) as ctx:
        chatty = await ctx.spawn(Chatty)
        assert await chatty.say.call_one(1 << 20) == 1 << 20  # 1 MiB in one line
        assert await chatty.say.call_one(100_000, 20) == 2_000_000  # more than a pipe holds
        assert await chatty.say.call_one(3) == 3
    lines = [line for line in capsys.readouterr().out.splitlines() if "xxx" in line]
    assert len(lines) == 22
    assert lines[0].endswith(f" ... [line cut: {(1 << 20) - 16 * 1024} more bytes dropped]")
    assert lines[-1].endswith(") xxx")


async def test_workers_keep_grpc_cores_info_lines_out_of_the_jobs_output(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("GRPC_VERBOSITY", raising=False)
    async with open_cluster() as ctx:
        env = await ctx.spawn(Environ)
        assert await env.get.call_one("GRPC_VERBOSITY") == "ERROR"
    monkeypatch.setenv("GRPC_VERBOSITY", "DEBUG")  # one who asks for more gets it
    async with open_cluster() as ctx:
        env = await ctx.spawn(Environ)
        assert await env.get.call_one("GRPC_VERBOSITY") == "DEBUG"
