"""A mutual-TLS cluster from the CLI: `orchestr start --tls-*`, clients with and without the
certificates in ORCHESTR_TLS_*, a job run over TLS, and where refusals are logged. Real daemons."""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from ..tlsutil import CertAuthority, TlsFiles
from .test_cluster import ROOT, cli, state_dir  # noqa: F401 (a fixture)

GRPC_LOGS_HANDSHAKES = os.environ.get("GRPC_VERBOSITY", "").upper() in ("", "INFO", "DEBUG")


def flags(files: TlsFiles) -> list[str]:
    return ["--tls-cert", str(files.cert), "--tls-key", str(files.key), "--tls-ca", str(files.ca)]


@pytest.mark.timeout(240)
def test_a_tls_cluster_serves_only_clients_with_its_certificates(
    state_dir: pathlib.Path,  # noqa: F811
    tmp_path: pathlib.Path,
) -> None:
    ca = CertAuthority(tmp_path / "ca")
    files = ca.issue("host")
    rogue = CertAuthority(tmp_path / "other", "another-ca").issue("rogue")
    folder = str(state_dir)

    partial = cli("start", "--head", "--state-dir", folder, "--tls-cert", str(files.cert))
    assert partial.returncode == 1
    assert "missing: ORCHESTR_TLS_KEY (--tls-key), ORCHESTR_TLS_CA" in partial.stderr

    head = cli("start", "--head", "--state-dir", folder, *flags(files))
    assert head.returncode == 0, head.stderr
    assert f"signed by {files.ca}" in head.stdout
    address = json.loads((state_dir / "head.json").read_text())["address"]

    plain_node = cli("start", "--address", address, "--state-dir", folder)
    assert plain_node.returncode == 1
    assert "requires mutual TLS and this client has none" in plain_node.stderr

    node = cli("start", "--address", address, "--state-dir", folder, *flags(files))
    assert node.returncode == 0, node.stderr

    status = cli("status", "--json", "--state-dir", folder, **files.env())
    assert status.returncode == 0, status.stderr
    assert [n["alive"] for n in json.loads(status.stdout)["nodes"]] == [True]

    plain = cli("status", "--state-dir", folder)
    assert plain.returncode == 1
    assert "AuthenticationError" in plain.stderr and "requires mutual TLS" in plain.stderr
    foreign = TlsFiles(rogue.cert, rogue.key, files.ca)
    refused = cli("status", "--state-dir", folder, **foreign.env())
    assert refused.returncode == 1
    assert "did not accept this client's certificate" in refused.stderr
    if GRPC_LOGS_HANDSHAKES:
        # gRPC core logs what it refused to the head's stderr, which `start` keeps in head.log
        head_log = (state_dir / "logs" / "head.log").read_text()
        assert "Handshake failed" in head_log
        assert "WRONG_VERSION_NUMBER" in head_log and "CERTIFICATE_VERIFY_FAILED" in head_log

    # a job whose calls (driver to worker, and worker to worker) ride TLS
    ran = cli("run", "--state-dir", folder, "examples/hello.py", **files.env())
    assert ran.returncode == 0, ran.stderr[-3000:]
    no_tls = cli("run", "--state-dir", folder, "examples/hello.py")
    assert no_tls.returncode == 1
    assert "requires mutual TLS" in no_tls.stderr and "Traceback" not in no_tls.stderr

    # a submitted job: the head runs its controller, which reaches the cluster over TLS too
    wd = tmp_path / "wd"
    wd.mkdir()
    (wd / "job.py").write_text((ROOT / "examples" / "hello.py").read_text())
    submitted = cli("submit", "--state-dir", folder, str(wd / "job.py"), **files.env())
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    assert "succeeded (exit code 0)" in submitted.stderr

    stopped = cli("stop", "--state-dir", folder)
    assert stopped.returncode == 0, stopped.stderr
    assert "stopped head" in stopped.stdout
