"""Serving on virtual time: the front door's real router over simulated generators, co-located
or with prefill and decode apart.

:func:`simulate_serving` plays a workload of :class:`ServingRequest` (arrival, prompt, output
length) against ``generators`` :class:`~._generation.SimGenerator` (the engine's own scheduler,
closed-form runs of decodes) and routes each arrival with ``orchestr.roles.serving.Router``
(``kv``: Dynamo's cost over the prefix cache each generator's block events describe and its
load in blocks, from :meth:`Scheduler.load`; or ``round_robin``, ``least_loaded``), as the
front door does. The front door's view here is exact: every generator's events and load are
read at each arrival (the live one polls them, so it routes on reports up to a poll old).

With ``prefill`` generators (DistServe's split), a prompt of at least ``min_prefill_tokens``
tokens is first routed over the prefill pool and computed there (as one token that is
thrown away, as ``Generator.prefill`` does), and its KV (``kv_bytes_per_token`` a token) then
crosses the prefill generator's link to the decode generator's (each ``kv_gbps``, shared
max-min fairly by the transfers crossing it, on a :class:`~._flows.FlowNet`). The decode
generator enters the prompt's full blocks into its prefix cache (:meth:`Scheduler.adopt`, as
a handoff does) and continues the request: it computes what the blocks do not hold (the last
partial block), samples the first token, and decodes the rest. Shorter prompts are prefilled
on their decode generator, as the front door's conditional rule does. With ``spill_at``, the
front door's spill rule (``should_spill``) on the requests each pool's least-busy generator
holds sends a request whole (prefill and decode) to the prefill pool when the decode pool is
full.

With ``cpus``, every generator's steps and the serving path's work on each streamed token
(``token_cpu_s``: one thread each, the front door's process and a load generator's on the
same host) share one host's cores (:class:`~._cpu.HostCpu`), as a server on one machine shares
them; the generators then step one step an event.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import resource
import time
from collections.abc import Hashable, Sequence
from typing import Any

from orchestr.roles.serving import Load, Router, should_spill

from ._cpu import HostCpu
from ._engine import Engine, ns
from ._flows import FlowNet
from ._generation import RequestTimes, SimGenerator, StepTimeModel

__all__ = ["ServingRequest", "ServingRun", "simulate_serving"]


@dataclasses.dataclass(frozen=True)
class ServingRequest:
    """One request of a workload: it arrives at ``arrival`` seconds with ``prompt`` and
    generates ``output_tokens`` tokens."""

    id: str
    arrival: float
    prompt: Sequence[int]
    output_tokens: int


@dataclasses.dataclass
class Served:
    """One request's life: arrival, first token, end (virtual seconds), and how it went."""

    id: str
    arrival: float
    prompt_tokens: int
    output_tokens: int
    first_token: float = math.nan
    end: float = math.nan
    cached_tokens: int = 0
    path: str = "colocated"  # or "disaggregated", "prefilled_on_decode", "spilled"
    worker: str = ""  # the generator that decoded it

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float:
        n = self.output_tokens - 1
        return (self.end - self.first_token) / n if n > 0 else 0.0


@dataclasses.dataclass
class ServingRun:
    """A simulated serving run: every request's :class:`Served`, and what it cost."""

    served: list[Served]
    virtual_s: float
    events: int
    wall_s: float
    peak_rss_bytes: int
    steps: int
    runs: int
    kv_bytes: float

    def summary(
        self, ttft_slo_s: float | None = None, tpot_slo_s: float | None = None
    ) -> dict[str, Any]:
        """Throughput, TTFT and TPOT percentiles, and with SLOs the goodput: requests a second
        that met both."""
        done = [s for s in self.served if not math.isnan(s.end)]
        span = max((s.end for s in done), default=0.0) - min((s.arrival for s in done), default=0.0)
        ttft = sorted(s.ttft for s in done)
        tpot = sorted(s.tpot for s in done if s.output_tokens > 1)
        out: dict[str, Any] = {
            "requests": len(self.served),
            "completed": len(done),
            "duration_s": span,
            "requests_per_s": len(done) / span if span else 0.0,
            "output_tokens_per_s": sum(s.output_tokens for s in done) / span if span else 0.0,
            **{f"ttft_s_p{q}": _pct(ttft, q) for q in (50, 90, 99)},
            **{f"tpot_s_p{q}": _pct(tpot, q) for q in (50, 90, 99)},
            "paths": dict(collections.Counter(s.path for s in self.served)),
            "events": self.events,
            "events_per_s": self.events / self.wall_s if self.wall_s else 0.0,
            "wall_s": self.wall_s,
            "peak_rss_bytes": self.peak_rss_bytes,
            "engine_steps": self.steps,
            "closed_form_runs": self.runs,
        }
        if ttft_slo_s is not None or tpot_slo_s is not None:
            good = [
                s
                for s in done
                if (ttft_slo_s is None or s.ttft <= ttft_slo_s)
                and (tpot_slo_s is None or s.tpot <= tpot_slo_s)
            ]
            out["goodput_per_s"] = len(good) / span if span else 0.0
            out["slo_attainment"] = len(good) / len(self.served) if self.served else 0.0
        return out


