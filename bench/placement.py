"""Expert placement modes against each other: how balanced each leaves the hosts and how many
experts each makes them load, when the load drifts.

    python bench/placement.py [--rounds 40] [--experts 16] [--replicas 32] [--hosts 8]

Each round draws a Zipf(s = 1.2) load over the experts of 4 layers (popularity in random
order, 10,000 tokens a layer), places it with ``eplb`` (the placement serving), lets the
popularity drift (``--drift`` random pairs of experts trade loads in each layer) and places the
new load twice: ``eplb`` from scratch and ``stable`` from the serving placement. Reported per
mode over all rounds: ``balancedness`` (mean over max tokens per host, summed over layers, as
:func:`orchestr.roles.experts.balancedness`), ``experts_moved`` (replicas a host must load,
:func:`orchestr.roles.experts.experts_moved`) and the share of all slots that is; plus the
serving placement's balancedness under the drifted load (``before``). Groups of 4 experts on 2
nodes, as DeepSeek's example has. One JSON line per drift.
"""

from __future__ import annotations

import argparse
import json
import random

from orchestr.roles.experts import balancedness, experts_moved, rebalance

LAYERS, GROUPS, NODES = 4, 4, 2


def zipf(rng: random.Random, experts: int, s: float, tokens: int = 10_000) -> list[float]:
    ranks = list(range(1, experts + 1))
    rng.shuffle(ranks)
    weights = [1.0 / r**s for r in ranks]
    total = sum(weights)
    return [tokens * w / total for w in weights]


def measure(args: argparse.Namespace, drift: int) -> dict[str, object]:
    rng = random.Random(args.seed)
    moved = {"eplb": 0, "stable": 0}
    balance = {"eplb": 0.0, "stable": 0.0, "before": 0.0}
    for _ in range(args.rounds):
        before = [zipf(rng, args.experts, 1.2) for _ in range(LAYERS)]
        after = [list(row) for row in before]
        for row in after:
            for _ in range(drift):
                i, j = rng.sample(range(args.experts), 2)
                row[i], row[j] = row[j], row[i]
        now = rebalance(before, args.replicas, GROUPS, NODES, args.hosts)
        balance["before"] += balancedness(now, after) / args.rounds
        for mode in moved:
            new = rebalance(after, args.replicas, GROUPS, NODES, args.hosts, mode=mode, current=now)
            moved[mode] += experts_moved(now, new)
            balance[mode] += balancedness(new, after) / args.rounds
    slots = args.rounds * LAYERS * args.replicas
    return {
        "drift_pairs": drift,
        "balancedness_before": round(balance["before"], 4),
        **{
            mode: {
                "balancedness": round(balance[mode], 4),
                "experts_moved": moved[mode],
                "moved_share": round(moved[mode] / slots, 4),
            }
            for mode in moved
        },
        "moved_ratio": round(moved["stable"] / max(moved["eplb"], 1), 3),
    }


def main() -> None:
    from _record import add_record_flag, record

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--replicas", type=int, default=32)
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--drift", type=int, nargs="+", default=[1, 3, 8])
    add_record_flag(parser)
    args = parser.parse_args()
    print(
        f"{'drift':>5} {'before':>7} {'eplb bal':>9} {'moved':>6} {'stable bal':>11} {'moved':>6}"
    )
    lines = []
    for drift in args.drift:
        row = measure(args, drift)
        e, s = row["eplb"], row["stable"]
        assert isinstance(e, dict) and isinstance(s, dict)
        print(
            f"{drift:>5} {row['balancedness_before']:>7} {e['balancedness']:>9} "
            f"{e['experts_moved']:>6} {s['balancedness']:>11} {s['experts_moved']:>6}"
        )
        lines.append(row)
    for row in lines:
        print(json.dumps(row))
    if args.record:
        record("placement", {f"drift_{row['drift_pairs']}": row for row in lines})


if __name__ == "__main__":
    main()
