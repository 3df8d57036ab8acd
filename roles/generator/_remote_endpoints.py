"""A generator's parts on other actors: routed experts on expert hosts
(:mod:`orchestr.roles.experts`) and the core attention of long decodes on attention servers
(:mod:`orchestr.roles.attention`), with the endpoint that switches the experts' routing."""

from __future__ import annotations

import asyncio
from typing import Any

import orchestr as oc
from orchestr.roles.attention import AttentionOffload
from orchestr.roles.experts import ExpertClient, ExpertMap, attach_experts

from ._paged_engine import PagedEngine

__all__ = ["RemoteEndpoints"]

EXPERT_OPTIONS = ("on_lost", "wait_s", "poll_s", "window", "router_bias", "ffn_shards")
ATTENTION_OPTIONS = ("min_tokens",)


class RemoteEndpoints:
    _engine: Any
    _lock: asyncio.Lock
    _experts: ExpertClient | None
    _offload: AttentionOffload | None

    def _init_remote(
        self,
        name: str,
        hosts: Any,
        expert_options: dict[str, Any] | None,
        servers: Any,
        attention_options: dict[str, Any] | None,
    ) -> None:
        """Attach expert ``hosts`` and attention ``servers`` (either ``None``: none). Raises
        :class:`ConfigError` for an engine other than the paged one, an expert option that does
        not fit the model,
        attention without the paged kernel, or an unknown option."""
        self._experts = self._offload = None
        for what, given, options, known in (
            ("expert", hosts, expert_options, EXPERT_OPTIONS),
            ("attention", servers, attention_options, ATTENTION_OPTIONS),
        ):
            if given is None and options:
                raise oc.ConfigError(f"{what}_options apply with {what} actors given")
            unknown = sorted(set(options or {}) - set(known))
            if unknown:
                raise oc.ConfigError(f"unknown {what} option(s) {unknown}; known: {list(known)}")
            if given is not None and not isinstance(self._engine, PagedEngine):
                raise oc.ConfigError(
                    f"{what} actors serve the paged engine's model; this generator runs "
                    f"{type(self._engine).__name__}"
                )
        if hosts is not None:
            self._experts = attach_experts(
                self._engine.model, hosts, engine=name, **(expert_options or {})
            )
        if servers is not None:
            runner = self._engine._runner
            if runner.ops is None:
                raise oc.ConfigError("attention servers take decodes from the paged kernel")
            keys = self._engine._kv.keys[0]  # [blocks, block_size, kv_heads, head_dim]
            runner.offload = self._offload = AttentionOffload(
                servers, asyncio.get_running_loop(), memory=self._engine.kv_memory,
                layout=self._engine.kv_layout, block_size=keys.shape[1], kv_heads=keys.shape[2],
                head_dim=keys.shape[3],
                min_tokens=(attention_options or {}).get("min_tokens", 1024),
            )  # fmt: skip

    def _remote_stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self._experts is not None:
            out["experts"] = self._experts.stats()
        if self._offload is not None:
            out["attention"] = self._offload.stats()
        return out

    @oc.endpoint(concurrent=True)
    async def route_experts(self, holders: dict[int, list[list[int]]] | None = None) -> None:
        """Route the sparse layers' experts by ``holders`` (``[layer][expert]``: host ranks;
        ``None``: ask the hosts) from the next engine step on: a rebalance's switch. Blocks on
        the step in progress. Raises :class:`~orchestr.ConfigError` without expert hosts and
        :class:`~orchestr.roles.ExpertUnavailableError` for a map that leaves an expert
        without a host (the old one stays). Cancel-safe: the switch is made or not."""
        if self._experts is None:
            raise oc.ConfigError("this generator has no expert hosts (expert_hosts=)")
        async with self._lock:
            if holders is None:
                await self._experts.refresh()
            else:
                self._experts.use(ExpertMap(holders))
