"""The trainer role: a model and its optimizer, GRPO steps, data parallel, versioned weights.

Each member of a trainer mesh holds a full replica. After ``ctx.init_distributed(trainers)``
the members are one ``torch.distributed`` group: each takes whole groups of the batch, every
mean is over the whole batch's tokens and the gradients are summed across the group (one
all-reduce over a flat bucket), so the replicas stay bitwise equal when they start equal (the
same ``seed``). The policy version is the number of batches trained on.

A step takes scored completions as a generator made them (prompt, tokens, the behaviour
log-probs, the policy version) and runs :func:`~._update.grpo_update`, the code the
single-process reference runs: GRPO's clipped ratio against the behaviour log-probs
(:mod:`._grpo`), a few optimizer steps per batch. :meth:`Trainer.sft_step` is supervised
fine-tuning's step instead (the response tokens' negative log-likelihood, :mod:`._sft`), on
the same replicas, optimizer and schedule. Weights leave by the data plane:
:meth:`Trainer.publish` returns a small :class:`~orchestr.roles.WeightsRef` that generators
load from directly.

The algorithm's options live on :class:`~._update.UpdateConfig` (advantage estimator,
clip-higher, loss aggregation, KL penalty, overlong filter, micro-batches); the trainer's own
are the learning-rate warm-up and schedule (:mod:`._schedule`), mixed precision (``dtype``:
bfloat16 autocast over float32 weights, as in Micikevicius et al. 2018, "Mixed Precision
Training", arXiv:1710.03740) and activation checkpointing (:mod:`._activations`).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

import orchestr as oc
from orchestr.roles._common._alloc import peak_resident_bytes, return_freed_memory
from orchestr.roles._common._backend import BackendSpec, choose_backend
from orchestr.roles._common._factory import DEFAULT_MODEL, build_model
from orchestr.roles._common._model import TinyLM
from orchestr.roles._common._rollout import completion_logprobs, generate, token_logprobs
from orchestr.roles._common._weightplan import StaleWeightsError, weights_digest
from orchestr.roles._common._weights import ShardedWeightsRef, WeightPublisher, WeightsRef

from ._activations import checkpoint_layers
from ._advantages import group_advantages
from ._samples import build_batch, sample_row
from ._schedule import scheduled_lr
from ._sft import sft_batch, sft_evaluate, sft_update
from ._sharding import (
    SHARDING,
    full_tensors,
    is_sharded,
    load_rows,
    load_sharded,
    local_rows,
    local_state_bytes,
    meta_model,
    reshard,
    rows_folder,
    save_sharded,
    shard_model,
)
from ._update import UpdateConfig, grpo_update, rank_and_world

__all__ = ["Trainer", "build_model"]

#: ``Trainer(dtype=)``: the autocast dtype of the training forward passes (None: none).
_DTYPES: dict[str, torch.dtype | None] = {"float32": None, "bfloat16": torch.bfloat16}


class Trainer(oc.Actor):
    """A replica of the policy and its optimizer (AdamW with ``betas`` and ``weight_decay``);
    ``update`` (:class:`~._update.UpdateConfig` or a dict of its fields) says how each batch
    is trained on. ``max_staleness`` (η), when set, refuses a batch holding a sample older
    than ``version - η``. ``backend`` (a :class:`~orchestr.roles.BackendSpec` or a name,
    default the best this node has) says where and how the model runs. ``pad_id`` pads
    batches (a TinyLM's own unless given, else 0) and ``eos_id`` ends :meth:`greedy`'s
    completions (None: only their lengths do); both are the model's vocabulary's.
    ``lr_schedule`` ``cosine`` or ``linear`` lowers the rate from ``lr`` to ``min_lr_ratio``
    of it over ``lr_steps`` versions, after ``warmup_steps`` versions of linear warm-up
    (:func:`~._schedule.scheduled_lr`); each batch's rate follows from the version it is
    trained at, so a restored trainer goes on where the checkpoint was.

    ``dtype`` ``"bfloat16"`` runs the training forward passes under ``torch.autocast`` in
    bfloat16 (mixed precision: the weights, gradients and AdamW's state stay float32, and
    the loss's arithmetic too); ``"float32"`` (default) runs them as the model is. The
    evaluation endpoints (:meth:`greedy`, :meth:`logprobs`, :meth:`completion_logprobs`)
    run as the model is either way. ``activation_checkpointing`` recomputes each decoder
    layer's activations in the backward pass instead of keeping them
    (:mod:`._activations`; CausalLM and TinyLM models): less memory, one more forward.
    ``sharding="full"`` shards the parameters, gradients and AdamW's state over the mesh's
    process group (FSDP2, :mod:`._sharding`) at the first step after
    ``ctx.init_distributed``; every endpoint then runs collectives, so call it on every member
    together. Bad settings raise :class:`orchestr.ConfigError`."""

    __module__ = "orchestr.roles"  # its name on the wire and in the head's store (pinned)

    def __init__(
        self,
        model_factory: str = DEFAULT_MODEL,
        model_kwargs: dict[str, Any] | None = None,
        *,
        seed: int = 0,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        update: UpdateConfig | dict[str, Any] | None = None,
        max_staleness: int | None = None,
        torch_threads: int | None = None,
        bucket_bytes: int = 64 << 20,
        backend: BackendSpec | dict[str, Any] | str | None = None,
        pad_id: int | None = None,
        eos_id: int | None = None,
        lr_schedule: str = "constant",
        lr_steps: int = 1,
        min_lr_ratio: float = 0.0,
        warmup_steps: int = 0,
        dtype: str = "float32",
        activation_checkpointing: bool = False,
        sharding: str = "none",
    ) -> None:
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        if not lr > 0:
            raise oc.ConfigError(f"lr must be positive, got {lr}")
        if max_staleness is not None and max_staleness < 0:
            raise oc.ConfigError(f"max_staleness must be >= 0, got {max_staleness}")
        if dtype not in _DTYPES:
            raise oc.ConfigError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
        if not isinstance(activation_checkpointing, bool):
            raise oc.ConfigError(
                f"activation_checkpointing must be True or False, got {activation_checkpointing!r}"
            )
        if sharding not in SHARDING:
            raise oc.ConfigError(f"sharding must be one of {', '.join(SHARDING)}, got {sharding!r}")
        self.sharding = sharding
        self.autocast_dtype = _DTYPES[dtype]
        try:
            self.base_lr = float(lr)
            self.schedule = (lr_schedule, int(lr_steps), float(min_lr_ratio))
            self.warmup = int(warmup_steps)
            scheduled_lr(lr, 0, *self.schedule, warmup=self.warmup)  # checks it
            self.update = (
                update if isinstance(update, UpdateConfig) else UpdateConfig(**(update or {}))
            )
            self.optimizer_args = {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay}
            self.backend = choose_backend(backend)
            # sharded, a checkpoint's model is read by rows once it is sharded (_ready)
            self.rows_from = (
                rows_folder(model_factory, model_kwargs) if sharding == "full" else None
            )
            if self.rows_from is not None:
                self.model = meta_model(self.rows_from)
            else:
                self.model = build_model(model_factory, model_kwargs, seed)
            if activation_checkpointing:
                checkpoint_layers(self.model)
            # the checkpoint a Hugging Face model was loaded from: what export_hf copies
            self.source = (model_kwargs or {}).get("folder")
            # runs the forward passes: the same parameters, on the backend's device, dtype and
            # (when compiled) under torch.compile; self.model keeps the names weights go by.
            # A model still on the meta device is prepared once it has its rows.
            if self.rows_from is None:
                self.runner = self.backend.prepare(self.model)
            else:
                self.runner = self.model
            self.optimizer = torch.optim.AdamW(self.model.parameters(), **self.optimizer_args)  # type: ignore[arg-type]
        except (TypeError, ValueError) as exc:
            raise oc.ConfigError(f"bad trainer settings: {exc}") from exc
        if pad_id is None and isinstance(self.model, TinyLM):
            pad_id = self.model.cfg.pad_id
        self.pad_id = 0 if pad_id is None else pad_id
        self.eos_id = eos_id
        self.max_staleness = max_staleness
        self.version = 0
        self.bucket_bytes = bucket_bytes
        self.publisher = WeightPublisher(bucket_bytes=bucket_bytes)

    @oc.endpoint
    def train_step(
        self, samples: list[Any], group_size: int, advantage_scale: float = 1.0
    ) -> dict[str, float]:
        """Train on one batch and advance the version by one.

        ``samples``: :class:`~orchestr.roles.Completion` objects (or dicts with ``prompt``,
        ``tokens``, ``sample_logprobs`` and ``version``) each carrying a ``reward``
        (a ``(completion, reward)`` pair, or a dict with a ``reward`` key), whole groups of
        ``group_size`` consecutive samples of one prompt. A sample may carry
        ``ref_logprobs`` (needed with ``kl_coef > 0``) and ``finish_reason`` (``"length"``
        samples leave the loss with ``overlong_filter``). The advantages are
        ``update.advantage``'s (:func:`~._advantages.group_advantages`);
        ``advantage_scale`` 0 or -1 gives the controls. With a process group every member
        calls this together with its share.

        Returns the update's statistics over the whole batch (:func:`~._update.grpo_update`:
        ``kl`` with a KL penalty, ``overlong_filtered`` with the overlong filter) plus
        ``reward_mean`` (this shard's), ``version`` (after), ``oldest_version``,
        ``staleness`` (the version before the step minus the oldest sample's) and ``lr``.
        Raises ``ValueError`` for a malformed batch (a sample without ``ref_logprobs`` when
        the KL penalty is on among them) and ``StaleWeightsError`` past ``max_staleness``;
        either leaves the model untouched. ``busy_s`` is the step's time in this actor."""
        t0 = time.perf_counter()
        self._ready()
        rows = [sample_row(s) for s in samples]
        if not rows:
            raise ValueError("an empty batch; give at least one group")
        oldest = min(r.version for r in rows)
        if self.max_staleness is not None and oldest < self.version - self.max_staleness:
            raise StaleWeightsError(
                f"a sample of version {oldest} is older than the trainer's version "
                f"{self.version} minus max_staleness {self.max_staleness}"
            )
        config = self.update
        batch = build_batch(rows, self.pad_id, need_ref=config.kl_coef > 0)
        weights = None
        if config.advantage == "reinforce_pp":
            # whitened over the tokens the loss sees
            weights = batch.gen.lengths.float()
            if config.overlong_filter:
                weights = torch.where(batch.truncated, 0.0, weights)
        advantages = group_advantages(
            batch.rewards,
            int(group_size),
            scale=float(advantage_scale),
            estimator=config.advantage,
            weights=weights,
        )
        rate = self._set_rate()
        stats = grpo_update(
            self.runner,
            self.optimizer,
            batch.gen,
            advantages,
            config,
            ref_logprobs=batch.ref_logprobs,
            truncated=batch.truncated,
            autocast_dtype=self.autocast_dtype,
        )
        stats.update(
            reward_mean=float(batch.rewards.mean()),
            oldest_version=oldest,
            staleness=self.version - oldest,
            version=self.version + 1,
            busy_s=time.perf_counter() - t0,
            lr=rate,
        )
        self.version += 1
        return stats

    def _ready(self) -> None:
        """Shard the model at first use when asked to (the process group exists by then);
        the optimizer is made again over the shards (it has no state before a step)."""
        if self.sharding == "full" and not is_sharded(self.model):
            return_freed_memory()  # gathered layers freed go back (the point is the peak)
            shard_model(self.model, self.backend.device)
            if self.rows_from is not None:
                load_rows(self.model, self.rows_from, self.backend.device)
            self.runner = self.backend.prepare(self.model)
            self.optimizer = torch.optim.AdamW(self.model.parameters(), **self.optimizer_args)  # type: ignore[arg-type]
        elif self.sharding == "full":
            reshard(self.model)  # from the shards, whatever ran last

    def _set_rate(self) -> float:
        """Set (and return) the learning rate of the batch trained at this version."""
        rate = scheduled_lr(self.base_lr, self.version, *self.schedule, warmup=self.warmup)
        for group in self.optimizer.param_groups:
            group["lr"] = rate
        return rate

    @oc.endpoint
    def sft_step(self, samples: list[Any]) -> dict[str, float]:
        """One supervised step: an optimizer step on the mean negative log-likelihood of the
        response tokens of ``samples`` (dicts with ``prompt`` and ``tokens``: the response's
        ids, the stop token included when it is to be learnt), prompt tokens masked out, the
        mean over every response token of the batch (:func:`~._sft.sft_update`: micro-batches
        of ``update.micro_batch_tokens``, gradients clipped to ``update.max_grad_norm``, the
        ``dtype``'s autocast, the rate of the schedule at this version); the version goes up
        by one. With a process group every member calls this together with its share (at
        least one sample each): the mean is the whole batch's, the gradients summed.

        Returns the whole batch's ``loss`` (before the step), ``tokens`` and ``grad_norm``,
        and ``lr``, ``version`` (after) and ``busy_s`` (the step's time in this actor).
        Raises ``ValueError`` for an empty or malformed batch, leaving the model untouched.
        Not idempotent: each call is a step."""
        t0 = time.perf_counter()
        self._ready()
        gen = sft_batch(samples, self.pad_id)
        rate = self._set_rate()
        stats = sft_update(
            self.runner, self.optimizer, gen, self.update, autocast_dtype=self.autocast_dtype
        )
        self.version += 1
        stats.update(lr=rate, version=self.version, busy_s=time.perf_counter() - t0)
        return stats

    @oc.endpoint
    def sft_loss(self, samples: list[Any]) -> dict[str, float]:
        """The current weights' mean negative log-likelihood of the response tokens of
        ``samples`` (as :meth:`sft_step` takes them), no gradient, run as the model is
        (no autocast) in micro-batches of ``update.micro_batch_tokens``: the held-out loss.
        Returns ``loss`` and ``tokens``. No collective: one member scores the whole set.
        Raises ``ValueError`` for an empty or malformed batch. Idempotent."""
        self._ready()
        gen = sft_batch(samples, self.pad_id)
        self.runner.eval()
        return sft_evaluate(self.runner, gen, self.update.micro_batch_tokens)

    @oc.endpoint
    def logprobs(self, tokens: Any, start: int) -> list[list[float]]:
        """The current policy's log-probs of ``tokens[:, start:]`` (no gradient), to compare
        with what a generator recorded."""
        self._ready()
        self.runner.eval()
        with torch.no_grad():
            t = torch.as_tensor(tokens, dtype=torch.long, device=self.backend.device)
            out: list[list[float]] = token_logprobs(self.runner, t, int(start)).tolist()
            return out

    @oc.endpoint
    def greedy(self, prompts: list[list[int]], max_new_tokens: list[int]) -> list[list[int]]:
        """Greedy completions of encoded ``prompts`` under the current weights (the
        held-out evaluation, with the weights being trained and no generator's time). Sharded,
        every member calls this together."""
        self._ready()
        self.runner.eval()
        gen = generate(self.runner, prompts, max_new_tokens, pad_id=self.pad_id, eos_id=self.eos_id)
        return [gen.completion(i) for i in range(len(prompts))]

    @oc.endpoint
    def completion_logprobs(self, samples: list[Any]) -> list[list[float]]:
        """The current policy's log-prob of each token of each sample (a ``Completion`` or a
        dict of its fields; no reward needed), to compare with what a generator recorded."""
        self._ready()
        rows = [sample_row(s, need_reward=False) for s in samples]
        gen = build_batch(rows, self.pad_id).gen
        self.runner.eval()
        with torch.no_grad():
            logp, _ = completion_logprobs(self.runner, gen.to(self.backend.device))
        return [logp[i, : len(r.tokens)].tolist() for i, r in enumerate(rows)]

    @oc.endpoint
    def publish(self) -> WeightsRef | ShardedWeightsRef:
        """Copy the weights into the publisher's buffers as ``version``; generators load them
        from this actor with the returned ref. Sharded, each member publishes its rows of
        each tensor (no gather) and returns a :class:`ShardedWeightsRef` of them; call it on
        every member and join their refs (:func:`publish_weights` does)."""
        self._ready()
        if not is_sharded(self.model):
            return self.publisher.publish(self.model, self.version)
        rows, manifest = local_rows(self.model)
        parts = (self.publisher.publish(rows, self.version),) if rows else ()
        return ShardedWeightsRef(self.version, manifest, parts)

    @oc.endpoint
    def digest(self) -> dict[str, Any]:
        """The weights' digest (equal digests: bitwise-equal weights), version, rank and
        backend."""
        rank, world = rank_and_world()
        self._ready()
        weights: torch.nn.Module | dict[str, torch.Tensor] = self.model
        if is_sharded(self.model):  # the whole weights, gathered by every member
            weights = {k: v for k, v in full_tensors(self.model) if v is not None}
        return {
            "digest": weights_digest(weights),
            "version": self.version,
            "rank": rank,
            "world_size": world,
            "backend": self.backend.describe(),
        }

    @oc.endpoint
    def memory(self) -> dict[str, float]:
        """What this member holds, in MiB: ``params``, ``grads`` and ``optimizer`` (its shards,
        sharded), ``model_states`` their sum, and ``peak_rss`` the process's peak resident
        memory so far."""
        held = {k: v / 2**20 for k, v in local_state_bytes(self.model, self.optimizer).items()}
        held["model_states"] = sum(held.values())
        held["peak_rss"] = peak_resident_bytes() / 2**20
        return held

    @oc.endpoint
    def checkpoint(self, path: str) -> str:
        """Write model, optimizer and version to ``path`` (atomically: a temporary file, then a
        rename). Returns the path. Sharded, every member calls this together and ``path`` is
        a folder each writes its own shards to (``torch.distributed.checkpoint``)."""
        self._ready()
        if is_sharded(self.model):
            save_sharded(self.model, self.optimizer, {"version": self.version}, path)
            return path
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "version": self.version,
        }
        tmp = f"{path}.tmp-{os.getpid()}"
        torch.save(state, tmp)
        os.replace(tmp, path)
        return path

    @oc.endpoint
    def export_hf(self, folder: str, source: str | None = None, force: bool = False) -> str:
        """Write the weights trained so far as a Hugging Face folder (``config.json``,
        ``model.safetensors``, ``generation_config.json``, the tokenizer files and chat
        template of ``source``: by default the checkpoint the model was loaded from) that
        ``transformers`` and ``orchestr serve`` load. Returns its path. Raises
        :class:`ConfigError` for a model that is not a Hugging Face format one and what
        :func:`~orchestr.roles.models.export_checkpoint` raises."""
        from orchestr.roles._common._hf._export import export_checkpoint, export_streamed

        where = source if source is not None else self.source
        if not isinstance(where, str):
            raise oc.ConfigError("export_hf needs the source checkpoint's folder (source=)")
        self._ready()
        if not is_sharded(self.model):
            return export_checkpoint(self.model, where, folder, force=force)
        # every member gathers each tensor in turn; rank 0 writes each as it comes, holding
        # one at a time
        gathered = full_tensors(self.model, 0)
        try:
            if rank_and_world()[0] != 0:
                return folder
            entries = [(k, v.dtype, tuple(v.shape)) for k, v in self.model.state_dict().items()]
            whole = ((k, v) for k, v in gathered if v is not None)
            return export_streamed(self.model, where, folder, entries, whole, force=force)
        finally:
            for _ in gathered:  # the others' gathers go on to the end, whatever happened here
                pass

    @oc.endpoint
    def restore(self, path: str) -> int:
        """Load what :meth:`checkpoint` wrote; returns the restored version. Versions start
        again from it: the publisher is a new one (refs of the old one go stale), so the next
        publish may be of an older version than the last. Raises ValueError when the
        checkpoint does not fit this model, and then changes nothing. A folder is a sharded
        checkpoint: every member restores it together (into shards of any count)."""
        self._ready()
        if os.path.isdir(path):
            if not is_sharded(self.model):
                raise ValueError(f"{path} is a sharded checkpoint: restore it with sharding='full'")
            self.version = int(
                load_sharded(self.model, self.optimizer, {"version": 0}, path)["version"]
            )
            self.publisher.close()
            self.publisher = WeightPublisher(bucket_bytes=self.bucket_bytes)
            return self.version
        state = torch.load(path, map_location="cpu", weights_only=True)
        try:
            self.model.load_state_dict(state["model"])
        except RuntimeError as exc:
            raise ValueError(f"checkpoint {path} does not fit this model: {exc}") from exc
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        self.publisher.close()
        self.publisher = WeightPublisher(bucket_bytes=self.bucket_bytes)
        return self.version
