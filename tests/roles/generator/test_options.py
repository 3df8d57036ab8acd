"""A Generator's option groups: typed, given as dataclasses or dicts of their fields, with the
engines' own defaults; the keywords they replaced are still read, with a warning; and a spawn
carries them to a worker by their pinned names."""

from __future__ import annotations

import dataclasses
import inspect
import pathlib
from collections.abc import Callable

import pytest

import orchestr as oc
from orchestr.roles import (
    AttentionOptions,
    ExpertOptions,
    Generator,
    HandoffOptions,
    KVOptions,
    PagedEngine,
    Request,
)
from orchestr.roles.experts import ExpertClient
from orchestr.roles.generator._core._options import as_options, legacy_options
from tests.roles.generator.test_kv_offload import folder

__all__ = ["folder"]  # the fixture, used by name


def _defaults(fn: Callable[..., object]) -> dict[str, object]:
    return {
        k: p.default
        for k, p in inspect.signature(fn).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


def test_the_groups_defaults_are_the_engines_own() -> None:
    engine = _defaults(PagedEngine)
    for f in dataclasses.fields(KVOptions):
        assert f.default == engine[f.name], f.name
    client = _defaults(ExpertClient)
    for f in dataclasses.fields(ExpertOptions):
        if f.name in client:
            assert f.default == client[f.name], f.name


def test_a_group_is_a_dataclass_or_a_dict_of_its_fields() -> None:
    kv = KVOptions(num_blocks=64)
    assert as_options(KVOptions, kv, "kv") is kv
    assert as_options(KVOptions, {"num_blocks": 64}, "kv") == kv
    assert as_options(KVOptions, None, "kv") is None
    with pytest.raises(oc.ConfigError, match=r"unknown kv option\(s\) \['blocks'\]; known: "):
        as_options(KVOptions, {"blocks": 64}, "kv")
    with pytest.raises(oc.ConfigError, match="kv is a KVOptions or a dict of its fields"):
        as_options(KVOptions, [64], "kv")
    with pytest.raises(oc.ConfigError, match="hosts"):  # the one field without a default
        as_options(ExpertOptions, {"on_lost": "wait"}, "expert")
    with pytest.raises(oc.ConfigError, match="handoff read is one of direct, staged"):
        HandoffOptions(read="copy")


def test_the_keywords_the_groups_replaced_still_read_with_a_warning() -> None:
    hosts, servers = object(), object()
    with pytest.warns(DeprecationWarning, match=r"give handoff=, experts=, attention="):
        handoff, experts, attention = legacy_options(
            {
                "on_handoff_failure": "fail",
                "kv_read": "staged",
                "expert_hosts": hosts,
                "expert_options": {"on_lost": "wait"},
                "attention_servers": servers,
                "attention_options": {"min_tokens": 40},
            },
            None,
            None,
            None,
        )
    assert as_options(HandoffOptions, handoff, "handoff") == HandoffOptions("fail", "staged")
    assert as_options(ExpertOptions, experts, "expert") == ExpertOptions(hosts, on_lost="wait")
    assert as_options(AttentionOptions, attention, "attention") == AttentionOptions(servers, 40)
    # none given (or given as None): the groups as they are, and no warning
    assert legacy_options({"kv_read": None}, {"read": "staged"}, None, None) == (
        {"read": "staged"},
        None,
        None,
    )
    with pytest.raises(oc.ConfigError, match="give handoff= or kv_read=, not both"):
        legacy_options({"kv_read": "staged"}, HandoffOptions(), None, None)
    with pytest.raises(TypeError, match="unexpected keyword argument 'kv_reads'"):
        legacy_options({"kv_reads": "staged"}, None, None, None)


def test_a_generator_built_with_an_old_keyword_takes_it(folder: pathlib.Path) -> None:
    with pytest.warns(DeprecationWarning, match=r"Generator\(kv_read=\) is deprecated"):
        gen = Generator(checkpoint=str(folder), kv_read="staged", kv={"num_blocks": 16})
    assert gen._handoff.options == HandoffOptions(read="staged")
    with pytest.raises(TypeError, match="unexpected keyword argument 'kv_options'"):
        Generator(checkpoint=str(folder), kv_options={"num_blocks": 16})


async def test_a_spawn_carries_the_groups_to_its_worker(
    ctx: oc.JobContext, folder: pathlib.Path
) -> None:
    gen = await ctx.spawn(
        Generator,
        name="grouped",
        checkpoint=str(folder),
        torch_threads=1,
        kv=KVOptions(num_blocks=24, block_size=8),
        handoff=HandoffOptions(on_failure="fail", read="staged"),
    )
    (done,) = await gen.generate.call_one([Request("r", list(range(5, 25)), 3)])
    assert len(done.tokens) == 3
    updates = await gen.updates.call_one("reader", timeout_s=0)
    assert updates.block_size == 8
    assert (await gen.stats.call_one())["held"] == 0
