"""Mesh handles and the call adverbs (``call``, ``call_one``, ``choose``, ``stream``,
``broadcast``). A handle is plain data (ids and addresses), so it can be passed to other
actors as an argument and used there."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from orchestr.errors import MeshError
from orchestr.fabric.lowlevel import check_fallback

from . import _registry
from ._bulk import fanout
from ._client import current_client

__all__ = ["EXT_MESH", "Endpoint", "Member", "Mesh"]

EXT_MESH = _registry.EXT_MESH


@dataclasses.dataclass(frozen=True)
class Member:
    actor_id: str
    address: str
    rank: int


class Mesh:
    """A handle to a group of actors of one class, indexed by rank.

    ``mesh[i]`` and ``mesh[a:b]`` are meshes too. Endpoints are attributes: ``mesh.add.call(1)``.
    """

    def __init__(
        self,
        mesh_id: str,
        name: str,
        class_path: str,
        members: Sequence[Member],
        endpoints: Sequence[str],
        retry: bool = False,
    ) -> None:
        self.mesh_id = mesh_id
        self.name = name
        self.class_path = class_path
        self.members = tuple(members)
        self.endpoints = tuple(endpoints)
        #: At-least-once: calls in flight when a member dies go to its restarted incarnation.
        self.retry = retry

    def __len__(self) -> int:
        return len(self.members)

    def __iter__(self) -> Iterator[Mesh]:
        for i in range(len(self.members)):
            yield self[i]

    def __getitem__(self, key: int | slice) -> Mesh:
        if isinstance(key, slice):
            members = self.members[key]
        elif isinstance(key, int):
            try:
                members = (self.members[key],)
            except IndexError:
                raise IndexError(
                    f"mesh {self.name!r} has {len(self.members)} members; index {key} is out of range"
                ) from None
        else:
            raise TypeError(f"index a mesh with an int or a slice, not {type(key).__name__}")
        return Mesh(self.mesh_id, self.name, self.class_path, members, self.endpoints, self.retry)

    def __getattr__(self, name: str) -> Endpoint:
        if name.startswith("_") or name not in self.endpoints:
            raise AttributeError(
                f"{self.name} has no endpoint {name!r}; endpoints: {', '.join(self.endpoints) or 'none'}"
            )
        return Endpoint(self, name, None)

    def __repr__(self) -> str:
        ranks = [m.rank for m in self.members]
        return f"<Mesh {self.name} ranks={ranks} class={self.class_path}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mesh) and (self.mesh_id, self.members) == (
            other.mesh_id,
            other.members,
        )

    def __hash__(self) -> int:
        return hash((self.mesh_id, self.members))

    def label(self, member: Member) -> str:
        return f"{self.name}[{member.rank}]"


class Endpoint:
    """One endpoint of a mesh, with the ways to call it."""

    _round_robin = itertools.count()

    def __init__(
        self, mesh: Mesh, name: str, timeout: float | None, fallback: str | None = None
    ) -> None:
        self.mesh = mesh
        self.name = name
        self.timeout = timeout
        self.fallback = fallback

    def options(self, *, timeout: float | None = None, fallback: str | None = None) -> Endpoint:
        """The same endpoint with per-call options: ``timeout``, a deadline in seconds (default
        ``Config.call_timeout``), and ``fallback``, ``"allow"`` or ``"error"`` when a large
        value cannot take the transport it should (default ``Config.transport_fallback``)."""
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be positive, got {timeout!r}")
        if fallback is not None:
            check_fallback(fallback)
        return Endpoint(
            self.mesh,
            self.name,
            self.timeout if timeout is None else timeout,
            self.fallback if fallback is None else fallback,
        )

    def _send(
        self, member: Member, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> asyncio.Future[Any]:
        return current_client().call(
            member.address,
            member.actor_id,
            self.mesh.label(member),
            self.name,
            args,
            kwargs,
            self.timeout,
            self.fallback,
            self.mesh.retry,
        )

    def call(self, *args: Any, **kwargs: Any) -> asyncio.Future[list[Any]]:
        """Call every member; resolves to the results in rank order.

        Raises the first member's error if any fails. Not idempotent: each call runs once per member.
        """
        if not self.mesh.members:
            raise MeshError(f"mesh {self.mesh.name!r} is empty")
        with fanout():  # a large argument is copied once for all members on this host
            return asyncio.gather(*[self._send(m, args, kwargs) for m in self.mesh.members])

    def call_one(self, *args: Any, **kwargs: Any) -> asyncio.Future[Any]:
        """Call the mesh's only member; raises :class:`MeshError` unless it has exactly one."""
        if len(self.mesh.members) != 1:
            raise MeshError(
                f"call_one needs a mesh of exactly one actor, but {self.mesh.name!r} has "
                f"{len(self.mesh.members)}; pick one with mesh[i], or use call/choose"
            )
        return self._send(self.mesh.members[0], args, kwargs)

    def choose(self, *args: Any, **kwargs: Any) -> asyncio.Future[Any]:
        """Call one member: the one with the fewest calls in flight from this process, ties
        broken round-robin."""
        members = self.mesh.members
        if not members:
            raise MeshError(f"mesh {self.mesh.name!r} is empty")
        client = current_client()
        start = next(self._round_robin) % len(members)
        best = min(
            range(len(members)),
            key=lambda i: (client.inflight(members[(start + i) % len(members)].actor_id), i),
        )
        return self._send(members[(start + best) % len(members)], args, kwargs)

    async def stream(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        """Call every member and yield results in the order they finish.

        Blocks on the next result to finish; raises a member's failure (:class:`ActorError`,
        :class:`ActorDiedError`, :class:`CallTimeoutError`) when it is its turn, and
        :class:`MeshError` for an empty mesh. Leaving the loop early (``break``, an error,
        cancellation) cancels the calls not yet read: their results are dropped, and an endpoint
        already running on its actor runs to its end there."""
        if not self.mesh.members:
            raise MeshError(f"mesh {self.mesh.name!r} is empty")
        with fanout():
            futures = [self._send(m, args, kwargs) for m in self.mesh.members]
        try:
            for next_done in asyncio.as_completed(futures):
                yield await next_done
        finally:
            for f in futures:
                f.cancel()

    def broadcast(self, *args: Any, **kwargs: Any) -> None:
        """Send to every member without waiting; an error is logged by the actor that raised it."""
        client = current_client()
        with fanout():
            for m in self.mesh.members:
                client.send(m.address, m.actor_id, self.name, args, kwargs)


def _mesh_to_wire(mesh: Mesh) -> list[Any]:
    return [
        mesh.mesh_id,
        mesh.name,
        mesh.class_path,
        list(mesh.endpoints),
        [[m.actor_id, m.address, m.rank] for m in mesh.members],
        mesh.retry,
    ]


def _mesh_from_wire(data: Any) -> Mesh:
    mesh_id, name, class_path, endpoints, members, retry = data
    return Mesh(
        mesh_id,
        name,
        class_path,
        [Member(a, addr, r) for a, addr, r in members],
        endpoints,
        bool(retry),
    )


_registry.register_ext(Mesh, EXT_MESH, _mesh_to_wire, _mesh_from_wire)
