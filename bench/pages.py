"""Writes each benchmark's page, ``docs/bench/<name>.md``, from its history,
``docs/bench/<name>.json``, and the index of them all, ``docs/bench/README.md``.

    python bench/pages.py [NAME ...] [--check]

With no names, every history in ``docs/bench``. ``--check`` writes nothing and fails (exit 1)
naming each page that differs from what its history gives. ``bench/_record.py`` appends a run
to a history (``python bench/<name>.py --record``) and calls this.

A history is a header and its runs. The header holds the text that is not a measurement:

- ``name``, ``title``; ``about``: one paragraph on what the benchmark measures; ``usage``: how
  to run it;
- ``figures`` (optional): ``{"key or glob": "label"}``, which figures the table shows and in
  what order (all, by default);
- ``ratios`` (optional): ``[{"label": ..., "of": key, "to": key}]``, a figure's median over
  another's (a peer's, a limit's), per run; with ``"written": key``, a run that has that figure
  (a ratio a past run's text gave) shows it instead;
- ``sections`` (optional): ``[{"title": ..., "text": ...}]``, the reading of the figures;
- ``did_not_help``: what was tried and did not help, one item each.

Each run has its ``date``, ``commit``, ``machine``, ``versions``, ``command``, ``figures`` and
an optional ``note``; a run carried over from text written before the histories existed names
that text in ``source``. A figure is ``{"values": [...]}`` (one per repeat: the table shows
their median and min-max), ``{"median": m, "min": a, "max": b, "n": repeats}`` (any of
them, as written) or ``{"value": v}``; what a run did not give shows as a dash.
"""

from __future__ import annotations

import fnmatch
import json
import re
import statistics
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parents[1] / "docs" / "bench"
DASH = "\u2014"  # what a run did not give
TO = "\u2013"  # between a minimum and a maximum

HOW_TO = """\
Each benchmark in `bench/` runs from the repository's root with the project's venv
(`.venv/bin/python bench/kv_store.py`; those that make network namespaces under `sudo`, and
each page gives its command and options) and prints the machine, the versions and its figures
(medians over repeats, with min and max), then one JSON line. Add `--record`
(`.venv/bin/python bench/kv_store.py --record`) to append the run to its history,
`docs/bench/<name>.json` (the date, the machine, the versions, orchestr's commit, the command
line and every figure with its repeats), and to write its page again. The pages are never
edited by hand: `python bench/pages.py` writes every page from its history (`--check` fails if
one differs, as `tests/test_bench_pages.py` does), and the text of a page that is not a
measurement (what the benchmark measures, how to read it, what did not help) is edited in the
header of its JSON file. Histories started before the flag existed carry the figures that the
guide and these pages had written, each dated by the commit that wrote it; where a past run
gave only a median or a range, the table shows a dash for what it lacks.
"""


# -- numbers ---------------------------------------------------------------------------------
def num(x: float) -> str:
    """A number as written: ints as they are, floats without the noise of arithmetic."""
    if isinstance(x, int):
        return str(x)
    shown = float(f"{x:.10g}")
    return str(int(shown)) if shown.is_integer() and abs(shown) < 1e15 else repr(shown)


def stats(figure: Mapping[str, Any]) -> tuple[float | None, float | None, float | None, int]:
    """(median, min, max, repeats) of a figure; ``None`` where it does not say."""
    values = figure.get("values")
    if values:
        return statistics.median(values), min(values), max(values), len(values)
    if "value" in figure:
        return figure["value"], None, None, 1
    return figure.get("median"), figure.get("min"), figure.get("max"), figure.get("n", 0)


def span(lo: float | None, hi: float | None) -> str:
    if lo is None and hi is None:
        return DASH
    return f"{DASH if lo is None else num(lo)}{TO}{DASH if hi is None else num(hi)}"


def when(run: Mapping[str, Any]) -> str:
    """A run's date and time (UTC) to the minute, as the tables show it."""
    return str(run["date"])[:16].replace("T", " ")


def cell(text: object) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


