"""``orchestr rl sft CONFIG.toml``: supervised fine-tuning of a checkpoint on prompt and response
rows, with the trainer role RL uses, on the embedded cluster (or a running one), written to a
run folder whose ``model/`` an RL config's ``[model] path`` can name."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import orchestr

from ._rl import section_help

__all__ = ["add_parser", "sft_config_help"]

#: ``[run]``'s description for an SFT run (the RL config's section, less its checkpoint keys).
RUN_HELP = (
    "What the run writes: a folder under dir (named name, default the time and 'sft') with "
    "config.json, metrics.jsonl, summary.json and, when export is on, model/: the trained "
    "weights as a Hugging Face folder (model-NNNNN/ every export_every steps; 0: at the end "
    "only)."
)


def sft_config_help() -> str:
    """Every section and key of an SFT config with its default, and each section's docstring."""
    from orchestr.roles.rl import SFT_SECTIONS, SFTConfig

    lines = ["config file (TOML): sections and keys, with their defaults", ""]
    for name, cls in SFT_SECTIONS.items():
        if name == "run":
            lines.extend(section_help("[run]", cls, SFTConfig.RUN_KEYS, RUN_HELP))
        else:
            lines.extend(section_help(f"[{name}]", cls))
    return "\n".join(lines)


class Progress:
    """A line for the first step and each held-out evaluation, or one line redrawn in place on
    a terminal: step, the batch's loss, the held-out loss, the rate, tokens/s."""

    def __init__(self, steps: int, quiet: bool) -> None:
        self.steps, self.quiet = steps, quiet
        self.live = sys.stdout.isatty() and not quiet
        self.held_out: float | None = None

    def on_step(self, record: Any) -> None:
        if record.held_out is not None:
            self.held_out = record.held_out
        if self.live:
            sys.stdout.write("\r\x1b[2K" + self.line(record))
            sys.stdout.flush()
        elif not self.quiet and (record.held_out is not None or record.step == 0):
            print(self.line(record), flush=True)

    def line(self, r: Any) -> str:
        held = "  -  " if self.held_out is None else f"{self.held_out:6.3f}"
        return (
            f"step {r.step + 1:4d}/{self.steps} | loss {r.loss:6.3f} | held-out {held} | "
            f"lr {r.lr:.2e} | grad {r.grad_norm:6.3f} | {r.tokens_per_s:6.0f} tokens/s"
        )

    def close(self) -> None:
        if self.live:
            sys.stdout.write("\n")


def _sft(args: argparse.Namespace) -> int:
    from orchestr.roles.rl import load_sft_config, plan_sft, run_sft

    try:
        config = load_sft_config(args.config, args.set)
        plan = plan_sft(config, args.run_dir)  # every check, before any process starts
    except orchestr.ConfigError as exc:
        print(f"orchestr rl sft: {exc}", file=sys.stderr)
        return 2
    rows = (
        f"{len(plan.train)} training rows ({plan.train.tokens} response tokens), "
        f"{len(plan.held_out)} held out"
    )
    skipped = plan.train.too_long + plan.held_out.too_long
    if skipped:
        rows += f"; {skipped} rows longer than data.max_tokens left out"
    if args.check:
        print(f"{args.config}: ok; {rows}; the run would write {plan.run_dir}")
        return 0
    s = config.schedule
    print(
        f"SFT on {config.model.path}: {config.layout.trainers} trainer(s), {s.steps} steps of "
        f"{s.batch_size} rows; {rows} -> {plan.run_dir}",
        flush=True,
    )
    progress = Progress(s.steps, args.quiet)
    summary: dict[str, Any] = {}

    async def main(ctx: orchestr.JobContext) -> None:
        nonlocal summary
        try:
            _, _, summary = await run_sft(ctx, config, progress.on_step, run_dir=plan.run_dir)
        finally:
            progress.close()

    from ._main import run_on_cluster

    code = run_on_cluster(main, args, "rl sft", plan.run_dir)
    if code:
        return code
    print(
        f"done in {summary['wall_s']:.1f} s: held-out loss {summary['first_held_out']:.3f} -> "
        f"{summary['last_held_out']:.3f}, {summary['tokens_per_s']:.0f} tokens/s"
    )
    written = sorted(os.listdir(plan.run_dir))
    print(f"wrote {plan.run_dir}/ ({', '.join(written)})")
    return 0


def add_parser(rl_sub: Any, state_dir_help: str) -> None:
    """Add ``sft`` to the ``orchestr rl`` subcommands ``rl_sub``."""
    sft = rl_sub.add_parser(
        "sft",
        help="fine-tune a checkpoint on prompt and response rows (supervised), to start RL from",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sft.epilog_of = sft_config_help  # made when help is printed (it imports torch)
    sft.add_argument("config", help="the run's TOML file (see examples/rl/sft.toml)")
    sft.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a key of the file (the value read as TOML, else as text); repeatable",
    )
    sft.add_argument("--run-dir", help="the run's folder (default: run.dir/run.name)")
    sft.add_argument("--check", action="store_true", help="check the config and rows and stop")
    sft.add_argument("--quiet", action="store_true", help="no progress lines")
    sft.add_argument("--address", metavar="HOST:PORT", help="run on this cluster's head")
    sft.add_argument("--state-dir", help=state_dir_help)
    sft.set_defaults(func=_sft)
