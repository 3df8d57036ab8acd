"""One call from a cluster to an OpenAI app: :func:`openai_server`."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from starlette.applications import Starlette

import orchestr as oc

from ..generator._actor import Generator
from ._frontdoor import FrontDoor
from ._http import ServedModel, openai_app

__all__ = ["openai_server"]


@contextlib.asynccontextmanager
async def openai_server(
    ctx: oc.JobContext,
    checkpoint: str | os.PathLike[str],
    *,
    generators: int = 1,
    engine: str = "paged",
    names: Sequence[str] = (),
    router: str = "kv",
    api_key: str | None = None,
    max_pending: int = 256,
    resend: bool = False,
    restarts: int = 3,
    options: Mapping[str, Any] | None = None,
) -> AsyncIterator[Starlette]:
    """Spawn ``generators`` :class:`~orchestr.roles.Generator` actors of ``checkpoint`` on
    ``ctx``'s cluster (``oc.open_local_cluster()`` or ``oc.connect(address)``), start a
    :class:`FrontDoor` over them and yield its OpenAI app, to mount in an app of your own or
    serve with uvicorn. On exit the front door closes (requests in flight end) and the
    generators stop. A generator that dies is restarted up to ``restarts`` times, then left
    dead while the others serve. ``options`` are more keywords for the generators
    (``max_batch``, ``kv``, ``torch_threads``...).

    Blocks on the spawn (the checkpoints load); raises ``ConfigError`` for a folder that is
    not a checkpoint and what ``ctx.spawn`` raises."""
    folder = os.path.abspath(os.fspath(checkpoint))  # noqa: ASYNC240 (no waiting: a getcwd)
    model = ServedModel(folder, names or [os.fspath(checkpoint)])
    mesh = await ctx.spawn(
        Generator,
        n=generators,
        name="generator",
        restart=oc.RestartPolicy(max_restarts=restarts),
        # a generator out of restarts is left dead: the others keep serving
        supervise=lambda failure: "restart" if failure.can_restart else "handle",
        checkpoint=folder,
        engine=engine,
        **dict(options or {}),
    )
    try:
        async with FrontDoor(mesh, router=router, max_pending=max_pending, resend=resend) as front:
            yield openai_app(front, model, api_key=api_key)
    finally:
        await ctx.stop(mesh)
