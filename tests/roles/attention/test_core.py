"""Core attention in shards: any cut of a sequence's keys, attended shard by shard (alone or
rebatched with other requests' shards) and merged by log-sum-exp, equals the attention over
all of them, grouped-query heads and causal positions included."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestr.roles.attention import Shard, attend, attend_batch, merge


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_from: int | None
) -> torch.Tensor:
    """torch's attention: ``q [n, heads, dim]`` over ``k, v [m, kv_heads, dim]``; with
    ``causal_from``, query row i sits at position ``causal_from + i`` and key j at j."""
    group = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(group, 1).transpose(0, 1)
    vv = v.repeat_interleave(group, 1).transpose(0, 1)
    mask = None
    if causal_from is not None:
        mask = (
            torch.arange(k.shape[0])[None, :] <= (causal_from + torch.arange(q.shape[0]))[:, None]
        )
    return F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=mask).transpose(0, 1)


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    kv_heads=st.sampled_from([1, 2, 4]),
    group=st.sampled_from([1, 2, 4]),
    dim=st.sampled_from([8, 16, 32]),
    length=st.integers(1, 300),
    queries=st.integers(1, 5),
    cuts=st.lists(st.floats(0.0, 1.0), max_size=6),
    causal=st.booleans(),
)
def test_shards_merged_by_lse_equal_monolithic_attention(
    seed: int,
    kv_heads: int,
    group: int,
    dim: int,
    length: int,
    queries: int,
    cuts: list[float],
    causal: bool,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    q = torch.randn(queries, heads, dim, generator=gen)
    k = torch.randn(length, kv_heads, dim, generator=gen) * 2
    v = torch.randn(length, kv_heads, dim, generator=gen)
    queries = min(queries, length)
    q = q[:queries]
    start = length - queries if causal else None  # the last queries of the sequence
    bounds = sorted({0, length, *(int(c * length) for c in cuts)})
    shards = []
    for lo, hi in itertools.pairwise(bounds):
        pos = (
            dict(q_positions=torch.arange(start, length), k_positions=torch.arange(lo, hi))
            if causal
            else {}
        )
        shards.append(Shard(q, k[lo:hi], v[lo:hi], **pos))
    scale = 1 / math.sqrt(dim)
    want = reference(q, k, v, start)
    alone = merge([attend(s, scale) for s in shards])
    together = merge(attend_batch(shards, scale))
    assert torch.allclose(alone[0], want, atol=1e-5)
    assert torch.allclose(together[0], want, atol=1e-5)
    _, whole_lse = attend(Shard(q, k, v), scale)
    if not causal:
        assert torch.allclose(together[1], whole_lse, atol=1e-4)


def test_a_shard_that_sees_nothing_adds_nothing() -> None:
    q, k, v = torch.randn(1, 2, 8), torch.randn(6, 1, 8), torch.randn(6, 1, 8)
    early = Shard(q, k[:3], v[:3], torch.tensor([2]), torch.arange(0, 3))
    late = Shard(q, k[3:], v[3:], torch.tensor([2]), torch.arange(3, 6))  # all in the future
    out, lse = attend(late, 0.3)
    assert torch.all(out == 0) and torch.all(torch.isinf(lse))
    merged, _ = merge([attend(early, 0.3), (out, lse)])
    assert torch.allclose(merged, attend(early, 0.3)[0])


@pytest.mark.parametrize(
    ("shard", "match"),
    [
        (Shard(torch.zeros(1, 3, 8), torch.zeros(2, 2, 8), torch.zeros(2, 2, 8)), "cannot share"),
        (Shard(torch.zeros(1, 2, 8), torch.zeros(2, 2, 4), torch.zeros(2, 2, 4)), "cannot share"),
        (Shard(torch.zeros(1, 2, 8), torch.zeros(2, 2, 8), torch.zeros(3, 2, 8)), "q is"),
        (
            Shard(torch.zeros(1, 2, 8), torch.zeros(2, 2, 8), torch.zeros(2, 2, 8), torch.zeros(1)),
            "both",
        ),
    ],
)
def test_shards_that_do_not_fit_are_refused(shard: Shard, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        attend(shard, 1.0)
    with pytest.raises(ValueError, match="nothing to merge"):
        merge([])