def _pct(values: list[float], q: int) -> float:
    if not values:
        return math.nan
    return values[min(len(values) - 1, int(q / 100 * len(values)))]


class _Pool:
    """Generators behind one router, as a front door keeps them."""

    def __init__(self, engine: Engine, prefix: str, n: int, router: Router, **gen: Any) -> None:
        self.router = router
        self.gens = {f"{prefix}{i}": SimGenerator(engine, **gen) for i in range(n)}
        self.loads = {name: Load() for name in self.gens}
        self.seen = dict.fromkeys(self.gens, -1)  # each one's changes when last read
        for name in self.gens:
            router.add(name)

    def submit(self, request_id: str, prompt: Sequence[int], max_tokens: int, now: float) -> str:
        """Route a request and submit it there, with the block keys the router made."""
        worker, known = self.route(prompt, now)
        self.gens[worker].submit(request_id, prompt, max_tokens, known)
        return worker

    def route(
        self, prompt: Sequence[int], now: float
    ) -> tuple[str, tuple[tuple[Any, ...], list[bytes]] | None]:
        """The generator for ``prompt``, and its block keys if the rule made them."""
        loads = self.loads
        for name, gen in self.gens.items():  # those that changed since: their events, load
            if gen.changes != self.seen[name]:
                self.seen[name] = gen.changes
                self.router.apply(name, gen.scheduler.pool.take_events())
                loads[name] = Load(*gen.load)
        hashes: list[bytes] = []
        known = None
        if self.router.policy == "kv":  # as the front door: hashed only for the kv rule
            known = next(iter(self.gens.values())).scheduler.keyed(prompt)
            hashes = known[1]
        choice = self.router.choose(hashes, loads, now)
        self.router.expect(choice.worker, hashes, now)
        return choice.worker, known


class _Thread:
    """One thread's work on a host's cores, in turn: what arrives while it runs waits."""

    def __init__(self, cpu: HostCpu) -> None:
        self.cpu, self.pending, self.busy = cpu, 0.0, False

    def add(self, seconds: float) -> None:
        self.pending += seconds
        if not self.busy:
            self._next()

    def _next(self) -> None:
        work, self.pending = self.pending, 0.0
        self.busy = work > 0
        if self.busy:
            self.cpu.run(work, self._next)


