"""Experts on hosts of their own: dispatch and combine against the model's own MoE layer, a
host that reads only its experts' tensors, and a generator whose sparse layers run on two
expert host actors producing the logits, tokens and log-probs of the model in one process."""

from __future__ import annotations

import asyncio
import copy
import pathlib
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import orchestr as oc
from orchestr.roles import ExpertHost, Generator, Request, models
from orchestr.roles._common._hf._load import load_experts
from orchestr.roles.experts import (
    ExpertClient,
    ExpertMap,
    LoadWindow,
    attach_experts,
    combine,
    packed_experts,
    run_experts,
)
from orchestr.roles.generator._engines._paged import PagedEngine
from orchestr.roles.serving import openai_server
from tests.roles.generator.test_handoff import close
from tests.roles.generator.test_paged_engine import drain
from tests.roles.serving.test_frontdoor import client_of, served

pytestmark = pytest.mark.timeout(240)

EXPERTS = 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("moe") / "moe"
    return pathlib.Path(
        models.make_tiny("qwen2_moe", path, experts=EXPERTS, experts_per_token=2, layers=2)
    )


@pytest.fixture(scope="module")
def model(folder: pathlib.Path) -> models.CausalLM:
    return models.load_model(folder)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 1000),
    tokens=st.integers(1, 40),
    hosts=st.integers(1, 4),
    extra=st.integers(0, 6),
    packed=st.booleans(),
)
def test_dispatch_and_combine_equal_the_layers_own_experts(
    model: models.CausalLM, seed: int, tokens: int, hosts: int, extra: int, packed: bool
) -> None:
    moe = model.model.layers[0].mlp
    assert isinstance(moe, models.SparseMoE)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, model.config.hidden_size, generator=gen)
    experts, weights = moe.route(x)
    # each expert on one host, then ``extra`` replicas on random hosts
    holders = [[e % hosts] for e in range(EXPERTS)]
    for _ in range(extra):
        holders[int(torch.randint(EXPERTS, (1,), generator=gen))].append(
            int(torch.randint(hosts, (1,), generator=gen))
        )
    sends = ExpertMap({0: holders}).plan(0, experts, weights)
    assert len({s.host for s in sends}) == len(sends) <= hosts
    assert sum(s.experts.numel() for s in sends) == experts.numel()
    for s in sends:
        assert all(s.host in holders[e] for e in s.experts.tolist())
    own = dict(enumerate(moe.experts))
    modules: dict[int, Callable[[torch.Tensor], torch.Tensor]] = dict(own)
    if packed:  # what a host runs: the products packed for the CPU
        modules = packed_experts(own)
        assert not any(isinstance(m, torch.nn.Module) for m in modules.values())
    outputs = [run_experts(modules, x[s.rows], s.slot, s.experts, s.weights) for s in sends]
    assert torch.allclose(
        combine(x, sends, outputs),
        moe.run_experts(x, experts, weights),
        atol=1e-5 if packed else 1e-6,
    )


def test_a_missing_expert_stops_a_send_before_any_expert_runs(model: models.CausalLM) -> None:
    moe = model.model.layers[0].mlp
    assert isinstance(moe, models.SparseMoE)
    ran: list[int] = []

    def recording(e: int):  # type: ignore[no-untyped-def]
        return lambda x: (ran.append(e), moe.experts[e](x))[1]

    x = torch.randn(3, model.config.hidden_size)
    slot, experts = torch.tensor([0, 1, 2]), torch.tensor([0, 1, 5])
    with pytest.raises(KeyError, match="5"):
        run_experts({0: recording(0), 1: recording(1)}, x, slot, experts, torch.ones(3))
    assert ran == []
    assert torch.equal(
        run_experts({}, x, slot[:0], experts[:0], torch.ones(0)), torch.zeros_like(x)
    )


