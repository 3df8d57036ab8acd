"""How ``orchestr serve`` listens: the API key read from a private file (:func:`read_key`), a
Unix-domain socket only its user can open (:func:`private_socket`), and uvicorn's server
without its own signal handling (:func:`server_class`)."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
from collections.abc import Iterator

import orchestr

__all__ = ["private_socket", "read_key", "server_class"]


def read_key(path: str) -> str:
    """The API key in ``path``: a regular file that only its owner can read (as ssh asks of
    a private key), its first line."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ValueError(f"--api-key-file {path}: {exc.strerror}") from None
    with os.fdopen(fd, encoding="utf-8") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"--api-key-file {path}: not a regular file")
        if st.st_uid != os.geteuid():  # its owner could change the key under us
            raise ValueError(
                f"--api-key-file {path}: owned by uid {st.st_uid}, not by this user; use a "
                f"file of your own"
            )
        if st.st_mode & 0o077:
            raise ValueError(
                f"--api-key-file {path}: other users can read or write it (mode "
                f"{stat.S_IMODE(st.st_mode):04o}); chmod 600 it"
            )
        key = f.readline(4096).strip()
    if not key:
        raise ValueError(f"--api-key-file {path}: the file is empty")
    return key


def private_socket(path: str) -> socket.socket:
    """A Unix-domain socket listening at ``path`` with mode 0600 from its creation (uvicorn's
    own makes it 0666); a socket left there by an earlier server of this user is replaced,
    anything else is refused."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
            raise orchestr.ConfigError(
                f"--uds {path}: something other than a socket of yours is there; remove it or "
                f"choose another path"
            )
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(path)
    except OSError as exc:
        sock.close()
        raise orchestr.ConfigError(f"--uds {path}: cannot bind ({exc.strerror})") from None
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(2048)
    return sock


def server_class() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server without its own signal handling (it raises the signal again
        once stopped): ``orchestr serve`` stops it, then closes the front door and the job."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

        def exit(self) -> None:
            if self.should_exit:
                self.force_exit = True  # a second signal: stop without waiting
            self.should_exit = True

    return Server
