"""The GRPO job survives SIGKILL of each of its roles' workers: the role restarts, the work it
held is done again (counted), and the run ends where it would have without the deaths."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import pathlib
import random
import subprocess
import sys

import pytest

import orchestr as oc
from orchestr.roles import MODES, SMALL_CONFIG, Generator, GRPOConfig, Trainer, run_grpo
from orchestr.roles.rl._faults import parse_kill
from orchestr.roles.rl._reference import step_requests


@pytest.mark.timeout(240)
async def test_sync_mode_ends_with_the_same_weights_after_each_role_was_killed(
    ctx: oc.JobContext, tmp_path: pathlib.Path
) -> None:
    tc = dataclasses.replace(SMALL_CONFIG, steps=10, eval_every=5, seed=3)
    config = GRPOConfig(
        train=tc,
        checkpoint_every=3,
        checkpoint_dir=str(tmp_path),
        scorer="tests.roles.scorers:slow_reverse",
    )
    calm = await run_grpo(ctx, config)
    # a generator as it starts generating batch 2 (0.05 s later it had at times finished its
    # half already, and nothing was redrawn), the reward worker while it scores, the trainer
    # while it trains on batch 7: it goes back to its checkpoint after batch 6 (version 6)
    kills = ("generator1@2:generate", "reward@4:score+0.05", "trainer@7:train")
    hit = await run_grpo(ctx, dataclasses.replace(config, kill=kills))
    faults = hit.faults
    assert [k["kill"] for k in faults["kills"]] == list(kills)
    assert faults["restarts"] == {"generator": 1, "reward": 1, "trainer": 1}
    assert faults["redrawn_groups"] >= 1  # the generator's half of batch 2
    assert faults["rescored_samples"] >= 1
    assert faults["rolled_back_batches"] == 1
    assert calm.faults["restarts"] == {"generator": 0, "reward": 0, "trainer": 0}
    # keyed samples and a checkpoint with the optimizer: the same run, bit for bit
    assert hit.final_digest == calm.final_digest
    assert [r.loss for r in hit.steps] == [r.loss for r in calm.steps]
    assert [r.step for r in hit.steps] == list(range(10))
    assert [a for _, a, _ in hit.evals] == [a for _, a, _ in calm.evals]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sharding", ["none", "full"])
async def test_a_data_parallel_trainer_group_is_formed_again_after_a_kill(
    ctx: oc.JobContext, tmp_path: pathlib.Path, sharding: str
) -> None:
    # two trainers, replicated or sharded: trainer 1 is killed as the group trains batch 3;
    # the group is stopped, a new one formed and restored from the checkpoint after batch 1,
    # and the run trains batches 2 and 3 again: the same weights as a run without the kill
    tc = dataclasses.replace(SMALL_CONFIG, steps=5, eval_every=5, seed=4)
    config = GRPOConfig(
        train=tc,
        trainers=2,
        checkpoint_every=2,
        checkpoint_dir=str(tmp_path),
        trainer_options={"sharding": sharding},
    )
    calm = await run_grpo(ctx, config)
    hit = await run_grpo(ctx, dataclasses.replace(config, kill=("trainer1@3:train",)))
    assert hit.faults["restarts"]["trainer"] == 1
    assert hit.faults["rolled_back_batches"] == 1  # batch 2, after the checkpoint
    assert [k["rank"] for k in hit.faults["kills"]] == [1]
    assert [r.step for r in hit.steps] == list(range(5))
    assert hit.final_digest == calm.final_digest and hit.trainer_digests_equal
    assert [r.loss for r in hit.steps] == [r.loss for r in calm.steps]
    # the checkpoints of the replaced versions are removed as the run goes (one is kept)
    assert len([n for n in os.listdir(tmp_path) if n.startswith("trainer-v")]) <= 1


def test_bad_kills_are_refused() -> None:
    assert parse_kill("generator1@12:generate").rank == 1
    assert parse_kill("reward@3:score+0.25").delay == 0.25
    for bad in ("generator", "gen@3", "trainer@0", "reward@x", "trainer@3:nap", "reward@3:score+x"):
        with pytest.raises(oc.ConfigError, match="ROLE|phase|delay"):
            parse_kill(bad)
    with pytest.raises(oc.ConfigError, match="needs checkpoint_every > 0"):
        GRPOConfig(train=SMALL_CONFIG, trainers=2, checkpoint_every=0, kill=("trainer@3",))
    for kill, why in [
        ("generator@3:generate", "no phase 'generate'"),  # the stream modes do not pause for it
        ("trainer@100", "batches 0-99"),
        ("trainer@3:eval", "without an evaluation"),
    ]:
        with pytest.raises(oc.ConfigError, match=why):
            GRPOConfig(train=SMALL_CONFIG, mode="stream", kill=(kill,))
    with pytest.raises(oc.ConfigError, match="checkpoint_every"):
        GRPOConfig(train=SMALL_CONFIG, checkpoint_every=-1)


ROOT = pathlib.Path(__file__).resolve().parents[3]

#: Each mode's learning test on the example's model (a Llama checkpoint copying digits): the
#: example's flags, its batches, and what it must reach. ``sync`` (the config's 120 batches)
#: must learn the task (last-50 reward >= 0.8, final held-out accuracy >= 0.9, a gain of
#: 0.5). ``stream`` (far off-policy: eta 4, three batches ahead, a smaller step, 140 batches)
#: must reach the same reward and gain, not the final 0.9: at eta 4 it sometimes loses a digit
#: for good (greedy accuracy flat from batch 60 on). With an entropy bonus of 0.01 that took 2
#: of 5 runs of 100 batches (0.48-0.77 at the end); with 0.03, over 140 batches and kills
#: drawn as here, 8 of 10 runs ended at 0.99-1.0, one at 0.875 (a failed CI run) and one
#: stuck at 0.625 (gain 0.55, last-50 reward 0.91), with weights borrowed or read alike.
#: ``stream+skew`` must route long prompts and learn within 40 batches (mean reward of the
#: last 10 up by 0.2 over the first 10's, about 0.09). Over 10 runs with kills drawn as here
#: the gain was 0.29-0.47 (mean 0.39): 0.3, the bar before, failed one CI run at 0.286 (the
#: tests share the 2 cores with the vLLM venv's install).
LEARNING = {
    "sync": ([], 120),
    "stream": (["--eta", "4", "--lookahead", "3", "--lr", "1e-3"], 140),
    "stream+skew": ([], 40),
}


#: The sync mode is left out of the random kills here: its kills change nothing at all (the
#: first test of this module: the calm run's weights, bit for bit, after a kill of each role in
#: the phase where it works), and the learning tests run in sync mode
#: (``tests/roles/rl/test_rl_learning.py``). What a random kill could still find there cost
#: 70 s of CI's 30 minutes.
RANDOM_KILL_MODES = tuple(mode for mode in MODES if mode != "sync")


@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode", RANDOM_KILL_MODES)
def test_each_mode_learns_through_the_example_while_each_role_is_killed(
    mode: str, tmp_path: pathlib.Path
) -> None:
    """``examples/grpo_reverse.py --small`` (Llama) while each role's worker is SIGKILLed once, at a
    random batch and moment (the draw is in the assertion messages, to rerun it)."""
    flags, steps = LEARNING[mode]
    seed = random.SystemRandom().randrange(1 << 16)
    rng = random.Random(seed)
    kills = {role: rng.randrange(3, steps - 5) for role in ("generator", "reward", "trainer")}
    args = [f"--kill={role}@{step}" for role, step in kills.items()]
    drawn = f"kills {kills}, --kill-seed {seed}"
    shm_before = set(os.listdir("/dev/shm"))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "orchestr.cli",
            "run",
            "examples/grpo_reverse.py",
            "--small",
            "--mode",
            mode,
            "--steps",
            str(steps),
            *flags,
            "--runs",
            str(tmp_path),
            "--quiet",
            f"--kill-seed={seed}",
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=380,
    )
    assert proc.returncode == 0, f"{drawn}\n{proc.stderr[-4000:]}"
    (run,) = tmp_path.iterdir()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["restarts"] == {"generator": 1, "reward": 1, "trainer": 1}, drawn
    assert sorted(k["kill"] for k in summary["kills"]) == sorted(a[7:] for a in args), drawn
    assert summary["redrawn_groups"] >= 0 and summary["rescored_samples"] >= 0
    # restored from its checkpoint of every 10 batches, a trainer undoes at most 10: all 10
    # when the batch before the next checkpoint was recorded too (it went to the restarted
    # trainer before the death was heard, or the trainer died writing that checkpoint)
    assert 0 <= summary["rolled_back_batches"] <= 10, drawn
    assert "survived 3 kill(s)" in proc.stdout, drawn
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    batches = [r for r in rows if r["kind"] == "step"]
    assert [r["step"] for r in batches] == list(range(steps)), drawn
    assert [r["version"] for r in batches] == list(range(1, steps + 1))
    lags = [r["max_lag"] for r in batches]
    rewards = [r["reward"] for r in batches]
    evals = [r["accuracy"] for r in rows if r["kind"] == "eval"]
    if mode != "sync":
        # the rollouts run on a graph; the trainer's rollback ended a run and a new one
        # went on (the groups of the first drawn again)
        events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
        runs = [e for e in events if e["kind"] == "graph"]
        assert {e["name"] for e in runs} == {f"grpo-{mode.replace('+', '-')}"}, drawn
        assert len(runs) >= 2 and len(runs) == sum(e["kind"] == "graph_end" for e in events)
    if mode == "stream+skew":
        assert max(lags) <= 1, drawn  # eta 1, across the rollback too
        assert summary["routed_long"] > 0
        assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10 + 0.2, drawn
    else:
        if mode == "sync":
            assert set(lags) == {0}  # on-policy, deaths or not
            assert summary["weight_sync"]["bytes"] > 0
        else:
            assert max(lags) <= 4, drawn  # every trained sample within eta
            assert sum(lag >= 3 for lag in lags) > len(lags) / 2  # it ran that far off-policy
        assert summary["last50_reward"] >= 0.8, drawn
        assert evals[-1] - evals[0] >= 0.5, f"{drawn}: {evals}"
        if mode == "sync":
            assert evals[-1] >= 0.9, f"{drawn}: {evals}"
    assert set(os.listdir("/dev/shm")) - shm_before == set(), "a shared-memory segment leaked"


async def test_a_reset_generator_drops_its_requests_and_loads_a_restored_trainer(
    ctx: oc.JobContext, tmp_path: pathlib.Path
) -> None:
    tc = dataclasses.replace(SMALL_CONFIG, prompts_per_step=4)
    model = dataclasses.asdict(tc.model)
    trainer = await ctx.spawn(Trainer, model_kwargs=model, seed=1, torch_threads=1)
    gen = await ctx.spawn(Generator, model_kwargs=model, seed=1, torch_threads=1)
    ckpt = str(tmp_path / "v0.pt")
    await trainer.checkpoint.call_one(ckpt)
    await gen.sync_weights.call_one(await trainer.publish.call_one())
    requests = step_requests(tc, 0)
    done = await gen.generate.call_one(requests)
    rewards = [1.0 if i % 2 else 0.0 for i in range(len(done))]
    await trainer.train_step.call_one(list(zip(done, rewards, strict=True)), tc.group_size)
    assert (await gen.sync_weights.call_one(await trainer.publish.call_one()))["version"] == 1
    first = await gen.reset.call_one()
    assert first["dropped"] == 0
    # a reader from before a reset (waiting for ever) ends with nothing, at the reset
    waiting = asyncio.ensure_future(gen.next_completed.call_one(64, None, first["token"]))
    await asyncio.sleep(0.2)
    await gen.submit.call_one(requests)
    reset = await gen.reset.call_one()
    assert reset["dropped"] + len(await waiting) == len(requests)
    assert await gen.next_completed.call_one(64, 0.3, reset["token"]) == []
    assert await gen.next_completed.call_one(64, 0.3, first["token"]) == []
    # the trainer goes back to version 0 and publishes it anew; the generator takes it
    assert await trainer.restore.call_one(ckpt) == 0
    report = await gen.sync_weights.call_one(await trainer.publish.call_one())
    assert report["loaded"] and report["version"] == 0
    want = await trainer.digest.call_one()
    assert (await gen.digest.call_one())["digest"] == want["digest"]
    again = await gen.generate.call_one(requests)
    assert [c.tokens for c in again] == [c.tokens for c in done]  # keyed samples, same weights
    # without a reset, an older version is refused
    await trainer.train_step.call_one(list(zip(again, rewards, strict=True)), tc.group_size)
    await gen.sync_weights.call_one(await trainer.publish.call_one())
    await trainer.restore.call_one(ckpt)
    with pytest.raises(oc.ActorError, match="older than"):
        await gen.sync_weights.call_one(await trainer.publish.call_one())