def test_experts_not_in_float32_run_as_modules(model: models.CausalLM) -> None:
    moe = model.model.layers[0].mlp
    assert isinstance(moe, models.SparseMoE)
    halves = {e: copy.deepcopy(m).to(torch.bfloat16) for e, m in enumerate(moe.experts)}
    assert all(m is halves[e] for e, m in packed_experts(halves).items())


def test_replicas_take_equal_shares() -> None:
    experts = torch.zeros(10, 1, dtype=torch.int64)  # ten tokens, all to expert 0
    sends = ExpertMap({3: [[0, 1], [1]]}).plan(3, experts, torch.ones(10, 1))
    assert [(s.host, s.experts.numel()) for s in sends] == [(0, 5), (1, 5)]
    orphan = ExpertMap({0: [[0], []]})
    assert orphan.holes([0, 1], 2) == [(0, 1), (1, 0), (1, 1)]
    with pytest.raises(ValueError, match="no host holds expert 1"):
        orphan.plan(0, torch.tensor([[0], [1]]), torch.ones(2, 1))
    assert ExpertMap({0: [[0, 1], [1]]}).without({1}).holders == {0: [[0], []]}
    with pytest.raises(ValueError, match="holds expert 9 of 8"):
        ExpertMap.of_hosts([{0: [9]}], EXPERTS)


def test_the_load_window_forgets_old_passes() -> None:
    window = LoadWindow([0, 2], 4, window=2)
    for routed in ([[0, 1]], [[1, 1]], [[3, 3]]):
        window.add(2, torch.tensor(routed))
    assert window.load() == {0: [0, 0, 0, 0], 2: [0, 2, 0, 2]}
    with pytest.raises(ValueError, match="at least one pass"):
        LoadWindow([0], 4, window=0)


def test_a_host_reads_only_its_experts(folder: pathlib.Path, model: models.CausalLM) -> None:
    held = load_experts(folder, {1: [2, 5]})
    assert sorted(held) == [(1, 2), (1, 5)]
    moe = model.model.layers[1].mlp
    assert isinstance(moe, models.SparseMoE)
    own = moe.experts[5].state_dict()
    assert all(torch.equal(own[k], v) for k, v in held[1, 5].state_dict().items())
    for wanted, match in (({2: [0]}, "layer 2 does not route"), ({0: [8]}, "no expert 8")):
        with pytest.raises(oc.ConfigError, match=match):
            load_experts(folder, wanted)


