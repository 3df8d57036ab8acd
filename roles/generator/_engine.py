"""The generator's continuous-batching engine: a sans-IO core (no threads, no event loop).

:class:`Engine` holds a causal LM (any ``torch.nn.Module`` whose ``forward(tokens[B, T])``
returns ``logits[B, T, V]`` and whose position ``t`` depends only on tokens ``0..t``), a FIFO
of waiting requests and the running batch. Each :meth:`Engine.step` admits waiting requests
up to ``max_batch``, runs one decode step for every running request and returns the
completions that finished in it; a finished request leaves the batch at once and its slot is
filled at the next step.

**Decoding** is a full recompute: each step runs the model over every running sequence
(prompt + tokens so far), right-padded with ``pad_id`` to the longest, and reads the logits at
each sequence's last real position. Right padding is exact for any causal model (a position
never sees the padding after it, and positions start at 0 whatever the batch), so no attention
mask or KV-cache interface is needed from the model; the price is O(T) model work per token.

**What is recorded per token** (what the trainer's importance ratio needs):

- ``logprobs[i]`` = ``log_softmax(logits)[token]`` of the *untempered* model (temperature 1)
  under the weights that produced the token, computed in float32 from the logits at the
  position before it. A separate forward pass of the same weights over ``prompt + tokens``
  gives the same values up to float rounding (about 1e-6).
- ``sample_logprobs[i]``: the log-probability under the distribution actually sampled from
  (logits / temperature); equal to ``logprobs`` at temperature 1, 0.0 for greedy decoding.
- ``versions[i]``: the policy version of the weights that produced the token. A request that
  lives across :meth:`Engine.load_weights` has tokens from several versions;
  ``Completion.version`` is the oldest.

**Sampling** draws one uniform per token from a ``torch.Generator`` owned by the request and
seeded from it (``Request.seed``, else a hash of the engine seed and the request id), and
inverts the CDF: a request's tokens do not depend on which other requests share its batch.
(Logits can differ in the last float bits between batch shapes, so a token could differ only
if its uniform falls within that distance of a CDF boundary.)
"""

from __future__ import annotations

import dataclasses
import math
import operator
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ._sampling import check_sampling, choose_tokens
from ._types import Completion, EngineStats, Request

__all__ = ["Engine"]


