"""Actors a job's own program hosts, and meshes found by name.

A program that is not an orchestr worker (a web service, a cache service) can host an actor it
built itself: :meth:`Hosting.serve` listens for calls in this process, registers the actor
with the head as a mesh of one, and keeps that registration open. Other jobs find it by name
(:func:`lookup`) and call it as any other actor. The registration is a stream the head holds:
when this program exits or is killed, the stream ends and the head records the actor dead,
so its callers get :class:`~orchestr.ActorDiedError` instead of waiting. When the head
restarts, the program registers the actor again with the ids it was given.
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog

from orchestr._actor._actor import Actor, class_path
from orchestr._actor._host import ActorHost
from orchestr._call._mesh import Member, Mesh
from orchestr._call._server import CallServer
from orchestr._control._convert import ActorInfo, MeshInfo
from orchestr._control._head_client import HeadClient, HostRegistration
from orchestr.config import Config
from orchestr.errors import ConfigError, ControlPlaneError, MeshError, OrchestrError
from orchestr.tasks import TaskOwner

__all__ = ["Hosting", "lookup"]

log = structlog.get_logger("orchestr.driver")


class _Hosted:
    def __init__(self, actor: Actor, info: MeshInfo, registration: HostRegistration) -> None:
        self.actor = actor
        self.info = info
        self.registration = registration
        self.task: asyncio.Task[None] | None = None


class Hosting:
    """The actors this program hosts: one call server for all of them, started with the
    first, and each one's registration with the head."""

    def __init__(self, head: HeadClient, token: str, config: Config) -> None:
        self._head = head
        self._token = token
        self._config = config
        self._server: CallServer | None = None
        self._hosted: dict[str, _Hosted] = {}  # by mesh id
        self._tasks = TaskOwner()  # each hosted actor's keeper of its registration

    def hosts(self, mesh: Mesh) -> bool:
        return mesh.mesh_id in self._hosted

    async def serve(self, actor: Actor, name: str) -> Mesh:
        if not isinstance(actor, Actor):
            raise ConfigError(f"serve_actor takes an Actor instance, got {actor!r}")
        if any(h.actor is actor for h in self._hosted.values()):
            raise ConfigError(f"{actor!r} is hosted already")
        if not isinstance(name, str):
            raise ConfigError(f"name must be a string, got {name!r}")
        if self._server is None:
            server = CallServer(self._token, self._config)
            await server.start(f"tcp://{self._config.bind_host}:0")
            self._server = server
        endpoints = sorted(type(actor)._orchestr_endpoints)
        registration = self._head.host_actor(
            name, class_path(type(actor)), self._server.url, endpoints
        )
        try:
            info = await registration.mesh()
        except BaseException:
            registration.cancel()
            raise
        (member,) = info.members
        actor.rank, actor.mesh_name, actor.actor_id = 0, info.name, member.actor_id
        self._server.actors[member.actor_id] = ActorHost(actor, f"{info.name}[0]", member.actor_id)
        hosted = self._hosted[info.mesh_id] = _Hosted(actor, info, registration)
        hosted.task = self._tasks.start(self._keep(hosted), name=f"orchestr-host-{info.name}")
        log.info("hosting", actor=f"{info.name}[0]", actor_id=member.actor_id)
        return Mesh(
            info.mesh_id,
            info.name,
            info.class_path,
            [Member(member.actor_id, member.call_address, 0)],
            endpoints,
        )

    async def _keep(self, hosted: _Hosted) -> None:
        """Hold the registration; when the head goes away, register again (with the same ids)
        once a heartbeat interval until it answers."""
        info, (member,) = hosted.info, hosted.info.members
        while True:
            try:
                await hosted.registration.held()
            except ControlPlaneError as exc:
                log.warning("the head dropped a hosted actor's registration", error=str(exc))
            hosted.registration.cancel()
            while True:
                await asyncio.sleep(self._config.heartbeat_interval)
                assert self._server is not None
                hosted.registration = self._head.host_actor(
                    info.name,
                    info.class_path,
                    self._server.url,
                    member.endpoints,
                    mesh_id=info.mesh_id,
                    actor_id=member.actor_id,
                )
                try:
                    await hosted.registration.mesh()
                except ControlPlaneError:
                    hosted.registration.cancel()
                    continue
                except OrchestrError as exc:  # the head knows it as stopped, or another's
                    log.error("cannot host the actor again", actor=member.actor_id, error=str(exc))
                    hosted.registration.cancel()
                    host = self._server.actors.pop(member.actor_id, None)
                    if host is not None:
                        await host.aclose()
                    return
                log.info("hosted actor registered again", actor_id=member.actor_id)
                break

    async def stop(self, mesh: Mesh) -> None:
        """Stop hosting ``mesh``'s actor: the head records it stopped, then the registration
        ends and calls to it are refused."""
        if mesh.mesh_id in self._hosted:
            await self._head.stop_mesh(mesh.mesh_id)
            await self._end(mesh.mesh_id)

    async def aclose(self) -> None:
        """Stop hosting everything (each is recorded stopped when the head can be reached)
        and close the call server."""
        for mesh_id in list(self._hosted):
            with contextlib.suppress(OrchestrError):
                await self._head.stop_mesh(mesh_id)
            await self._end(mesh_id)
        await self._tasks.aclose()
        if self._server is not None:
            await self._server.aclose()
            self._server = None

    async def _end(self, mesh_id: str) -> None:
        """End the registration of ``mesh_id``'s actor and stop serving its calls."""
        hosted = self._hosted.pop(mesh_id, None)
        if hosted is None:
            return
        if hosted.task is not None:
            hosted.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await hosted.task
        hosted.registration.cancel()
        if self._server is not None:
            host = self._server.actors.pop(hosted.info.members[0].actor_id, None)
            if host is not None:
                await host.aclose()


def lookup(actors: list[ActorInfo], name: str) -> Mesh:
    """The live mesh named ``name`` among ``actors`` (the head's records): all of its
    members, in rank order. Raises :class:`MeshError` when no mesh of that name has a live
    member, or several do."""
    live = {a.mesh_id for a in actors if a.name == name and a.state == "alive"}
    if not live:
        raise MeshError(f"no live mesh is named {name!r}")
    if len(live) > 1:
        raise MeshError(
            f"{len(live)} live meshes are named {name!r} ({', '.join(sorted(live))}); give "
            f"meshes that others look up a name of their own"
        )
    (mesh_id,) = live
    members = sorted((a for a in actors if a.mesh_id == mesh_id), key=lambda a: a.rank)
    first = next(a for a in members if a.state == "alive")
    return Mesh(
        mesh_id,
        name,
        first.class_path,
        [Member(a.actor_id, a.call_address, a.rank) for a in members],
        first.endpoints,
    )