async def test_a_generator_with_expert_hosts_matches_the_model_in_one_process(
    ctx: oc.JobContext, folder: pathlib.Path
) -> None:
    # experts 0-3 on host 0, 4-7 on host 1, and expert 2 on both (a replica)
    hosts = await ctx.spawn(ExpertHost, str(folder), n=2, torch_threads=1)
    await hosts[0].load.call_one({0: [0, 1, 2, 3], 1: [0, 1, 2, 3]})
    assert await hosts[1].load.call_one({0: [2, 4, 5, 6, 7], 1: [4, 5, 6, 7]}) == {
        0: [2, 4, 5, 6, 7],
        1: [4, 5, 6, 7],
    }
    # logits of a batch, the experts dispatched from this process's own copy of the model
    whole, split = models.load_model(folder), models.load_model(folder)
    client = attach_experts(split, hosts)
    assert all(len(layer.mlp.experts) == 0 for layer in split.model.layers)  # type: ignore[union-attr]
    tokens = torch.tensor([[(5 * i + 3 * b) % 380 + 5 for i in range(24)] for b in range(3)])
    lengths = torch.tensor([24, 17, 9])
    with torch.no_grad():
        want = whole(tokens, lengths)
        got = await asyncio.to_thread(split, tokens, lengths)
    assert torch.allclose(got, want, atol=1e-5)
    assert client.calls == 4  # two layers, two hosts each: one call per host per layer
    assert sum(client.stats()["load"][0]) == 3 * 24 * 2  # every row, padding too, top 2
    with pytest.raises(RuntimeError, match="engine's thread"):
        client.run(0, tokens.float(), tokens[:, :2], tokens[:, :2].float())

    # a generator serving a batch of mixed requests, against one engine holding it all
    gen = await ctx.spawn(
        Generator,
        checkpoint=str(folder),
        torch_threads=1,
        experts={"hosts": hosts},
        kv={"num_blocks": 64, "block_size": 16, "micro_batches": 2},  # ping-pong
    )
    requests = [
        Request(
            f"r{i}", [(11 * j + i) % 380 + 5 for j in range(n)], 10, temperature=0.0, top_logprobs=1
        )
        for i, n in enumerate((40, 7, 23, 64))
    ]
    got_c = await gen.generate.call_one(requests)
    alone = PagedEngine(models.load_model(folder), num_blocks=64, block_size=16, model_id="m")
    alone.submit(requests)
    reference = drain(alone)
    for c in got_c:
        close(c, reference[c.id])
    stats = await gen.stats.call_one()
    assert stats["experts"]["holders"][0][2] == [0, 1]
    host_stats = await hosts.stats.call()
    assert all(s["tokens"][0][2] > 0 for s in host_stats)  # the replica took its share

    # what a host refuses
    with pytest.raises(oc.ActorError, match="ExpertUnavailableError: .* no expert 7 of layer 0"):
        await hosts[0].forward.call_one(
            0,
            torch.zeros(1, 64),
            torch.zeros(1, dtype=torch.int64),
            torch.tensor([7]),
            torch.ones(1),
        )
    with pytest.raises(oc.ActorError, match="ValueError: .* of one length"):
        await hosts[0].forward.call_one(
            0,
            torch.zeros(1, 64),
            torch.zeros(2, dtype=torch.int64),
            torch.tensor([1]),
            torch.ones(1),
        )
    with pytest.raises(oc.ActorError, match="ConfigError: .*no expert 9"):
        await hosts[0].load.call_one({0: [9]})
    assert await hosts[0].drop.call_one({0: [0]}) == {0: [1, 2, 3], 1: [0, 1, 2, 3]}


