"""orchestr.fabric: the data plane.

Two shapes behind one registry by URL scheme:

- **streams** (``tcp://`` built in): ordered frames with backpressure; actor calls ride them.
- **one-sided buffers** (``inproc``, ``shm``, ``tcp``, ``rdma``, optional ``nixl``): register
  memory, pass a small descriptor, the peer reads into or writes from it. :class:`Buffer` is the
  user-facing handle.

:func:`transport_report` says what works in this process and why not; a fallback from the
transport a transfer wanted is an error or logged and counted, never silent. :func:`empty`
allocates tensors in shared memory: sending one to an actor on this host copies nothing.
"""

from ._buffers._borrow import Borrowed, Claim
from ._buffers._handle import Buffer
from ._buffers._segments import empty
from ._buffers._transport import BufferTransport, Descriptor, Region
from ._local import host_id, process_key
from ._registry import (
    buffer_transport,
    buffer_transports,
    configure,
    connections,
    register_buffer_transport,
    release_all,
    shutdown,
    transport_report,
)
from ._streams._transport import (
    Listener,
    StreamTransport,
    connect_stream,
    listen_stream,
    register_stream_transport,
    split_url,
    stream_transports,
)

__all__ = [
    "Borrowed",
    "Buffer",
    "BufferTransport",
    "Claim",
    "Descriptor",
    "Listener",
    "Region",
    "StreamTransport",
    "buffer_transport",
    "buffer_transports",
    "configure",
    "connect_stream",
    "connections",
    "empty",
    "host_id",
    "listen_stream",
    "process_key",
    "register_buffer_transport",
    "register_stream_transport",
    "release_all",
    "shutdown",
    "split_url",
    "stream_transports",
    "transport_report",
]
