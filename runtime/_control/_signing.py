"""Control-plane request signatures: every gRPC request proves the cluster token without
carrying it.

A request carries one metadata entry,
``orchestr-signature: v1.<instance>.<ms>.<nonce>.<digest>.<mac>``: the server instance it is
meant for, the time it was signed (Unix milliseconds), a random nonce, the SHA-256 of the
serialized request body and ``mac`` = HMAC-SHA256 keyed with the token over the method and all
of those. The server checks it in two steps:

1. from the metadata alone, before a byte of the body is read: the MAC, that it is meant for
   this very server process (its instance, drawn at random when it starts), the time (within
   :data:`WINDOW_S` of its own clock) and that the nonce was not seen before. A request without
   the token is refused here, whatever body it announces;
2. once the body has arrived: that it hashes to the digest the MAC covered.

A refusal tells the caller the server's instance (``orchestr-instance`` in its trailing
metadata), which it signs for from then on: a caller learns it on its first request, and again
after the server restarts.

So a signature captured by a server that does not know the token (a process that took a dead
head's port) opens nothing: it is bound to one method, one body and a server instance that
is gone (a restarted head draws a new one), is refused a second time (the nonce), and expires.
An active relay to a live server is the one thing it cannot stop; mutual TLS does.
No I/O here.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import secrets

from orchestr.errors import AuthenticationError

__all__ = ["HEADER", "INSTANCE", "WINDOW_S", "Verifier", "WrongInstanceError", "sign"]

HEADER = "orchestr-signature"
#: Trailing metadata of a refusal: the instance the server wants requests signed for.
INSTANCE = "orchestr-instance"
#: How far a request's signing time may be from the server's clock, in seconds: the hosts of a
#: cluster must keep their clocks this close (NTP does, by orders of magnitude).
WINDOW_S = 120.0
_VERSION = "v1"


def _mac(token: bytes, method: str, *fields: str) -> str:
    message = "\n".join((_VERSION, method, *fields)).encode()
    return hmac.new(token, message, hashlib.sha256).hexdigest()


def sign(token: bytes, method: str, body: bytes, instance: str, now: float) -> str:
    """The signature header for one request of ``method`` (``/orchestr.v1.Head/ListNodes``) to
    the server ``instance`` ("" while it is not known yet: that request is refused with it)."""
    fields = (
        instance,
        str(int(now * 1000)),
        secrets.token_hex(16),
        hashlib.sha256(body).hexdigest(),
    )
    return ".".join((_VERSION, *fields, _mac(token, method, *fields)))


class WrongInstanceError(AuthenticationError):
    """A request signed for another instance of the server (or none): sign it again for
    :attr:`instance`."""

    def __init__(self, instance: str) -> None:
        super().__init__("the request was signed for another instance of this server")
        self.instance = instance


class Verifier:
    """Checks signatures for one server. Nonces are remembered for twice the window (a
    signature older than that is refused by its time), so memory is bounded by the rate of
    genuine requests: only a request whose MAC is good adds one."""

    def __init__(self, token: bytes, window_s: float = WINDOW_S) -> None:
        self._token = token
        self._window = window_s
        #: This server process: requests signed for another are refused.
        self.instance = secrets.token_hex(16)
        self._seen: set[str] = set()
        self._expiry: collections.deque[tuple[float, str]] = collections.deque()

    def check_header(self, method: str, value: str | None, now: float) -> str:
        """Step 1; returns the body digest the signature covers. Raises
        :class:`AuthenticationError` saying what was wrong."""
        if not value:
            raise AuthenticationError("the request is not signed with the cluster token")
        parts = value.split(".")
        if len(parts) != 6 or parts[0] != _VERSION:
            raise AuthenticationError("the request's signature is malformed")
        _, instance, ms, nonce, digest, mac = parts
        if not hmac.compare_digest(_mac(self._token, method, instance, ms, nonce, digest), mac):
            raise AuthenticationError("the request is not signed with the cluster token")
        if not hmac.compare_digest(instance, self.instance):
            raise WrongInstanceError(self.instance)
        skew = int(ms) / 1000 - now  # a good MAC: ms is the signer's, an integer
        if abs(skew) > self._window:
            raise AuthenticationError(
                f"the request was signed {skew:+.0f} s from this server's clock; the clocks "
                f"of a cluster's hosts must agree within {self._window:.0f} s"
            )
        self._forget(now)
        if nonce in self._seen:
            raise AuthenticationError("the request was replayed: its signature was used before")
        self._seen.add(nonce)
        self._expiry.append((now + 2 * self._window, nonce))
        return digest

    @staticmethod
    def check_body(digest: str, body: bytes) -> None:
        """Step 2: raises :class:`AuthenticationError` if ``body`` is not the one signed."""
        if not hmac.compare_digest(hashlib.sha256(body).hexdigest(), digest):
            raise AuthenticationError("the request's body is not the one its signature covers")

    def _forget(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] < now:
            self._seen.discard(self._expiry.popleft()[1])
