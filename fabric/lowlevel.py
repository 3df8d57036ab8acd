"""The data plane's parts that the runtime builds on: not for jobs, stable only within a release.

The runtime (``orchestr``) reaches the data plane through this module and the public
``orchestr.fabric`` names only; nothing outside ``fabric/`` imports ``orchestr.fabric._*``. What
is here and what uses it:

- shared-memory segments (the call path's large values): :class:`Segment`, :func:`open_peer`,
  the process's send :func:`pool` and :func:`receive_pool`, :func:`peers`, :func:`copy`,
  :func:`address_of`;
- the stream ends the call connection drives (:class:`StreamEnd`, the shm ring's
  :class:`RingEnd`) and the TLS settings of the ``tcp`` stream (:func:`tls_contexts`,
  :func:`set_tls`, :class:`StreamTls`);
- one-sided buffer bookkeeping: the per-scheme :data:`buffer_stats` (:class:`Counters`),
  :func:`check_fallback`, :func:`usable_buffer_transports`, and :data:`connection_sources`,
  where the call path lists its connections for :func:`orchestr.fabric.connections`;
- process identity: :func:`host_of`, :func:`pid_of` (the inverses of
  :func:`orchestr.fabric.process_key`).
"""

from __future__ import annotations

from ._buffers._fallback import Fallback, check_fallback
from ._buffers._memfd import Segment, open_peer
from ._buffers._segments import copy, peers, pool, receive_pool
from ._buffers._shm import address_of
from ._buffers._transport import Counters
from ._buffers._transport import stats as buffer_stats
from ._local import host_of, pid_of
from ._registry import connection_sources, usable_buffer_transports
from ._streams._flow import StreamEnd
from ._streams._shmring import RingEnd
from ._streams._transport import StreamTls, set_tls, tls_contexts

__all__ = [
    "Counters",
    "Fallback",
    "RingEnd",
    "Segment",
    "StreamEnd",
    "StreamTls",
    "address_of",
    "buffer_stats",
    "check_fallback",
    "connection_sources",
    "copy",
    "host_of",
    "open_peer",
    "peers",
    "pid_of",
    "pool",
    "receive_pool",
    "set_tls",
    "tls_contexts",
    "usable_buffer_transports",
]
