"""The simulator's L2 benches side by side with the real runs: each metric's real median,
min and max, the simulated value and its signed error, as a JSON entry and a printed table
(``bench/sim_generation.py``, ``bench/sim_serving.py``, ``bench/sim_fabric.py``)."""

from __future__ import annotations

import statistics
from typing import Any


def compare(runs: list[dict[str, float]], sim: dict[str, float], digits: int = 3) -> dict[str, Any]:
    """The real runs' median, min and max of each of ``sim``'s metrics, ``sim``'s, and its
    signed error against the median (``None`` where the median is 0), rounded to ``digits``."""
    entry: dict[str, Any] = {"real": {}, "sim": {}, "error": {}}
    for metric in sim:
        values = [r[metric] for r in runs]
        med = statistics.median(values)
        entry["real"][metric] = {"median": round(med, digits), "min": round(min(values), digits),
                                 "max": round(max(values), digits),
                                 "values": [round(v, digits) for v in values]}  # fmt: skip
        entry["sim"][metric] = round(sim[metric], digits)
        entry["error"][metric] = round(sim[metric] / med - 1, 4) if med else None
    return entry


def table(out: dict[str, Any], width: int) -> None:
    """Print :func:`compare`'s entries in ``out``, a row per entry and metric."""
    print(f"{'workload':<{width}}{'metric':<24}{'real p50':>10}{'real min-max':>22}{'sim':>10}"
          f"{'error':>9}")  # fmt: skip
    for name, entry in out.items():
        if not isinstance(entry, dict) or "real" not in entry:
            continue
        for metric, r in entry["real"].items():
            spread = f"{r['min']}-{r['max']}"
            err = entry["error"][metric]
            shown = "-" if err is None else f"{err:+.1%}"
            print(f"{name:<{width}}{metric:<24}{r['median']:>10}{spread:>22}"
                  f"{entry['sim'][metric]:>10}{shown:>9}")  # fmt: skip
