"""What the head's groups of RPCs (:mod:`._head_meshes`, :mod:`._head_jobs`) share: the head's
settings and state, and the few helpers they call, which :class:`~._head.HeadService`
provides."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestr.config import Config
from orchestr.protos import orchestr_pb2 as pb

from ._headstate import HeadState
from ._headstore import MeshRecord
from ._records import ActorRecord

if TYPE_CHECKING:
    from orchestr._control._grpc import ControlChannel
    from orchestr.fabric.optical import FabricManager

    from ._submitted import JobManager

__all__ = ["HeadBase"]


class HeadBase:
    token: str
    config: Config
    state: HeadState
    meshes: dict[str, MeshRecord]
    _dirty_meshes: set[str]
    _watchers: set[asyncio.Queue[pb.ActorEvent | None]]
    #: The open registration stream of each actor a program of its own hosts.
    _host_streams: dict[str, object]
    jobs: JobManager | None
    log_dir: Path | None
    fabric: FabricManager | None

    def save(self) -> None:
        """Write what changed to the head's store (the service does)."""
        raise NotImplementedError

    def _channel(self, address: str) -> ControlChannel:
        raise NotImplementedError

    def _notify(self, actor_id: str) -> None:
        raise NotImplementedError

    async def _wait_while(self, record: ActorRecord, still: Any, limit_s: float) -> None:
        raise NotImplementedError
