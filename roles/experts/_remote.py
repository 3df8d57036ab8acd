"""A generator's side of expert hosts: its MoE layers route here and their routed experts run
on the hosts; or a dense model's MLPs run there, in slices.

:func:`attach_experts` hands each sparse layer of a :class:`CausalLM` an
:class:`ExpertClient` in place of its own routed experts (which it then drops): the layer
still routes and runs its shared expert itself. In a dense model each layer's MLP goes
instead (its weights dropped), cut into ``ffn_shards`` slices of its width, as experts every
token is routed to with weight 1: the hosts' partial sums add up to the MLP's output, and
each host reads only its slices' weights per call (the FFN's tensor parallelism, through the
experts' dispatch, replicas and failover). The engine's step runs in a worker thread
(the generator's ``in_thread``); :meth:`ExpertClient.run` is called there, once per MoE layer,
and waits on the actor's event loop for one call per host with work (all in flight at once),
then combines. It must not be called on the loop's own thread: that would wait on itself.

The hosts say what they hold (``hosted``) before the first layer runs; the map is rebuilt
when :meth:`ExpertClient.refresh` is called between two steps.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import torch
from torch import nn

import orchestr as oc
from orchestr.roles._common._hf._layers import MLP, CausalLM, SparseMoE
from orchestr.roles._common._hf._load import ffn_units

from ._dispatch import ExpertMap, LoadWindow, Send
from ._host import ExpertUnavailableError
from ._metrics import ExpertMetrics

__all__ = ["ON_LOST", "ExpertClient", "attach_experts"]

ON_LOST = ("fail", "wait")
#: How long a host may take to say what it holds before it counts as holding nothing.
ASK_S = 5.0


class ExpertClient:
    """Runs routed experts of ``layers`` (of ``experts`` each) on the actors of ``hosts``
    (an :class:`ExpertHost` mesh) from an engine thread, with ``loop`` the actor's loop.

    A host that dies (its call fails with anything but an error its endpoint raised) leaves
    the map, and the pairs it was sent go again to the experts' other replicas. An expert no
    live host holds is ``on_lost``: ``"fail"`` raises :class:`ExpertUnavailableError` naming
    it; ``"wait"`` asks the hosts again every ``poll_s`` until one holds it (a restarted or
    newly loaded host) and sends then, failing the same way after ``wait_s``."""

    def __init__(
        self,
        hosts: oc.Mesh,
        layers: Sequence[int],
        experts: int,
        loop: asyncio.AbstractEventLoop,
        *,
        window: int = 64,
        engine: str = "",
        on_lost: str = "fail",
        wait_s: float = 30.0,
        poll_s: float = 0.2,
        noun: str = "expert",
    ) -> None:
        if on_lost not in ON_LOST:
            raise oc.ConfigError(f"on_lost must be one of {', '.join(ON_LOST)}, got {on_lost!r}")
        if not (wait_s >= 0 and poll_s > 0 and window >= 1):
            raise oc.ConfigError(
                f"wait_s >= 0, poll_s > 0 and window >= 1, got {wait_s}, {poll_s}, {window}"
            )
        self.hosts = [hosts[i] for i in range(len(hosts))]
        self.layers, self.experts = list(layers), experts
        self.loop = loop
        self._loop_thread = threading.get_ident()  # made on the loop (attach_experts)
        self.window = LoadWindow(self.layers, experts, window)
        self.metrics = ExpertMetrics(engine)
        self.on_lost, self.wait_s, self.poll_s = on_lost, wait_s, poll_s
        self.noun = noun
        self.map: ExpertMap | None = None
        self.calls = 0
        self.lost_hosts = 0
        self.resent_pairs = 0

    async def refresh(self) -> ExpertMap:
        """Ask every host what it holds and route by that from the next layer on (a host that
        does not answer holds nothing). Raises :class:`ExpertUnavailableError` when an expert
        of a layer is held by none (the previous map stays). Blocks on one call per host;
        cancel-safe."""
        answers = await asyncio.gather(
            *(h.hosted.options(timeout=ASK_S).call_one() for h in self.hosts),
            return_exceptions=True,
        )
        hosted = [a if isinstance(a, dict) else {} for a in answers]
        self.use(ExpertMap.of_hosts(hosted, self.experts, self.layers))
        assert self.map is not None
        return self.map

    def use(self, new: ExpertMap) -> None:
        """Route by ``new`` from the next layer on. Raises :class:`ExpertUnavailableError`
        for a map that lacks a layer or an expert (nothing changes then)."""
        holes = new.holes(self.layers, self.experts)
        if holes:
            layer, expert = holes[0]
            raise ExpertUnavailableError(
                f"no live expert host holds {self.noun} {expert} of layer {layer}"
                + (f" (and {len(holes) - 1} more)" if len(holes) > 1 else "")
            )
        self.map = new

    def run(
        self, layer: int, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Layer ``layer``'s routed experts over tokens ``x`` ``[n, hidden]`` routed as
        ``experts``/``weights`` ``[n, k]``: the weighted sums ``[n, hidden]``. Blocks the
        calling (engine) thread on the hosts. Raises :class:`ExpertUnavailableError` when an
        expert it needs is held by no live host (after ``wait_s`` under ``on_lost="wait"``)."""
        if threading.get_ident() == self._loop_thread:
            raise RuntimeError("expert hosts are called from the engine's thread, not the loop's")
        work = self._run(layer, x, experts.reshape(len(x), -1), weights.reshape(len(x), -1))
        return asyncio.run_coroutine_threadsafe(work, self.loop).result()

    def run_all(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """:meth:`run` with every token routed to every unit with weight 1: a dense layer's
        MLP over ``x`` ``[n, hidden]`` as the sum of its slices."""
        n = len(x)
        units = torch.arange(self.experts).expand(n, self.experts)
        return self.run(layer, x, units, torch.ones(n, self.experts, dtype=x.dtype))

    async def _run(
        self, layer: int, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        if self.map is None:
            await self._covered(self.refresh)
        assert self.map is not None
        counts = self.window.add(layer, experts)
        self.metrics.routed(layer, counts, self.window.of(layer), self.map)
        out = torch.zeros_like(x)
        sends = self.map.plan(layer, experts, weights)
        while sends:
            results = await asyncio.gather(
                *(self._call(layer, x, s) for s in sends), return_exceptions=True
            )
            again: list[Send] = []
            dead: set[int] = set()
            for send, result in zip(sends, results, strict=True):
                if isinstance(result, torch.Tensor):
                    out.index_add_(0, send.rows, result.to(out.dtype))
                    continue
                if not isinstance(result, Exception):
                    raise result
                if isinstance(result, oc.ActorError):
                    if "ExpertUnavailableError" not in str(result):
                        raise result  # the host's endpoint refused: a bug, not a loss
                else:  # the call did not reach a live host: it is gone
                    dead.add(send.host)
                again.append(send)
            sends = await self._resend(layer, again, dead) if again else []
        return out

    async def _call(self, layer: int, x: torch.Tensor, send: Send) -> torch.Tensor:
        self.calls += 1
        y: torch.Tensor = await self.hosts[send.host].forward.call_one(
            layer, x[send.rows], send.slot, send.experts, send.weights, self.experts
        )
        return y

    async def _resend(self, layer: int, failed: list[Send], dead: set[int]) -> list[Send]:
        """The failed sends' pairs planned again (each pair its own row of the original
        tokens): without the ``dead`` hosts, over a map asked afresh when it no longer covers
        every expert or a live host no longer held what it was sent (a rebalance)."""
        assert self.map is not None
        self.lost_hosts += len(dead)
        self.map = self.map.without(dead)
        self.metrics.failed(len(dead), sum(len(s.experts) for s in failed))
        stale = len(dead) < len({s.host for s in failed})
        await self._covered(self.refresh if stale else self._check_or_refresh)
        assert self.map is not None
        token = torch.cat([s.rows[s.slot] for s in failed])
        experts = torch.cat([s.experts for s in failed])
        weights = torch.cat([s.weights for s in failed])
        self.resent_pairs += len(token)
        plan = self.map.plan(layer, experts[:, None], weights[:, None])
        return [Send(p.host, token[p.rows], p.slot, p.experts, p.weights) for p in plan]

    async def _check_or_refresh(self) -> ExpertMap:
        assert self.map is not None
        if self.map.holes(self.layers, self.experts):
            return await self.refresh()
        return self.map

    async def _covered(self, attempt: Callable[[], Awaitable[ExpertMap]]) -> None:
        """``attempt`` until the map covers every expert: once under ``"fail"``, every
        ``poll_s`` up to ``wait_s`` under ``"wait"``."""
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                await attempt()
                return
            except ExpertUnavailableError:
                if self.on_lost == "fail" or time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(self.poll_s)
            attempt = self.refresh

    def stats(self) -> dict[str, Any]:
        """The load window (``load[layer][expert]`` tokens), host calls made, hosts lost,
        pairs sent again, and what each host holds as last known."""
        return {
            "load": self.window.load(),
            "calls": self.calls,
            "lost_hosts": self.lost_hosts,
            "resent_pairs": self.resent_pairs,
            "holders": self.map.holders if self.map else {},
        }


def attach_experts(
    model: CausalLM,
    hosts: oc.Mesh,
    *,
    router_bias: Sequence[float] | None = None,
    ffn_shards: int | None = None,
    **options: Any,
) -> ExpertClient:
    """Route ``model``'s sparse layers' experts to ``hosts`` and drop its own copies of them;
    or, for a dense model, every layer's MLP in ``ffn_shards`` slices (default one per host,
    as :func:`spawn_expert_hosts` cuts them; the hosts must cut them the same way).
    ``options`` go to :class:`ExpertClient`; ``router_bias`` (one value per expert) is added
    to every sparse layer's router logits where it picks experts (:class:`SparseMoE`'s
    ``bias``). Call on the actor's event loop (it keeps it). Raises
    :class:`orchestr.ConfigError` for ``hosts`` that is not a mesh, an option that does not
    fit the model, or a bad option."""
    if not isinstance(hosts, oc.Mesh) or len(hosts) == 0:
        raise oc.ConfigError(f"expert_hosts is a mesh of ExpertHost actors, got {hosts!r}")
    cfg = model.config
    dense = cfg.moe is None
    if dense and ffn_shards is None:
        ffn_shards = len(hosts)
    layers, units = ffn_units(cfg, ffn_shards, f"a {cfg.model_type} model")
    if not layers:
        raise oc.ConfigError(f"a {cfg.model_type} model has no experts to host apart")
    if router_bias is not None and (dense or len(router_bias) != units):
        raise oc.ConfigError(f"router_bias has one value per expert of a MoE model ({units})")
    loop = asyncio.get_running_loop()
    client = ExpertClient(
        hosts, layers, units, loop, noun="FFN shard" if dense else "expert", **options
    )
    for i in layers:
        mlp = model.model.layers[i].mlp
        if isinstance(mlp, SparseMoE):
            if router_bias is not None:
                mlp.bias = torch.tensor(router_bias, dtype=torch.float32)
            mlp.remote = functools.partial(client.run, i)
            mlp.experts = nn.ModuleList()
        else:
            assert isinstance(mlp, MLP)
            mlp.remote = functools.partial(client.run_all, i)
            for name in ("gate_proj", "up_proj", "down_proj"):
                delattr(mlp, name)  # held on the hosts now
    return client
