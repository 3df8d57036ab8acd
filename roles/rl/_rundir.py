"""A run's folder, written as the run goes (:class:`RunWriter`): ``config.json``,
``metrics.jsonl`` a line per batch, ``samples.jsonl``, ``tensorboard/``, ``summary.json``, and
``reward.png`` (:func:`plot`), and with ``run.mlflow`` the same to an MLflow run
(:class:`~._mlflow.MlflowLog`: the config's keys as params, each ``metrics.jsonl`` number as a
metric, the files above as artifacts). A resumed run keeps the lines of the batches its
checkpoint holds and writes the others again (to the same MLflow run)."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import TYPE_CHECKING, Any

from ._config import GRPOResult, StepRecord
from ._mlflow import MlflowLog, flat
from ._recovery import read_state

if TYPE_CHECKING:
    from ._run import Plan

__all__ = ["RunWriter", "plot"]


def _board(folder: str, purge: int | None) -> Any:
    """A TensorBoard event writer for ``folder`` (dropping the events from ``purge`` on, which
    a resumed run writes again); None without the tensorboard package."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(folder, purge_step=purge)


def _keep_before(path: str, version: int) -> None:
    """Keep the lines of ``path`` about batches before ``version`` (a resumed run redoes the
    others; evaluations are written at the end)."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        rows = [line for line in f if line.strip()]
    kept = [line for line in rows if json.loads(line).get("step", version) < version]
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(kept)


class RunWriter:
    """Writes the run folder as the run goes: ``metrics.jsonl`` line by line, then the rest."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        os.makedirs(plan.run_dir, exist_ok=True)
        with open(os.path.join(plan.run_dir, "config.json"), "w", encoding="utf-8") as f:
            json.dump(dataclasses.asdict(plan.config), f, indent=2, default=str)
        self.mlflow: MlflowLog | None = None
        if plan.mlflow is not None:  # before the files: a store that fails leaves none open
            self.mlflow = MlflowLog.open(
                plan.mlflow,
                plan.run_dir,
                resume=plan.job.resume,
                tags={
                    "mode": plan.job.mode,
                    "orchestr.config": plan.config.source,
                    "orchestr.run_dir": plan.run_dir,
                },
                params=flat(json.loads(json.dumps(dataclasses.asdict(plan.config), default=str))),
            )
        metrics = os.path.join(plan.run_dir, "metrics.jsonl")
        samples = os.path.join(plan.run_dir, "samples.jsonl")
        purge = None
        if plan.job.resume:  # the lines of batches the checkpoint holds; the rest is redone
            assert plan.job.checkpoint_dir is not None
            state = read_state(os.path.join(plan.job.checkpoint_dir, "controller.json"))
            _keep_before(metrics, int(state["version"]))
            _keep_before(samples, int(state["version"]))
            purge = int(state["version"]) + 1  # TensorBoard's steps are versions
        self.metrics = open(metrics, "a", encoding="utf-8")
        self.samples = open(samples, "a", encoding="utf-8")
        self.board = _board(os.path.join(plan.run_dir, "tensorboard"), purge)

    def step(self, record: StepRecord) -> None:
        row = {"kind": "step", **dataclasses.asdict(record)}
        tally = self.plan.source.tally
        if tally.last:
            row["rewards"] = dict(tally.last)
        self.metrics.write(json.dumps(row) + "\n")
        self.metrics.flush()
        if self.mlflow is not None:
            self.mlflow.log(row, record.step + 1)  # the policy version, as TensorBoard's step
        if self.board is not None:
            version = record.step + 1
            for key in (
                "reward",
                "mean_length",
                "kl",
                "entropy",
                "clip_frac",
                "samples_per_s",
                "version_lag",
                "loss",
            ):
                self.board.add_scalar(f"train/{key}", getattr(record, key), version)
            for name, value in tally.last.items():
                self.board.add_scalar(f"reward/{name}", value, version)
            if record.accuracy is not None:
                self.board.add_scalar("held_out/score", record.accuracy, version)
            self.board.flush()
        if record.accuracy is not None:
            for sample in self.plan.source.samples():
                self.samples.write(json.dumps({"step": record.step, **sample}) + "\n")
            self.samples.flush()

    def close(self, result: GRPOResult | None) -> dict[str, Any]:
        """Write the rest (``summary.json`` and ``reward.png`` with a result) and close the
        files; end the MLflow run, ``FAILED`` without a result (the run raised)."""
        try:
            summary = self._close(result)
            if self.mlflow is not None and result is not None:
                for version, score, _ in result.evals:
                    self.mlflow.log({"held_out": score}, version)
                self.mlflow.log(summary, self.plan.job.train.steps, prefix="summary/")
        except BaseException:
            if self.mlflow is not None:
                self.mlflow.end(failed=True)
            raise
        if self.mlflow is not None:
            files = ("config.json", "summary.json", "reward.png")
            paths = [os.path.join(self.plan.run_dir, name) for name in files]
            self.mlflow.end(
                failed=result is None, artifacts=[p for p in paths if os.path.isfile(p)]
            )
        return summary

    def _close(self, result: GRPOResult | None) -> dict[str, Any]:
        self.samples.close()
        if self.board is not None:
            self.board.close()
        summary: dict[str, Any] = {}
        if result is not None:
            for version, score, wall in result.evals:
                row = {"kind": "eval", "version": version, "held_out": score, "wall_s": wall}
                self.metrics.write(json.dumps(row) + "\n")
            summary = {
                "mode": self.plan.job.mode,
                **result.summary(),
                "held_out": [e[1] for e in result.evals],
                "weight_sync": result.weight_sync,
                "final_digest": result.final_digest,
                "reward_failures": result.rewards,
                "exported": result.exported,
            }
            with open(os.path.join(self.plan.run_dir, "summary.json"), "w", encoding="utf-8") as f:
                json.dump(summary, f, indent=2, default=str)
            plot(os.path.join(self.plan.run_dir, "reward.png"), result, self.plan.config.source)
        self.metrics.close()
        return summary


def plot(path: str, result: GRPOResult, title: str) -> bool:
    """The reward curve and the held-out score as a PNG; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(
        [r.step + 1 for r in result.steps], [r.reward for r in result.steps], label="batch reward"
    )
    ax.plot([e[0] for e in result.evals], [e[1] for e in result.evals], "o-", label="held-out")
    ax.set(xlabel="batch (policy version)", title=os.path.basename(title))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
