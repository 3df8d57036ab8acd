"""Splitting a model: a tensor-parallel generator against the whole one, a sharded trainer's
memory against a replicated one's, and each pipeline schedule's bubble against its closed
form, in one run.

    python bench/parallel.py [--requests 16] [--new-tokens 64] [--repeats 3] [--record]

- **Tensor parallelism** (``Generator(tp=2)``'s engine, in this process and the rank it
  starts): a Llama checkpoint (``--hidden`` wide, 8 layers, 8 heads and 4 key/value heads,
  its tokenizer's vocabulary), ``--requests`` greedy requests of 32-token prompts and ``--new-tokens``
  tokens each. ``decode_tokens_per_s_tp1`` runs it whole on this machine's two threads,
  ``decode_tokens_per_s_tp2`` split over two processes of one thread each (tokens after
  every request's first, over the time they took; median of ``--repeats``).
  ``tp_logit_max_abs_diff`` is the largest difference between the two engines' logits over
  every step of the first run. On 2 cores tp=2 is not expected to win: each layer waits on
  two all-reduces over loopback, and the whole engine already has both cores.
- **The sharded trainer** (``Trainer(sharding="full")``, FSDP2) against the replicated one, two
  members each, a TinyLM of ``--trainer-width`` (8 layers) after two steps and a publish
  (the replicated pair's member 0 copies the whole model into its buckets, each sharded
  member its rows).
  ``trainer_peak_mib_per_rank_*`` is a member's peak resident memory less that of a member
  whose model is negligible (the process, torch and orchestr), so what remains is the
  model's: parameters, gradients, AdamW's moments and what the steps needed on top. Beside
  it, ``trainer_model_states_mib_*``, the states alone (``Trainer.memory()``).
- **Pipeline schedules**: ``bench/pipeline.py``'s measurement (2 ranks, 8 micro-batches)
  of GPipe, 1F1B, interleaved 1F1B and ZB-H1: ``bubble_measured`` (median) and
  ``bubble_theory``.
- ``reshard_s``: the sync RL job (:func:`orchestr.roles.rl.run_grpo`, 3 batches of the copy
  task) on a Llama of the tensor-parallel part's shape, its generator pool re-sharded from
  two tp=1 generators to one tp=2 generator before the second batch (layout costs that say
  so): drain, stop, spawn, load the trainer's version over the data plane, as
  :func:`orchestr.roles.rl.reshard_pool` does. Beside it ``load_s``, the median seconds one
  generator of the job took to load a version.

Prints one JSON line per part, then the summary line.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import tempfile
import time
from typing import Any

import torch

import orchestr as oc
from orchestr.roles import KVOptions, models
from orchestr.roles._common._backend import choose_backend
from orchestr.roles.generator._core._types import Request
from orchestr.roles.generator._engines._build import build_engine
from orchestr.roles.generator._engines._paged import PagedEngine
from orchestr.roles.trainer import publish_weights
from orchestr.roles.trainer._actor import Trainer

PROMPT = 32


def _engine(folder: str, tp: int, requests: int) -> PagedEngine:
    torch.set_num_threads(2 // tp)  # the ranks take this process's count
    kv = KVOptions(num_blocks=requests * 8 + 16, block_size=16, token_budget=512)
    _, engine = build_engine(
        choose_backend("cpu"), "", 0, requests, engine="paged", checkpoint=folder, kv=kv,
        vllm=None, model_kwargs=None, version=0, eos_id=None, pad_id=None, max_seq_len=None,
        vocab_size=None, tp=tp,
    )  # fmt: skip
    assert isinstance(engine, PagedEngine)
    return engine


def decode_rate(
    engine: PagedEngine, args: argparse.Namespace, salt: int, logits: list[Any] | None
) -> float:
    """Decode tokens a second over ``--requests`` greedy requests (prompts differ by
    ``salt``: no prefix hits between runs); ``logits``, when given, gets every step's."""
    if logits is not None:
        run = engine._runner.run

        def recorded(step: Any) -> dict[str, torch.Tensor]:
            out = run(step)
            logits.append({k: v.clone() for k, v in out.items()})
            return out

        engine._runner.run = recorded  # type: ignore[method-assign]
    ids = [f"s{salt}r{i}" for i in range(args.requests)]
    engine.submit(
        [
            Request(id=rid, prompt=[(7 * i + 13 * salt + j) % 300 + 1 for j in range(PROMPT)],
                    max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
            for i, rid in enumerate(ids)
        ]
    )  # fmt: skip
    started = None
    done = []
    while engine.has_work():
        done += engine.step()
        if started is None and all((live := engine.live(r)) is None or live.tokens for r in ids):
            started = time.perf_counter()
    assert started is not None and len(done) == args.requests
    return args.requests * (args.new_tokens - 1) / (time.perf_counter() - started)


def tp_checkpoint(tmp: str, args: argparse.Namespace) -> str:
    shape = {"layers": 8, "hidden": args.hidden, "heads": 8, "kv_heads": 4}
    return str(models.make_tiny("llama", f"{tmp}/llama", intermediate=4 * args.hidden, **shape))


def tensor_parallel(args: argparse.Namespace, folder: str) -> dict[str, Any]:
    rates: dict[int, list[float]] = {1: [], 2: []}
    logits: dict[int, list[Any]] = {1: [], 2: []}
    for tp in (1, 2):
        engine = _engine(folder, tp, args.requests)
        try:
            decode_rate(engine, args, 99, None)  # warm-up (packing, the kernel's first call)
            for repeat in range(args.repeats):
                keep = logits[tp] if repeat == 0 else None
                rates[tp].append(decode_rate(engine, args, repeat, keep))
        finally:
            engine.close()
    diff = max(
        float((a[k] - b[k]).abs().max())
        for a, b in zip(logits[1], logits[2], strict=True)
        for k in a
    )
    return {
        "tp_logit_max_abs_diff": diff,
        "decode_tokens_per_s_tp1": summary(rates[1]),
        "decode_tokens_per_s_tp2": summary(rates[2]),
    }


async def reshard(ctx: oc.JobContext, args: argparse.Namespace) -> dict[str, Any]:
    """The sync RL job on the tensor-parallel part's model shape, its pool told by its
    layout costs to go from 2 x tp1 to 1 x tp2 after the first batch."""
    from orchestr.roles.rl import LLAMA_CONFIG, GRPOConfig, LayoutCosts, LlamaModel, run_grpo

    torch.set_num_threads(2)  # the tp=2 generator's ranks take half of this process's count
    h = args.hidden
    model = LlamaModel(hidden=h, layers=8, heads=8, kv_heads=4, intermediate=4 * h)
    train = dataclasses.replace(
        LLAMA_CONFIG, model=model, steps=3, prompts_per_step=4, eval_every=3, eval_size=8,
        threads=1,
    )  # fmt: skip
    # reading the weights is every decode iteration's cost and a degree of 2 halves it
    costs = LayoutCosts(
        base_s=1e-3, decode_s=0.0, attention_s=0.0, layers=8, row_bytes=0.0,
        allreduce_alpha_s=0.0, allreduce_byte_s=0.0, device_bytes=1e12, weight_bytes=0.0,
        kv_bytes_per_token=1.0, reshard_s=0.0,
    )  # fmt: skip
    config = GRPOConfig(train=train, layout_degrees=(1, 2), layout_costs=costs)
    result = await run_grpo(ctx, config)
    [change] = result.layouts
    parts = {f"reshard_{k}": change[k] for k in ("drain_s", "stop_s", "spawn_s", "load_s")}
    return {"reshard_s": change["total_s"], "load_s": result.weight_sync["seconds"], **parts}


async def trainer_memory(ctx: oc.JobContext, args: argparse.Namespace) -> dict[str, Any]:
    width = args.trainer_width
    big = {"d_model": width, "n_heads": 8, "n_layers": 8, "d_ff": 4 * width}
    small = {"d_model": 8, "n_heads": 1, "n_layers": 1, "d_ff": 8}
    batch = scored_batch()
    out: dict[str, Any] = {}
    for label, sharding, model in (
        ("baseline", "none", small),
        ("replicated", "none", big),
        ("sharded", "full", big),
    ):
        pair = await ctx.spawn(
            Trainer, n=2, resources={"cpu": 0.5}, model_kwargs=model, torch_threads=1,
            sharding=sharding, name=f"trainer-{label}",
        )  # fmt: skip
        await ctx.init_distributed(pair)
        for _ in range(2):
            await asyncio.gather(*(pair[r].train_step.call_one(batch[2 * r : 2 * r + 2], 2)
                                   for r in (0, 1)))  # fmt: skip
        await publish_weights(pair, sharding == "full")  # the whole model or its rows
        memory = await pair.memory.call()
        out[label] = {
            "peak_rss_mib": max(m["peak_rss"] for m in memory),
            "model_states_mib": max(m["model_states"] for m in memory),
        }
        await ctx.stop(pair)
    base = out["baseline"]["peak_rss_mib"]
    return {
        "trainer_peak_mib_per_rank_replicated": out["replicated"]["peak_rss_mib"] - base,
        "trainer_peak_mib_per_rank_sharded": out["sharded"]["peak_rss_mib"] - base,
        "trainer_model_states_mib_replicated": out["replicated"]["model_states_mib"],
        "trainer_model_states_mib_sharded": out["sharded"]["model_states_mib"],
        "_process_peak_rss_mib": base,
    }


def scored_batch() -> list[tuple[Any, float]]:
    """Four scored completions of the digit task from a small fresh TinyLM."""
    import dataclasses

    from orchestr.roles.generator import RecomputeEngine
    from orchestr.roles.rl import _task
    from orchestr.roles.rl._reference import TrainConfig, request_digits, step_requests
    from orchestr.roles.trainer._actor import build_model

    model = build_model("orchestr.roles:TinyLM", {"d_model": 32, "n_heads": 2}, seed=3)
    engine = RecomputeEngine(model, max_batch=64, pad_id=_task.PAD, vocab_size=_task.VOCAB_SIZE)
    config = TrainConfig(prompts_per_step=2, group_size=2, lengths=_task.LengthDistribution(6))
    requests = step_requests(config, 0)
    engine.submit(requests)
    done = {}
    while engine.has_work():
        done.update((c.id, c) for c in engine.step())
    out = []
    for r in requests:
        c = dataclasses.replace(done[r.id], version=0)
        out.append((c, _task.reward(request_digits(c), c.tokens)))
    return out


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    import pipeline
    from _record import add_record_flag, record

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--trainer-width", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=3)
    add_record_flag(parser)
    args = parser.parse_args()

    tmp = tempfile.TemporaryDirectory()
    folder = tp_checkpoint(tmp.name, args)
    tp = tensor_parallel(args, folder)
    print(json.dumps({"part": "tensor_parallel", **tp}))
    pipe_args = argparse.Namespace(
        microbatches=8, repeats=args.repeats, width=512, depth=4, rows=64
    )

    async def job(ctx: oc.JobContext) -> tuple[Any, ...]:
        changed = await reshard(ctx, args)
        memory = await trainer_memory(ctx, args)
        return changed, memory, await pipeline.measure(ctx, pipe_args)

    changed, memory, schedules = oc.run(job)
    tmp.cleanup()
    print(json.dumps({"part": "reshard", **changed}))
    print(json.dumps({"part": "trainer_memory", **memory}))
    bubbles = {
        row["schedule"]: {
            "bubble_measured": row["bubble_measured"]["median"],
            "bubble_theory": row["bubble_theory"],
        }
        for row in schedules
    }
    print(json.dumps({"part": "pipeline", **bubbles}))
    line = {
        "tp_logit_max_abs_diff": tp["tp_logit_max_abs_diff"],
        "decode_tokens_per_s_tp1": tp["decode_tokens_per_s_tp1"]["median"],
        "decode_tokens_per_s_tp2": tp["decode_tokens_per_s_tp2"]["median"],
        "tp2_over_tp1": tp["decode_tokens_per_s_tp2"]["median"]
        / tp["decode_tokens_per_s_tp1"]["median"],
        **{k: v for k, v in memory.items() if not k.startswith("_")},
        "sharded_over_replicated": memory["trainer_peak_mib_per_rank_sharded"]
        / memory["trainer_peak_mib_per_rank_replicated"],
        "reshard_s": changed["reshard_s"],
        "load_s": changed["load_s"],
        **bubbles,
    }
    print(json.dumps(line))
    if args.record:
        ratios = {k: line[k] for k in ("tp2_over_tp1", "sharded_over_replicated")}
        record("parallel", {**tp, **memory, **changed, **ratios, "pipeline": bubbles})


if __name__ == "__main__":
    main()