async def test_attention_and_experts_apart_behind_the_front_door(
    ctx: oc.JobContext, folder: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    options = {"torch_threads": 1, "kv": {"num_blocks": 64, "block_size": 16}}
    # a MoE model's experts over three hosts; a dense model's MLPs in two slices, one per host
    dense = models.make_tiny("llama", tmp_path / "dense", layers=2)
    for model, name, hosts in ((folder, "moe", 3), (dense, "dense", 2)):
        async with (
            openai_server(
                ctx, model, names=[name], options=options, expert_hosts=hosts, micro_batches=2
            ) as app,
            served(app) as url,
            client_of(url) as client,
        ):
            alive = [a for a in await ctx.actors() if a.name == "experts" and a.state == "alive"]
            assert len(alive) == hosts
            r = await client.completions.create(
                model=name,
                prompt=[[5, 9, 14, 200, 7, 31, 8]],
                max_tokens=6,
                extra_body={"ignore_eos": True},
                temperature=0.0,
            )
        alone = PagedEngine(models.load_model(model), num_blocks=64, block_size=16, model_id="m")
        alone.submit([Request("a", [5, 9, 14, 200, 7, 31, 8], 6, temperature=0.0, ignore_eos=True)])
        assert r.choices[0].text == models.Tokenizer(model).decode(drain(alone)["a"].tokens)
        assert {a.state for a in await ctx.actors() if a.name == "experts"} == {"stopped"}


async def test_a_dense_models_ffn_on_hosts_in_slices(
    ctx: oc.JobContext, tmp_path: pathlib.Path, folder: pathlib.Path
) -> None:
    dense = pathlib.Path(models.make_tiny("llama", tmp_path / "dense", layers=2))
    model = models.load_model(dense)
    # three slices of layer 1's MLP (uneven widths) add up to the MLP
    slices = load_experts(dense, {1: [0, 1, 2]}, ffn_shards=3)
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        parts = [slices[1, s](x) for s in range(3)]
        mlp = model.model.layers[1].mlp
        assert isinstance(mlp, models.MLP)
        assert torch.allclose(sum(parts), mlp(x), atol=1e-6)
    assert sum(m.up_proj.out_features for m in slices.values()) == model.config.intermediate_size
    for wanted, shards, match in (
        ({1: [3]}, 3, "no FFN shard 3"),
        ({2: [0]}, 3, "no layer 2"),
        ({0: [0]}, None, "in ffn_shards slices"),
        ({0: [0]}, 0, "in ffn_shards slices"),
    ):
        with pytest.raises(oc.ConfigError, match=match):
            load_experts(dense, wanted, ffn_shards=shards)
    with pytest.raises(oc.ConfigError, match="ffn_shards cuts a dense model"):
        load_experts(folder, {0: [0]}, ffn_shards=2)

    # host 0 holds slices 0 and 1 of each layer, host 1 slices 1 and 2 (slice 1 twice)
    hosts = await ctx.spawn(ExpertHost, str(dense), n=2, ffn_shards=3, torch_threads=1)
    await hosts[0].load.call_one({0: [0, 1], 1: [0, 1]})
    await hosts[1].load.call_one({0: [1, 2], 1: [1, 2]})
    split = models.load_model(dense)
    client = attach_experts(split, hosts, ffn_shards=3)
    assert not any(hasattr(layer.mlp, "up_proj") for layer in split.model.layers)
    tokens = torch.tensor([[(5 * i + 3 * b) % 380 + 5 for i in range(24)] for b in range(3)])
    lengths = torch.tensor([24, 17, 9])
    with torch.no_grad():
        want = model(tokens, lengths)
        got = await asyncio.to_thread(split, tokens, lengths)
    assert torch.allclose(got, want, atol=1e-5)
    assert client.calls == 4  # two layers, two hosts each
    assert client.stats()["holders"][0] == [[0], [0, 1], [1]]
    # a generator that cuts the layers otherwise is refused, not answered wrongly
    with pytest.raises(
        oc.ActorError, match="ValueError: the caller cuts layer 0 into 2 FFN shards"
    ):
        await hosts[0].forward.call_one(
            0,
            torch.zeros(1, 64),
            torch.zeros(1, dtype=torch.int64),
            torch.tensor([0]),
            torch.ones(1),
            2,
        )
    with pytest.raises(oc.ConfigError, match="router_bias has one value per expert of a MoE"):
        attach_experts(models.load_model(dense), hosts, router_bias=[0.0])


def test_a_router_bias_steers_the_choice_not_the_weights(model: models.CausalLM) -> None:
    moe = model.model.layers[0].mlp
    assert isinstance(moe, models.SparseMoE)
    x = torch.randn(50, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    try:
        moe.bias = torch.tensor([0.0, 0, 0, 100, 0, 0, 0, 0])
        experts, weights = moe.route(x)
    finally:
        moe.bias = None
    assert bool((experts == 3).any(dim=-1).all())  # every token picks expert 3
    probs = torch.softmax(moe.gate(x), dim=-1)
    want = probs.gather(-1, experts)
    assert torch.allclose(weights, want / want.sum(-1, keepdim=True) if moe.normalise else want)


@pytest.mark.parametrize(
    ("options", "match"),
    [({"on_lost": "retry"}, "on_lost must be one of fail, wait"), ({"poll_s": 0}, "poll_s > 0")],
)
def test_bad_client_options_are_refused(options: dict, match: str) -> None:  # type: ignore[type-arg]
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(oc.ConfigError, match=match):
            ExpertClient(None, [0], EXPERTS, loop, **options)
    finally:
        loop.close()
