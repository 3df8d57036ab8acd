"""Generation on virtual time: the generator's own scheduler, with a step-time model for the
model's work.

:class:`SimGenerator` holds the real :class:`orchestr.roles.generator.Scheduler` over a real
block pool (continuous batching, chunked prefill, the prefix cache, preemption: the objects
the paged engine runs) and charges each step the seconds a :class:`StepTimeModel` gives for
what the step computes, so queueing, batching and cache hits come from the real code and only
the matrix work is modelled. Tokens are not computed: a request ends at its ``max_tokens``
(its output length is the workload's), which is what a benchmark with ``ignore_eos`` does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from orchestr.roles.generator import STEP_TERMS as TERMS
from orchestr.roles.generator import (
    BlockPool,
    Scheduler,
    Seq,
    Step,
    StepTimeModel,
    attention_pairs,
    step_features,
)

from ._cpu import HostCpu
from ._engine import Engine, Event, ns

__all__ = [
    "TERMS",
    "RequestTimes",
    "SimGenerator",
    "StepTimeModel",
    "attention_pairs",
    "recompute_features",
]


def recompute_features(step: Step) -> tuple[int, int, int, int, int]:
    """The features of ``step`` on the recompute engine
    (``orchestr.roles.generator.RecomputeEngine``), which runs every scheduled sequence whole (prompt and tokens so far) through the model,
    padded to the longest ``t``: ``b`` sequences are ``b * t`` prompt tokens and ``b * t (t +
    1) / 2`` pairs, and ``b`` rows sampled (counted as decodes)."""
    b = len(step.scheduled)
    t = max((seq.num_computed + n for seq, n in step.scheduled), default=0)
    return b * t, b, b * attention_pairs(0, t), 0, 0


@dataclasses.dataclass
class RequestTimes:
    """One request's life in virtual seconds: arrival, first token, end, and tokens out."""

    id: str
    arrival: float
    prompt_tokens: int
    first_token: float = -1.0
    end: float = -1.0
    output_tokens: int = 0
    cached_tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first (0 for a single token)."""
        n = self.output_tokens - 1
        return (self.end - self.first_token) / n if n > 0 else 0.0


class SimGenerator:
    """A generator on ``engine``'s clock: the real scheduler (``num_blocks`` blocks of
    ``block_size`` tokens, ``max_batch`` sequences and ``token_budget`` tokens a step), steps
    timed by ``model``. ``done(times)`` is called for each request that ends.

    ``closed_form`` (the default) takes a run of alike decode steps (the scheduler's
    :meth:`~orchestr.roles.generator.Scheduler.decode_run`: the same sequences decoding,
    nothing admitted, preempted or ended before its last step) as one event: its time is the
    sum of its steps' in closed form (each step's attention grows by one key per sequence)
    and the scheduler advances it in one go, to the state the steps leave. A request that
    arrives meanwhile cuts the run at the step then in progress, where the step-by-step
    generator would admit it. ``cache_outputs`` is the scheduler's (whether blocks of
    generated tokens enter the prefix cache).

    ``recompute`` times each step as the recompute engine computes it
    (:func:`recompute_features`: no KV cache), ``cpu`` is the host's cores its steps run on
    as one thread of ``weight`` (:class:`~._cpu.HostCpu`: a step beside other work takes
    longer), and either takes each step as its own event. ``busy_s`` counts the steps' time
    on the clock, as the real generator times them. ``tokens(n)`` is called with the tokens
    each step (or run of steps) samples, as they are streamed out."""

    def __init__(
        self,
        engine: Engine,
        model: StepTimeModel,
        *,
        num_blocks: int = 4096,
        block_size: int = 16,
        max_batch: int = 256,
        token_budget: int = 2048,
        done: Callable[[RequestTimes], None] | None = None,
        closed_form: bool = True,
        cache_outputs: bool = True,
        recompute: bool = False,
        cpu: HostCpu | None = None,
        weight: float = 1024.0,
        tokens: Callable[[int], None] | None = None,
    ) -> None:
        self.engine, self.model, self.tokens = engine, model, tokens
        self.recompute, self.cpu, self.weight = recompute, cpu, weight
        self.scheduler = Scheduler(
            BlockPool(num_blocks, block_size),
            max_batch=max_batch,
            token_budget=token_budget,
            cache_outputs=cache_outputs,
        )
        self.done = done
        self.closed_form = closed_form and not recompute and cpu is None
        self.times: dict[str, RequestTimes] = {}
        self.finished: list[RequestTimes] = []
        self.steps = 0
        self.runs = 0  # runs of decode steps taken in one go
        #: Counts the changes to the scheduler (steps and arrivals): a caller that saw this
        #: number has seen its state (its load and pool events) since.
        self.changes = 0
        self.busy_s = 0.0
        self._stepping = False
        #: The run in progress: (start ns, steps, per-step seconds a, growth b, the first
        #: step's extra seconds, its event).
        self._run: tuple[int, int, float, float, float, Event] | None = None
        self._prefilled = False  # whether the last step computed a prefill chunk
        self._arrived: list[Seq] = []  # during the run
        self._load: tuple[int, int] | None = None  # load(), until the scheduler changes

    @property
    def load(self) -> tuple[int, int]:
        """``(prefill_blocks, decode_blocks)``: the scheduler's :meth:`Scheduler.load`, and
        the prompts arrived during a run of decode steps, not queued there yet."""
        if self._load is None:  # changed since last asked
            prefill, decode = self.scheduler.load()
            for seq in self._arrived:
                prefill += self.scheduler.blocks_for(seq.num_tokens)
            self._load = (prefill, decode)
        return self._load

    def submit(
        self,
        request_id: str,
        prompt: Sequence[int],
        max_tokens: int,
        known_keys: tuple[tuple[Any, ...], list[bytes]] | None = None,
    ) -> None:
        """A request arriving now: ``prompt``'s tokens (their values matter only to the prefix
        cache) and ``max_tokens`` out; ``known_keys`` its block keys if a router made them
        (``Scheduler.keyed``). Raises ``ValueError`` for one the scheduler refuses (an empty
        prompt, or one that could never fit) and for a repeated id."""
        if request_id in self.times:
            raise ValueError(f"request {request_id!r} is already here")
        seq = Seq(request_id, list(prompt), max_tokens, known_keys=known_keys)
        if self._run is None:
            self.scheduler.add(seq)
        else:  # queued after the step in progress, which cannot have seen it
            self.scheduler.check(seq)
            self._arrived.append(seq)
            self._cut_run()
        self.times[request_id] = RequestTimes(request_id, self.engine.seconds, len(prompt))
        self._load = None
        self.changes += 1
        if not self._stepping:
            self._stepping = True
            self.engine.at(self.engine.now, self._step, name="generator step")

    def _step(self) -> None:
        self._load = None
        self.changes += 1
        if self.closed_form and self._start_run():
            return
        step = self.scheduler.schedule()
        if not step.scheduled:
            self._stepping = False
            return
        f = recompute_features(step) if self.recompute else step_features(step)
        seconds = self.model.seconds(*f, after_prefill=int(self._prefilled and f[0] == 0))
        self._prefilled = f[0] > 0
        self.steps += 1
        if self.cpu is None:
            self.busy_s += seconds
            self.engine.after(seconds, self._finish, step, name="generator step done")
        else:
            began = self.engine.now
            self.cpu.run(seconds, lambda: self._finish_shared(step, began), self.weight)

    def _finish_shared(self, step: Step, began: int) -> None:
        self.busy_s += (self.engine.now - began) / 1e9
        self._finish(step)

    def _finish(self, step: Step) -> None:
        now = self.engine.seconds
        sampled = {}
        for seq, n in step.scheduled:
            if step.samples(seq, n):
                sampled[seq.id] = 0
                times = self.times[seq.id]
                if times.first_token < 0:
                    times.first_token = now
                    times.cached_tokens = seq.cached_tokens
        if self.tokens is not None and sampled:
            self.tokens(len(sampled))
        self._ended(self.scheduler.update(step, sampled))
        self._step()

    def _ended(self, seqs: list[Seq]) -> None:
        now = self.engine.seconds
        for seq in seqs:
            times = self.times.pop(seq.id)
            times.end = now
            times.output_tokens = len(seq.output)
            self.finished.append(times)
            if self.done is not None:
                self.done(times)

    # -- runs of decode steps in closed form ----------------------------------------------------
    def _start_run(self) -> bool:
        k = self.scheduler.decode_run(1 << 40)
        if k < 2:
            return False
        running = self.scheduler.running
        n = len(running)
        m = self.model
        keys = sum(s.num_computed + 1 for s in running)  # the first step's decode pairs
        a = m.base_s + m.decode_s * n + m.decode_attention_s * keys
        b = m.decode_attention_s * n  # each step attends to one more key per sequence
        first = m.after_prefill_s if self._prefilled else 0.0  # charged to the run's first step
        self._prefilled = False
        event = self.engine.at(
            self.engine.now + ns(_run_seconds(k, a, b, first)),
            self._finish_run,
            name="decode run done",
        )
        self._run = (self.engine.now, k, a, b, first, event)
        return True

    def _cut_run(self) -> None:
        """End the run at the step in progress now (a request arrived)."""
        assert self._run is not None
        start, k, a, b, first, event = self._run
        elapsed = self.engine.now - start
        low, high = 0, k  # the first m whose end is at or after now is in (low, high]
        while high - low > 1:
            mid = (low + high) // 2
            done = ns(_run_seconds(mid, a, b, first)) >= elapsed
            low, high = (low, mid) if done else (mid, high)
        if high < k:
            event.cancel()
            when = start + ns(_run_seconds(high, a, b, first))
            self._run = (start, high, a, b, first, self.engine.at(when, self._finish_run))

    def _finish_run(self) -> None:
        assert self._run is not None
        _, k, a, b, first, _ = self._run
        self._run = None
        self.steps += k
        self.runs += 1
        self.busy_s += _run_seconds(k, a, b, first)
        if self.tokens is not None:  # a token a sequence a step: none joins or leaves a run
            self.tokens(k * len(self.scheduler.running))
        self._ended(self.scheduler.advance_decodes(k, 0))
        for seq in self._arrived:
            self.scheduler.add(seq)
        self._arrived.clear()
        self._step()


def _run_seconds(steps: int, a: float, b: float, first: float = 0.0) -> float:
    """Seconds of ``steps`` decode steps, the first taking ``a`` (and ``first`` more) and each
    next ``b`` more than the one before."""
    return steps * a + b * steps * (steps - 1) / 2 + (first if steps > 0 else 0.0)