# -- the parts of a page ---------------------------------------------------------------------
def shown(data: Mapping[str, Any], run: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The (key, label) of each figure of ``run`` that the page shows, in the run's order."""
    wanted: Mapping[str, str] = data.get("figures") or {"*": ""}
    out = []
    for key in run.get("figures", {}):
        if key in wanted:
            out.append((key, wanted[key]))
        elif any(fnmatch.fnmatchcase(key, pattern) for pattern in wanted):
            out.append((key, ""))
    return out


def describe(values: Mapping[str, Any], order: tuple[str, ...]) -> str:
    """A machine's or versions' dict as one line, known keys first."""
    parts = []
    for key in [*order, *sorted(k for k in values if k not in order)]:
        if key not in values or values[key] in (None, "", []):
            continue
        v = values[key]
        if key == "cores":
            parts.append(f"{v} core" + ("s" if v != 1 else ""))
        elif key == "memory_gib":
            parts.append(f"{v} GiB memory")
        elif key == "gpus":
            parts.append("GPU: " + ", ".join(v))
        elif key == "load":
            parts.append("load " + " ".join(num(x) for x in v))
        elif key in ("cpu", "note"):
            parts.append(str(v))
        else:
            parts.append(f"{key} {v}")
    return ", ".join(parts) or DASH


def machine_line(run: Mapping[str, Any]) -> str:
    m = run.get("machine") or {}
    line = describe(m, ("cpu", "cores", "memory_gib", "gpus", "load", "os", "note"))
    return line if m.get("gpus") != [] else f"{line}, no GPU"


def versions_line(run: Mapping[str, Any]) -> str:
    return describe(run.get("versions") or {}, ("python", "orchestr", "torch", "note"))


def commit_of(run: Mapping[str, Any]) -> str:
    commit = run.get("commit")
    if not commit:
        return ""
    return f"commit `{commit}`" + (" with changes not yet committed" if run.get("dirty") else "")


def runs_table(data: Mapping[str, Any], runs: list[Mapping[str, Any]]) -> list[str]:
    lines = [f"| date | figure | median | min{TO}max | repeats |", "|---|---|---|---|---|"]
    for run in runs:
        for key, label in shown(data, run):
            median, lo, hi, n = stats(run["figures"][key])
            name = f"{label} (`{key}`)" if label else f"`{key}`"
            count = str(n) if n else DASH
            row = [when(run), cell(name), DASH if median is None else num(median)]
            lines.append("| " + " | ".join([*row, span(lo, hi), count]) + " |")
    return lines


def pairs(ratio: Mapping[str, str], figures: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(numerator, denominator, what ``*`` stood for) of a ratio in one run's figures. A ``*``
    in ``of`` or ``to`` matches the same text in both (``orchestr.*`` over ``ray.*``)."""
    of, to = ratio["of"], ratio["to"]
    if "*" not in of and "*" not in to:
        return [(of, to, "")]
    star, other = (of, to) if "*" in of else (to, of)
    pattern = re.compile(re.escape(star).replace(r"\*", "(.+)", 1) + "$")
    out = []
    for key in figures:
        found = pattern.match(key)
        if found:
            there = other.replace("*", found[1], 1)
            out.append((key, there, found[1]) if star == of else (there, key, found[1]))
    return out


def ratio_rows(data: Mapping[str, Any], runs: list[Mapping[str, Any]]) -> list[str]:
    rows = []
    for run in runs:
        figures = run.get("figures", {})
        for ratio in data.get("ratios", []):
            written = figures.get(ratio.get("written", ""))
            if written:  # a past run's ratio as its text gave it, from figures since rounded
                value, how = stats(written)[0], f"`{ratio['written']}`, as written"
                if value is not None:
                    rows.append(f"| {when(run)} | {cell(ratio['label'])} | {num(value)}x | {how} |")
                continue
            for of, to, tail in pairs(ratio, figures):
                if of == to or of not in figures or to not in figures:
                    continue
                top, bottom = stats(figures[of])[0], stats(figures[to])[0]
                if top is None or not bottom:
                    continue
                label = cell(ratio["label"] + (f": {tail}" if tail else ""))
                how = f"`{of}` / `{to}`"
                rows.append(f"| {when(run)} | {label} | {top / bottom:.3g}x | {how} |")
    if not rows:
        return []
    return [
        "## Ratios",
        "",
        "| date | ratio | median over median | of |",
        "|---|---|---|---|",
        *rows,
        "",
    ]


def run_items(runs: list[Mapping[str, Any]]) -> list[str]:
    lines = []
    for run in runs:
        head = f"- **{run['date']}**"
        commit = commit_of(run)
        if commit:
            head += f", {commit}"
        if run.get("command"):
            head += f": `{run['command']}`"
        lines.append(head)
        lines.append(f"  - Machine: {machine_line(run)}.")
        lines.append(f"  - Versions: {versions_line(run)}.")
        if run.get("note"):
            lines.append(f"  - {' '.join(run['note'].split())}")
        if run.get("source"):
            lines.append(f"  - Carried over from {run['source']}.")
    return lines


def render(data: Mapping[str, Any]) -> str:
    """The page of one history."""
    name = data["name"]
    runs = sorted(data.get("runs", []), key=lambda r: r["date"], reverse=True)
    out = [
        f"<!-- Generated by `python bench/pages.py {name}` from {name}.json: edit the JSON "
        "(its header for the text), never this page. -->",
        f"# {data['title']}",
        "",
        data.get("about", "").strip(),
        "",
        f"Run it: `{data.get('usage') or f'python bench/{name}.py'}`; add `--record` to append "
        f"the run to [{name}.json]({name}.json) and write this page again.",
        "",
    ]
    if runs:
        latest = runs[0]
        command = f"`{latest['command']}`" if latest.get("command") else DASH
        out += [
            "## Latest run",
            "",
            f"{latest['date']}" + (f", {commit_of(latest)}" if latest.get("commit") else "") + ".",
            "",
            *([f"Carried over from {latest['source']}.", ""] if latest.get("source") else []),
            f"- Command: {command}",
            f"- Machine: {machine_line(latest)}",
            f"- Versions: {versions_line(latest)}",
            "",
        ]
    out += ["## Runs", ""]
    out += [*runs_table(data, runs), ""] if runs else ["No run recorded yet.", ""]
    out += ratio_rows(data, runs)
    for section in data.get("sections", []):
        out += [f"## {section['title']}", "", section["text"].strip(), ""]
    out += ["## What did not help", ""]
    tried = [f"- {' '.join(x.split())}" for x in data.get("did_not_help", [])]
    out += tried or ["Nothing recorded."]
    out.append("")
    if runs:
        out += ["## Each run", "", *run_items(runs), ""]
    return "\n".join(out)


def render_index(histories: list[Mapping[str, Any]]) -> str:
    out = [
        "<!-- Generated by `python bench/pages.py` from the *.json histories here: edit "
        "bench/pages.py or a history, never this page. -->",
        "# Benchmarks",
        "",
        HOW_TO.strip(),
        "",
        "| benchmark | script | runs | latest |",
        "|---|---|---|---|",
    ]
    for data in sorted(histories, key=lambda d: d["name"]):
        runs = data.get("runs", [])
        latest = max((r["date"][:10] for r in runs), default=DASH)
        link = f"[{cell(data['title'])}]({data['name']}.md)"
        out.append(f"| {link} | `bench/{data['name']}.py` | {len(runs)} | {latest} |")
    return "\n".join(out) + "\n"


# -- files -----------------------------------------------------------------------------------
def load(name: str, docs: Path = DOCS) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((docs / f"{name}.json").read_text())
    return data


def names(docs: Path = DOCS) -> list[str]:
    return sorted(p.stem for p in docs.glob("*.json"))


def expected(docs: Path = DOCS, only: list[str] | None = None) -> dict[Path, str]:
    """Each page's path and the text its history gives; the index among them."""
    histories = {name: load(name, docs) for name in names(docs)}
    out = {docs / f"{n}.md": render(histories[n]) for n in (only or histories)}
    out[docs / "README.md"] = render_index(list(histories.values()))
    return out


def write_page(name: str, docs: Path = DOCS) -> Path:
    """Write ``name``'s page and the index; the page's path."""
    for path, text in expected(docs, [name]).items():
        path.write_text(text)
    return docs / f"{name}.md"


def main(argv: list[str]) -> int:
    check = "--check" in argv
    only = [a for a in argv if a != "--check"] or None
    unknown = sorted(set(only or []) - set(names()))
    if unknown:
        print(f"no history docs/bench/<name>.json for {', '.join(unknown)}", file=sys.stderr)
        return 2
    stale = []
    for path, text in expected(DOCS, only).items():
        if path.exists() and path.read_text() == text:
            continue
        stale.append(path)
        if not check:
            path.write_text(text)
    for path in stale:
        verb = "differs from its history" if check else "written"
        print(f"{path.relative_to(DOCS.parents[1])}: {verb}", file=sys.stderr)
    return 1 if check and stale else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