class _Live:
    """A request in the engine: its sequence so far and what was recorded for each token."""

    __slots__ = (
        "admitted",
        "first_token",
        "generator",
        "logprobs",
        "request",
        "sample_logprobs",
        "seq",
        "steps",
        "stop",
        "submitted",
        "tokens",
        "versions",
    )

    def __init__(self, request: Request, seed: int, stop: int | None, now: float) -> None:
        self.request = request
        self.stop = stop
        self.seq = list(request.prompt)
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.sample_logprobs: list[float] = []
        self.versions: list[int] = []
        self.generator = torch.Generator().manual_seed(seed)
        self.submitted = now
        self.admitted: float | None = None
        self.first_token: float | None = None
        self.steps = 0

    def finish(self, reason: str, version: int, now: float) -> Completion:
        nan = math.nan
        r = self.request
        return Completion(
            id=r.id,
            prompt=list(r.prompt),
            tokens=self.tokens,
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


class Engine:
    """Continuous batching over ``model`` (see the module docstring). Not thread-safe: one
    caller at a time. ``vocab_size`` and ``max_seq_len`` default to the model's attributes of
    those names; without ``vocab_size`` one forward pass over a single token measures it.
    ``runner`` (default ``model``) is what decode steps call: the same weights prepared by a
    backend (moved, cast or compiled); weight loads always go to ``model``."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_batch: int = 32,
        version: int = 0,
        seed: int = 0,
        pad_id: int = 0,
        eos_id: int | None = None,
        vocab_size: int | None = None,
        max_seq_len: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        runner: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.model = model.eval()
        self._run = runner if runner is not None else model
        self._device = next(iter(model.parameters()), torch.empty(0)).device
        self._max_batch = max_batch
        self._version = version
        self._seed = seed
        self._pad = pad_id
        self._clock = clock
        self._paused = False
        self._waiting: deque[_Live] = deque()
        self._running: dict[str, _Live] = {}
        self._ids: set[str] = set()  # waiting or running
        self._vocab = vocab_size or getattr(model, "vocab_size", None) or self._measure_vocab()
        self._max_len = max_seq_len or getattr(model, "max_seq_len", None)
        self._eos = None if eos_id is None else self._token(eos_id, "eos_id")
        self._steps = self._tokens = self._finished = 0
        self._busy_s = 0.0

    # -- requests ----------------------------------------------------------------------------
    def submit(self, requests: Iterable[Request]) -> None:
        """Queue ``requests`` (FIFO). All are checked first: on a ``ValueError`` none is
        queued. Ids must be unique among the waiting and running requests."""
        checked: list[_Live] = []
        ids: set[str] = set()
        now = self._clock()
        for r in requests:
            live = self._check(r, now)
            if r.id in ids or r.id in self._ids:
                raise ValueError(
                    f"request id {r.id!r} is already waiting or running; ids must be unique"
                )
            ids.add(r.id)
            checked.append(live)
        self._waiting.extend(checked)
        self._ids |= ids

    def cancel(self, request_id: str) -> Completion:
        """Remove a waiting or running request; returns what it generated so far
        (``finish_reason="cancelled"``). Raises ``KeyError`` for an id that is neither."""
        live = self._running.pop(request_id, None)
        if live is None:
            found = [w for w in self._waiting if w.request.id == request_id]
            if not found:
                raise KeyError(
                    f"no request {request_id!r} is waiting or running (it may have finished "
                    f"already); ids: {sorted(self.request_ids())}"
                )
            live = found[0]
            self._waiting.remove(live)
        self._ids.discard(request_id)
        self._finished += 1
        return live.finish("cancelled", self._version, self._clock())

    def drop_all(self) -> int:
        """Drop every waiting and running request, without completions; returns how many."""
        dropped = len(self._running) + len(self._waiting)
        self._running.clear()
        self._waiting.clear()
        self._ids.clear()
        self._finished += dropped
        return dropped

    def request_ids(self) -> list[str]:
        """Ids of the running requests, then the waiting ones in queue order."""
        return [*self._running, *(w.request.id for w in self._waiting)]

    # -- weights and pausing -----------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    @property
    def paused(self) -> bool:
        return self._paused

    def pause(self) -> None:
        """Stop stepping: :meth:`step` does nothing until :meth:`resume`. Running requests
        keep their tokens. Idempotent."""
        self._paused = True

    def resume(self) -> None:
        """Continue stepping; tokens from now on carry the current version. Idempotent."""
        self._paused = False

    def load_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy ``state`` (every key of the model's ``state_dict``, same shapes) into the model
        and make ``version`` current. Allowed paused or not: it takes effect at the next step.
        Checked before anything is copied: a ``ValueError`` leaves weights and version as
        they were. Versions never go back."""
        if version < self._version:
            raise ValueError(f"version {version} is older than the loaded {self._version}")
        own = self.model.state_dict()
        missing, extra = own.keys() - state.keys(), state.keys() - own.keys()
        if missing or extra:
            raise ValueError(
                f"state does not fit the model: missing {sorted(missing)}, unexpected {sorted(extra)}"
            )
        for k, v in own.items():
            if tuple(state[k].shape) != tuple(v.shape):
                raise ValueError(
                    f"state[{k!r}] has shape {tuple(state[k].shape)}, model {tuple(v.shape)}"
                )
        self.model.load_state_dict(dict(state), strict=True)
        self._version = version

    def set_version(self, version: int, *, rewind: bool = False) -> None:
        """Make ``version`` current after the caller wrote its weights into the model in place
        (as :class:`~orchestr.roles.WeightLoader` does). Versions never go back, unless ``rewind``
        says the policy itself went back (its trainer restarted from a checkpoint)."""
        if version < self._version and not rewind:
            raise ValueError(f"version {version} is older than the loaded {self._version}")
        self._version = version

    # -- stepping ----------------------------------------------------------------------------
    def has_work(self) -> bool:
        """Whether :meth:`step` would run the model."""
        return not self._paused and bool(self._running or self._waiting)

    def step(self) -> list[Completion]:
        """Admit waiting requests, decode one token for each running request and return the
        completions that finished (in batch order). Does nothing while paused or idle."""
        if self._paused:
            return []
        start = self._clock()
        while self._waiting and len(self._running) < self._max_batch:
            live = self._waiting.popleft()
            live.admitted = start
            self._running[live.request.id] = live
        if not self._running:
            return []
        batch = list(self._running.values())
        tokens, logprobs, sample_logprobs = self._decode(batch)
        now = self._clock()
        done: list[Completion] = []
        for live, tok, lp, slp in zip(batch, tokens, logprobs, sample_logprobs, strict=True):
            live.seq.append(tok)
            live.tokens.append(tok)
            live.logprobs.append(lp)
            live.sample_logprobs.append(slp)
            live.versions.append(self._version)
            live.steps += 1
            if live.first_token is None:
                live.first_token = now
            full = len(live.tokens) >= live.request.max_new_tokens
            if tok == live.stop or full:
                reason = "stop" if tok == live.stop else "length"
                del self._running[live.request.id]
                self._ids.discard(live.request.id)
                done.append(live.finish(reason, self._version, now))
        self._steps += 1
        self._tokens += len(batch)
        self._finished += len(done)
        self._busy_s += now - start
        return done

    def stats(self) -> EngineStats:
        return EngineStats(
            version=self._version,
            paused=self._paused,
            waiting=len(self._waiting),
            running=len(self._running),
            finished=self._finished,
            steps=self._steps,
            tokens=self._tokens,
            busy_s=self._busy_s,
            tokens_per_s=self._tokens / self._busy_s if self._busy_s else 0.0,
            mean_batch=self._tokens / self._steps if self._steps else 0.0,
        )

    # -- internals ---------------------------------------------------------------------------
    def _decode(self, batch: list[_Live]) -> tuple[list[int], list[float], list[float]]:
        lengths = [len(x.seq) for x in batch]
        width = max(lengths)
        rows = [x.seq + [self._pad] * (width - len(x.seq)) for x in batch]
        with torch.inference_mode():
            logits = self._run(torch.tensor(rows, dtype=torch.long, device=self._device))
            got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits)
            if not (isinstance(got, tuple) and len(got) == 3 and got[:2] == (len(batch), width)):
                raise TypeError(
                    f"model({len(batch)}x{width} tokens) returned {got}; it must "
                    f"return logits of shape [B, T, vocab]"
                )
            index = torch.tensor(lengths, device=logits.device) - 1
            last = logits[torch.arange(len(batch), device=logits.device), index].float()
            reqs = [x.request for x in batch]
            return choose_tokens(last, reqs, [x.generator for x in batch])

    def _check(self, r: Any, now: float) -> _Live:
        if not isinstance(r, Request):
            raise TypeError(f"expected a Request, got {type(r).__name__}")
        if not isinstance(r.id, str) or not r.id:
            raise ValueError(f"a request id must be a non-empty string, got {r.id!r}")
        prompt = [self._token(t, f"prompt of {r.id!r}") for t in r.prompt]
        if not prompt:
            raise ValueError(
                f"request {r.id!r} has an empty prompt; give at least one token (e.g. BOS)"
            )
        if not isinstance(r.max_new_tokens, int) or r.max_new_tokens < 1:
            raise ValueError(
                f"request {r.id!r}: max_new_tokens must be an int >= 1, got {r.max_new_tokens!r}"
            )
        if self._max_len is not None and len(prompt) + r.max_new_tokens > self._max_len:
            raise ValueError(
                f"request {r.id!r}: prompt ({len(prompt)}) + max_new_tokens ({r.max_new_tokens}) "
                f"exceeds the model's max_seq_len {self._max_len}"
            )
        if not (isinstance(r.temperature, int | float) and 0 <= r.temperature < math.inf):
            raise ValueError(
                f"request {r.id!r}: temperature must be >= 0 and finite, got {r.temperature!r}"
            )
        check_sampling(r)
        stop = (
            self._eos
            if r.stop_token is None
            else self._token(r.stop_token, f"stop_token of {r.id!r}")
        )
        seed = r.seed if r.seed is not None else zlib.crc32(f"{self._seed}:{r.id}".encode())
        r = dataclasses.replace(r, prompt=prompt)
        return _Live(r, operator.index(seed), stop, now)

    def _token(self, t: Any, what: str) -> int:
        try:
            i = operator.index(t)
        except TypeError:
            raise ValueError(f"{what}: token {t!r} is not an int") from None
        if not 0 <= i < self._vocab:
            raise ValueError(f"{what}: token {i} is outside the vocabulary [0, {self._vocab})")
        return i

    def _measure_vocab(self) -> int:
        with torch.inference_mode():
            out = self.model(torch.zeros(1, 1, dtype=torch.long, device=self._device))
        return int(out.shape[-1])
