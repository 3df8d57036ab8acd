"""Mutual TLS on the control plane (a real TLS gRPC head) and on tcp:// call connections (a real
call server, real worker processes): what gets through, and how each refusal looks to the client
and in the server's log."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import pathlib
import re
import ssl
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
import structlog

from orchestr._call._server import CallServer
from orchestr._cluster._head import HeadService
from orchestr._control._grpc import ControlChannel
from orchestr._control._tls import install_stream_tls
from orchestr.config import Config, load_config
from orchestr.errors import AuthenticationError, ConfigError
from orchestr.fabric import connect_stream
from orchestr.fabric.lowlevel import set_tls, tls_contexts
from orchestr.protos import orchestr_pb2 as pb
from orchestr.protos import orchestr_pb2_grpc as pb_grpc
from tests.cluster import open_cluster
from tests.runtime.actors import Counter
from tests.tlsutil import CertAuthority, TlsFiles

TOKEN = "the-cluster-token"
#: gRPC core logs refused handshakes at INFO, which GRPC_VERBOSITY=ERROR or NONE hides.
GRPC_LOGS_HANDSHAKES = os.environ.get("GRPC_VERBOSITY", "").upper() in ("", "INFO", "DEBUG")


@dataclasses.dataclass(frozen=True)
class Pki:
    #: A host of the cluster: its certificate and key, and the cluster's CA.
    good: TlsFiles
    #: A certificate another CA signed, by a client that trusts the cluster's CA.
    foreign: TlsFiles
    #: The cluster's certificate, by a client that trusts only the other CA.
    distrusting: TlsFiles
    #: A certificate of the cluster's CA that names 10.9.9.9 only.
    elsewhere: TlsFiles


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    root = tmp_path_factory.mktemp("pki")
    cluster = CertAuthority(root / "cluster")
    other = CertAuthority(root / "other", "another-ca")
    good = cluster.issue("node")
    rogue = other.issue("rogue")
    return Pki(
        good=good,
        foreign=TlsFiles(rogue.cert, rogue.key, good.ca),
        distrusting=TlsFiles(good.cert, good.key, other.cert),
        elsewhere=cluster.issue("elsewhere", ips=("10.9.9.9",)),
    )


def tls_config(files: TlsFiles) -> Config:
    return load_config({}, **files.settings())


@pytest.fixture(autouse=True)
def plain_streams() -> Iterator[None]:
    """Each test installs the stream TLS it wants; none leaks into the next test."""
    yield
    set_tls(None)


async def list_nodes(address: str, token: str, config: Config) -> list[Any]:
    channel = ControlChannel(address, token, config)
    try:
        async with asyncio.timeout(20):  # a refusal must never hang
            stub = channel.stub(pb_grpc.HeadStub)
            return list((await channel.rpc(stub.ListNodes, pb.Empty(), timeout=10)).nodes)
    finally:
        await channel.aclose()


async def grpc_log(capfd: pytest.CaptureFixture[str], text: str) -> str:
    """What gRPC core wrote to this process's stderr, once it holds ``text`` (its own thread
    writes it)."""
    seen = ""
    for _ in range(50):
        seen += capfd.readouterr().err
        if text in seen:
            break
        await asyncio.sleep(0.05)
    return seen


# -- the control plane -------------------------------------------------------------------


async def test_a_client_with_the_cluster_certificate_and_token_is_served(pki: Pki) -> None:
    config = tls_config(pki.good)
    async with HeadService(TOKEN, config) as head:
        assert await list_nodes(head.address, TOKEN, config) == []


@pytest.mark.parametrize("token", ["", "not-the-token"], ids=["no-token", "wrong-token"])
async def test_a_missing_or_wrong_token_is_refused_over_tls_too(pki: Pki, token: str) -> None:
    config = tls_config(pki.good)
    async with HeadService(TOKEN, config) as head:
        with structlog.testing.capture_logs() as logs:
            with pytest.raises(AuthenticationError, match="not signed with the cluster token"):
                await list_nodes(head.address, token, config)
    refusals = [e for e in logs if e["event"] == "refused a control-plane request"]
    assert refusals and "not signed with the cluster token" in refusals[0]["reason"]
    assert refusals[0]["log_level"] == "warning"


@pytest.mark.parametrize(
    ("client", "message", "server_log"),
    [
        (
            "foreign",
            "closed the connection during the TLS handshake: it did not accept this client's "
            "certificate",
            "CERTIFICATE_VERIFY_FAILED",
        ),
        ("plain", "requires mutual TLS and this client has none", "WRONG_VERSION_NUMBER"),
        ("distrusting", "does not trust the server's certificate", None),
    ],
)
async def test_a_client_the_tls_head_cannot_trust_is_refused_with_a_clear_error(
    pki: Pki, capfd: pytest.CaptureFixture[str], client: str, message: str, server_log: str | None
) -> None:
    config = Config() if client == "plain" else tls_config(getattr(pki, client))
    async with HeadService(TOKEN, tls_config(pki.good)) as head:
        capfd.readouterr()
        with pytest.raises(AuthenticationError, match=message) as info:
            await list_nodes(head.address, TOKEN, config)
        assert str(info.value).startswith("/orchestr.")
        assert f"Head/ListNodes to {head.address}: " in str(info.value)
        if server_log is not None and GRPC_LOGS_HANDSHAKES:
            # gRPC core refuses the handshake without calling Python; its log is the record.
            err = await grpc_log(capfd, server_log)
            assert "Handshake failed" in err and server_log in err
        # the head goes on serving its cluster
        assert await list_nodes(head.address, TOKEN, tls_config(pki.good)) == []


async def test_a_tls_client_of_a_plaintext_head_is_told_so(pki: Pki) -> None:
    async with HeadService(TOKEN, Config()) as head:
        with pytest.raises(AuthenticationError, match="does not use TLS but this client does"):
            await list_nodes(head.address, TOKEN, tls_config(pki.good))


async def test_a_certificate_must_name_the_address_it_is_reached_at(pki: Pki) -> None:
    async with HeadService(TOKEN, tls_config(pki.elsewhere)) as head:
        with pytest.raises(AuthenticationError, match="does not name 127.0.0.1 in its subject"):
            await list_nodes(head.address, TOKEN, tls_config(pki.good))


# -- settings ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "missing"),
    [
        (("cert",), "ORCHESTR_TLS_KEY (--tls-key), ORCHESTR_TLS_CA (--tls-ca)"),
        (("cert", "key"), "ORCHESTR_TLS_CA (--tls-ca)"),
        (("ca",), "ORCHESTR_TLS_CERT (--tls-cert), ORCHESTR_TLS_KEY (--tls-key)"),
    ],
)
def test_tls_needs_all_three_files(pki: Pki, given: tuple[str, ...], missing: str) -> None:
    environ = {k: v for k, v in pki.good.env().items() if k.lower().endswith(given)}
    with pytest.raises(ConfigError, match=re.escape(f"missing: {missing}") + "$"):
        load_config(environ)


def test_an_unreadable_tls_file_is_named(pki: Pki, tmp_path: pathlib.Path) -> None:
    gone = tmp_path / "gone.pem"
    with pytest.raises(ConfigError, match=f"ORCHESTR_TLS_KEY: cannot read {gone}: No such file"):
        load_config({**pki.good.env(), "ORCHESTR_TLS_KEY": str(gone)})
    empty = tmp_path / "empty.pem"
    empty.touch()
    with pytest.raises(ConfigError, match=f"ORCHESTR_TLS_CA: {empty} is empty"):
        load_config({**pki.good.env(), "ORCHESTR_TLS_CA": str(empty)})


def test_tls_paths_are_made_absolute(pki: Pki, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(pki.good.cert.parent)
    config = load_config({}, tls_cert="node.pem", tls_key="node.key", tls_ca="ca.pem")
    assert config.tls and config.tls_cert == str(pki.good.cert)


async def test_a_key_that_is_not_the_certificates_is_refused(pki: Pki) -> None:
    config = load_config({}, **{**pki.good.settings(), "tls_key": str(pki.foreign.key)})
    with pytest.raises(ConfigError, match="the key the certificate's own"):
        HeadService(TOKEN, config)
    with pytest.raises(ConfigError, match="the key the certificate's own"):
        install_stream_tls(config)


# -- the data plane ----------------------------------------------------------------------


async def closed_by_peer(reader: asyncio.StreamReader) -> bool:
    """Whether the peer closed the connection (EOF, a reset, or a TLS alert) within 10 s."""
    try:
        async with asyncio.timeout(10):
            return await reader.read(1024) == b""
    except (ConnectionError, ssl.SSLError):
        return True


async def open_call_server(config: Config) -> CallServer:
    server = CallServer(TOKEN, config)
    await server.start("tcp://127.0.0.1:0")
    return server


async def test_a_tls_call_server_refuses_plain_and_foreign_clients_and_logs_it(pki: Pki) -> None:
    install_stream_tls(tls_config(pki.good))
    server = await open_call_server(tls_config(pki.good))
    parts = urlsplit(server.url)
    host, port = parts.hostname, parts.port
    try:
        foreign = tls_contexts(str(pki.foreign.cert), str(pki.foreign.key), str(pki.foreign.ca))
        good = tls_contexts(str(pki.good.cert), str(pki.good.key), str(pki.good.ca))
        with structlog.testing.capture_logs() as logs:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"\x00" * 64)  # not a TLS ClientHello
            assert await closed_by_peer(reader)
            writer.close()
            reader, writer = await asyncio.open_connection(
                host, port, ssl=foreign.client, server_hostname=host
            )  # TLS 1.3: the server checks the client's certificate after the client is done
            writer.write(b"\x00" * 64)
            assert await closed_by_peer(reader)
            writer.close()
        refused = [e for e in logs if e["event"].startswith("refused a data-plane connection")]
        assert len(refused) == 2, logs
        assert "WRONG_VERSION_NUMBER" in refused[0]["error"]
        assert "certificate verify failed" in refused[1]["error"]
        assert not server.connections
        # the server goes on accepting the cluster's own
        reader, writer = await asyncio.open_connection(
            host, port, ssl=good.client, server_hostname=host
        )
        for _ in range(1000):  # its handshake completes on the server's side too
            if server.connections:
                break
            await asyncio.sleep(0.01)
        transport = next(iter(server.connections)).transport
        assert transport is not None and transport.get_extra_info("ssl_object") is not None
        writer.close()
    finally:
        await server.aclose()


async def test_a_call_client_that_distrusts_the_server_says_why(pki: Pki) -> None:
    install_stream_tls(tls_config(pki.good))
    server = await open_call_server(tls_config(pki.good))
    try:
        install_stream_tls(tls_config(pki.distrusting))
        with pytest.raises(ConnectionError, match="TLS handshake with 127.0.0.1:.* failed"):
            await connect_stream(server.url, asyncio.BufferedProtocol)
    finally:
        await server.aclose()


def worker_logs(session_dir: str) -> str:
    return "".join(p.read_text() for p in pathlib.Path(session_dir, "logs").glob("*.jsonl"))


@pytest.mark.timeout(120)
async def test_calls_ride_mutual_tls_in_an_embedded_cluster(pki: Pki) -> None:
    config = tls_config(pki.good)
    assert config.local_call_transport == "tcp"
    async with open_cluster(config) as ctx:
        mesh = await ctx.spawn(Counter, 1)
        assert await mesh.add.call_one(2) == 3
        blob = os.urandom(300_000)  # many TLS records, inline in the frame
        assert await mesh.echo.call_one(blob) == blob
        [conn] = ctx.client._connections.values()
        assert conn.transport is not None
        assert conn.transport.get_extra_info("ssl_object") is not None
        # a plain TCP client of the worker's call server is refused; the worker serves on
        parts = urlsplit(mesh.members[0].address)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        writer.write(b"\x00" * 64)
        assert await closed_by_peer(reader)
        writer.close()
        assert await mesh.add.call_one(4) == 7
        # the worker logged the refusal
        for _ in range(100):
            if "refused a data-plane connection" in worker_logs(ctx.session_dir):
                break
            await asyncio.sleep(0.05)
        assert "refused a data-plane connection: the TLS handshake failed" in worker_logs(
            ctx.session_dir
        )
