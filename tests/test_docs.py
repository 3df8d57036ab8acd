"""The code examples of README.md and docs/guide/*.md run.

Every fenced ``python`` block runs in a process of its own, with this interpreter, from a
temporary folder, and must exit 0 with no traceback. A block that defines a job's
``async def main(ctx)`` without running it is a job file, and runs as the README says:
``orchestr run example.py``.

A block that cannot run here (a fragment of a job's body, one that needs a GPU, a running
server or a model download) says so, and why, on the line before its fence::

    <!-- not run: a fragment: ctx and the meshes come from a job's main -->

Such a block is still checked: it parses (top-level ``await`` allowed, as in a job's body),
and every name it imports from orchestr, and every ``oc.NAME`` it uses, exists.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]
TIMEOUT_S = 45

_FENCE = re.compile(r"^\s*(`{3,})\s*([\w+-]*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*not run:(?P<reason>.*?)-->\s*$")
_ANY_MARKER = re.compile(r"<!--\s*not[ -]run", re.IGNORECASE)


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    code: str
    reason: str | None  # why it is not run; None: it runs

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def is_job(self) -> bool:
        """A job file: an ``async def main(ctx)`` that the block does not run itself."""
        tree = ast.parse(self.code)
        has_main = any(
            isinstance(n, ast.AsyncFunctionDef) and n.name == "main" and n.args.args
            for n in tree.body
        )
        return has_main and "run(main" not in self.code


def parse(page: Path) -> tuple[list[Block], list[str]]:
    """The page's python blocks, and what is wrong with its markers."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    problems: list[str] = []
    marked: set[int] = set()  # markers' line indexes that precede a python block
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        ticks, lang = m.groups()
        end = i + 1
        while end < len(lines) and lines[end].strip() != ticks:
            end += 1
        if lang == "python":
            prev = i - 1
            while prev >= 0 and not lines[prev].strip():
                prev -= 1
            reason = None
            marker = _MARKER.match(lines[prev]) if prev >= 0 else None
            if marker:
                marked.add(prev)
                reason = marker["reason"].strip()
            code = textwrap.dedent("\n".join(lines[i + 1 : end])) + "\n"
            blocks.append(Block(page, i + 1, code, reason))
        i = end + 1
    for n, text in enumerate(lines):
        where = f"{page.relative_to(ROOT)}:{n + 1}"
        if not _ANY_MARKER.search(text):
            continue
        marker = _MARKER.match(text)
        if marker is None:
            problems.append(f"{where}: write a marker as `<!-- not run: REASON -->`: {text!r}")
        elif len(marker["reason"].split()) < 2:
            problems.append(f"{where}: a marker says why the block cannot run here: {text!r}")
        elif n not in marked:
            problems.append(f"{where}: a marker stands right before a ```python block")
    return blocks, problems


BLOCKS = [b for page in PAGES for b in parse(page)[0]]
RUNNABLE = [b for b in BLOCKS if b.reason is None]


def test_the_pages_have_examples_and_well_formed_markers() -> None:
    assert len(PAGES) > 10 and RUNNABLE, "no pages or no runnable examples found"
    problems = [p for page in PAGES for p in parse(page)[1]]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: b.name)
def test_example_runs(block: Block, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    file = work / "example.py"
    file.write_text(block.code, encoding="utf-8")
    if block.is_job:
        cmd = [sys.executable, "-m", "orchestr.cli", "run", str(file)]
    else:
        cmd = [sys.executable, str(file)]
    # an embedded cluster of its own, never a cluster this machine may be running
    env = {k: v for k, v in os.environ.items() if k not in ("ORCHESTR_ADDRESS", "ORCHESTR_TOKEN")}
    env["ORCHESTR_STATE_DIR"] = str(tmp_path / "state")
    try:
        done = subprocess.run(
            cmd, cwd=work, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{block.name} ran past {TIMEOUT_S} s: {exc.stderr!r}")
    out = f"{block.name} ({' '.join(cmd[1:])}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert done.returncode == 0, out
    assert "Traceback" not in done.stderr, out


def _api_names(block: Block) -> list[tuple[str, str | None]]:
    """(module, name) pairs the block takes from orchestr; ``oc`` is ``import orchestr as oc``."""
    flags = ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    tree = compile(block.code, block.name, "exec", flags=flags)
    names: list[tuple[str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "orchestr":
            names += [(node.module or "", a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            names += [(a.name, None) for a in node.names if a.name.split(".")[0] == "orchestr"]
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "oc"
        ):
            names.append(("orchestr", node.attr))
    return names


_CHECK = """
import importlib, json, sys
missing = []
for block, module, name in json.load(sys.stdin):
    try:
        found = importlib.import_module(module)
        if name is not None:
            getattr(found, name)
    except (ImportError, AttributeError) as exc:
        missing.append(f"{block}: {module}{'.' + name if name else ''}: {exc}")
print("\\n".join(missing))
"""


def test_examples_parse_and_name_real_api(tmp_path: Path) -> None:
    checks: list[list[str | None]] = []
    for block in BLOCKS:
        try:
            pairs = _api_names(block)
        except SyntaxError as exc:
            pytest.fail(f"{block.name} does not parse: {exc}")
        checks += [[block.name, module, name] for module, name in sorted(set(pairs), key=str)]
    done = subprocess.run(
        [sys.executable, "-c", _CHECK],
        input=json.dumps(checks),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr
    assert not done.stdout.strip(), f"names the examples use that do not exist:\n{done.stdout}"
