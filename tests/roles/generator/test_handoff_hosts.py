"""Prefill on one host, decode on another: two network-namespace hosts (the cluster tests'
``two_hosts``), the decode generator reading the prefilled blocks over ``tcp`` buffers (no
shared memory reaches across hosts), whole or streamed layer by layer as the prompt is
computed, with the tokens and log-probs of one engine alone."""

from __future__ import annotations

import pathlib

import pytest

import orchestr as oc
from orchestr.roles import Generator, Request, models
from tests.roles.generator.test_handoff import BLOCK, close
from tests.roles.generator.test_kv_offload import prompt
from tests.runtime.cluster.test_cross_host import two_hosts

__all__ = ["two_hosts"]  # the fixture, used by name

pytestmark = pytest.mark.timeout(240)


async def test_a_prompt_prefilled_on_one_host_decodes_on_another(
    two_hosts: oc.JobContext, tmp_path: pathlib.Path
) -> None:
    folder = models.make_tiny("llama", tmp_path / "llama")

    async def spawn(name: str, host: str) -> oc.Mesh:
        return await two_hosts.spawn(
            Generator,
            name=name,
            labels={"host": host},
            checkpoint=str(folder),
            torch_threads=1,
            kv={"num_blocks": 64, "block_size": BLOCK, "token_budget": 32},
        )

    pre, dec = await spawn("prefill", "b"), await spawn("decode", "a")
    r = Request("x", prompt(150), 12, temperature=1.0, seed=11)
    handoff = await pre.prefill.call_one(r)
    (got,) = await dec.generate.call_one([r], kv_from={r.id: handoff.sent_from(pre)})
    (want,) = await pre.generate.call_one([r])
    close(got, want)
    stats = await dec.stats.call_one()
    assert stats["orchestr:kv_transfers"] == 1 and stats["orchestr:kv_transfer_failures"] == 0
    assert stats["tokens"] == 150 - 9 * BLOCK + 11  # the prompt past its 9 handed blocks
    # streamed: read over tcp layer by layer as the prompt is computed, 32 tokens a step
    s = Request("y", prompt(150, salt=5), 12, temperature=0.0)
    handoff = await pre.prefill.call_one(s, stream=True)
    (got,) = await dec.generate.call_one([s], kv_from={s.id: handoff.sent_from(pre)})
    (want,) = await pre.generate.call_one([s])
    close(got, want)
    stats = await dec.stats.call_one()
    assert stats["orchestr:kv_transfers"] == 2 and stats["orchestr:kv_transfer_failures"] == 0
    assert stats["orchestr:kv_transfer_reads"] > 2
    assert (await pre.stats.call_one())["held"] == 0
