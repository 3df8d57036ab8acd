"""``orchestr gpu-check`` (``make gpu-check``): what only a CUDA host can show, checked there.

Each check runs one thing this project builds for GPUs and cannot run on a CPU-only machine,
and compares it with the CPU where there is a reference:

- ``backend``: the CUDA torch backend runs a model, as the CPU does;
- ``paged-engine``: the paged engine (torch's attention) on CUDA gives the CPU's greedy tokens;
- ``weight-sync``: a version published from a CUDA model loads into another CUDA model
  (pinned host buckets, then a copy to the device), bitwise;
- ``vllm``: vLLM's CUDA engine, when vLLM is installed, serves through a generator;
- ``tp-nccl``: a ``tp=2`` generator (its ranks' NCCL group) gives the whole model's tokens
  (two devices);
- ``fsdp-nccl``: a sharded trainer pair (FSDP2 over NCCL) trains, both ranks' weights equal
  (two devices).

It prints a table (check, result, seconds, detail) and exits 1 when a check failed, 0
otherwise. A check that cannot run here is skipped, saying why: without a GPU every one is,
and the command exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["add_parsers", "run_checks"]


class _Skipped(Exception):
    """A check that cannot run on this host, and why."""


@dataclasses.dataclass
class Outcome:
    name: str
    result: str  # "pass", "fail" or "skip"
    seconds: float
    detail: str


def _cuda_devices() -> int:
    import torch

    if not torch.cuda.is_available():
        raise _Skipped(
            f"torch sees no CUDA device (torch {torch.__version__}, built for CUDA "
            f"{torch.version.cuda})"
        )
    return int(torch.cuda.device_count())


def _two_devices() -> None:
    if _cuda_devices() < 2:
        raise _Skipped("needs two CUDA devices")


def check_backend(folder: str) -> str:
    import torch

    from orchestr.roles import choose_backend, models

    _cuda_devices()
    backend = choose_backend("cuda")
    model = models.load_model(folder)
    tokens = torch.tensor([[1, 5, 9, 17, 33, 2]])
    with torch.no_grad():
        want = model(tokens)
        got = backend.prepare(model.to(backend.device))(tokens.to(backend.device)).cpu()
    diff = float((got - want).abs().max())
    if diff > 1e-3:
        raise AssertionError(f"CUDA logits differ from the CPU's by {diff:.2e}")
    return f"{backend.describe()}; logits within {diff:.1e} of the CPU's"


def _greedy(folder: str, device: str) -> list[list[int]]:
    import torch

    from orchestr.roles import Request, models
    from orchestr.roles.generator import PagedEngine

    model = models.load_model(folder, dtype=torch.float32, device=device)
    engine = PagedEngine(model, num_blocks=128, block_size=16, attention="torch")
    engine.submit(
        [Request(f"r{i}", list(range(3 + i, 40 + i)), 12, temperature=0.0) for i in range(4)]
    )
    done = []
    while engine.has_work():
        done += engine.step()
    return [c.tokens for c in sorted(done, key=lambda c: c.id)]


def check_paged_engine(folder: str) -> str:
    _cuda_devices()
    got, want = _greedy(folder, "cuda"), _greedy(folder, "cpu")
    if got != want:
        raise AssertionError(f"greedy tokens on CUDA {got[0]} differ from the CPU's {want[0]}")
    return "4 greedy requests, the CPU's tokens"


def check_weight_sync(folder: str) -> str:
    import torch

    from orchestr.roles import WeightLoader, WeightPublisher, models

    _cuda_devices()
    trained = models.load_model(folder, device="cuda")
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.01)
    target = models.load_model(folder, device="cuda")
    with WeightPublisher() as publisher:
        ref = publisher.publish(trained, 1)
        start = time.perf_counter()
        asyncio.run(WeightLoader().load(target, ref))
        seconds = time.perf_counter() - start
    pairs = zip(target.state_dict().values(), trained.state_dict().values(), strict=True)
    if not all(torch.equal(a, b) for a, b in pairs):
        raise AssertionError("the loaded weights are not the published ones")
    return f"{ref.nbytes / 2**20:.1f} MiB in {seconds * 1e3:.1f} ms, bitwise"


def _on_cluster(job: Callable[[Any], Any]) -> Any:
    import orchestr as oc

    async def main(ctx: Any) -> Any:
        return await job(ctx)

    return oc.run(main)


def check_vllm(folder: str) -> str:
    import importlib.util

    _cuda_devices()
    if importlib.util.find_spec("vllm") is None:
        raise _Skipped("vLLM is not installed (pip install 'orchestr[vllm]')")
    from orchestr.roles import Generator, Request

    async def job(ctx: Any) -> list[int]:
        gen = await ctx.spawn(Generator, checkpoint=folder, engine="vllm", backend="cuda")
        (done,) = await gen.generate.call_one([Request("r", [1, 5, 9], 8, temperature=0.0)])
        return list(done.tokens)

    tokens = _on_cluster(job)
    if len(tokens) != 8:
        raise AssertionError(f"vLLM returned {len(tokens)} tokens for 8")
    return "8 greedy tokens through a generator"


def check_tp_nccl(folder: str) -> str:
    _two_devices()
    from orchestr.roles import Generator, Request

    request = Request("r", list(range(3, 40)), 12, temperature=0.0)

    async def job(ctx: Any) -> list[list[int]]:
        out = []
        for tp in (1, 2):
            gen = await ctx.spawn(Generator, checkpoint=folder, tp=tp, backend="cuda")
            (done,) = await gen.generate.call_one([request])
            out.append(list(done.tokens))
            await ctx.stop(gen)
        return out

    whole, split = _on_cluster(job)
    if whole != split:
        raise AssertionError(f"tp=2 gave {split}, tp=1 {whole}")
    return "tp=2 over NCCL, the whole model's greedy tokens"


def check_fsdp_nccl(folder: str) -> str:
    _two_devices()
    from orchestr.roles import Trainer

    async def job(ctx: Any) -> list[str]:
        pair = await ctx.spawn(
            Trainer,
            n=2,
            model_factory="orchestr.roles.models:load_model",
            model_kwargs={"folder": folder},
            backend="cuda",
            sharding="full",
            resources={"gpu": 1},
        )
        await ctx.init_distributed(pair, backend="nccl")
        digests = await pair.digest.call()
        return [d["digest"] for d in digests]

    digests = _on_cluster(job)
    if len(set(digests)) != 1:
        raise AssertionError("the two ranks' gathered weights differ")
    return "two ranks sharded over NCCL, equal weights"


CHECKS: dict[str, Callable[[str], str]] = {
    "backend": check_backend,
    "paged-engine": check_paged_engine,
    "weight-sync": check_weight_sync,
    "vllm": check_vllm,
    "tp-nccl": check_tp_nccl,
    "fsdp-nccl": check_fsdp_nccl,
}


def run_checks(names: list[str] | None = None) -> list[Outcome]:
    """Run ``names`` (default: every check) on a small checkpoint made here."""
    from orchestr.roles import models

    outcomes = []
    with tempfile.TemporaryDirectory(prefix="orchestr-gpu-check-") as tmp:
        folder = str(models.make_tiny("llama", f"{tmp}/llama", layers=2, hidden=64))
        for name in names or list(CHECKS):
            start = time.perf_counter()
            try:
                detail, result = CHECKS[name](folder), "pass"
            except _Skipped as why:
                detail, result = str(why), "skip"
            except Exception as exc:
                last = traceback.extract_tb(exc.__traceback__)[-1]
                detail, result = f"{type(exc).__name__}: {exc} ({last.name}:{last.lineno})", "fail"
            outcomes.append(Outcome(name, result, time.perf_counter() - start, detail))
    return outcomes


def _main(args: argparse.Namespace) -> int:
    outcomes = run_checks(args.only or None)
    width = max(len(o.name) for o in outcomes)
    print(f"{'check':<{width}}  result  seconds  detail")
    for o in outcomes:
        print(f"{o.name:<{width}}  {o.result:<6}  {o.seconds:7.2f}  {o.detail}")
    failed = [o.name for o in outcomes if o.result == "fail"]
    if failed:
        print(f"orchestr gpu-check: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def add_parsers(sub: Any) -> None:
    p = sub.add_parser(
        "gpu-check",
        help="check, on a CUDA host, what a CPU-only machine cannot (each check skips without one)",
    )
    p.add_argument(
        "--only", action="append", choices=sorted(CHECKS), help="run this check (repeatable)"
    )
    p.set_defaults(func=_main)
