"""Test certificates made with the ``openssl`` command: a CA, leaf certificates it signs (usable
as server and as client, with IP SANs), and an unrelated second CA for refusal tests."""

from __future__ import annotations

import dataclasses
import pathlib
import shutil
import subprocess

import pytest

DAYS = "2"


@dataclasses.dataclass(frozen=True)
class TlsFiles:
    cert: pathlib.Path
    key: pathlib.Path
    ca: pathlib.Path

    def env(self) -> dict[str, str]:
        """As ``ORCHESTR_TLS_*`` variables."""
        return {
            "ORCHESTR_TLS_CERT": str(self.cert),
            "ORCHESTR_TLS_KEY": str(self.key),
            "ORCHESTR_TLS_CA": str(self.ca),
        }

    def settings(self) -> dict[str, str]:
        """As :class:`orchestr.Config` fields."""
        return {"tls_cert": str(self.cert), "tls_key": str(self.key), "tls_ca": str(self.ca)}


def _openssl(*args: str, cwd: pathlib.Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make test certificates")
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _new_key(name: str) -> list[str]:
    return ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", name]


class CertAuthority:
    """A self-signed CA in ``folder``; :meth:`issue` signs leaf certificates with it."""

    def __init__(self, folder: pathlib.Path, name: str = "orchestr-test-ca") -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.cert = folder / "ca.pem"
        self.key = folder / "ca.key"
        _openssl(
            "req",
            "-x509",
            *_new_key(self.key.name),
            "-out",
            self.cert.name,
            "-days",
            DAYS,
            "-subj",
            f"/CN={name}",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
            cwd=folder,
        )

    def issue(self, name: str, ips: tuple[str, ...] = ("127.0.0.1",)) -> TlsFiles:
        """A certificate for both ends of a connection (serverAuth and clientAuth), naming
        ``ips`` (and localhost) in its subjectAltName, with its key; trusts this CA."""
        sans = ",".join([*(f"IP:{ip}" for ip in ips), "DNS:localhost"])
        ext = self.folder / f"{name}.ext"
        ext.write_text(
            f"subjectAltName={sans}\n"
            "basicConstraints=CA:FALSE\n"
            "keyUsage=critical,digitalSignature,keyEncipherment\n"
            "extendedKeyUsage=serverAuth,clientAuth\n"
        )
        _openssl(
            "req",
            "-new",
            *_new_key(f"{name}.key"),
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN={name}",
            cwd=self.folder,
        )
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            self.cert.name,
            "-CAkey",
            self.key.name,
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            DAYS,
            "-extfile",
            ext.name,
            cwd=self.folder,
        )
        key = self.folder / f"{name}.key"
        key.chmod(0o600)
        return TlsFiles(self.folder / f"{name}.pem", key, self.cert)
