"""`orchestr fabric show | plan | history` against a head daemon running the fabric manager
for a cabling plan; bad plans and bad demands refused with what is wrong."""

from __future__ import annotations

import json
import pathlib

from .test_cluster import ROOT, cli, state_dir  # noqa: F401 (a fixture)

PLAN = str(ROOT / "examples" / "fabric" / "small.toml")


def test_fabric_commands(state_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:  # noqa: F811
    sd = ["--state-dir", str(state_dir)]
    bad = tmp_path / "bad.toml"
    bad.write_text(
        (ROOT / "examples" / "fabric" / "small.toml").read_text()
        + '\n[[wires]]\nocs = "ocs0:9"\nport = "tor1:7"\ngbps = 400\n'
    )
    refused = cli("start", "--head", "--fabric", str(bad), *sd)
    assert refused.returncode == 1 and "ocs0" in refused.stderr and "radix" in refused.stderr
    started = cli("start", "--head", "--fabric", PLAN, *sd)
    assert started.returncode == 0, started.stderr

    shown = json.loads(cli("fabric", "show", "--json", *sd).stdout)
    assert shown["hosts"] == 4 and shown["endpoints"] == ["agg0", "tor0", "tor1"]
    assert shown["ocs"][0]["circuits"] == []
    dry = cli("fabric", "plan", "--demand", "tor0:tor1:5e11", "--json", *sd)
    assert dry.returncode == 0, dry.stderr
    planned = json.loads(dry.stdout)
    assert planned["commit"] and planned["add"] == [["tor0", "tor1", 1]]
    assert json.loads(cli("fabric", "history", "--json", *sd).stdout) == []  # a dry run
    applied = cli("fabric", "plan", "--apply", "--demand", "tor0:tor1:5e11", *sd)
    assert applied.returncode == 0 and "applied" in applied.stdout, applied.stderr
    (record,) = json.loads(cli("fabric", "history", "--json", *sd).stdout)
    assert record["status"] == "applied" and record["add"] == [["tor0", "tor1", 1]]
    assert [
        c[2:] for c in json.loads(cli("fabric", "show", "--json", *sd).stdout)["ocs"][0]["circuits"]
    ] == [["tor0", "tor1"]]
    text = cli("fabric", "show", *sd).stdout
    assert "tor0 <-> tor1" in text

    wrong = cli("fabric", "plan", "--demand", "tor0-tor1", *sd)
    assert wrong.returncode == 1 and "SRC:DST:BYTES" in wrong.stderr
    unknown = cli("fabric", "plan", "--demand", "tor0:core7:1e9", *sd)
    assert unknown.returncode == 1 and "switches an OCS reaches" in unknown.stderr


def test_a_head_without_a_fabric_says_so(state_dir: pathlib.Path) -> None:  # noqa: F811
    sd = ["--state-dir", str(state_dir)]
    assert cli("start", "--head", *sd).returncode == 0
    shown = cli("fabric", "show", *sd)
    assert shown.returncode == 1 and "runs no fabric manager" in shown.stderr
