"""Experts and core attention on another host: a generator on one network-namespace host (the
cluster tests' ``two_hosts``) whose sparse layers' experts run on an expert host on the other,
and whose long decodes' core attention runs on an attention server there, reading the
generator's KV blocks over ``tcp`` buffers (no shared memory reaches across hosts); the
tokens and log-probs are those of one engine holding it all."""

from __future__ import annotations

import pathlib

import pytest

import orchestr as oc
from orchestr.roles import AttentionServer, ExpertHost, Generator, Request, models
from orchestr.roles.generator._engines._paged import PagedEngine
from tests.roles.generator.test_handoff import close
from tests.roles.generator.test_paged_engine import drain
from tests.runtime.cluster.test_cross_host import two_hosts

__all__ = ["two_hosts"]  # the fixture, used by name

pytestmark = pytest.mark.timeout(240)


async def test_experts_and_attention_on_another_host(
    two_hosts: oc.JobContext, tmp_path: pathlib.Path
) -> None:
    folder = str(models.make_tiny("qwen2_moe", tmp_path / "moe", experts=8, layers=2))
    everything = {0: list(range(8)), 1: list(range(8))}
    hosts = await two_hosts.spawn(
        ExpertHost, folder, everything, labels={"host": "b"}, torch_threads=1
    )
    servers = await two_hosts.spawn(AttentionServer, labels={"host": "b"}, torch_threads=1)
    gen = await two_hosts.spawn(
        Generator,
        labels={"host": "a"},
        checkpoint=folder,
        torch_threads=1,
        experts={"hosts": hosts},
        attention={"servers": servers, "min_tokens": 40},
        kv={"num_blocks": 64, "block_size": 16},
    )
    placed = {a.name: a.node_id for a in await two_hosts.actors()}
    assert placed[hosts.name] == placed[servers.name] != placed[gen.name]
    requests = [
        Request(
            f"r{i}",
            [(11 * j + i) % 380 + 5 for j in range(n)],
            10,
            temperature=1.0,
            seed=i,
            top_logprobs=1,
        )
        for i, n in enumerate((45, 7, 23))  # the first decodes past 40 tokens from the start
    ]
    got = await gen.generate.call_one(requests)
    alone = PagedEngine(models.load_model(folder), num_blocks=64, block_size=16, model_id="m")
    alone.submit(requests)
    want = drain(alone)
    for c in got:
        close(c, want[c.id])
    stats = await gen.stats.call_one()
    assert stats["experts"]["calls"] > 0 and stats["experts"]["lost_hosts"] == 0
    assert stats["attention"]["offloaded_decodes"] > 0
    served = await servers.stats.call_one()
    assert served["bytes_read"] > 0  # read over tcp from the generator's pool
