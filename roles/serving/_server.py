"""One call from a cluster to an OpenAI app: :func:`openai_server`."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from starlette.applications import Starlette

import orchestr as oc

from ..experts import spawn_expert_hosts
from ..generator._actor import Generator
from ..generator._core._options import ExpertOptions, KVOptions, as_options
from ..generator._kv._store_link import kv_block_bytes
from ..kvstore import KVStore, KVWriter
from ._disagg import MIN_TOKENS
from ._frontdoor import FrontDoor
from ._http import openai_app
from ._router import Router
from ._served import ServedModel

__all__ = ["openai_server"]


@contextlib.asynccontextmanager
async def openai_server(
    ctx: oc.JobContext,
    checkpoint: str | os.PathLike[str],
    *,
    generators: int = 1,
    engine: str = "paged",
    names: Sequence[str] = (),
    router: str | Router = "kv",
    api_key: str | None = None,
    max_pending: int = 256,
    resend: bool = False,
    restarts: int = 3,
    options: Mapping[str, Any] | None = None,
    kv_store_blocks: int = 0,
    prefill: int = 0,
    prefill_min_tokens: int = MIN_TOKENS,
    prefill_overlap: bool = True,
    spill_at: int | None = None,
    placement: Mapping[str, Mapping[str, Any]] | None = None,
    expert_hosts: int = 0,
    micro_batches: int = 1,
) -> AsyncIterator[Starlette]:
    """Spawn ``generators`` :class:`~orchestr.roles.Generator` actors of ``checkpoint`` on
    ``ctx``'s cluster (``oc.open_local_cluster()`` or ``oc.connect(address)``), start a
    :class:`FrontDoor` over them and yield its OpenAI app, to mount in an app of your own or
    serve with uvicorn. On exit the front door closes (requests in flight end) and the
    generators stop. A generator that dies is restarted up to ``restarts`` times, then left
    dead while the others serve. ``router`` is a policy's name or a :class:`Router` (say, the
    kv policy with another ``prefill_weight``). ``options`` are more keywords for the generators
    (``max_batch``, ``kv``, ``torch_threads``...). With ``kv_store_blocks`` a
    :class:`~orchestr.roles.KVStore` of that many blocks in host memory backs the generators'
    prefix caches (paged engine, float32 blocks; its namespaces are this deployment's alone)
    and the router counts its blocks. With
    ``prefill`` generators more, spawned beside them, prompts of ``prefill_min_tokens`` or
    more are prefilled on those and decoded on the others (:mod:`._disagg`; 0: every
    generator does both; ``prefill_overlap``: each prompt's KV is read layer by layer as it
    is computed; ``spill_at``: requests per decode generator beyond which they are served
    whole on the prefill pool). ``placement`` gives ``ctx.spawn``'s placement keywords
    (``resources``, ``labels``...) per pool, ``"decode"`` and ``"prefill"``: to pin the two
    pools to different hosts. With ``expert_hosts`` (a MoE checkpoint) that many
    :class:`~orchestr.roles.ExpertHost` actors hold the routed experts, spread evenly (with
    replicas filling whole hosts), and the generators run attention and route to them
    (attention/FFN disaggregation); ``micro_batches`` > 1 splits each engine step into that many
    ping-pong micro-batches.

    Blocks on the spawn (the checkpoints load); raises ``ConfigError`` for a folder that is
    not a checkpoint and what ``ctx.spawn`` raises."""
    folder = os.path.abspath(os.fspath(checkpoint))  # noqa: ASYNC240 (no waiting: a getcwd)
    model = ServedModel(folder, names or [os.fspath(checkpoint)])
    options = dict(options or {})
    if prefill and engine not in ("paged", "sim"):
        raise oc.ConfigError("prefill generators hand off the paged engine's KV blocks")
    if (expert_hosts or micro_batches != 1) and engine != "paged":
        raise oc.ConfigError("expert hosts and micro-batches serve the paged engine's model")
    kv = as_options(KVOptions, options.get("kv"), "kv") or KVOptions()
    if micro_batches != 1:
        options["kv"] = kv = dataclasses.replace(kv, micro_batches=micro_batches)
    placement = dict(placement or {})
    if set(placement) - {"decode", "prefill"}:
        raise oc.ConfigError(f"placement names pools 'decode' and 'prefill', got {placement}")
    pools = {"decode": ("generator", generators), "prefill": ("prefill", prefill)}
    meshes: dict[str, oc.Mesh] = {}
    store = hosts = None
    try:
        if kv_store_blocks:
            block = kv_block_bytes(folder, kv.block_size, engine=engine)
            store = await ctx.spawn(KVStore, block, kv_store_blocks, name="kvstore")
            # the deployment's generators write and read the store's namespaces as one writer
            options["kv_store"] = KVWriter(store, secrets.token_urlsafe(24))
        if expert_hosts:
            threads = {k: v for k, v in options.items() if k == "torch_threads"}
            hosts = await spawn_expert_hosts(ctx, folder, expert_hosts, **threads)
            experts = options.get("experts")  # the options given, with the hosts made here
            if isinstance(experts, ExpertOptions):
                options["experts"] = dataclasses.replace(experts, hosts=hosts)
            else:
                options["experts"] = {**dict(experts or {}), "hosts": hosts}
        for pool, (name, n) in pools.items():
            if n:
                meshes[pool] = await ctx.spawn(
                    Generator,
                    n=n,
                    name=name,
                    restart=oc.RestartPolicy(max_restarts=restarts),
                    # a generator out of restarts is left dead: the others keep serving
                    supervise=lambda failure: "restart" if failure.can_restart else "handle",
                    checkpoint=folder,
                    engine=engine,
                    **dict(placement.get(pool) or {}),
                    **options,
                )
    except BaseException:
        for m in [*meshes.values(), store, hosts]:
            if m is not None:
                await ctx.stop(m)
        raise
    mesh = meshes["decode"]
    try:
        async with FrontDoor(
            mesh,
            router=router,
            max_pending=max_pending,
            resend=resend,
            store=store,
            prefill=meshes.get("prefill"),
            prefill_min_tokens=prefill_min_tokens,
            prefill_overlap=prefill_overlap,
            spill_at=spill_at,
        ) as front:
            yield openai_app(front, model, api_key=api_key)
    finally:
        for m in [*meshes.values(), store, hosts]:
            if m is not None:
                await ctx.stop(m)
