"""What both engines do alike with a request: check it where it comes in (:class:`Intake`),
record each token it is given (:class:`Live`), end it at a stop token, a stop string or its
length, and finish it into a :class:`~.._core._types.Completion`; and the checks of a weight load
(:func:`check_state`).

**Stop strings** are found in the detokenized output (the engine's ``detokenize``, the
checkpoint's tokenizer), decoded incrementally (:mod:`orchestr.roles._common._text`): after
each token its text is searched together with the last characters before it, so a stop
string split across tokens is found as soon as its last piece arrives, and a token costs the
same at any output length. The completion keeps every token it generated (the one that
completed the stop string too) and its ``text`` ends just before the stop string, as vLLM's
does. A request that names stop strings on an engine without a tokenizer is refused.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import zlib
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import torch

from orchestr.roles._common._text import IncrementalText, StopFinder

from .._core._types import (
    MAX_ID_CHARS,
    MAX_STOP_CHARS,
    MAX_STOPS,
    MAX_TOP_LOGPROBS,
    Completion,
    EngineStats,
    Request,
)
from .._runner._token_choice import check_sampling

__all__ = [
    "Intake",
    "Latencies",
    "Live",
    "Pausable",
    "check_state",
    "engine_stats",
    "request_seed",
]

Detokenize = Callable[[list[int]], str]


@dataclasses.dataclass(eq=False)
class Live:
    """A request in an engine: what was recorded for each of its tokens, and its times."""

    request: Request
    generator: torch.Generator
    submitted: float
    stop_ids: frozenset[int]
    detokenize: Detokenize | None = None
    admitted: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    steps: int = 0
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    sample_logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    text: str | None = None
    stop_reason: int | str | None = None
    ended: str | None = None  # why, once record() has ended it
    _text: IncrementalText | None = dataclasses.field(default=None, repr=False)
    _finder: StopFinder | None = dataclasses.field(default=None, repr=False)

    def record(
        self,
        token: int,
        logprob: float,
        sample_logprob: float,
        top: dict[int, float] | None,
        version: int,
    ) -> str | None:
        """Append one token; returns why the request ends with it (``"stop"`` for a stop
        token or string, ``"length"`` at ``max_new_tokens``), else ``None``."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.sample_logprobs.append(sample_logprob)
        self.versions.append(version)
        if top is not None:
            self.top_logprobs.append(top)
        self.steps += 1
        if token in self.stop_ids:
            self.stop_reason, self.ended = token, "stop"
        elif self.request.stop and self._stop_string():
            self.ended = "stop"
        elif len(self.tokens) >= self.request.max_new_tokens:
            self.ended = "length"
        return self.ended

    def _stop_string(self) -> bool:
        assert self.detokenize is not None  # Intake refuses stop strings without one
        if self._finder is None:
            self._text = IncrementalText(self.detokenize)
            self._finder = StopFinder(self.request.stop)
            new = self._text.push(self.tokens)  # the tokens so far (the first one, usually)
        else:
            assert self._text is not None
            new = self._text.push(self.tokens[-1:])
        hit = self._finder.feed(new)
        if hit is None:
            return False
        at, self.stop_reason = hit
        self.text = self._text.text[:at]
        return True

    def finish(self, reason: str, version: int, now: float) -> Completion:
        nan = math.nan
        r = self.request
        text = self.text
        if text is None and self.detokenize is not None and r.stop:
            text = self.detokenize(self.tokens)
        return Completion(
            id=r.id,
            prompt=list(r.prompt),
            tokens=list(self.tokens),
            logprobs=self.logprobs,
            sample_logprobs=self.sample_logprobs,
            versions=self.versions,
            version=min(self.versions, default=version),
            finish_reason=reason,
            queue_s=nan if self.admitted is None else self.admitted - self.submitted,
            ttft_s=nan if self.first_token is None else self.first_token - self.submitted,
            latency_s=now - self.submitted,
            steps=self.steps,
            top_logprobs=self.top_logprobs if r.top_logprobs else None,
            text=text,
            stop_reason=self.stop_reason,
        )


