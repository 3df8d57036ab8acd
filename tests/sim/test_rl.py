"""The GRPO job's own code on a simulated cluster: its three schedules against role models on
virtual time, placed by the head's placement, with weight syncs and all-reduces moved by the
flow network and phases hinted to the real fabric manager."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import pytest

import orchestr as oc
import orchestr.roles.rl as rl
from orchestr.fabric.optical import (
    FabricManager,
    OcsLayer,
    ReconfigLatency,
    RecordingRouter,
    SimOcs,
    fat_tree,
    ring_all_reduce_s,
)
from orchestr.roles.generator import Scheduler
from orchestr.roles.rl import GRPOConfig, TrainConfig
from orchestr.sim import (
    Engine,
    OutputLengths,
    RLCosts,
    SimCluster,
    SimContext,
    StepTimeModel,
    one_host,
)
from orchestr.sim import _rl as sim_rl
from orchestr.sim._calibrate_rl import calibrate_rl
from orchestr.sim._rlroles import rl_roles

GB = 1 << 30
NIC = 400e9 / 8  # fat_tree's default NIC, bytes/s
STEP = StepTimeModel(base_s=0.01, prefill_token_s=1e-5, decode_s=1e-4, decode_attention_s=1e-8)
EIGHT = {"generator": {"gpu": 8}, "trainer": {"gpu": 8}}


def config(
    mode: str = "sync", *, steps: int = 3, generators: int = 4, trainers: int = 1, **kw: Any
) -> GRPOConfig:
    tc = dataclasses.replace(TrainConfig(), steps=steps, prompts_per_step=8, group_size=4)
    return GRPOConfig(train=tc, mode=mode, generators=generators, trainers=trainers, **kw)


def costs(**kw: Any) -> RLCosts:
    base: dict[str, Any] = {"generation": STEP, "weight_bytes": GB, "train_token_s": 0.0}
    return RLCosts(**(base | kw))


def test_the_simulator_runs_the_jobs_own_code() -> None:
    # the job, its schedules and its ranker are the ones orchestr.roles.rl runs live
    assert sim_rl.run_grpo is rl.run_grpo  # type: ignore[attr-defined]
    run = sim_rl.simulate_grpo(config(), fat_tree(4), costs(), resources=EIGHT)
    assert type(run.result) is rl.GRPOResult
    assert [s.step for s in run.result.steps] == [0, 1, 2]
    assert {name for name, _, _ in run.phases} == {"generation", "training", "weight_sync"}


def test_sync_mode_costs_what_its_phases_move() -> None:
    c = costs(train_step_s=0.5)
    run = sim_rl.simulate_grpo(config(trainers=2), fat_tree(4), c, resources=EIGHT)
    result = run.result
    assert all(s.version_lag == 0 and s.max_lag == 0 for s in result.steps)
    trainers, gens = run.placement["trainer"], run.placement["generator"]
    assert len(set(trainers + gens)) == 6  # a host each: every member takes all 8 accelerators
    # every generator reads the weights through the publishing trainer's NIC at once
    assert result.weight_sync["seconds"] == pytest.approx(4 * GB / NIC, rel=1e-6)
    # a training phase: the step's compute, then a ring all-reduce over the two hosts
    training = [end - start for name, start, end in run.phases if name == "training"]
    closed = ring_all_reduce_s(2, GB, NIC)
    assert training == pytest.approx([0.5 + closed] * 3, rel=1e-6)


def test_the_stream_modes_keep_their_staleness_bound_and_overlap_generation() -> None:
    lengths = OutputLengths(per_prompt_token=16, sigma=1.0)
    runs = {
        mode: sim_rl.simulate_grpo(
            config(mode, steps=6, eta=1),
            fat_tree(4),
            costs(train_step_s=0.3),
            lengths,
            resources=EIGHT,
        )
        for mode in rl.MODES
    }
    for mode in ("stream", "stream+skew"):
        assert all(s.max_lag <= 1 for s in runs[mode].result.steps)
        assert runs[mode].result.generator_idle_frac < runs["sync"].result.generator_idle_frac
        assert runs[mode].virtual_s < runs["sync"].virtual_s
    # stream+skew's ranker sent the groups it predicts longest to the long generator
    assert runs["stream+skew"].result.routed_long > 0
    assert runs["stream"].result.routed_long == 0


def test_the_same_seed_gives_the_same_trace() -> None:
    lengths = OutputLengths(per_prompt_token=8, sigma=0.8)

    def once(seed: int) -> sim_rl.RLRun:
        return sim_rl.simulate_grpo(
            config("stream+skew"),
            fat_tree(4),
            costs(score_s=1e-3),
            lengths,
            seed=seed,
            trace=True,
            resources=EIGHT,
        )

    a, b, other = once(1), once(1), once(2)
    assert a.trace and a.trace == b.trace
    assert a.result.steps == b.result.steps and a.phases == b.phases
    assert [s.reward for s in other.result.steps] != [s.reward for s in a.result.steps]


def test_members_are_placed_by_the_heads_placement() -> None:
    with pytest.raises(oc.PlacementError):  # 16 hosts of 8 accelerators: no 17th generator
        sim_rl.simulate_grpo(config(generators=16), fat_tree(4), costs(), resources=EIGHT)
    run = sim_rl.simulate_grpo(config(generators=15), fat_tree(4), costs(), resources=EIGHT)
    assert len(set(run.placement["generator"] + run.placement["trainer"])) == 16
    with pytest.raises(ValueError, match="deaths"):
        sim_rl.simulate_grpo(config(kill=("generator0@1:generate",)), fat_tree(4), costs())


class Unmodelled(oc.Actor):
    pass


async def test_a_class_without_a_model_is_refused(tmp_path: os.PathLike[str]) -> None:
    cluster = SimCluster(Engine(), fat_tree(4), rl_roles(costs(), OutputLengths()))
    ctx = SimContext(cluster, trace_dir=str(tmp_path))
    try:
        with pytest.raises(oc.ConfigError, match="no model of .*Unmodelled"):
            await ctx.spawn(Unmodelled)
        with pytest.raises(oc.ConfigError, match="positive"):
            await ctx.spawn(Unmodelled, n=0)
    finally:
        ctx.close()


def test_the_generator_model_is_the_engines_scheduler() -> None:
    roles = rl_roles(costs(), OutputLengths())
    cluster = SimCluster(Engine(), fat_tree(4), roles)
    mesh = cluster.place(
        "orchestr.roles:Generator", "generator", 1, {}, {}, "SPREAD", (), {"max_batch": 7}
    )
    model = cluster.actors[mesh.members[0].actor_id]
    assert type(model.engine.scheduler) is Scheduler and model.engine.scheduler.max_batch == 7


def test_phases_reach_the_fabric_manager_and_its_circuits_carry_the_weights(
    tmp_path: os.PathLike[str],
) -> None:
    fast = ReconfigLatency(switch_ms=1, control_ms=1, settle_ms=1)

    def once(managed: bool) -> tuple[sim_rl.RLRun, FabricManager]:
        # hosts with NICs faster than their ToR's two uplinks: weights leaving a ToR queue
        topo = fat_tree(4, nic_gbps=1600, ocs=OcsLayer(uplinks=4, latency=fast))
        ocs = topo.ocs[0]
        fm = FabricManager(topo, {ocs.name: SimOcs(ocs.radix, rng=0)}, RecordingRouter())
        run = sim_rl.simulate_grpo(
            config(generators=3),
            topo,
            costs(),
            resources=EIGHT,
            fabric=fm if managed else None,
            trace_dir=os.path.join(tmp_path, str(managed)),
        )
        return run, fm

    static, _ = once(False)
    managed, fm = once(True)
    assert [r.phase for r in fm.history][:1] == ["weight_sync"]
    assert fm.history[0].status == "applied"
    assert managed.result.weight_sync["seconds"] < static.result.weight_sync["seconds"]
    # the job's phases, on virtual time, in the Perfetto trace of its event log
    ctx_trace = os.path.join(managed.trace_dir, "trace.json")
    from orchestr._job._events import export_trace

    export_trace(os.path.join(managed.trace_dir, "events.jsonl"), ctx_trace)
    with open(ctx_trace, encoding="utf-8") as f:
        events = json.load(f)["traceEvents"]
    syncs = [e["dur"] / 1e6 for e in events if e["name"] == "weight_sync"]
    phases = [end - start for name, start, end in managed.phases if name == "weight_sync"]
    assert syncs == pytest.approx(phases, abs=1e-6)


def test_stream_skew_takes_its_ranker_from_the_config() -> None:
    lengths = OutputLengths(per_prompt_token=16, sigma=1.5, sample_sigma=0.2)
    routed = {}
    for ranker in (None, "orchestr.sim:OracleRanker", "orchestr.sim:RandomRanker"):
        run = sim_rl.simulate_grpo(
            config("stream+skew", steps=4, ranker=ranker),
            fat_tree(4),
            costs(),
            lengths,
            resources=EIGHT,
        )
        routed[ranker] = run.result.routed_long
        assert all(s.max_lag <= 1 for s in run.result.steps)
    assert all(n > 0 for n in routed.values())
    with pytest.raises(oc.ConfigError, match="import path"):
        config("stream+skew", ranker="no colon")
    with pytest.raises(oc.ConfigError, match="does not import"):
        sim_rl.simulate_grpo(
            config("stream+skew", ranker="orchestr.sim:NoSuchRanker"),
            fat_tree(4),
            costs(),
            lengths,
            resources=EIGHT,
        )


def test_the_oracle_knows_each_prompts_expected_length() -> None:
    lengths = OutputLengths(per_prompt_token=10, sigma=1.0, seed=3)
    a, b = [1, 5, 7, 2], [1, 5, 8, 2]
    assert lengths.expected(a) == lengths.expected(list(a)) != lengths.expected(b)
    # prompts of one length average per_prompt_token per prompt token (mean-1 factors)
    rng = __import__("random").Random(0)
    prompts = [[rng.randrange(10) for _ in range(4)] for _ in range(4000)]
    mean = sum(lengths.expected(p) for p in prompts) / len(prompts)
    assert mean == pytest.approx(40, rel=0.05)
    with pytest.raises(ValueError, match="sample_sigma"):
        OutputLengths(sample_sigma=-1.0)


CPUS = {role: {"cpu": 0.25} for role in ("generator", "trainer", "reward")}
RECOMPUTE = StepTimeModel(base_s=1e-3, prefill_token_s=1e-4)


def test_samples_can_run_to_their_requests_length() -> None:
    lengths = OutputLengths(requested=True, per_prompt_token=100)
    tc = config().train
    requests = rl.step_requests(tc, 0)
    assert [lengths.draw(r) for r in requests] == [r.max_new_tokens for r in requests]
    run = sim_rl.simulate_grpo(
        config(), one_host(), costs(engine="recompute"), lengths, resources=CPUS
    )
    for s in run.result.steps:
        wanted = [r.max_new_tokens for r in rl.step_requests(tc, s.step)]
        assert s.mean_length == pytest.approx(sum(wanted) / len(wanted))
    with pytest.raises(ValueError, match="engine"):
        costs(engine="eager")


def test_on_one_machines_cores_the_roles_contend_and_the_generators_yield() -> None:
    def once(cpus: float | None) -> sim_rl.RLRun:
        c = costs(generation=RECOMPUTE, engine="recompute", train_step_s=0.3, load_s=0.01)
        return sim_rl.simulate_grpo(
            config("stream", steps=6, generators=2),
            one_host(),
            c,
            OutputLengths(requested=True),
            resources=CPUS,
            host_cpus=cpus,
        )

    def training(run: sim_rl.RLRun) -> list[float]:
        return [end - start for name, start, end in run.phases if name == "training"]

    alone, two, one = once(None), once(2), once(1)
    assert set(alone.placement["generator"] + alone.placement["trainer"]) == {"local"}
    # two cores: the trainer (nice 0) keeps a core, the generators (nice 10) share the other
    assert training(two) == pytest.approx(training(alone), rel=1e-9)
    assert two.result.generator_idle_frac < alone.result.generator_idle_frac
    assert two.virtual_s > alone.virtual_s
    # one core: the trainer shares it too
    assert sum(training(one)) > sum(training(alone)) * 1.05
    assert one.virtual_s > two.virtual_s


def test_calibration_times_the_roles_own_code() -> None:
    tc = dataclasses.replace(rl.SMALL_CONFIG, prompts_per_step=4, group_size=2, eval_size=8)
    c, report = calibrate_rl(tc, steps=1)
    # a usable fit: no term below 0, so more work never costs less (on a busy machine the
    # small steps' differences can drop every term but the base: no stricter order is asked)
    g = c.generation
    assert c.engine == "recompute" and g.seconds(80, 8, 8 * 55) >= g.seconds(8, 1, 36) > 0
    assert c.train_token_s > 0 or c.train_step_s > 0
    assert min(c.publish_s, c.load_s, c.eval_s, c.score_s) > 0
    assert c.weight_bytes > 0 and c.weight_bytes % 4 == 0  # float32 TinyLM
    # the whole batch, then its half, quarter and eighth (whole groups), each run as many
    # steps as its longest answer has tokens, one sequence a row
    requests = rl.step_requests(tc, 0)
    runs = [requests[:n] for n in (8, 4, 2, 2)]
    assert len(report["generation_steps"]) == sum(max(r.max_new_tokens for r in x) for x in runs)
    assert report["generation_steps"][0][1] == 8
    assert len(report["train_steps"]) == 2  # the batch and its half
    with pytest.raises(ValueError, match="TinyLM"):
        calibrate_rl(dataclasses.replace(tc, model=rl.LlamaModel()))
    with pytest.raises(ValueError, match="fractions"):
        calibrate_rl(tc, fractions=(0.0,))


def test_each_call_costs_what_it_carries() -> None:
    def once(**kw: float) -> float:
        return sim_rl.simulate_grpo(config(), fat_tree(4), costs(**kw), resources=EIGHT).virtual_s

    # a step: four generate calls of 8 requests at once, then a score and a train_step of 32
    added = once(call_s=0.01, call_item_s=1e-4) - once()
    assert added == pytest.approx(3 * (3 * 0.01 + (8 + 32 + 32) * 1e-4), rel=1e-6)
    with pytest.raises(ValueError, match="call_item_s"):
        costs(call_item_s=-1.0)


def test_costs_round_trip_as_a_profile_and_bad_ones_are_refused() -> None:
    c = costs(engine="recompute", call_s=1e-3, publish_s=2e-3, train_token_s=5e-5)
    data = json.loads(json.dumps(c.to_json()))
    assert RLCosts.from_json(data) == c
    assert StepTimeModel.from_json(data["step_time"]) == c.generation
    for bad, message in (
        ({"step_time": data["step_time"]}, "rl_costs and step_time"),
        ({**data, "rl_costs": {**data["rl_costs"], "gpus": 1}}, "unknown rl_costs field"),
        ({**data, "rl_costs": {"train_s": 1.0}}, "unknown rl_costs field"),
        ({**data, "rl_costs": {"train_token_s": 1.0}}, "needs weight_bytes"),
        ({**data, "rl_costs": {**data["rl_costs"], "load_s": -1.0}}, "load_s is seconds"),
        ({**data, "step_time": {}}, "base_s"),
    ):
        with pytest.raises(ValueError, match=message):
            RLCosts.from_json(bad)
