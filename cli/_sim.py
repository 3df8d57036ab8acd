"""``orchestr sim``: the simulator's commands (``calibrate`` times the real engine here and
writes a step-time profile; ``calibrate-rl`` times the RL job's roles and writes their costs;
``run`` runs a scenario file)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import orchestr as oc

from ._models import _positive

__all__ = ["add_parsers"]


def _pairs(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        b, _, c = part.partition("x")
        if not (b.isdigit() and c.isdigit() and int(b) > 0 and int(c) > 0):
            raise argparse.ArgumentTypeError(
                f"expected BATCHxCONTEXT pairs like 8x64,32x32; got {text!r}"
            )
        out.append((int(b), int(c)))
    return out


def _triples(text: str) -> list[tuple[int, int, int]]:
    if text == "none":
        return []
    out = []
    for part in text.split(","):
        fields = part.split("x")
        if len(fields) != 3 or not all(f.isdigit() and int(f) > 0 for f in fields):
            raise argparse.ArgumentTypeError(
                f"expected BATCHxCONTEXTxPROMPT triples like 4x128x256 (or none); got {text!r}"
            )
        b, c, p = map(int, fields)
        out.append((b, c, p))
    return out


def _lengths(text: str) -> list[int]:
    parts = text.split(",")
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected prompt lengths like 32,128,512; got {text!r}")
    return [int(p) for p in parts]


def _kept(where: str, args: argparse.Namespace) -> bool:
    """Whether ``args.out`` exists and is to be kept (no ``--force``), said on stderr."""
    if os.path.exists(args.out) and not args.force:
        print(f"{where}: {args.out} exists (--force to replace it)", file=sys.stderr)
        return True
    return False


def _write(path: str, profile: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(profile, f, indent=1)
        f.write("\n")


def calibrate(args: argparse.Namespace) -> int:
    from orchestr.sim._calibrate import calibrate as run

    where = "orchestr sim calibrate"
    if _kept(where, args):
        return 2
    try:
        model, report = run(
            args.model_dir,
            prefills=args.prefills,
            decodes=args.decodes,
            mixes=args.mixes,
            decode_steps=args.decode_steps,
            repeats=args.repeats,
            torch_threads=args.torch_threads,
        )
    except (oc.ConfigError, ValueError) as exc:
        print(f"{where}: {exc}", file=sys.stderr)
        return 2
    _write(args.out, {"step_time": model.to_json(), "calibration": report})
    print(
        f"wrote {args.out}: base {model.base_s * 1e3:.3f} ms, {model.prefill_token_s * 1e6:.2f} "
        f"us per prompt token, {model.decode_s * 1e6:.2f} us per decode; fit error median "
        f"{report['median_abs_error']:.1%}, largest {report['max_abs_error']:.1%} over "
        f"{len(report['samples'])} steps"
    )
    return 0


def calibrate_rl(args: argparse.Namespace) -> int:
    from orchestr.roles.rl import DEMO_CONFIG, SMALL_CONFIG
    from orchestr.sim._calibrate_rl import calibrate_rl as run

    where = "orchestr sim calibrate-rl"
    if _kept(where, args):
        return 2
    train = DEMO_CONFIG if args.config == "demo" else SMALL_CONFIG
    try:
        costs, report = run(train, steps=args.steps, torch_threads=args.torch_threads)
    except (oc.ConfigError, ValueError) as exc:
        print(f"{where}: {exc}", file=sys.stderr)
        return 2
    _write(args.out, {**costs.to_json(), "config": args.config, "calibration": report})
    print(
        f"wrote {args.out}: a generation step {costs.generation.base_s * 1e3:.3f} ms + "
        f"{costs.generation.prefill_token_s * 1e6:.2f} us a token (fit error median "
        f"{report['generation_median_abs_error']:.1%}); a trainer step "
        f"{costs.train_step_s * 1e3:.1f} ms + {costs.train_token_s * 1e6:.1f} us a token; a "
        f"weight load {costs.load_s * 1e3:.2f} ms; on {report['machine']}"
    )
    return 0


def run(args: argparse.Namespace) -> int:
    from orchestr.sim._scenario import load_scenario, run_scenario

    where = "orchestr sim run"
    try:
        scenario = load_scenario(args.scenario)
        out = args.out or os.path.splitext(os.path.basename(args.scenario))[0] + "-sim"
        metrics = run_scenario(scenario, out)
    except (oc.ConfigError, oc.PlacementError) as exc:
        print(f"{where}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(metrics, default=str))
        return 0
    print(
        f"{scenario.kind} scenario {args.scenario}: metrics in {out}/metrics.json, "
        f"the timeline in {out}/trace.json (open it in ui.perfetto.dev)"
    )
    for key, value in metrics.items():
        if isinstance(value, float):
            print(f"  {key:24} {value:.6g}")
        elif isinstance(value, int | str):
            print(f"  {key:24} {value}")
    return 0


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("sim", help="the simulator: orchestr's control code on virtual time")
    cmds = p.add_subparsers(dest="sim_command", required=True)
    c = cmds.add_parser(
        "calibrate",
        help="time the paged engine's steps on a checkpoint here and write a step-time profile",
    )
    c.add_argument("model_dir", help="a model folder (orchestr model make-tiny writes one)")
    c.add_argument("--out", required=True, help="the profile to write (JSON)")
    c.add_argument("--force", action="store_true", help="replace --out if it exists")
    c.add_argument(
        "--prefills",
        type=_lengths,
        default=[32, 128, 512],
        help="prompt lengths of the timed prefill steps (default 32,128,512)",
    )
    c.add_argument(
        "--decodes",
        type=_pairs,
        default=[(1, 64), (8, 64), (8, 256), (16, 128), (32, 32), (32, 64)],
        help="BATCHxCONTEXT decode runs (default 1x64,8x64,8x256,16x128,32x32,32x64)",
    )
    c.add_argument(
        "--mixes",
        type=_triples,
        default=[(2, 256, 384), (4, 128, 256), (8, 64, 512)],
        help="BATCHxCONTEXTxPROMPT decode runs a prompt joins after 3 decode steps, "
        "or none (default 2x256x384,4x128x256,8x64x512)",
    )
    c.add_argument(
        "--decode-steps",
        type=_positive,
        default=16,
        help="decode steps per run (at least 5 with --mixes)",
    )
    c.add_argument("--repeats", type=_positive, default=3, help="timed runs per step (median)")
    c.add_argument("--torch-threads", type=_positive, default=None)
    c.set_defaults(func=calibrate)
    q = cmds.add_parser(
        "calibrate-rl",
        help="time the GRPO job's roles here (generation, training, scoring, weight loads) "
        "and write their costs",
    )
    q.add_argument("--out", required=True, help="the profile to write (JSON)")
    q.add_argument("--force", action="store_true", help="replace --out if it exists")
    q.add_argument(
        "--config",
        choices=("small", "demo"),
        default="small",
        help="the run to calibrate: SMALL_CONFIG or DEMO_CONFIG (default small)",
    )
    q.add_argument("--steps", type=_positive, default=2, help="batches timed (default 2)")
    q.add_argument(
        "--torch-threads",
        type=_positive,
        default=1,
        help="torch threads, as each role runs (default 1)",
    )
    q.set_defaults(func=calibrate_rl)
    r = cmds.add_parser(
        "run", help="run a scenario (TOML): metrics, a Perfetto trace of the simulated timeline"
    )
    r.add_argument("scenario", help="the scenario file (see examples/sim/)")
    r.add_argument("--out", help="the folder to write (default: SCENARIO-sim beside you)")
    r.add_argument("--json", action="store_true", help="print the metrics as one JSON line")
    r.set_defaults(func=run)
