"""``nixl://`` one-sided buffers through NVIDIA's NIXL library (optional: ``orchestr[nixl]``).

Each process that uses the backend runs one NIXL agent with the UCX backend. The owner registers
a region with its agent and publishes ``(host, port, agent name, address)``: where its TCP side
channel listens, the agent's name and the region's address. NIXL needs the owner agent's metadata
(connection details and registered memory, several kilobytes) before it can move bytes; a reader
fetches it over the side channel and loads it, and fetches it again whenever the owner's
registrations changed since. Before each transfer the reader asks the side channel whether the
region is still registered and which metadata generation is current (one small round trip), so
a released region is reported as :class:`StaleDescriptorError`. That check names the bytes the
transfer moves, and the owner refuses those outside a scoped region's spans (:mod:`._scope`); a
scoped region is registered with the agent span by span, so the agent's metadata reaches no
byte of it outside a span (though it reaches every span the process has granted to anyone). The bytes themselves move through
NIXL (``initialize_xfer`` / ``transfer``), polled in a thread until done.

``nixl`` is imported on first probe; the module imports without it.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.metadata
import logging
import os
import socket
import socketserver
import struct
import sys
import threading
import time
from typing import Any

from orchestr.errors import (
    DescriptorError,
    StaleDescriptorError,
    TransportError,
    TransportUnavailableError,
)
from orchestr.fabric import _local

from . import _scope, _transport
from ._scope import Scope
from ._sidechannel import SideChannel, recv_exactly
from ._transport import Descriptor, OneSided, Region

__all__ = ["NixlBuffers", "load_nixl"]

NOT_INSTALLED = "the nixl package is not installed (pip install 'orchestr[nixl]')"
#: Seconds one transfer may take.
TRANSFER_TIMEOUT = 60.0
_REQ = struct.Struct("<4sBQQQQ")  # magic, op, region, key, offset, bytes to move
_MAGIC = b"ONXL"
_CHECK_READ, _META, _CHECK_WRITE = 1, 2, 3
_LIVE, _RELEASED, _READ_ONLY, _OUTSIDE = 0, 1, 2, 3
_STATE = struct.Struct("<BQQQ")  # region state, metadata generation, address, length
_META_HEAD = struct.Struct("<QI")  # generation, metadata length


def load_nixl() -> Any | None:
    """The ``nixl`` package, or ``None`` when it is not installed."""
    try:
        nixl = importlib.import_module("nixl")
    except ImportError:
        return None
    # nixl logs INFO lines to stdout, where this process may speak a protocol: move them to
    # stderr, and keep only warnings unless NIXL_LOG_LEVEL asks for more
    logger = logging.getLogger("nixl")
    if not os.environ.get("NIXL_LOG_LEVEL"):
        logger.setLevel(logging.WARNING)
    for handler in logger.handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)
    return nixl


class _Handler(socketserver.BaseRequestHandler):
    """Owner side: answers liveness checks and hands out the agent's metadata."""

    def handle(self) -> None:
        sock: socket.socket = self.request
        backend: NixlBuffers = self.server.backend  # type: ignore[attr-defined]
        proven = False  # the agent's metadata goes only to a peer that named a live region
        while (head := recv_exactly(sock, _REQ.size)) is not None:
            magic, op, region_id, key, offset, nbytes = _REQ.unpack(head)
            if magic != _MAGIC:
                return
            if op in (_CHECK_READ, _CHECK_WRITE):
                addr = length = 0
                try:
                    region = _transport.lookup(region_id, key)
                    addr, length = backend._regs[region_id][1], region.mem.nbytes
                    state = _READ_ONLY if op == _CHECK_WRITE and region.mem.readonly else _LIVE
                    if state == _LIVE and not region.reaches(offset, nbytes):
                        state = _OUTSIDE
                except (StaleDescriptorError, KeyError):
                    state = _RELEASED
                if state != _RELEASED and not proven:
                    proven = True
                    sock.settimeout(None)  # a peer with a key keeps its side channel open
                sock.sendall(_STATE.pack(state, backend._generation, addr, length))
            elif op == _META and proven:
                generation, meta = backend._metadata()
                sock.sendall(_META_HEAD.pack(generation, len(meta)) + meta)
            else:
                return


class _Peer:
    """Reader side: the side channel to one owner and what was loaded from it."""

    def __init__(self, host: str, port: int) -> None:
        self.lock = threading.Lock()
        self.sock = socket.create_connection((host, port), timeout=10)
        self.name: str | None = None  # the owner agent, once its metadata is loaded
        self.generation = -1

    def ask(
        self, op: int, region: int = 0, key: int = 0, offset: int = 0, nbytes: int = 0
    ) -> bytes:
        self.sock.sendall(_REQ.pack(_MAGIC, op, region, key, offset, nbytes))
        size = _META_HEAD.size if op == _META else _STATE.size
        head = recv_exactly(self.sock, size)
        if head is not None and op == _META:
            meta = recv_exactly(self.sock, _META_HEAD.unpack(head)[1])
            head = None if meta is None else head + meta
        if head is None:
            raise ConnectionError("the nixl owner closed its side channel")
        return head


