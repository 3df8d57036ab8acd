"""A call-path client written from the wire description alone, on a plain blocking socket: for
tests that send frames the real client never would."""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
from typing import Any

import msgpack

import orchestr as oc

HELLO, CALL, ERR, WELCOME, CHALLENGE, AUTH = 0, 1, 4, 5, 8, 9


def connect(address: str, timeout: float = 5.0) -> socket.socket:
    _, host, port = oc.fabric.split_url(address)
    return socket.create_connection((host, port), timeout=timeout)


def frame(obj: object, extra: int = 0) -> bytes:
    body = msgpack.packb(obj)
    return struct.pack("<IQ", len(body), extra) + body


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def read_frame(sock: socket.socket) -> list[Any]:
    n, extra = struct.unpack("<IQ", _recv_exact(sock, 12))
    body = _recv_exact(sock, n + extra)
    return msgpack.unpackb(body[:n])


def closed(sock: socket.socket) -> bool:
    """Whether the server closed the connection (reading what it still sends first)."""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def mac(token: str, role: str, server: str, cn: bytes, sn: bytes) -> bytes:
    digest = hmac.new(token.encode(), digestmod=hashlib.sha256)
    for part in (b"orchestr-call-v2", role.encode(), server.encode(), cn, sn):
        digest.update(len(part).to_bytes(4, "big") + part)
    return digest.digest()


def handshake(
    sock: socket.socket, token: str, address: str, info: dict[str, Any] | None = None
) -> list[Any]:
    """Prove ``token`` to the worker at ``address``; returns its WELCOME (or refusal). The
    server's proof is checked only when the token is right. ``extra`` goes into AUTH."""
    extra = info
    cn = os.urandom(32)
    sock.sendall(frame([HELLO, 0, {"nonce": cn}]))
    kind, _, info = read_frame(sock)
    assert kind == CHALLENGE, kind
    server = address.partition("?")[0]
    good = hmac.compare_digest(info["proof"], mac(token, "server", server, cn, info["nonce"]))
    assert good or token.startswith("wrong")
    proof = mac(token, "client", server, cn, info["nonce"])
    sock.sendall(frame([AUTH, 0, {"proof": proof, **(extra or {})}]))
    return read_frame(sock)