def simulate_serving(
    requests: Sequence[ServingRequest],
    model: StepTimeModel,
    *,
    generators: int = 1,
    policy: str = "kv",
    prefill: int = 0,
    prefill_model: StepTimeModel | None = None,
    min_prefill_tokens: int = 64,
    spill_at: int | None = None,
    kv_bytes_per_token: float = 0.0,
    kv_gbps: float = 100.0,
    request_s: float = 0.0,
    handoff_s: float = 0.0,
    num_blocks: int = 4096,
    block_size: int = 16,
    max_batch: int = 256,
    token_budget: int = 2048,
    seed: int = 0,
    closed_form: bool = True,
    cache_outputs: bool = False,
    cpus: float | None = None,
    token_cpu_s: Sequence[float] = (),
) -> ServingRun:
    """Serve ``requests`` on ``generators`` (decode) generators timed by ``model`` and, with
    ``prefill`` > 0, a prefill pool timed by ``prefill_model`` (default ``model``); see the
    module docstring. The serving path's own costs, where measured: ``request_s`` from a
    request's arrival to its generator's queue (the HTTP server, the front door, the call), and
    ``handoff_s`` of a handoff's control calls, after the KV's transfer and before the decode
    side takes the request. ``spill_at``: the front door's spill rule (``should_spill``, on
    the requests each generator holds), a request it spills served whole on the prefill
    pool. ``cache_outputs`` is the schedulers' (off: the outputs are
    placeholders, and cached they would be shared as real outputs are not; the prompts' blocks
    are cached either way). ``cpus``: the host's cores all of it shares, with ``token_cpu_s``
    seconds of work on each streamed token for each of the serving path's threads (see the
    module docstring; without ``cpus`` every generator has a core of its own and the path's
    work takes none). Raises ``ValueError`` for bad counts, a bad policy, a negative time, or
    a request the scheduler refuses (an empty prompt, one that could never fit)."""
    if generators < 1 or prefill < 0:
        raise ValueError(f"generators >= 1 and prefill >= 0, got {generators}, {prefill}")
    if not kv_gbps > 0 or kv_bytes_per_token < 0 or min_prefill_tokens < 1:
        raise ValueError("kv_gbps > 0, kv_bytes_per_token >= 0 and min_prefill_tokens >= 1")
    if spill_at is not None and (isinstance(spill_at, bool) or spill_at < 1):
        raise ValueError(f"spill_at is None or a whole number >= 1, got {spill_at!r}")
    if not (request_s >= 0 and handoff_s >= 0):
        raise ValueError(f"request_s and handoff_s are seconds >= 0: {request_s}, {handoff_s}")
    if not all(t >= 0 for t in token_cpu_s) or (token_cpu_s and cpus is None):
        raise ValueError(f"token_cpu_s are seconds >= 0, with cpus: {list(token_cpu_s)}")
    started = time.perf_counter()
    engine = Engine(seed)
    shape = {
        "num_blocks": num_blocks,
        "block_size": block_size,
        "max_batch": max_batch,
        "token_budget": token_budget,
        "closed_form": closed_form,
        "cache_outputs": cache_outputs,
    }
    served = {r.id: Served(r.id, r.arrival, len(r.prompt), r.output_tokens) for r in requests}
    if len(served) != len(requests):
        raise ValueError("request ids repeat")

    def decoded(times: RequestTimes) -> None:
        s = served[times.id]
        s.first_token = times.first_token  # sampled on the decode side, whatever the path
        if s.path != "disaggregated":  # (the prefill side's hits are the request's)
            s.cached_tokens = times.cached_tokens
        s.end = times.end

    cpu = None if cpus is None else HostCpu(engine, cpus)
    threads = [] if cpu is None else [(_Thread(cpu), t) for t in token_cpu_s]

    def streamed(tokens: int) -> None:
        for thread, seconds in threads:
            thread.add(tokens * seconds)

    decode = _Pool(
        engine,
        "decode",
        generators,
        Router(policy),
        model=model,
        done=decoded,
        cpu=cpu,
        tokens=streamed if threads else None,
        **shape,
    )
    net: FlowNet | None = None
    pre: _Pool | None = None
    moved = [0.0]
    if prefill:

        def prefilled(times: RequestTimes) -> None:
            if served[times.id].path == "spilled":  # served whole on the prefill side
                return decoded(times)
            request = by_id[times.id]
            s = served[times.id]
            s.cached_tokens = times.cached_tokens
            source = where[times.id]
            target, known = decode.route(request.prompt, engine.seconds)
            s.worker = target
            nbytes = kv_bytes_per_token * len(request.prompt)
            moved[0] += nbytes
            path = ((source, "fabric"), ("fabric", target))
            assert net is not None
            net.start(path, nbytes, lambda: later(request, target, known))

        def later(request: ServingRequest, target: str, known: Any) -> None:
            engine.after(handoff_s, handoff, request, target, known, name="handoff calls")

        def handoff(request: ServingRequest, target: str, known: Any) -> None:
            sched = decode.gens[target].scheduler
            if known is None:  # the rule did not hash the prompt
                known = sched.keyed(request.prompt)
            keys = known[1]
            start = sched.cached_run(keys)
            sched.adopt(keys, request.prompt, start, len(keys) - start)
            decode.gens[target].submit(request.id, request.prompt, request.output_tokens, known)

        # spilled requests stream their tokens from the prefill pool (which then also charges
        # the one token each handed-off prefill samples, a token the live one never streams)
        spilled = streamed if threads and spill_at is not None else None
        pre = _Pool(
            engine,
            "prefill",
            prefill,
            Router(policy),
            model=prefill_model or model,
            done=prefilled,
            cpu=cpu,
            tokens=spilled,
            **shape,
        )
        bandwidth = kv_gbps * 1e9 / 8
        capacity: dict[tuple[Hashable, ...], float] = {}
        for name in [*pre.gens, *decode.gens]:
            capacity[name, "fabric"] = capacity["fabric", name] = bandwidth
        net = FlowNet(engine, capacity)
    by_id = {r.id: r for r in requests}
    where: dict[str, str] = {}

    def arrive(request: ServingRequest) -> None:
        now = engine.seconds
        if pre is not None and len(request.prompt) >= min_prefill_tokens:
            held = [min(len(g.times) for g in p.gens.values()) for p in (decode, pre)]
            if should_spill(spill_at, *held):
                served[request.id].path = "spilled"
                served[request.id].worker = pre.submit(
                    request.id, request.prompt, request.output_tokens, now
                )
                return
            served[request.id].path = "disaggregated"
            where[request.id] = pre.submit(request.id, request.prompt, 1, now)
            return
        if pre is not None:
            served[request.id].path = "prefilled_on_decode"
        worker = decode.submit(request.id, request.prompt, request.output_tokens, now)
        served[request.id].worker = worker

    for r in sorted(requests, key=lambda r: r.arrival):
        engine.at(round(r.arrival * 1e9) + ns(request_s), arrive, r, name="arrival")
    engine.run()
    gens = [*decode.gens.values(), *(pre.gens.values() if pre is not None else ())]
    return ServingRun(
        served=list(served.values()),
        virtual_s=engine.seconds,
        events=engine.events_run,
        wall_s=time.perf_counter() - started,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        steps=sum(g.steps for g in gens),
        runs=sum(g.runs for g in gens),
        kv_bytes=moved[0],
    )
