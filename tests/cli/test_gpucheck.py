"""``orchestr gpu-check`` on a machine without a GPU: every check is skipped, each saying why,
and the command succeeds; a check that fails makes it exit 1."""

from __future__ import annotations

import argparse
import subprocess

import pytest

from orchestr.cli import _gpucheck

from .test_run import ORCHESTR


def test_without_a_gpu_every_check_skips_saying_why() -> None:
    proc = subprocess.run([*ORCHESTR, "gpu-check"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = proc.stdout.splitlines()
    assert rows[0].split() == ["check", "result", "seconds", "detail"]
    assert [r.split()[0] for r in rows[1:]] == list(_gpucheck.CHECKS)
    assert all(r.split()[1] == "skip" and "no CUDA device" in r for r in rows[1:]), rows


def test_a_failed_check_is_reported_and_fails_the_command(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(folder: str) -> str:
        raise AssertionError("the tokens differ")

    monkeypatch.setitem(_gpucheck.CHECKS, "backend", broken)
    parser = argparse.ArgumentParser()
    _gpucheck.add_parsers(parser.add_subparsers())
    args = parser.parse_args(["gpu-check", "--only", "backend"])
    assert args.func(args) == 1
    out, err = capsys.readouterr()
    assert "backend" in out and "fail" in out and "the tokens differ" in out
    assert "failed: backend" in err
