"""Ping-pong micro-batches: a step's sequences dealt into groups of about equal tokens and
run at once in threads give the tokens and log-probs of one batch, on either attention."""

from __future__ import annotations

import pathlib

import pytest
import torch

from orchestr.roles import Request, models
from orchestr.roles.generator._core._scheduler import Seq
from orchestr.roles.generator._engines._paged import PagedEngine
from orchestr.roles.generator._runner._microbatch import split
from tests.roles.generator.test_kv_offload import folder, prompt
from tests.roles.generator.test_paged_engine import drain

__all__ = ["folder"]  # the fixture, used by name


def test_split_deals_sequences_by_tokens() -> None:
    seqs = [Seq(f"s{i}", [1] * 4, 8) for i in range(5)]
    scheduled = list(zip(seqs, [1, 30, 1, 12, 1], strict=True))
    groups = split(scheduled, 2)
    assert [[s.id for s, _ in g] for g in groups] == [["s1"], ["s0", "s2", "s3", "s4"]]
    assert split(scheduled[:1], 4) == [scheduled[:1]]


@pytest.mark.parametrize("attention", ["kernel", "torch"])
def test_micro_batches_give_the_tokens_of_one_batch(folder: pathlib.Path, attention: str) -> None:
    reqs = [
        Request(f"r{i}", prompt(5 + 9 * i, salt=i), 12, temperature=1.0, seed=i, top_logprobs=2)
        for i in range(6)
    ]
    done = {}
    for parts in (1, 3):
        engine = PagedEngine(
            models.load_model(folder),
            num_blocks=64,
            block_size=16,
            model_id="m",
            attention=attention,
            micro_batches=parts,
        )
        engine.submit(reqs)
        done[parts] = drain(engine)
    for r in reqs:
        assert done[3][r.id].tokens == done[1][r.id].tokens
        assert torch.allclose(
            torch.tensor(done[3][r.id].logprobs), torch.tensor(done[1][r.id].logprobs), atol=1e-5
        )
    with pytest.raises(ValueError, match="micro_batches is a whole number"):
        PagedEngine(models.load_model(folder), num_blocks=8, micro_batches=0)
