"""The paged engine: :class:`~._engine.Engine`'s contract (``submit``, ``step``, ``cancel``,
weight loads and versions, per-token log-probs) over a KV cache of blocks, for Hugging Face
format models (:class:`orchestr.roles.models.CausalLM`).

Each :meth:`PagedEngine.step` asks the sans-IO :class:`~._scheduler.Scheduler` what to compute
(decodes and prefill chunks within ``token_budget`` tokens, prefix hits, preemptions), runs it
with :class:`~._paged.PagedRunner` and samples one token for each sequence whose chunk reached
its end, exactly as the recompute engine samples (:func:`~._sampling.choose_tokens`: a request's
tokens do not depend on its batch).

**New weights while requests are in flight** (``on_new_weights``):

- ``"keep"`` (the default): the keys and values already computed stay; tokens from then on
  carry the new version (each token's version is recorded either way). The blocks a
  sequence fills after the change hold keys of both versions, so they are not entered into
  the prefix cache.
- ``"recompute"``: every running sequence is preempted and recomputed under the new weights
  (counted as preemptions); its tokens so far keep the versions that made them.

Block keys carry ``(model_id, version)``: a block computed under other weights never
matches. Metrics follow vLLM's names where the meaning is the same (:meth:`metrics`).
"""

from __future__ import annotations

import dataclasses
import math
import operator
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import torch

from orchestr.roles._common._hf._layers import CausalLM

from ._blocks import BlockPool
from ._paged import PagedKV, PagedRunner
from ._sampling import check_sampling, choose_tokens
from ._scheduler import Scheduler, Seq
from ._types import Completion, EngineStats, Request

__all__ = ["PagedEngine"]

KVPolicy = Literal["keep", "recompute"]


@dataclasses.dataclass(eq=False)
class _Live:
    request: Request
    seq: Seq
    generator: torch.Generator
    submitted: float
    admitted: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    steps: int = 0
    logprobs: list[float] = dataclasses.field(default_factory=list)
    sample_logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)

    def finish(self, reason: str, version: int, now: float) -> Completion:
        nan = math.nan
        return Completion(
            id=self.request.id,
            prompt=list(self.request.prompt),
            tokens=list(self.seq.output),
            logprobs=self.logprobs,
            sample_logprobs=self.sample_logprobs,
            versions=self.versions,
            version=min(self.versions, default=version),
            finish_reason=reason,
            queue_s=nan if self.admitted is None else self.admitted - self.submitted,
            ttft_s=nan if self.first_token is None else self.first_token - self.submitted,
            latency_s=now - self.submitted,
            steps=self.steps,
        )


