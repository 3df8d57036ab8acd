"""``orchestr rl train CONFIG.toml``: RL post-training of a checkpoint on a user's data and reward,
on the embedded cluster (or a running one), written to a run folder."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import textwrap
from collections.abc import Callable, Collection
from typing import Any

import orchestr

__all__ = ["add_parsers", "config_help"]


def config_help() -> str:
    """Every section and key of a config with its default, and each section's docstring."""
    from orchestr.roles.rl import SECTIONS, DataSpec, DigitsData, RewardSection

    lines = ["config file (TOML): sections and keys, with their defaults", ""]
    tables: list[tuple[str, type]] = [
        ("[model]", SECTIONS["model"]),
        ("[data]", DataSpec),
        ("[data] digits = {...}", DigitsData),
        ("[[reward]]", RewardSection),
        *((f"[{name}]", cls) for name, cls in SECTIONS.items() if name != "model"),
    ]
    for title, cls in tables:
        lines.extend(section_help(title, cls))
    return "\n".join(lines)


def section_help(
    title: str, cls: type, keys: Collection[str] | None = None, doc: str | None = None
) -> list[str]:
    """A config section's help: its title, ``doc`` (default: its docstring), and each key (of
    ``keys``, default all) with its default, a blank line after."""
    doc = doc if doc is not None else " ".join((cls.__doc__ or "").split())
    lines = [title, *textwrap.wrap(doc, 92, initial_indent="  ", subsequent_indent="  ")]
    for f in dataclasses.fields(cls):
        if keys is not None and f.name not in keys:
            continue
        if f.default is not dataclasses.MISSING:
            default = _toml(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = _toml(f.default_factory())
        else:
            default = "(required)"
        lines.append(f"    {f.name} = {default}")
    return [*lines, ""]


def _toml(value: Any) -> str:
    if value is None:
        return "(unset)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    return str(value)


class Progress:
    """A line per held-out evaluation (and the first batch), or on a terminal a progress bar
    (tqdm's, when installed; else one line redrawn in place): step, reward (per function
    too), held-out score, length, KL, entropy, clip fraction, samples/s and the controller's
    phase."""

    def __init__(self, steps: int, quiet: bool, source: Any) -> None:
        self.steps, self.quiet, self.source = steps, quiet, source
        self.live = sys.stdout.isatty() and not quiet
        self.last: Any = None
        self.held_out: float | None = None
        self.phase = "starting"
        self.bar: Any = None

    def _start_bar(self) -> None:
        """The bar, from the first phase after the roles are up (so its rate is the run's)."""
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar = False
        else:
            self.bar = tqdm(total=self.steps, unit="batch", dynamic_ncols=True, file=sys.stdout)

    def on_phase(self, phase: str) -> None:
        self.phase = phase
        if self.live and self.bar is None:
            self._start_bar()
        if self.bar:
            self.bar.set_description_str(phase, refresh=False)
        elif self.live:
            self.draw()

    def on_step(self, record: Any) -> None:
        self.last = record
        if record.accuracy is not None:
            self.held_out = record.accuracy
        if self.bar:
            self.bar.set_postfix_str(self.fields(record), refresh=False)
            self.bar.update(record.step + 1 - self.bar.n)
        elif self.live:
            self.draw()
        elif not self.quiet and (record.accuracy is not None or record.step == 0):
            print(self.line(), flush=True)

    def fields(self, r: Any) -> str:
        held = "  -  " if self.held_out is None else f"{self.held_out:5.3f}"
        per = self.source.tally.last
        parts = f" ({', '.join(f'{k} {v:.2f}' for k, v in per.items())})" if len(per) > 1 else ""
        return (
            f"reward {r.reward:5.3f}{parts} | held-out {held} | len {r.mean_length:5.1f} | "
            f"kl {r.kl:.4f} | entropy {r.entropy:4.2f} | clip {r.clip_frac:4.2f} | "
            f"{r.samples_per_s:5.0f} samples/s"
        )

    def line(self) -> str:
        r = self.last
        if r is None:
            return f"step    0/{self.steps} | {self.phase}"
        return f"step {r.step + 1:4d}/{self.steps} | {self.fields(r)} | {self.phase}"

    def draw(self) -> None:
        sys.stdout.write("\r\x1b[2K" + self.line())
        sys.stdout.flush()

    def close(self) -> None:
        if self.bar:
            self.bar.close()
        elif self.live:
            sys.stdout.write("\n")


def _train(args: argparse.Namespace) -> int:
    from orchestr.roles.rl import load_rl_config, plan_rl, run_rl

    try:
        config = load_rl_config(args.config, args.set)
        if args.resume and args.run_dir:
            raise orchestr.ConfigError("--resume names the run's folder: leave --run-dir out")
        # every check, before any process starts
        plan = plan_rl(config, args.resume or args.run_dir, resume=bool(args.resume))
    except orchestr.ConfigError as exc:
        print(f"orchestr rl train: {exc}", file=sys.stderr)
        return 2
    job = plan.job
    if args.check:
        print(f"{args.config}: ok; the run would write {plan.run_dir}")
        return 0
    print(
        f"RL on {config.model.path or 'the digit task'}: {job.mode}, {job.generators} "
        f"generator(s), {job.trainers} trainer(s), {job.rewards} reward worker(s); "
        f"{job.train.steps} batches of {job.train.prompts_per_step} prompts x "
        f"{job.train.group_size} samples -> {plan.run_dir}",
        flush=True,
    )
    progress = Progress(job.train.steps, args.quiet, plan.source)
    result: Any = None

    async def main(ctx: orchestr.JobContext) -> None:
        nonlocal result
        try:
            _, result, _ = await run_rl(
                ctx,
                config,
                progress.on_step,
                on_phase=progress.on_phase,
                run_dir=plan.run_dir,
                resume=bool(args.resume),
            )
        finally:
            progress.close()

    from ._main import run_on_cluster

    code = run_on_cluster(main, args, "rl train", plan.run_dir)
    if code:
        return code
    first, last = result.evals[0][1], result.evals[-1][1]
    failures = sum(n for causes in result.rewards.values() for n in causes.values())
    print(
        f"done in {result.wall_s:.1f} s: last-10 reward {result.mean_reward(10):.3f}, held-out "
        f"{first:.3f} -> {last:.3f}" + (f", {failures} reward calls failed" if failures else "")
    )
    written = sorted(os.listdir(plan.run_dir))
    print(f"wrote {plan.run_dir}/ ({', '.join(written)})")
    return 0


class LazyHelpParser(argparse.ArgumentParser):
    """A parser whose epilog is made when help is printed (``epilog_of``): the configs' help
    imports the RL package, and with it torch, which every other command does without."""

    epilog_of: Callable[[], str] | None = None

    def format_help(self) -> str:
        if self.epilog is None and self.epilog_of is not None:
            self.epilog = self.epilog_of()
        return super().format_help()


def add_parsers(sub: Any, state_dir_help: str) -> None:
    rl = sub.add_parser("rl", help="RL post-training of your own checkpoint, data and reward")
    rl_sub = rl.add_subparsers(dest="rl_command", required=True, parser_class=LazyHelpParser)
    from . import _sft

    _sft.add_parser(rl_sub, state_dir_help)
    train = rl_sub.add_parser(
        "train",
        help="train a checkpoint with GRPO (or RLOO, REINFORCE++) on a config file",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.epilog_of = config_help
    train.add_argument("config", help="the run's TOML file (see examples/rl/)")
    train.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a key of the file (the value read as TOML, else as text); repeatable",
    )
    train.add_argument("--run-dir", help="the run's folder (default: run.dir/run.name)")
    train.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="go on with the run in RUN_DIR (stopped or killed) from its last checkpoint",
    )
    train.add_argument("--check", action="store_true", help="check the config and stop")
    train.add_argument("--quiet", action="store_true", help="no progress lines")
    train.add_argument("--address", metavar="HOST:PORT", help="run on this cluster's head")
    train.add_argument("--state-dir", help=state_dir_help)
    train.set_defaults(func=_train)
