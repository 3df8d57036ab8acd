"""What a :class:`~._actor.Generator` runs: a model and the engine around it, from a factory
(the :class:`~._recompute.RecomputeEngine`, for any causal LM) or from a Hugging Face format
checkpoint folder (the :class:`~._paged.PagedEngine` over a paged KV cache, or vLLM's
engine, :class:`~._vllm.VllmEngine`); and :class:`Weights`, where its weight loads go."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

import orchestr as oc
from orchestr.fabric import Buffer
from orchestr.roles._common._backend import Backend
from orchestr.roles._common._factory import build_model
from orchestr.roles._common._hf._config import read_config
from orchestr.roles._common._hf._load import load_model
from orchestr.roles._common._hf._tokenizer import Tokenizer
from orchestr.roles._common._hf._tp import check_tp, load_shard
from orchestr.roles._common._model import TinyLM
from orchestr.roles._common._weightplan import weights_digest
from orchestr.roles._common._weightref import AnyWeightsRef
from orchestr.roles._common._weights import WeightLoader

from .._core._options import KVOptions
from .._core._steptime import StepTimeModel
from ._paged import PagedEngine
from ._recompute import RecomputeEngine
from ._sim import SimEngine
from ._tp import TPRanks
from ._vllm import VllmEngine

__all__ = ["ENGINES", "AnyEngine", "Weights", "build_engine", "in_thread"]

#: ``engine=`` values: the recompute engine (a model factory's), the paged engine, vLLM's and
#: the simulated one (a checkpoint's; the paged one is the default there).
ENGINES = ("recompute", "paged", "vllm", "sim")
AnyEngine = RecomputeEngine | PagedEngine | VllmEngine
T = TypeVar("T")


class Weights:
    """A generator's weights as loads see them: a torch model orchestr runs, whose tensors
    are written in place, or vLLM's, which takes the checkpoint's names through its own
    ``load_weights``."""

    def __init__(self, model: torch.nn.Module | None, engine: AnyEngine) -> None:
        self.model, self.engine = model, engine

    @property
    def tp(self) -> int:
        """The ranks the model is split over (:attr:`model` is this rank's share)."""
        return self.engine.tp if isinstance(self.engine, PagedEngine) else 1

    def shapes(self) -> Mapping[str, torch.Tensor]:
        """Each tensor a load takes, by name (its shape and dtype are what matter)."""
        if isinstance(self.engine, VllmEngine):
            return self.engine.like
        if isinstance(self.engine, PagedEngine) and self.engine.tp > 1:
            return self.engine.whole_like()
        assert self.model is not None
        return self.model.state_dict()

    async def sync(self, loader: WeightLoader, ref: AnyWeightsRef) -> bool:
        """Load ``ref`` with ``loader`` (see :meth:`WeightLoader.load`)."""
        engine = self.engine
        if isinstance(engine, SimEngine):  # its stand-in model is no place for real weights
            raise ValueError("a simulated engine has no weights to load")
        if isinstance(engine, VllmEngine):

            async def apply(tensors: list[tuple[str, torch.Tensor]]) -> None:
                await in_thread(engine.write_weights, tensors)

            return await loader.load(engine.like, ref, apply=apply)
        if isinstance(engine, PagedEngine) and engine.tp > 1:
            split = engine

            async def write(tensors: list[tuple[str, torch.Tensor]]) -> None:
                await in_thread(split.write_whole, tensors)

            return await loader.load(split.whole_like(), ref, apply=write)
        assert self.model is not None
        return await loader.load(self.model, ref)

    def digest(self) -> str:
        if isinstance(self.engine, VllmEngine):
            return self.engine.digest()
        if isinstance(self.engine, PagedEngine) and self.engine.tp > 1:
            return weights_digest(self.engine.gather_whole())
        assert self.model is not None
        return weights_digest(self.model)


def build_engine(
    backend: Backend,
    model_factory: str,
    seed: int,
    max_batch: int,
    *,
    engine: str | None,
    checkpoint: str | None,
    kv: KVOptions | None,
    vllm: dict[str, Any] | None,
    model_kwargs: dict[str, Any] | None,
    version: int,
    eos_id: int | None,
    pad_id: int | None,
    max_seq_len: int | None,
    vocab_size: int | None,
    tp: int = 1,
    profile: str | None = None,
) -> tuple[Weights, AnyEngine]:
    """The engine and where weight syncs write; ``tp`` > 1 splits a checkpoint's model over
    that many ranks (this process and ``tp - 1`` it starts: :mod:`._tp`); ``engine="sim"``
    steps ``profile``'s times (a step-time model's JSON file) instead of the model
    (:mod:`._sim`). Raises :class:`ConfigError` for options that do not fit the engine."""
    kind = engine or ("paged" if checkpoint is not None else "recompute")
    if kind not in ENGINES:
        raise oc.ConfigError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if (kind == "recompute") != (checkpoint is None):
        raise oc.ConfigError(
            f"engine={kind!r} runs "
            + (
                "a model factory's model; drop checkpoint="
                if checkpoint
                else "a checkpoint; give checkpoint=DIR"
            )
        )
    if kv not in (None, KVOptions()) and kind not in ("paged", "sim"):
        raise oc.ConfigError("kv options apply to a checkpoint's paged engine (engine='paged')")
    if (profile is not None) != (kind == "sim"):
        raise oc.ConfigError(
            "engine='sim' steps a step-time profile: give profile=FILE (from `orchestr sim "
            "calibrate`)"
            if kind == "sim"
            else f"profile= is the simulated engine's (engine='sim'), not {kind!r}'s"
        )
    if vllm and kind != "vllm":
        raise oc.ConfigError("vllm options apply to engine='vllm'")
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise oc.ConfigError(f"tp is a whole number >= 1, got {tp!r}")
    if tp > 1 and kind != "paged":  # a simulated engine's step time is its profile's
        raise oc.ConfigError(f"tp={tp} splits a checkpoint on the paged engine, not {kind!r}")
    if checkpoint is None:
        return _recompute(
            backend, model_factory, seed, max_batch, model_kwargs, version, eos_id, pad_id,
            max_seq_len, vocab_size,
        )  # fmt: skip
    has_tokenizer = os.path.exists(os.path.join(checkpoint, "tokenizer.json"))
    detokenize = Tokenizer(checkpoint).decode if has_tokenizer else None
    dtype = backend.dtype or torch.float32
    if kind == "vllm":
        built = VllmEngine(
            checkpoint, max_batch=max_batch, version=version, seed=seed, dtype=dtype,
            options=vllm, detokenize=detokenize,
        )  # fmt: skip
        return Weights(None, built), built
    options = dataclasses.asdict(kv or KVOptions())
    if kind == "sim":
        assert profile is not None
        return _simulated(checkpoint, profile, max_batch, version, seed, detokenize, options)
    if tp == 1:
        lm = load_model(checkpoint, dtype=dtype, device=backend.device)
        ranks = None
    else:
        check_tp(read_config(checkpoint), tp, checkpoint)
        device = torch.device(backend.device)
        ranks = TPRanks(
            checkpoint,
            tp,
            dtype=dtype,
            device=device,
            num_blocks=options["num_blocks"],
            block_size=options["block_size"],
            packed=options["packed"],
            attention=options["attention"],
            threads=torch.get_num_threads(),
        )
        try:  # while the other ranks load theirs
            lm = load_shard(checkpoint, tp, 0, dtype=dtype, device=device)
        except BaseException:
            ranks.close()
            raise
    paged = PagedEngine(
        lm,
        max_batch=max_batch,
        version=version,
        seed=seed,
        model_id=os.path.abspath(checkpoint),
        detokenize=detokenize,
        ranks=ranks,
        **options,
    )
    return Weights(lm, paged), paged


def _simulated(
    checkpoint: str,
    profile: str,
    max_batch: int,
    version: int,
    seed: int,
    detokenize: Callable[[list[int]], str] | None,
    options: dict[str, Any],
) -> tuple[Weights, SimEngine]:
    try:
        steps = StepTimeModel.load(profile)
    except (OSError, ValueError) as exc:
        raise oc.ConfigError(f"profile: {exc}") from None
    built = SimEngine(
        read_config(checkpoint), steps, max_batch=max_batch, version=version, seed=seed,
        model_id=os.path.abspath(checkpoint), detokenize=detokenize, **options,
    )  # fmt: skip
    return Weights(built.model, built), built


def _recompute(
    backend: Backend,
    model_factory: str,
    seed: int,
    max_batch: int,
    model_kwargs: dict[str, Any] | None,
    version: int,
    eos_id: int | None,
    pad_id: int | None,
    max_seq_len: int | None,
    vocab_size: int | None,
) -> tuple[Weights, RecomputeEngine]:
    model = build_model(model_factory, model_kwargs, seed)
    runner = backend.prepare(model)
    if isinstance(model, TinyLM):  # its own sizes and padding unless told otherwise
        vocab_size = vocab_size or model.cfg.vocab_size
        pad_id = model.cfg.pad_id if pad_id is None else pad_id
    built = RecomputeEngine(
        model,
        runner=runner,
        max_batch=max_batch,
        version=version,
        seed=seed,
        pad_id=0 if pad_id is None else pad_id,
        eos_id=eos_id,
        max_seq_len=max_seq_len,
        vocab_size=vocab_size,
    )
    return Weights(model, built), built


async def in_thread(fn: Callable[..., T], *args: Any, threads: int | None = None) -> T:
    """Run ``fn`` in the default executor, with ``threads`` torch (OpenMP) threads when given:
    the count is the calling thread's own, so an executor thread has the process's default
    until told. A thread cannot be interrupted: on cancellation wait for it to end, so nothing
    touches the engine after the caller has gone."""
    call = functools.partial(_with_threads, threads, fn, *args) if threads else fn
    future = asyncio.get_running_loop().run_in_executor(None, call, *(() if threads else args))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        await asyncio.wait([future])
        raise


def _with_threads(threads: int, fn: Callable[..., T], *args: Any) -> T:
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return fn(*args)


async def read_staged(
    own: Mapping[str, torch.Tensor], state: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    """``state`` with each :class:`~orchestr.Buffer` value (for a tensor the model has) read
    into a new tensor shaped like the model's; raises ``ValueError`` for a buffer of another
    size (nothing is read then for it)."""
    tensors: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if isinstance(v, Buffer) and k in own:
            dst = torch.empty(own[k].shape, dtype=own[k].dtype)
            if v.nbytes != dst.nbytes:
                raise ValueError(f"buffer for {k!r} has {v.nbytes} bytes, needs {dst.nbytes}")
            await v.read_into(dst)
            v = dst
        tensors[k] = v
    return tensors
