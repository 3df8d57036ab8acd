"""A generator's parts on other actors: routed experts on expert hosts
(:mod:`orchestr.roles.experts`) and the core attention of long decodes on attention servers
(:mod:`orchestr.roles.attention`). The generator's ``route_experts`` endpoint delegates
here."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import orchestr as oc
from orchestr.roles.attention import AttentionOffload
from orchestr.roles.experts import ExpertClient, ExpertMap, attach_experts

from ._core._contract import Engine
from ._core._options import AttentionOptions, ExpertOptions
from ._engines._paged import PagedEngine

__all__ = ["RemoteParts"]


class RemoteParts:
    """``engine``'s experts on ``experts.hosts`` and long decodes' attention on
    ``attention.servers`` (either ``None``: none). Made on the actor's event loop. Raises
    :class:`ConfigError` for an engine other than the paged one, an expert option that does
    not fit the model, or attention without the paged kernel."""

    def __init__(
        self,
        engine: Engine,
        name: str,
        experts: ExpertOptions | None,
        attention: AttentionOptions | None,
    ) -> None:
        self.experts: ExpertClient | None = None
        self.offload: AttentionOffload | None = None
        for what, given in (("expert", experts), ("attention", attention)):
            if given is not None and not isinstance(engine, PagedEngine):
                raise oc.ConfigError(
                    f"{what} actors serve the paged engine's model; this generator runs "
                    f"{type(engine).__name__}"
                )
        if not isinstance(engine, PagedEngine):
            return
        if experts is not None:
            fields = [f.name for f in dataclasses.fields(experts) if f.name != "hosts"]
            options = {k: getattr(experts, k) for k in fields}  # as given: no copies
            self.experts = attach_experts(engine.model, experts.hosts, engine=name, **options)
        if attention is not None:
            runner = engine._runner
            if runner.ops is None:
                raise oc.ConfigError("attention servers take decodes from the paged kernel")
            keys = engine._kv.keys[0]  # [blocks, block_size, kv_heads, head_dim]
            runner.offload = self.offload = AttentionOffload(
                attention.servers,
                asyncio.get_running_loop(),
                memory=engine.kv_memory,
                layout=engine.kv_layout,
                block_size=keys.shape[1],
                kv_heads=keys.shape[2],
                head_dim=keys.shape[3],
                min_tokens=attention.min_tokens,
            )

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.experts is not None:
            out["experts"] = self.experts.stats()
        if self.offload is not None:
            out["attention"] = self.offload.stats()
        return out

    async def route(self, holders: dict[int, list[list[int]]] | None) -> None:
        """Route the experts by ``holders`` (``None``: ask the hosts), between steps. Raises
        :class:`~orchestr.ConfigError` without expert hosts and
        :class:`~orchestr.roles.ExpertUnavailableError` for a map that leaves an expert
        without a host (the old one stays)."""
        if self.experts is None:
            raise oc.ConfigError("this generator has no expert hosts (expert_hosts=)")
        if holders is None:
            await self.experts.refresh()
        else:
            self.experts.use(ExpertMap(holders))
