"""Mutual TLS from ``Config.tls_cert``/``tls_key``/``tls_ca``: gRPC credentials for the control
plane, the ``ssl`` contexts of the data plane's ``tcp://`` call connections, and what a refused
handshake looks like to a client.

Every process presents the same kind of certificate as server and as client (serverAuth and
clientAuth), signed by the cluster's CA, and accepts only peers whose certificate that CA signed.
Peers are checked against the address they were dialled at: the certificate's subjectAltName
must name the IP (``bind_host``) its services are reached at. No ``ssl_target_name_override``.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc

from orchestr.config import Config, check_tls_files
from orchestr.errors import ConfigError
from orchestr.fabric.lowlevel import set_tls, tls_contexts

__all__ = [
    "channel_credentials",
    "install_stream_tls",
    "refusal",
    "server_credentials",
]


def _pems(config: Config) -> tuple[bytes, bytes, bytes]:
    """``(cert, key, ca)`` read from the files, checked to load as a certificate, its key and
    CA certificates. Raises :class:`ConfigError` naming the file."""
    check_tls_files(config)
    try:
        probe = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        probe.load_cert_chain(config.tls_cert, config.tls_key)
        probe.load_verify_locations(config.tls_ca)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(
            f"cannot use {config.tls_cert} with the key {config.tls_key} and the CA "
            f"{config.tls_ca} for TLS: {exc}; they must be PEM files, the key the "
            "certificate's own"
        ) from None
    cert, key, ca = (Path(p).read_bytes() for p in (config.tls_cert, config.tls_key, config.tls_ca))
    return cert, key, ca


def server_credentials(config: Config) -> grpc.ServerCredentials:
    """A gRPC server's side of mutual TLS: clients must present a certificate the CA signed."""
    cert, key, ca = _pems(config)
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=True
    )


def channel_credentials(config: Config) -> grpc.ChannelCredentials:
    """A gRPC client's side of mutual TLS: this process's certificate, and the CA it trusts."""
    cert, key, ca = _pems(config)
    return grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=key, certificate_chain=cert
    )


def install_stream_tls(config: Config) -> None:
    """Make this process's ``tcp://`` call connections (both directions) use mutual TLS when
    ``config`` sets it, plain TCP otherwise. Listeners and connections already open keep what
    they had. Raises :class:`ConfigError` for unusable files."""
    if not config.tls:
        set_tls(None)
        return
    _pems(config)
    set_tls(tls_contexts(config.tls_cert, config.tls_key, config.tls_ca))


_FIX = (
    "every process of a cluster needs --tls-cert/--tls-key/--tls-ca (ORCHESTR_TLS_CERT, "
    "ORCHESTR_TLS_KEY, ORCHESTR_TLS_CA) with certificates signed by the same CA"
)


def refusal(details: str, host: str, tls: bool) -> str | None:
    """Why a gRPC connection failed, when the failure (``details`` of an UNAVAILABLE status)
    looks like TLS refusing it, said with what to do; ``None`` for other failures.

    A server refusing this client's certificate, or a plaintext client, is seen here only as
    the server closing the connection during the handshake ("Socket closed").
    """
    text = details.lower()
    broke_at_connect = "socket closed" in text and "failed to connect" in text
    if not tls:
        if broke_at_connect:  # not an open connection that broke
            return (
                "the server closed the connection before any request: it requires mutual TLS "
                f"and this client has none; {_FIX}"
            )
        return None
    if "wrong_version_number" in text:
        return f"the server does not use TLS but this client does; {_FIX}"
    if "hostname verification" in text:
        return (
            f"the server's certificate does not name {host} in its subjectAltName; issue it "
            "for the IP addresses the server is reached at"
        )
    if "certificate_verify_failed" in text:
        why = details.rpartition("CERTIFICATE_VERIFY_FAILED: ")[2].removesuffix(": OK")
        return (
            f"this client does not trust the server's certificate ({why}): ORCHESTR_TLS_CA "
            "(--tls-ca) must hold the CA that signed it"
        )
    if "handshake" in text or "ssl_error" in text:
        return f"the TLS handshake failed ({details}); {_FIX}"
    if broke_at_connect:
        return (
            "the server closed the connection during the TLS handshake: it did not accept "
            "this client's certificate (ORCHESTR_TLS_CERT must be signed by the CA in the "
            "server's --tls-ca; see the server's log)"
        )
    return None
