"""The simulated engine (``Generator(engine="sim", profile=FILE)``): the paged engine's real
scheduler, block pool, prefix cache, KV pool and request records, stepping on the wall clock,
with each step lasting what a calibrated :class:`~.._core._steptime.StepTimeModel` says it
costs instead of computing a model.

What is real: admission, continuous batching, chunked prefill, preemption, the prefix cache
and its events, the load a router reads, streaming, cancellation, and the KV pool that the
KV store and prefill/decode handoffs move blocks of. What is not: the tokens (each sequence's
next token is drawn from its id and position, never an end-of-sequence token, so a request
runs to its ``max_new_tokens`` as a benchmark with ``ignore_eos`` does) and the KV bytes (a
stand-in model of one small layer sizes the pool, so moving blocks is cheap). A step sleeps
until its modelled seconds have passed since it began, the scheduler's own time included;
a step whose bookkeeping already took longer runs late, as the real engine would.

So a cluster of many generators runs on one small machine: routing, admission, spill between
prefill and decode pools and the KV store can be tried at a size the real engine cannot
reach here (Dynamo's mocker and llm-d's inference simulator serve the same purpose). The
simulator (``orchestr.sim``) runs the same scheduler and model on virtual time; given this
engine a virtual clock and sleep, the two give the same times (tested).
"""

from __future__ import annotations

import dataclasses
import time
import zlib
from collections.abc import Callable
from typing import Any

import torch

from orchestr.roles._common._hf._config import ModelConfig
from orchestr.roles._common._hf._layers import CausalLM

from .._core._scheduler import Step
from .._core._steptime import StepTimeModel, step_features
from .._core._types import Completion
from .._runner._microbatch import MicroBatches
from ._paged import PagedEngine

__all__ = ["SimEngine", "stand_in", "stand_in_config"]

#: Tokens a simulated sequence draws from (ids below this, in every vocabulary).
TOKENS = 256


def stand_in_config(config: ModelConfig) -> ModelConfig:
    """``config`` with its vocabulary, context and special tokens, but one layer of one small
    head: a KV block of a few bytes."""
    return dataclasses.replace(
        config,
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=True,
        moe=None,
    )


def stand_in(config: ModelConfig) -> CausalLM:
    """The model of :func:`stand_in_config`, uninitialised: it sizes the simulated engine's
    pool and is never run."""
    with torch.device("meta"):
        model = CausalLM(stand_in_config(config))
    return model.to_empty(device="cpu")


class SimEngine(PagedEngine):
    """A :class:`PagedEngine` over :func:`stand_in`'s model whose steps take ``profile``'s
    seconds instead of computing (see the module docstring). ``clock`` and ``sleep`` are the
    time it runs on (virtual ones in tests); the rest is the paged engine's."""

    def __init__(
        self,
        config: ModelConfig,
        profile: StepTimeModel,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Any] = time.sleep,
        **options: Any,
    ) -> None:
        if options.get("micro_batches", 1) != 1 or options.get("ranks") is not None:
            raise ValueError("a simulated engine runs each step as one batch, on one rank")
        super().__init__(stand_in(config), clock=clock, **options)
        self.profile = profile
        self._sleep = sleep
        self._prefilled = False
        self._width = min(TOKENS, config.vocab_size)
        self._ends = [t for t in config.eos_token_ids if 0 <= t < self._width]
        self._batches = _Steps(self)  # in place of the model's micro-batches
        self._choices = [t for t in range(self._width) if t not in self._ends]
        self.began = 0.0  # when the step in progress began
        self.layer_hook: Callable[[Step, int], None] | None = None

    def step(self) -> list[Completion]:
        self.began = self._clock()
        return super().step()

    def watch_layers(self, hook: Callable[[Step, int], None] | None) -> None:
        """As the paged engine's: ``hook(step, layer)`` once each layer of a step is done
        (here, once its time has passed)."""
        self.layer_hook = hook

    def load_weights(self, state: Any, version: int) -> None:
        raise ValueError("a simulated engine has no weights to load")

    def step_seconds(self, step: Step) -> float:
        """The modelled seconds of ``step``, which follows the last one run."""
        f = step_features(step)
        seconds = self.profile.seconds(*f, after_prefill=int(self._prefilled and f[0] == 0))
        self._prefilled = f[0] > 0
        return seconds

    def logits(self, seq_id: str, position: int) -> torch.Tensor:
        """Logits that make the next token of ``seq_id`` at ``position`` a certainty: one of
        the first :data:`TOKENS` ids, never an end of sequence."""
        logits = torch.zeros(self._width)
        logits[self._ends] = float("-inf")
        seed = zlib.crc32(f"{seq_id}:{position}".encode())
        logits[self._choices[seed % len(self._choices)]] = 50.0
        return logits


class _Steps(MicroBatches):
    """What the paged engine calls for a step's logits (its micro-batches' place): the
    modelled time, slept; the model is never run."""

    def __init__(self, engine: SimEngine) -> None:
        super().__init__(engine._runner, 1)
        self.engine = engine

    def run(self, step: Step) -> dict[str, torch.Tensor]:
        engine = self.engine
        out = {
            seq.id: engine.logits(seq.id, seq.num_computed + n)
            for seq, n in step.scheduled
            if step.samples(seq, n)
        }
        left = engine.step_seconds(step) - (engine._clock() - engine.began)
        if left > 0:
            engine._sleep(left)
        hook = engine.layer_hook
        if hook is not None:  # a streamed handoff hands each layer's blocks over
            for layer in range(engine.num_layers):
                hook(step, layer)
        return out
