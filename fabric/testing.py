"""The transport conformance suite, for backends in this tree and out of it.

``await check_transport("shm")`` runs every check that applies to the scheme: the stream checks
(ordering, large and zero-length frames, backpressure, close versus abort, a peer killed
mid-transfer, deadline expiry) when it is a registered stream backend, and the one-sided checks
(sizes, partial reads, writes, out-of-bounds spans, wrong-length, forged and stale descriptors,
read-only regions, scoped regions (grants of some spans: reads and writes inside only, forged
scopes, widening, revocation), a deadline, an owner killed mid-transfer) when it is a
registered buffer backend. A backend is done when it passes. An out-of-tree backend registers
(directly or through the ``orchestr.transports`` entry-point group) and calls this from its
own tests; one that does not set ``scoped`` (:mod:`._buffers._scope`) is never given a scoped
region, and skips those checks.
"""

from __future__ import annotations

from orchestr.errors import TransportUnavailableError

from ._buffers._conformance import check_buffer_transport
from ._registry import buffer_transport
from ._streams._conformance import check_stream_transport
from ._streams._transport import stream_transports

__all__ = ["check_buffer_transport", "check_stream_transport", "check_transport"]


async def check_transport(scheme: str, *, url: str | None = None) -> dict[str, list[str]]:
    """Run the conformance checks for ``scheme``; returns the checks passed per shape
    (``"stream"``, ``"buffer"``). Raises AssertionError naming a failed check, and
    :class:`TransportUnavailableError` (with the backend's reason) when the scheme exists but
    cannot run here, or is unknown.

    Blocks and is cancel-safe as the checks it runs are."""
    passed: dict[str, list[str]] = {}
    if scheme in stream_transports():
        passed["stream"] = await check_stream_transport(scheme, url=url)
    backend = buffer_transport(scheme)
    if backend is not None:
        reason = backend.probe()
        if reason is not None:
            raise TransportUnavailableError(f"{scheme}: {reason}")
        passed["buffer"] = await check_buffer_transport(scheme)
    if not passed:
        raise TransportUnavailableError(f"no stream or buffer backend is registered for {scheme!r}")
    return passed
