"""The TCP side channel a buffer backend's owner runs (``tcp``, ``rdma``, ``nixl``).

:class:`SideChannel` is a threaded TCP server on an ephemeral port, made on first export: one
daemon thread serves, and one more per connection runs the backend's request handler, which
reaches the backend as ``self.server.backend``. :func:`recv_exactly` reads a fixed-size message
from a blocking socket.
"""

from __future__ import annotations

import socket
import socketserver
import threading
from typing import Any

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

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[socketserver.BaseRequestHandler],
        backend: Any = None,
    ) -> None:
        self.backend = backend
        super().__init__(address, handler)

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
