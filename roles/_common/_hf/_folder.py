"""Writing a checkpoint folder without trusting what already lies on its path.

A checkpoint is code-like input for whoever serves it (its config, tokenizer regexes and chat
template), and the writer may run as root, so:

- a missing folder is made, mode 0755; an existing one must be a real directory (not a
  symbolic link), owned by this user, that no other user may write to (no group or other
  write bit), and empty unless ``force``. Each refusal is a :class:`ConfigError` that says
  what to do instead;
- the folder is opened once (``O_NOFOLLOW``) and checked through that descriptor, and every
  file is created relative to it with ``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0644: nothing
  is written through a link and no file that was there is truncated in place;
- with ``force``, the files a checkpoint is made of (:data:`CHECKPOINT_FILES` and weight
  shards) are unlinked first (a link is removed, never followed); other files stay.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
from collections.abc import Iterable
from types import TracebackType

import orchestr as oc

__all__ = ["CHECKPOINT_FILES", "FILE_MODE", "FOLDER_MODE", "CheckpointFolder"]

#: What a checkpoint folder of ours holds besides its weight shards.
CHECKPOINT_FILES = frozenset(
    {
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors",
        "model.safetensors.index.json",
        "generation_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
    }
)
_SHARD = re.compile(r"model-\d{5,}-of-\d{5,}\.safetensors")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
FOLDER_MODE = 0o755
FILE_MODE = 0o644


def _is_checkpoint_file(name: str) -> bool:
    return name in CHECKPOINT_FILES or _SHARD.fullmatch(name) is not None


class CheckpointFolder:
    """A folder opened for writing a new checkpoint into: made when missing, else checked (see
    the module's docstring). Use as a context manager; leaving it with an exception removes
    the files written so far, and the folder too when this call made it.

    Blocks on the filesystem only. Raises :class:`ConfigError` for a folder it must not
    write into and for a file it cannot create. Not idempotent: a second writer of the same
    folder is refused (it is no longer empty)."""

    def __init__(self, folder: str | os.PathLike[str], *, force: bool = False) -> None:
        self.path = os.fspath(folder)
        self._made = False
        self._written: list[str] = []
        self._fd = self._open(force)

    def _open(self, force: bool) -> int:
        path = self.path
        parent = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as exc:
            raise oc.ConfigError(f"cannot make the folder {parent}: {exc.strerror}") from None
        try:
            os.mkdir(path, FOLDER_MODE)
            self._made = True
        except FileExistsError:
            pass
        except OSError as exc:
            raise oc.ConfigError(f"cannot make the folder {path}: {exc.strerror}") from None
        try:
            fd = os.open(path, _DIR_FLAGS)
        except OSError as exc:
            # O_NOFOLLOW with O_DIRECTORY fails a link with ELOOP or ENOTDIR, as the kernel picks
            if exc.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(path):
                raise oc.ConfigError(
                    f"{path} is a symbolic link; give the real folder's path (files are "
                    f"never written through a link)"
                ) from None
            if exc.errno == errno.ENOTDIR:
                raise oc.ConfigError(
                    f"{path} is not a folder; give a new or empty folder"
                ) from None
            raise oc.ConfigError(f"cannot open the folder {path}: {exc.strerror}") from None
        try:
            self._check(fd, force)
        except BaseException:
            os.close(fd)
            if self._made:
                with contextlib.suppress(OSError):
                    os.rmdir(path)
            raise
        return fd

    def _check(self, fd: int, force: bool) -> None:
        if self._made:
            os.fchmod(fd, FOLDER_MODE)  # exactly 0755, whatever the umask
        path, st, uid = self.path, os.fstat(fd), os.geteuid()
        if st.st_uid != uid:
            raise oc.ConfigError(
                f"the folder {path} is owned by uid {st.st_uid}, not by this user (uid {uid}): "
                f"its owner could change the checkpoint or plant links in it; use a folder of "
                f"your own"
            )
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise oc.ConfigError(
                f"the folder {path} is writable by other users (mode "
                f"{stat.filemode(st.st_mode)}): they could change the checkpoint or plant "
                f"links in it; run chmod go-w {path}, or use a new folder"
            )
        names = sorted(os.listdir(fd))
        if names and not force:
            if "config.json" in names:
                what = "already holds a checkpoint"
            else:
                shown = ", ".join(map(repr, names[:3])) + (", ..." if len(names) > 3 else "")
                what = f"is not empty (it holds {shown})"
            raise oc.ConfigError(
                f"{path} {what}; give a new or empty folder, or force=True (--force) to "
                f"replace the checkpoint files in it"
            )
        for name in filter(_is_checkpoint_file, names):
            try:
                os.unlink(name, dir_fd=fd)
            except OSError as exc:
                raise oc.ConfigError(
                    f"cannot replace {os.path.join(path, name)}: {exc.strerror}; remove it yourself"
                ) from None

    def write(self, name: str, data: bytes) -> None:
        """Create the file ``name`` (a bare name) in the folder holding ``data``, mode 0644.
        Raises :class:`ConfigError` when it exists or cannot be created."""
        self.write_chunks(name, (data,))

    def write_chunks(self, name: str, chunks: Iterable[bytes]) -> None:
        """:meth:`write` of the bytes ``chunks`` yields, each written as it comes (what
        raises while it yields is raised here, the file then removed with the rest)."""
        if os.path.basename(name) != name or name in ("", ".", ".."):
            raise ValueError(f"expected a bare file name, got {name!r}")
        try:
            fd = os.open(name, _FILE_FLAGS, FILE_MODE, dir_fd=self._fd)
        except OSError as exc:
            raise oc.ConfigError(
                f"cannot create {os.path.join(self.path, name)}: {exc.strerror}"
            ) from None
        self._written.append(name)
        with open(fd, "wb") as f:
            os.fchmod(fd, FILE_MODE)  # exactly 0644, whatever the umask
            for chunk in chunks:
                f.write(chunk)

    def close(self) -> None:
        """Release the folder's descriptor; idempotent."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _discard(self) -> None:
        # best effort: the error that got us here is the one to report
        for name in self._written:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=self._fd)
        self._written.clear()
        if self._made:
            with contextlib.suppress(OSError):
                os.rmdir(self.path)

    def __enter__(self) -> CheckpointFolder:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if exc_type is not None:
                self._discard()
        finally:
            self.close()
