"""The TCP side channel a buffer backend's owner runs (``tcp``, ``rdma``, ``nixl``).

:class:`SideChannel` is a threaded TCP server on an ephemeral port, made on first export: one
daemon thread serves, and one more per connection runs the backend's request handler, which
reaches the backend as ``self.server.backend``. :func:`recv_exactly` reads a fixed-size message
from a blocking socket.

Whoever connects gets no more than this before a handler has checked a region key: at most
:attr:`SideChannel.max_connections` connections are served at once (more are closed on
arrival), and every read or write on one waits at most the data plane's ``stall_timeout``
(a peer that sends nothing, or stops reading, is dropped). A handler whose peer has shown a
key may lift the limit for its connection.
"""

from __future__ import annotations

import socket
import socketserver
import sys
import threading
from typing import Any

from orchestr.fabric._registry import settings

__all__ = ["SideChannel", "recv_exactly"]


def recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    """The next ``n`` bytes from ``sock``, or ``None`` if the peer closes first."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


class SideChannel(socketserver.ThreadingTCPServer):
    """A threaded TCP server whose handlers find their backend at ``self.server.backend``."""

    daemon_threads = True
    allow_reuse_address = True
    #: Most connections served at once.
    max_connections = 256

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[socketserver.BaseRequestHandler],
        backend: Any = None,
    ) -> None:
        self.backend = backend
        self.active = 0
        #: Connections closed on arrival because ``max_connections`` were being served.
        self.refused = 0
        self._count = threading.Lock()
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._count:
            full = self.active >= self.max_connections
            if full:
                self.refused += 1
            else:
                self.active += 1
        if full:
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._count:
                self.active -= 1

    def finish_request(self, request: Any, client_address: Any) -> None:
        request.settimeout(settings.stall_timeout)
        super().finish_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # a peer that went silent (timeout) or away (reset) ends its connection, quietly;
        # anything else is a bug worth its traceback
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)

    def serve_in_thread(self, name: str) -> None:
        """Serve from a daemon thread called ``name``."""
        threading.Thread(target=self.serve_forever, name=name, daemon=True).start()

    @property
    def endpoint(self) -> tuple[str, int]:
        """The host and port peers connect to."""
        host, port = self.server_address[:2]
        return str(host), int(port)

    def stop(self) -> None:
        """Stop serving and close the listening socket (connections in progress run on)."""
        self.shutdown()
        self.server_close()
