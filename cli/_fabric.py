"""``orchestr fabric show | plan | history``: the cluster's fabric manager, through the head."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING, Any

from orchestr.errors import ConfigError, OrchestrError

from ._jobs import _call

if TYPE_CHECKING:
    from orchestr._control._head_client import HeadClient


def _demand(items: list[str]) -> list[tuple[str, str, float]]:
    """``SRC:DST:BYTES`` items (switch names, bytes as a number such as 5e9)."""
    out = []
    for item in items:
        parts = item.split(":")
        try:
            if len(parts) != 3 or not parts[0] or not parts[1]:
                raise ValueError
            nbytes = float(parts[2])
            if not nbytes >= 0:
                raise ValueError
        except ValueError:
            raise ConfigError(
                f"--demand takes SRC:DST:BYTES (two switch names and bytes >= 0), got {item!r}"
            ) from None
        out.append((parts[0], parts[1], nbytes))
    return out


def fabric(args: argparse.Namespace) -> int:
    async def go(head: HeadClient) -> Any:
        if args.fabric_command == "show":
            return await head.fabric_show()
        if args.fabric_command == "history":
            return await head.fabric_history(args.limit)
        demand = _demand(args.demand)
        return await head.fabric_hint(args.phase, demand=demand, dry_run=not args.apply)

    try:
        if args.fabric_command == "plan" and not args.demand:
            raise ConfigError("say the phase's traffic with --demand SRC:DST:BYTES (repeatable)")
        result = _call(args, go)
    except OrchestrError as exc:
        print(f"orchestr fabric: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result))
    elif args.fabric_command == "show":
        _print_show(result)
    elif args.fabric_command == "history":
        for record in result:
            _print_record(record)
        if not result:
            print("no plans yet")
    else:
        _print_record(result)
    return 0


def _print_show(shown: dict[str, Any]) -> None:
    tiers = ", ".join(f"{n} {tier}" for tier, n in shown["switches"].items())
    print(
        f"{shown['hosts']} hosts, {shown['accelerators']} accelerators; switches: {tiers}; "
        f"generation {shown['generation']}"
    )
    for ocs in shown["ocs"]:
        print(f"  {ocs['name']}: radix {ocs['radix']}, {ocs['wired']} ports wired")
        for p, q, a, b in ocs["circuits"]:
            print(f"    circuit {p}-{q}: {a} <-> {b}")
        if not ocs["circuits"]:
            print("    no circuits")


def _print_record(r: dict[str, Any]) -> None:
    when = time.strftime("%H:%M:%S", time.localtime(r["at_unix"])) if "at_unix" in r else "plan"
    circuits = " ".join(f"+{a}<->{b}x{n}" for a, b, n in r["add"])
    circuits += "".join(f" -{a}<->{b}x{n}" for a, b, n in r["remove"])
    status = r.get("status", "commit" if r["commit"] else "no commit")
    print(
        f"{when}  {r.get('job_id', '-')}  {r['phase']}  {status}  "
        f"predicted {r['predicted_s_static']:.3g} s -> {r['predicted_s_with']:.3g} s "
        f"(cost {r['reconfig_cost_s']:.3g} s)  {circuits or 'no change'}"
    )
    print(f"    {r['reason']}")
    if r.get("timings"):
        steps = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in r["timings"].items())
        print(f"    {steps}")


def add_parsers(sub: Any, state_dir_help: str) -> None:
    p = sub.add_parser("fabric", help="the cluster's fabric manager: circuits, plans, history")
    cmds = p.add_subparsers(dest="fabric_command", required=True)
    for name, text in (
        ("show", "the fabric: its size, its OCS and their live circuits"),
        ("plan", "what the manager would do for some traffic (--apply: do it)"),
        ("history", "the plans the manager made, their decisions and timings"),
    ):
        c = cmds.add_parser(name, help=text)
        c.add_argument("--address", metavar="HOST:PORT", help="the head (default: as for run)")
        c.add_argument("--state-dir", help=state_dir_help)
        c.add_argument("--json", action="store_true", help="print JSON")
        if name == "plan":
            c.add_argument(
                "--demand",
                action="append",
                default=[],
                metavar="SRC:DST:BYTES",
                help="bytes from switch SRC to switch DST in the phase (repeatable)",
            )
            c.add_argument("--phase", default="cli", help="the phase's name (default: cli)")
            c.add_argument("--apply", action="store_true", help="apply the plan if worth it")
        if name == "history":
            c.add_argument("--limit", type=int, default=0, help="the last N plans (0: all kept)")
        c.set_defaults(func=fabric)
