"""orchestr.fabric: the network. Today: the stream-transport seam that actor calls ride on.

The data-plane backends (shared memory, RDMA, NIXL), one-sided buffers, the topology model and
the fabric manager land here as they are built.
"""

from ._streams import (
    Listener,
    StreamTransport,
    connect_stream,
    listen_stream,
    register_stream_transport,
    split_url,
    stream_transports,
)

__all__ = [
    "Listener",
    "StreamTransport",
    "connect_stream",
    "listen_stream",
    "register_stream_transport",
    "split_url",
    "stream_transports",
]