class Pausable:
    """The weights version and pause flag every engine keeps (an engine's ``__init__`` calls
    this one's with the version it starts at)."""

    def __init__(self, version: int) -> None:
        self._version = version
        self._paused = False

    @property
    def version(self) -> int:
        return self._version

    @property
    def paused(self) -> bool:
        return self._paused

    def pause(self) -> None:
        """Stop stepping: ``step`` does nothing until :meth:`resume`. Requests keep their
        place and their tokens. Idempotent."""
        self._paused = True

    def resume(self) -> None:
        """Continue stepping; tokens from now on carry the current version. Idempotent."""
        self._paused = False


class Latencies:
    """Times to first token and between tokens, kept until taken (:meth:`take`); at most
    ``keep`` of each, the oldest dropped first, so an engine nobody reads stays small."""

    def __init__(self, keep: int = 100_000) -> None:
        self.ttft: deque[float] = deque(maxlen=keep)
        self.itl: deque[float] = deque(maxlen=keep)

    def token(self, live: Live, now: float) -> None:
        """``live`` was given a token at ``now``."""
        if live.first_token is None:
            live.first_token = now
            self.ttft.append(now - live.submitted)
        elif live.last_token is not None:
            self.itl.append(now - live.last_token)
        live.last_token = now

    def take(self) -> tuple[list[float], list[float]]:
        """The times to first token and between tokens since the last call."""
        out = list(self.ttft), list(self.itl)
        self.ttft.clear()
        self.itl.clear()
        return out


