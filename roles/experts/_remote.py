"""A generator's side of expert hosts: its MoE layers route here and their routed experts run
on the hosts.

:func:`attach_experts` hands each sparse layer of a :class:`CausalLM` an
:class:`ExpertClient` in place of its own routed experts (which it then drops): the layer
still routes and runs its shared expert itself. The engine's step runs in a worker thread
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
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

import orchestr as oc
from orchestr.roles._common._hf._layers import CausalLM, SparseMoE

from ._dispatch import ExpertMap, LoadWindow, Send, combine
from ._host import ExpertUnavailableError

__all__ = ["ExpertClient", "attach_experts"]


class ExpertClient:
    """Runs routed experts of ``layers`` (of ``experts`` each) on the actors of ``hosts``
    (an :class:`ExpertHost` mesh) from an engine thread, with ``loop`` the actor's loop."""

    def __init__(
        self,
        hosts: oc.Mesh,
        layers: Sequence[int],
        experts: int,
        loop: asyncio.AbstractEventLoop,
        *,
        window: int = 64,
    ) -> None:
        self.hosts = [hosts[i] for i in range(len(hosts))]
        self.layers, self.experts = list(layers), experts
        self.loop = loop
        self._loop_thread = threading.get_ident()  # made on the loop (attach_experts)
        self.window = LoadWindow(self.layers, experts, window)
        self.map: ExpertMap | None = None
        self.calls = 0

    async def refresh(self) -> ExpertMap:
        """Ask every host what it holds and route by that from the next layer on. Raises
        :class:`ExpertUnavailableError` when an expert of a layer is held by none (the
        previous map stays). Blocks on one call per host; cancel-safe."""
        hosted = await asyncio.gather(*(h.hosted.call_one() for h in self.hosts))
        try:
            new = ExpertMap.of_hosts(hosted, self.experts)
        except ValueError as exc:
            raise ExpertUnavailableError(f"the expert hosts cannot serve: {exc}") from None
        missing = [layer for layer in self.layers if layer not in new.holders]
        if missing:
            raise ExpertUnavailableError(f"no expert host holds any expert of layer {missing[0]}")
        self.map = new
        return new

    def run(
        self, layer: int, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Layer ``layer``'s routed experts over tokens ``x`` ``[n, hidden]`` routed as
        ``experts``/``weights`` ``[n, k]``: the weighted sums ``[n, hidden]``. Blocks the
        calling (engine) thread on the hosts. Raises :class:`ExpertUnavailableError` when a host
        with work fails, naming the layer and the experts it was asked for."""
        if threading.get_ident() == self._loop_thread:
            raise RuntimeError("expert hosts are called from the engine's thread, not the loop's")
        if self.map is None:
            asyncio.run_coroutine_threadsafe(self.refresh(), self.loop).result()
        assert self.map is not None
        self.window.add(layer, experts)
        sends = self.map.plan(layer, experts, weights)
        outputs = asyncio.run_coroutine_threadsafe(self._send(layer, x, sends), self.loop).result()
        self.calls += len(sends)
        return combine(x, sends, outputs)

    async def _send(self, layer: int, x: torch.Tensor, sends: list[Send]) -> list[torch.Tensor]:
        calls = [
            self.hosts[s.host].forward.call_one(layer, x[s.rows], s.slot, s.experts, s.weights)
            for s in sends
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for send, result in zip(sends, results, strict=True):
            if isinstance(result, BaseException):
                wanted = sorted(set(send.experts.tolist()))
                raise ExpertUnavailableError(
                    f"expert host {send.host} failed running experts {wanted} of layer "
                    f"{layer}: {type(result).__name__}: {result}"
                ) from result
        return [r for r in results if isinstance(r, torch.Tensor)]

    def stats(self) -> dict[str, Any]:
        """The load window (``load[layer][expert]`` tokens), host calls made, and what each
        host holds as last asked."""
        holders = self.map.holders if self.map else {}
        return {"load": self.window.load(), "calls": self.calls, "holders": holders}


def attach_experts(model: CausalLM, hosts: oc.Mesh, *, window: int = 64) -> ExpertClient:
    """Route ``model``'s sparse layers' experts to ``hosts`` and drop its own copies of them.
    Call on the actor's event loop (it keeps it). Raises :class:`orchestr.ConfigError` for a
    model without experts or ``hosts`` that is not a mesh."""
    if not isinstance(hosts, oc.Mesh) or len(hosts) == 0:
        raise oc.ConfigError(f"expert_hosts is a mesh of ExpertHost actors, got {hosts!r}")
    sparse = [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, SparseMoE)]
    moe = model.config.moe
    if moe is None or not sparse:
        raise oc.ConfigError(f"a {model.config.model_type} model has no experts to host apart")
    client = ExpertClient(hosts, sparse, moe.num_experts, asyncio.get_running_loop(), window=window)
    for i in sparse:
        mlp = model.model.layers[i].mlp
        assert isinstance(mlp, SparseMoE)
        mlp.remote = functools.partial(client.run, i)
        mlp.experts = nn.ModuleList()
    return client