class PagedEngine:
    """Continuous batching of ``model`` over ``num_blocks`` KV blocks of ``block_size``
    tokens. Not thread-safe: one caller at a time."""

    def __init__(
        self,
        model: CausalLM,
        *,
        num_blocks: int = 512,
        block_size: int = 16,
        max_batch: int = 32,
        token_budget: int = 512,
        version: int = 0,
        seed: int = 0,
        model_id: str = "model",
        on_new_weights: KVPolicy = "keep",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if on_new_weights not in ("keep", "recompute"):
            raise ValueError(f"on_new_weights is 'keep' or 'recompute', got {on_new_weights!r}")
        self.model = model.eval()
        cfg = model.config
        self._vocab = cfg.vocab_size
        self._max_len = cfg.max_position_embeddings
        self._eos = frozenset(cfg.eos_token_ids)
        self._pool = BlockPool(num_blocks, block_size)
        self._kv = PagedKV(model, num_blocks, block_size)
        self._runner = PagedRunner(model, self._kv)
        self._model_id = model_id
        self._version = version
        self._sched = Scheduler(
            self._pool,
            max_batch=max_batch,
            token_budget=token_budget,
            extra_keys=(model_id, version),
        )
        self._policy = on_new_weights
        self._seed = seed
        self._clock = clock
        self._paused = False
        self._live: dict[str, _Live] = {}
        self._steps = self._tokens = self._finished = 0
        self._busy_s = 0.0
        self._ttft: list[float] = []
        self._itl: list[float] = []

    # -- requests ----------------------------------------------------------------------------
    def submit(self, requests: Iterable[Request]) -> None:
        """Queue ``requests`` (FIFO). All are checked first: on a ``ValueError`` (a bad
        request, a duplicate id, one that can never fit the cache) none is queued."""
        checked: list[_Live] = []
        now = self._clock()
        for r in requests:
            live = self._check(r, now)
            if r.id in self._live or any(c.request.id == r.id for c in checked):
                raise ValueError(f"request id {r.id!r} is already waiting or running")
            checked.append(live)
        for live in checked:  # the pool size check cannot fail once all passed
            self._sched.add(live.seq)
            self._live[live.request.id] = live

    def cancel(self, request_id: str) -> Completion:
        """Remove a waiting or running request, its blocks freed; returns what it generated
        so far (``finish_reason="cancelled"``). Raises ``KeyError`` for an unknown id."""
        live = self._live.pop(request_id, None)
        if live is None:
            raise KeyError(f"no request {request_id!r} is waiting or running")
        self._sched.finish(live.seq, "cancelled")
        self._finished += 1
        return live.finish("cancelled", self._version, self._clock())

    def drop_all(self) -> int:
        """Drop every request without completions, their blocks freed; returns how many."""
        dropped = len(self._live)
        for rid in list(self._live):
            self._sched.finish(self._live.pop(rid).seq, "dropped")
        self._finished += dropped
        return dropped

    def request_ids(self) -> list[str]:
        """Ids of the running requests, then the waiting ones in queue order."""
        return [s.id for s in self._sched.running] + [s.id for s in self._sched.waiting]

    # -- weights -----------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    @property
    def paused(self) -> bool:
        return self._paused

    def pause(self) -> None:
        """Stop stepping until :meth:`resume`; requests keep their place. Idempotent."""
        self._paused = True

    def resume(self) -> None:
        """Continue stepping. Idempotent."""
        self._paused = False

    def load_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy ``state`` (the model's ``state_dict`` keys and shapes) into the model and make
        ``version`` current; checked first, so a ``ValueError`` changes nothing."""
        if version < self._version:
            raise ValueError(f"version {version} is older than the loaded {self._version}")
        own = self.model.state_dict()
        if own.keys() != state.keys():
            missing, extra = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
            raise ValueError(f"state does not fit the model: missing {missing}, unexpected {extra}")
        for k, v in own.items():
            if tuple(state[k].shape) != tuple(v.shape):
                raise ValueError(
                    f"state[{k!r}] has shape {tuple(state[k].shape)}, model {tuple(v.shape)}"
                )
        self.model.load_state_dict(dict(state), strict=True)
        self.set_version(version)

    def set_version(self, version: int, *, rewind: bool = False) -> None:
        """Make ``version`` current after its weights were written into the model in place;
        applies ``on_new_weights`` to the requests in flight. Versions never go back unless
        ``rewind``."""
        if version < self._version and not rewind:
            raise ValueError(f"version {version} is older than the loaded {self._version}")
        if version == self._version:
            return
        self._version = version
        self._sched.extra_keys = (self._model_id, version)
        if self._policy == "recompute":
            self._sched.preempt_all()
        else:
            for seq in self._sched.running:
                seq.cacheable = False

    # -- stepping ----------------------------------------------------------------------------
    def has_work(self) -> bool:
        return not self._paused and bool(self._live)

    def step(self) -> list[Completion]:
        """One model step: decodes and prefill chunks within the token budget; returns the
        completions that finished. Does nothing while paused or idle."""
        if self._paused or not self._live:
            return []
        start = self._clock()
        step = self._sched.schedule()
        for seq, _ in step.scheduled:
            live = self._live[seq.id]
            if live.admitted is None:
                live.admitted = start
        logits = self._runner.run(step)
        order = list(logits)
        tokens: dict[str, int] = {}
        if order:
            lives = [self._live[sid] for sid in order]
            last = torch.stack([logits[sid] for sid in order])
            reqs = [x.request for x in lives]
            chosen, lps, slps = choose_tokens(last, reqs, [x.generator for x in lives])
            now = self._clock()
            for live, tok, lp, slp in zip(lives, chosen, lps, slps, strict=True):
                tokens[live.request.id] = tok
                live.logprobs.append(lp)
                live.sample_logprobs.append(slp)
                live.versions.append(self._version)
                live.steps += 1
                if live.first_token is None:
                    live.first_token = now
                    self._ttft.append(now - live.submitted)
                elif live.last_token is not None:
                    self._itl.append(now - live.last_token)
                live.last_token = now
        finished = self._sched.update(step, tokens)
        now = self._clock()
        done = []
        for seq in finished:
            live = self._live.pop(seq.id)
            done.append(live.finish(seq.finish_reason or "stop", self._version, now))
        self._steps += 1
        self._tokens += step.num_tokens
        self._finished += len(done)
        self._busy_s += now - start
        return done

    def stats(self) -> EngineStats:
        return EngineStats(
            version=self._version,
            paused=self._paused,
            waiting=len(self._sched.waiting),
            running=len(self._sched.running),
            finished=self._finished,
            steps=self._steps,
            tokens=self._tokens,
            busy_s=self._busy_s,
            tokens_per_s=self._tokens / self._busy_s if self._busy_s else 0.0,
            mean_batch=self._tokens / self._steps if self._steps else 0.0,
        )

    def metrics(self) -> dict[str, Any]:
        """Counters and gauges under vLLM's names where the meaning is the same: prompt
        tokens looked up in the prefix cache and found there, the fraction of KV blocks in
        use, preemptions; and the times to first token and between tokens seen so far."""
        return {
            "vllm:prefix_cache_queries": self._sched.queries,
            "vllm:prefix_cache_hits": self._sched.hits,
            "vllm:kv_cache_usage_perc": self._pool.usage,
            "vllm:num_preemptions": self._sched.preemptions,
            "vllm:time_to_first_token_seconds": list(self._ttft),
            "vllm:inter_token_latency_seconds": list(self._itl),
        }

    def take_kv_events(self) -> list[Any]:
        """The block pool's stored/removed/cleared events since the last call."""
        return self._pool.take_events()

    # -- internals ---------------------------------------------------------------------------
    def _check(self, r: Any, now: float) -> _Live:
        if not isinstance(r, Request):
            raise TypeError(f"expected a Request, got {type(r).__name__}")
        if not isinstance(r.id, str) or not r.id:
            raise ValueError(f"a request id must be a non-empty string, got {r.id!r}")
        prompt = [self._token(t, f"prompt of {r.id!r}") for t in r.prompt]
        if not prompt:
            raise ValueError(f"request {r.id!r} has an empty prompt; give at least one token")
        if not isinstance(r.max_new_tokens, int) or r.max_new_tokens < 1:
            raise ValueError(f"request {r.id!r}: max_new_tokens must be an int >= 1")
        if len(prompt) + r.max_new_tokens > self._max_len:
            raise ValueError(
                f"request {r.id!r}: prompt ({len(prompt)}) + max_new_tokens "
                f"({r.max_new_tokens}) exceeds the model's {self._max_len} positions"
            )
        if not (isinstance(r.temperature, int | float) and 0 <= r.temperature < math.inf):
            raise ValueError(f"request {r.id!r}: temperature must be >= 0 and finite")
        check_sampling(r)
        stop = (
            self._eos
            if r.stop_token is None
            else frozenset({self._token(r.stop_token, "stop_token")})
        )
        need = self._sched.blocks_for(len(prompt) + r.max_new_tokens)
        if need > self._pool.num_blocks:
            raise ValueError(
                f"request {r.id!r} can never fit: it needs {need} blocks of "
                f"{self._pool.block_size} tokens; the cache has {self._pool.num_blocks}"
            )
        seed = r.seed if r.seed is not None else zlib.crc32(f"{self._seed}:{r.id}".encode())
        seq = Seq(r.id, prompt, r.max_new_tokens, stop_ids=stop)
        generator = torch.Generator().manual_seed(operator.index(seed))
        return _Live(dataclasses.replace(r, prompt=prompt), seq, generator, now)

    def _token(self, t: Any, what: str) -> int:
        try:
            i = operator.index(t)
        except TypeError:
            raise ValueError(f"{what}: token {t!r} is not an int") from None
        if not 0 <= i < self._vocab:
            raise ValueError(f"{what}: token {i} is outside the vocabulary [0, {self._vocab})")
        return i
