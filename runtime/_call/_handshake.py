"""The call path's handshake: each end proves it knows the cluster token without sending it.

::

    caller -> server  [HELLO,     0, {"nonce": cn}]
    server -> caller  [CHALLENGE, 0, {"nonce": sn, "proof": mac("server", cn, sn)}]
    caller -> server  [AUTH,      0, {"proof": mac("client", cn, sn), "process": ..., ...}]
    server -> caller  [WELCOME,   0, {...}]          (see ``_bulk``)

``mac(role, cn, sn)`` is HMAC-SHA256 keyed with the token over the role, the server's call
address (its published ``tcp://host:port``, what the caller dialled) and both nonces. So:

- what a caller sends to a server that does not know the token (a process that took a dead
  worker's port) is a random nonce and nothing else: the caller checks the server's proof before
  it sends its own proof, or any call;
- a proof is good for one pair of nonces at one address: replayed to any server, or relayed from
  one of the cluster's workers to another, it fails (each server draws a fresh nonce, and the
  address in the MAC is the one the server itself publishes).

An active attacker in the middle of one connection can still relay it whole; mutual TLS
(``ORCHESTR_TLS_*``) binds the connection to the certificates and closes that too.

Until the handshake is done, each end accepts only frames of at most
:data:`HANDSHAKE_MAX_BYTES` made of plain msgpack values (no extension types, no buffers), and
the server gives the caller :attr:`Config.handshake_timeout` seconds to finish it. No I/O here.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Any

from orchestr.errors import ProtocolError

__all__ = [
    "HANDSHAKE_MAX_BYTES",
    "NONCE_BYTES",
    "identity",
    "new_nonce",
    "nonce_of",
    "proof",
    "proof_of",
    "proves",
]

#: The largest frame either end accepts before the other has proven itself.
HANDSHAKE_MAX_BYTES = 4096
NONCE_BYTES = 32


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def identity(address: str) -> str:
    """What a proof is bound to: a call address without its query (``tcp://host:port``)."""
    return address.partition("?")[0]


def proof(token: bytes, role: str, server: str, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """The MAC one end sends to show it knows ``token``; ``role`` is ``server`` or ``client``."""
    mac = hmac.new(token, digestmod=hashlib.sha256)
    for part in (b"orchestr-call-v2", role.encode(), server.encode(), client_nonce, server_nonce):
        mac.update(len(part).to_bytes(4, "big"))
        mac.update(part)
    return mac.digest()


def proves(expected: bytes, presented: object) -> bool:
    """Whether ``presented`` is the proof ``expected`` (in constant time)."""
    return isinstance(presented, bytes) and hmac.compare_digest(expected, presented)


def nonce_of(info: Any) -> bytes:
    """The nonce a HELLO or CHALLENGE carries; raises :class:`ProtocolError` if there is none."""
    nonce = info.get("nonce") if isinstance(info, dict) else None
    if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
        raise ProtocolError(f"the handshake carries no {NONCE_BYTES}-byte nonce")
    return nonce


def proof_of(info: Any) -> bytes:
    value = info.get("proof") if isinstance(info, dict) else None
    if not isinstance(value, bytes):
        raise ProtocolError("the handshake carries no proof")
    return value
