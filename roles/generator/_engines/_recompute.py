"""The recompute engine: continuous batching with no KV cache, a sans-IO core (no threads, no
event loop); it keeps the :class:`~.._core._contract.Engine` contract.

:class:`RecomputeEngine` holds a causal LM (any ``torch.nn.Module`` whose ``forward(tokens[B, T])``
returns ``logits[B, T, V]`` and whose position ``t`` depends only on tokens ``0..t``), a FIFO
of waiting requests and the running batch. Each :meth:`RecomputeEngine.step` admits waiting requests
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
  lives across :meth:`RecomputeEngine.load_weights` has tokens from several versions;
  ``Completion.version`` is the oldest.

**Sampling** draws one uniform per token from a ``torch.Generator`` owned by the request and
seeded from it (``Request.seed``, else a hash of the engine seed and the request id), and
inverts the CDF: a request's tokens do not depend on which other requests share its batch.
(Logits can differ in the last float bits between batch shapes, so a token could differ only
if its uniform falls within that distance of a CDF boundary.)
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .._core._types import Completion, EngineStats, Request
from .._runner._token_choice import Chosen, choose_tokens
from ._requests import Detokenize, Intake, Latencies, Live, Pausable, check_state, engine_stats

__all__ = ["RecomputeEngine"]


class RecomputeEngine(Pausable):
    """Continuous batching over ``model`` (see the module docstring). Not thread-safe: one
    caller at a time. ``vocab_size`` and ``max_seq_len`` default to the model's attributes of
    those names; without ``vocab_size`` one forward pass over a single token measures it.
    ``runner`` (default ``model``) is what decode steps call: the same weights prepared by a
    backend (moved, cast or compiled); weight loads always go to ``model``. ``detokenize``
    (token ids to text) lets requests name stop strings."""

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
        detokenize: Detokenize | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.model = model.eval()
        self._run = runner if runner is not None else model
        self._device = next(iter(model.parameters()), torch.empty(0)).device
        self._max_batch = max_batch
        super().__init__(version)
        self._pad = pad_id
        self._clock = clock
        self._waiting: deque[Live] = deque()
        self._running: dict[str, Live] = {}
        self._ids: set[str] = set()  # waiting or running
        vocab = vocab_size or getattr(model, "vocab_size", None) or self._measure_vocab()
        self._intake = Intake(
            vocab=vocab,
            max_len=max_seq_len or getattr(model, "max_seq_len", None),
            eos=frozenset(),
            seed=seed,
            detokenize=detokenize,
        )
        if eos_id is not None:
            self._intake.eos = frozenset({self._intake.token(eos_id, "eos_id")})
        self._latencies = Latencies()
        self._steps = self._tokens = self._finished = 0
        self._busy_s = 0.0

    # -- requests ----------------------------------------------------------------------------
    def submit(self, requests: Iterable[Request]) -> None:
        """Queue ``requests`` (FIFO). All are checked first: on a ``ValueError`` none is
        queued. Ids must be unique among the waiting and running requests."""
        checked: list[Live] = []
        ids: set[str] = set()
        now = self._clock()
        for r in requests:
            live = self._intake.check(r, now)
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

    def live(self, request_id: str) -> Live | None:
        """The record of a running request (its tokens so far), else ``None`` (a waiting
        one has none yet)."""
        return self._running.get(request_id)

    # -- weights and pausing -----------------------------------------------------------------
    def load_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy ``state`` (every key of the model's ``state_dict``, same shapes) into the model
        and make ``version`` current. Allowed paused or not: it takes effect at the next step.
        Checked before anything is copied: a ``ValueError`` leaves weights and version as
        they were. Versions never go back."""
        if version < self._version:
            raise ValueError(f"version {version} is older than the loaded {self._version}")
        check_state(self.model, state)
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
        chosen = self._decode(batch)
        now = self._clock()
        done: list[Completion] = []
        for live, tok, lp, slp, top in zip(batch, *chosen, strict=True):
            reason = live.record(tok, lp, slp, top, self._version)
            self._latencies.token(live, now)
            if reason is not None:
                del self._running[live.request.id]
                self._ids.discard(live.request.id)
                done.append(live.finish(reason, self._version, now))
        self._steps += 1
        self._tokens += len(batch)
        self._finished += len(done)
        self._busy_s += now - start
        return done

    def metrics(self) -> dict[str, Any]:
        """None of the paged engine's cache metrics apply here: ``{}``."""
        return {}

    def take_latencies(self) -> tuple[list[float], list[float]]:
        """The times to first token and between tokens (seconds) since the last call."""
        return self._latencies.take()

    def close(self) -> None:
        """Nothing outside this process to release."""

    def stats(self) -> EngineStats:
        return engine_stats(
            version=self._version,
            paused=self._paused,
            waiting=len(self._waiting),
            running=len(self._running),
            finished=self._finished,
            steps=self._steps,
            tokens=self._tokens,
            busy_s=self._busy_s,
        )

    # -- internals ---------------------------------------------------------------------------
    def _decode(self, batch: list[Live]) -> Chosen:
        seqs = [x.request.prompt + x.tokens for x in batch]
        lengths = [len(x) for x in seqs]
        width = max(lengths)
        rows = [x + [self._pad] * (width - len(x)) for x in seqs]
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

    def _measure_vocab(self) -> int:
        with torch.inference_mode():
            out = self.model(torch.zeros(1, 1, dtype=torch.long, device=self._device))
        return int(out.shape[-1])