class NixlBuffers(OneSided):
    """The ``nixl`` buffer backend."""

    scheme = "nixl"
    scoped = "owner"  # each transfer's check, and a scoped region's agent registrations

    def __init__(self) -> None:
        self._nixl: Any = None
        self._agent: Any = None
        self._agent_pid = 0
        self._probed = False
        self._reason: str | None = None
        self._server: SideChannel | None = None
        #: region id -> (its registrations with the agent, address)
        self._regs: dict[int, tuple[list[Any], int]] = {}
        self._generation = 0
        self._peers: dict[tuple[str, int], _Peer] = {}
        self._lock = threading.Lock()

    def probe(self) -> str | None:
        if not self._probed:
            self._reason = self._check()
            self._probed = True
        return self._reason

    def _check(self) -> str | None:
        self._nixl = load_nixl()
        if self._nixl is None:
            return NOT_INSTALLED
        try:
            agent = self._my_agent()
        except Exception as exc:
            return f"nixl is installed but its agent does not start: {exc}"
        if "UCX" not in getattr(agent, "backends", {}):
            plugins = ", ".join(getattr(agent, "plugin_list", [])) or "none"
            return f"nixl has no UCX backend here (plugins: {plugins})"
        return None

    def details(self) -> dict[str, Any]:
        version = None
        if self._nixl is not None:
            try:
                version = importlib.metadata.version("nixl")
            except importlib.metadata.PackageNotFoundError:
                pass
        return {"nixl": version, "agent": getattr(self._agent, "name", None)}

    def reaches(self, owner: str) -> bool:
        return True

    def _my_agent(self) -> Any:
        """This process's agent (a forked child makes its own)."""
        with self._lock:
            if self._agent is None or self._agent_pid != os.getpid():
                nixl = self._nixl or load_nixl()
                if nixl is None:
                    raise TransportUnavailableError(NOT_INSTALLED)
                kwargs: dict[str, Any] = {"backends": ["UCX"]}
                sync = getattr(nixl, "nixl_thread_sync_t", None)
                if sync is not None:  # transfers run in worker threads
                    kwargs["sync_mode"] = sync.NIXL_THREAD_SYNC_STRICT
                name = f"orchestr-{_local.process_key()}"
                self._agent = nixl.nixl_agent(name, nixl.nixl_agent_config(**kwargs))
                self._agent_pid = os.getpid()
                self._regs.clear()
                self._peers.clear()
            return self._agent

    def _metadata(self) -> tuple[int, bytes]:
        with self._lock:
            generation = self._generation
        return generation, bytes(self._my_agent().get_agent_metadata())

    def export(self, region: Region) -> tuple[Any, ...]:
        from orchestr.fabric._registry import settings

        from ._shm import address_of

        if self.probe() is not None:
            raise TransportUnavailableError(f"nixl cannot be used here: {self._reason}")
        agent = self._my_agent()
        addr = address_of(region.mem)
        with self._lock:
            self._regs[region.id] = ([], addr)
        try:
            if region.scope is not None:
                self.widen(region, region.scope)
            elif region.mem.nbytes:
                self._register(agent, region.id, [(addr, region.mem.nbytes, 0, "")])
        except BaseException:
            self.unexport(region)
            raise
        with self._lock:
            if self._server is None:
                self._server = SideChannel((settings.bind_host, 0), _Handler, self)
                self._server.serve_in_thread("orchestr-nixl")
            host, port = self._server.endpoint
        return (host, port, str(agent.name), addr)

    def widen(self, region: Region, added: Scope) -> None:
        """Register the spans of ``added`` (new bytes of a scoped region) with the agent."""
        with self._lock:
            entry = self._regs.get(region.id)
        if entry is not None and added:
            spans = [(entry[1] + a, b - a, 0, "") for a, b in _scope.pairs(added)]
            self._register(self._my_agent(), region.id, spans)

    def _register(self, agent: Any, region_id: int, spans: list[tuple[int, int, int, str]]) -> None:
        try:
            reg = agent.register_memory(spans, "DRAM")
        except Exception as exc:
            nbytes = sum(s[1] for s in spans)
            raise TransportError(f"nixl could not register {nbytes} bytes: {exc}") from exc
        with self._lock:
            entry = self._regs.get(region_id)
            if entry is not None:
                entry[0].append(reg)
                self._generation += 1
                reg = None
        if reg is not None:  # unexported meanwhile
            agent.deregister_memory(reg)

    def unexport(self, region: Region) -> None:
        with self._lock:
            regs = self._regs.pop(region.id, ([], 0))[0]
            self._generation += 1
        for reg in regs:
            self._agent.deregister_memory(reg)

    def close(self) -> None:
        with self._lock:
            server, self._server = self._server, None
            peers, self._peers = self._peers, {}
        if server is not None:
            server.stop()
        for peer in peers.values():
            peer.sock.close()

    # -- reader side ---------------------------------------------------------------------------
    def _peer(self, host: str, port: int) -> _Peer:
        with self._lock:
            peer = self._peers.get((host, port))
            if peer is None:
                try:
                    peer = _Peer(host, port)
                except OSError as exc:
                    raise StaleDescriptorError(
                        f"cannot reach the nixl owner at {host}:{port}: {exc} (it may have exited)"
                    ) from exc
                self._peers[(host, port)] = peer
            return peer

    def _prepare(
        self,
        agent: Any,
        peer: _Peer,
        write: bool,
        desc: Descriptor,
        owner_agent: str,
        offset: int,
        nbytes: int,
    ) -> None:
        """Check the region is live, reaches the bytes to move, and the owner's current
        metadata is loaded."""
        op = _CHECK_WRITE if write else _CHECK_READ
        answer = peer.ask(op, desc.region, desc.key, offset, nbytes)
        state, generation, addr, length = _STATE.unpack(answer)
        if state == _RELEASED:
            raise StaleDescriptorError(
                f"buffer region {desc.region} of {desc.owner} was released (or the descriptor "
                f"is forged)"
            )
        if (addr, length) != (desc.where[3], desc.length):
            raise DescriptorError(
                f"descriptor of region {desc.region} says {desc.length} bytes at "
                f"{desc.where[3]:#x}; the owner registered {length} bytes at {addr:#x}"
            )
        if state == _READ_ONLY:
            raise DescriptorError(f"buffer region {desc.region} of {desc.owner} is read-only")
        if state == _OUTSIDE:
            raise DescriptorError(_transport.outside_scope(offset, nbytes, desc.region, desc.owner))
        if generation == peer.generation and peer.name is not None:
            return
        reply = peer.ask(_META)
        generation, size = _META_HEAD.unpack_from(reply)
        # loading an agent's metadata again adds what it registered since
        name = agent.add_remote_agent(reply[_META_HEAD.size : _META_HEAD.size + size])
        name = name.decode() if isinstance(name, bytes) else str(name)
        peer.name, peer.generation = name, generation
        if name != owner_agent:
            raise DescriptorError(f"the nixl side channel serves agent {name}, not {owner_agent}")

    def _move_sync(self, write: bool, desc: Descriptor, offset: int, local: memoryview) -> None:
        from ._shm import address_of

        host, port, owner_agent, raddr = desc.where
        agent = self._my_agent()
        peer = self._peer(host, port)
        laddr, n = address_of(local), local.nbytes
        with peer.lock:
            try:
                self._prepare(agent, peer, write, desc, owner_agent, offset, n)
            except OSError as exc:
                self._forget(host, port, peer)
                raise TransportError(f"the nixl owner {desc.owner} went away: {exc}") from exc
        reg = agent.register_memory([(laddr, n, 0, "")], "DRAM")
        handle = None
        try:
            local_descs = agent.get_xfer_descs([(laddr, n, 0)], "DRAM")
            remote_descs = agent.get_xfer_descs([(raddr + offset, n, 0)], "DRAM")
            op = "WRITE" if write else "READ"
            handle = agent.initialize_xfer(op, local_descs, remote_descs, peer.name)
            state = agent.transfer(handle)
            deadline = time.monotonic() + TRANSFER_TIMEOUT
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TransportError(
                        f"nixl {op} with {desc.owner} took over {TRANSFER_TIMEOUT}s"
                    )
                time.sleep(0.00005)
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransportError(f"nixl {op} with {desc.owner} failed ({state})")
        finally:
            if handle is not None:
                agent.release_xfer_handle(handle)
            agent.deregister_memory(reg)

    def _forget(self, host: str, port: int, peer: _Peer) -> None:
        with self._lock:
            if self._peers.get((host, port)) is peer:
                del self._peers[(host, port)]
        peer.sock.close()

    async def move(self, write: bool, desc: Descriptor, offset: int, local: memoryview) -> None:
        desc.check_span(offset, local.nbytes)
        w = desc.where
        if not (
            len(w) == 4
            and isinstance(w[0], str)
            and isinstance(w[1], int)
            and isinstance(w[2], str)
            and isinstance(w[3], int)
        ):
            raise DescriptorError(f"malformed nixl descriptor {w!r}")
        if local.nbytes:
            if self.probe() is not None:
                raise TransportUnavailableError(f"nixl cannot be used here: {self._reason}")
            try:
                await asyncio.to_thread(self._move_sync, write, desc, offset, local)
            except TransportError:
                raise
            except Exception as exc:  # nixl's own exceptions
                raise TransportError(f"nixl transfer with {desc.owner} failed: {exc}") from exc