class Intake:
    """Checks requests against an engine's vocabulary, context length and tokenizer, and
    makes each its :class:`Live` record with its own seeded generator."""

    def __init__(
        self,
        *,
        vocab: int,
        max_len: int | None,
        eos: frozenset[int],
        seed: int,
        detokenize: Detokenize | None = None,
    ) -> None:
        self.vocab, self.max_len, self.eos, self.seed = vocab, max_len, eos, seed
        self.detokenize = detokenize
        self._stops: dict[tuple[str, ...], list[str]] = {}

    def check(self, r: Any, now: float) -> Live:
        """``r`` as a :class:`Live`; raises ``TypeError``/``ValueError`` naming the request
        and the field for anything the engine cannot run."""
        if not isinstance(r, Request):
            raise TypeError(f"expected a Request, got {type(r).__name__}")
        if not isinstance(r.id, str) or not 0 < len(r.id) <= MAX_ID_CHARS:
            raise ValueError(
                f"a request id must be a string of 1 to {MAX_ID_CHARS} characters, got {r.id!r:.80}"
            )
        if not isinstance(r.prompt, list | tuple):
            raise ValueError(f"request {r.id!r}: prompt must be a list of token ids")
        prompt = [self.token(t, f"prompt of {r.id!r}") for t in r.prompt]
        if not prompt:
            raise ValueError(
                f"request {r.id!r} has an empty prompt; give at least one token (e.g. BOS)"
            )
        m = r.max_new_tokens
        if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m < 2**31:
            raise ValueError(
                f"request {r.id!r}: max_new_tokens must be an int from 1 to 2**31-1, got {m!r:.40}"
            )
        if self.max_len is not None and len(prompt) + r.max_new_tokens > self.max_len:
            raise ValueError(
                f"request {r.id!r}: prompt ({len(prompt)}) + max_new_tokens ({r.max_new_tokens}) "
                f"exceeds the model's max_seq_len {self.max_len}"
            )
        r = check_sampling(r, self.vocab)
        seed = r.seed
        if seed is not None and (
            isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**64
        ):
            raise ValueError(f"request {r.id!r}: seed must be a 64-bit integer, got {seed!r:.40}")
        salt = r.cache_salt
        if salt is not None and (not isinstance(salt, str) or not 0 < len(salt) <= MAX_ID_CHARS):
            raise ValueError(
                f"request {r.id!r}: cache_salt must be a string of 1 to {MAX_ID_CHARS} "
                f"characters, got {salt!r:.40}"
            )
        if not isinstance(r.ignore_eos, bool):
            raise ValueError(
                f"request {r.id!r}: ignore_eos must be a bool, got {r.ignore_eos!r:.40}"
            )
        stops = self._check_stops(r)
        if r.stop_token is not None:
            stop = frozenset({self.token(r.stop_token, f"stop_token of {r.id!r}")})
        else:
            stop = frozenset() if r.ignore_eos else self.eos
        generator = torch.Generator().manual_seed(request_seed(self.seed, r))
        request = dataclasses.replace(r, prompt=prompt, stop=stops)
        return Live(request, generator, now, stop, self.detokenize)

    def token(self, t: Any, what: str) -> int:
        try:
            i = operator.index(t)
        except TypeError:
            raise ValueError(f"{what}: token {t!r} is not an int") from None
        if not 0 <= i < self.vocab:
            raise ValueError(f"{what}: token {i} is outside the vocabulary [0, {self.vocab})")
        return i

    def _check_stops(self, r: Request) -> list[str]:
        """``r``'s stop strings checked; equal lists are one object (a request's ``n``
        choices come as ``n`` requests with the same stops: held once)."""
        stops = r.stop
        if isinstance(stops, str) or not isinstance(stops, list | tuple):
            raise ValueError(f"request {r.id!r}: stop must be a list of strings, got {stops!r:.60}")
        if len(stops) > MAX_STOPS:
            raise ValueError(
                f"request {r.id!r}: at most {MAX_STOPS} stop strings, got {len(stops)}"
            )
        if not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops):
            raise ValueError(
                f"request {r.id!r}: stop strings must have 1 to {MAX_STOP_CHARS} characters"
            )
        if stops and self.detokenize is None:
            raise ValueError(
                f"request {r.id!r}: stop strings need a tokenizer, and this engine has none "
                f"(load a checkpoint with tokenizer.json, or stop on a token: stop_token)"
            )
        n = r.top_logprobs
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"request {r.id!r}: top_logprobs must be an int in [0, {MAX_TOP_LOGPROBS}], "
                f"got {n!r:.40}"
            )
        if not stops:
            return []
        key = tuple(stops)
        shared = self._stops.get(key)
        if shared is None:
            if len(self._stops) >= 1024:  # a bound, not a cache policy: the oldest go
                self._stops.pop(next(iter(self._stops)))
            shared = self._stops[key] = list(key)
        return shared


def request_seed(engine_seed: int, r: Request) -> int:
    """The seed of ``r``'s own generator: its ``seed``, else one drawn from the engine's seed
    and the request's id."""
    return (
        operator.index(r.seed)
        if r.seed is not None
        else zlib.crc32(f"{engine_seed}:{r.id}".encode())
    )


def check_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Raise ``ValueError`` unless ``state`` has exactly ``model``'s ``state_dict`` keys,
    each of the same shape (nothing is copied)."""
    own = model.state_dict()
    if own.keys() != state.keys():
        missing, extra = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
        raise ValueError(f"state does not fit the model: missing {missing}, unexpected {extra}")
    for k, v in own.items():
        if tuple(state[k].shape) != tuple(v.shape):
            raise ValueError(
                f"state[{k!r}] has shape {tuple(state[k].shape)}, model {tuple(v.shape)}"
            )


def engine_stats(
    *,
    version: int,
    paused: bool,
    waiting: int,
    running: int,
    finished: int,
    steps: int,
    tokens: int,
    busy_s: float,
) -> EngineStats:
    """:class:`EngineStats` with the rates derived from the counts."""
    return EngineStats(
        version=version,
        paused=paused,
        waiting=waiting,
        running=running,
        finished=finished,
        steps=steps,
        tokens=tokens,
        busy_s=busy_s,
        tokens_per_s=tokens / busy_s if busy_s else 0.0,
        mean_batch=tokens / steps if steps else 0.0,
    )
