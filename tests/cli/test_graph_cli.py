"""``orchestr graph job.py``: a job's first graph, shown without running anything."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
ORCHESTR = [sys.executable, "-m", "orchestr.cli", "graph"]


def _graph(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*ORCHESTR, *args],
        cwd=ROOT,
        env=dict(os.environ, **env),
        capture_output=True,
        text=True,
        timeout=60,
    )


def _job(tmp_path: pathlib.Path, name: str, body: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text("import orchestr as oc\n" + textwrap.dedent(body))
    return str(path)


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz is not installed")
def test_graph_prints_and_draws_the_example(tmp_path: pathlib.Path) -> None:
    proc = _graph("examples/pipeline.py", "--out", str(tmp_path / "drawn"))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("graph 'rl': 4 node(s), 1 output(s)\n")
    assert "generate  map Generator.generate on 2 member(s) <- prompts" in out
    assert "<- generate.batch(count=8, timeout_s=0.05)" in out
    assert "train     fanout Trainer.step on 2 member(s)" in out
    dot, svg = tmp_path / "drawn" / "rl.dot", tmp_path / "drawn" / "rl.svg"
    assert f"wrote {dot}\nwrote {svg}\n" in out
    assert '"generate" -> "score"' in dot.read_text()
    assert "<svg" in svg.read_text() and "Trainer.step" in svg.read_text()

    as_json = _graph("examples/pipeline.py", "--out", str(tmp_path), "--json")
    assert as_json.returncode == 0, as_json.stderr
    data = json.loads(as_json.stdout)
    assert [n["name"] for n in data["graph"]["nodes"]] == ["prompts", "generate", "score", "train"]
    assert data["graph"]["nodes"][2]["staleness"] == {"eta": 2, "policy": "drop"}
    assert data["svg"] == str(tmp_path / "rl.svg")


def test_graph_without_graphviz_writes_the_dot_file_and_says_so(tmp_path: pathlib.Path) -> None:
    proc = _graph("examples/pipeline.py", "--out", str(tmp_path), PATH=str(tmp_path))
    assert proc.returncode == 1
    assert "`dot` is not on PATH" in proc.stderr and "install Graphviz" in proc.stderr
    assert proc.stdout.startswith("graph 'rl'") and (tmp_path / "rl.dot").exists()
    assert not (tmp_path / "rl.svg").exists()


def test_bad_jobs_get_clear_errors(tmp_path: pathlib.Path) -> None:
    missing = _graph(str(tmp_path / "missing.py"))
    assert missing.returncode == 2 and "no job file" in missing.stderr
    no_main = _graph(_job(tmp_path, "no_main", "x = 1\n"))
    assert no_main.returncode == 2 and "must define `async def main(ctx)`" in no_main.stderr
    broken = _graph(_job(tmp_path, "broken", "import no_such_module_here\n"))
    assert broken.returncode == 2 and "No module named 'no_such_module_here'" in broken.stderr

    no_graph = _graph(_job(tmp_path, "no_graph", "async def main(ctx):\n    return 1\n"))
    assert no_graph.returncode == 1 and "ended without running a graph" in no_graph.stderr

    calls_first = _job(
        tmp_path,
        "calls_first",
        """
        class Echo(oc.Actor):
            @oc.endpoint
            def echo(self, x):
                return x

        async def main(ctx):
            mesh = await ctx.spawn(Echo, n=2)
            await mesh.echo.call(1)
        """,
    )
    proc = _graph(calls_first)
    assert proc.returncode == 1
    assert "calls Echo.echo before its first graph" in proc.stderr
    assert "cannot run" in proc.stderr

    fails = _graph(_job(tmp_path, "fails", "async def main(ctx):\n    raise KeyError('k')\n"))
    assert fails.returncode == 1
    assert "the job failed before its first graph: KeyError: 'k'" in fails.stderr
