"""The trainer role: a model and its optimizer, GRPO steps, data parallel, versioned weights.

Each member of a trainer mesh holds a full replica. After ``ctx.init_distributed(trainers)``
the members are one ``torch.distributed`` group: each takes whole groups of the batch, every
mean is over the whole batch's tokens and the gradients are summed across the group (one
all-reduce over a flat bucket), so the replicas stay bitwise equal when they start equal (the
same ``seed``). The policy version is the number of batches trained on.

A step takes scored completions as a generator made them (prompt, tokens, the behaviour
log-probs, the policy version) and runs :func:`~._update.grpo_update`, the code the
single-process reference runs: GRPO's clipped ratio against the behaviour log-probs
(:mod:`._grpo`), a few optimizer steps per batch. Weights leave by the data plane: :meth:`Trainer.publish` returns a small
:class:`~orchestr.roles.WeightsRef` that generators load from directly.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

import orchestr as oc
from orchestr.roles._common._backend import BackendSpec, choose_backend
from orchestr.roles._common._factory import DEFAULT_MODEL, build_model
from orchestr.roles._common._model import TinyLM
from orchestr.roles._common._sampling import completion_logprobs, generate, pack, token_logprobs
from orchestr.roles._common._weightplan import StaleWeightsError, weights_digest
from orchestr.roles._common._weights import WeightPublisher, WeightsRef

from ._grpo import group_advantages
from ._update import UpdateConfig, grpo_update, rank_and_world, scheduled_lr

__all__ = ["Trainer", "build_model"]


def _sample_row(
    s: Any, need_reward: bool = True
) -> tuple[list[int], list[int], list[float], int, float]:
    """(prompt, tokens, behaviour log-probs, version, reward) of one sample."""
    reward: Any
    if isinstance(s, tuple | list) and len(s) == 2:
        s, reward = s
    elif isinstance(s, dict):
        reward = s.get("reward")
    else:
        reward = getattr(s, "reward", None)

    def get(key: str) -> Any:
        return s.get(key) if isinstance(s, dict) else getattr(s, key, None)

    prompt, tokens, logprobs, version = (
        get("prompt"),
        get("tokens"),
        get("sample_logprobs"),
        get("version"),
    )
    if prompt is None or tokens is None or logprobs is None or version is None:
        raise ValueError(
            "a sample needs prompt, tokens, sample_logprobs and version (a Completion does); "
            f"got {type(s).__name__}"
        )
    if not need_reward:
        reward = 0.0
    elif not isinstance(reward, int | float) or isinstance(reward, bool):
        raise ValueError(f"a sample needs a numeric reward, got {reward!r}")
    return list(prompt), list(tokens), [float(x) for x in logprobs], int(version), float(reward)


class Trainer(oc.Actor):
    """A replica of the policy and its optimizer (AdamW with ``betas`` and ``weight_decay``);
    ``update`` (:class:`~._update.UpdateConfig` or a dict of its fields) says how each batch
    is trained on. ``max_staleness`` (η), when set, refuses a batch holding a sample older
    than ``version - η``. ``backend`` (a :class:`~orchestr.roles.BackendSpec` or a name,
    default the best this node has) says where and how the model runs. ``pad_id`` pads
    batches (a TinyLM's own unless given, else 0) and ``eos_id`` ends :meth:`greedy`'s
    completions (None: only their lengths do); both are the model's vocabulary's.
    ``lr_schedule`` ``cosine`` lowers the rate from ``lr`` to ``min_lr_ratio`` of it over
    ``lr_steps`` versions (:func:`~._update.scheduled_lr`); each batch's rate follows from the
    version it is trained at, so a restored trainer goes on where the checkpoint was."""

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
    ) -> None:
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        if not lr > 0:
            raise oc.ConfigError(f"lr must be positive, got {lr}")
        if max_staleness is not None and max_staleness < 0:
            raise oc.ConfigError(f"max_staleness must be >= 0, got {max_staleness}")
        try:
            self.base_lr = float(lr)
            self.schedule = (lr_schedule, int(lr_steps), float(min_lr_ratio))
            scheduled_lr(lr, 0, *self.schedule)  # checks it
            self.update = (
                update if isinstance(update, UpdateConfig) else UpdateConfig(**(update or {}))
            )
            self.optimizer_args = {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay}
            self.backend = choose_backend(backend)
            self.model = build_model(model_factory, model_kwargs, seed)
            # the checkpoint a Hugging Face model was loaded from: what export_hf copies
            self.source = (model_kwargs or {}).get("folder")
            # runs the forward passes: the same parameters, on the backend's device, dtype and
            # (when compiled) under torch.compile; self.model keeps the names weights go by
            self.runner = self.backend.prepare(self.model)
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
        ``group_size`` consecutive samples of one prompt. ``advantage_scale`` 0 or -1 gives
        the controls. With a process group every member calls this together with its share.

        Returns the update's statistics over the whole batch plus ``reward_mean`` (this
        shard's), ``version`` (after), ``oldest_version`` and ``staleness`` (the version before
        the step minus the oldest sample's). Raises ``ValueError`` for a malformed batch and
        ``StaleWeightsError`` past ``max_staleness``; either leaves the model untouched.
        ``busy_s`` is the step's time in this actor."""
        t0 = time.perf_counter()
        rows = [_sample_row(s) for s in samples]
        if not rows:
            raise ValueError("an empty batch; give at least one group")
        oldest = min(r[3] for r in rows)
        if self.max_staleness is not None and oldest < self.version - self.max_staleness:
            raise StaleWeightsError(
                f"a sample of version {oldest} is older than the trainer's version "
                f"{self.version} minus max_staleness {self.max_staleness}"
            )
        rewards = torch.tensor([r[4] for r in rows], dtype=torch.float32)
        advantages = group_advantages(rewards, int(group_size), scale=float(advantage_scale))
        gen = pack(
            [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], pad_id=self.pad_id
        )
        rate = scheduled_lr(self.base_lr, self.version, *self.schedule)
        for group in self.optimizer.param_groups:
            group["lr"] = rate
        stats = grpo_update(self.runner, self.optimizer, gen, advantages, self.update)
        stats.update(
            reward_mean=float(rewards.mean()),
            oldest_version=oldest,
            staleness=self.version - oldest,
            version=self.version + 1,
            busy_s=time.perf_counter() - t0,
            lr=rate,
        )
        self.version += 1
        return stats

    @oc.endpoint
    def logprobs(self, tokens: Any, start: int) -> list[list[float]]:
        """The current policy's log-probs of ``tokens[:, start:]`` (no gradient), to compare
        with what a generator recorded."""
        self.runner.eval()
        with torch.no_grad():
            t = torch.as_tensor(tokens, dtype=torch.long, device=self.backend.device)
            out: list[list[float]] = token_logprobs(self.runner, t, int(start)).tolist()
            return out

    @oc.endpoint
    def greedy(self, prompts: list[list[int]], max_new_tokens: list[int]) -> list[list[int]]:
        """Greedy completions of encoded ``prompts`` under the current weights (the
        held-out evaluation, with the weights being trained and no generator's time)."""
        self.runner.eval()
        gen = generate(self.runner, prompts, max_new_tokens, pad_id=self.pad_id, eos_id=self.eos_id)
        return [gen.completion(i) for i in range(len(prompts))]

    @oc.endpoint
    def completion_logprobs(self, samples: list[Any]) -> list[list[float]]:
        """The current policy's log-prob of each token of each sample (a ``Completion`` or a
        dict of its fields; no reward needed), to compare with what a generator recorded."""
        rows = [_sample_row(s, need_reward=False) for s in samples]
        gen = pack(
            [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], pad_id=self.pad_id
        )
        self.runner.eval()
        with torch.no_grad():
            logp, _ = completion_logprobs(self.runner, gen.to(self.backend.device))
        return [logp[i, : len(r[1])].tolist() for i, r in enumerate(rows)]

    @oc.endpoint
    def publish(self) -> WeightsRef:
        """Copy the weights into the publisher's buffers as ``version``; generators load them
        from this actor with the returned ref."""
        return self.publisher.publish(self.model, self.version)

    @oc.endpoint
    def digest(self) -> dict[str, Any]:
        """The weights' digest (equal digests: bitwise-equal weights), version, rank and
        backend."""
        rank, world = rank_and_world()
        return {
            "digest": weights_digest(self.model),
            "version": self.version,
            "rank": rank,
            "world_size": world,
            "backend": self.backend.describe(),
        }

    @oc.endpoint
    def checkpoint(self, path: str) -> str:
        """Write model, optimizer and version to ``path`` (atomically: a temporary file, then a
        rename). Returns the path."""
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
        from orchestr.roles._common._hf._export import export_checkpoint

        where = source if source is not None else self.source
        if not isinstance(where, str):
            raise oc.ConfigError("export_hf needs the source checkpoint's folder (source=)")
        return export_checkpoint(self.model, where, folder, force=force)

    @oc.endpoint
    def restore(self, path: str) -> int:
        """Load what :meth:`checkpoint` wrote; returns the restored version. Versions start
        again from it: the publisher is a new one (refs of the old one go stale), so the next
        publish may be of an older version than the last. Raises ValueError when the
        checkpoint does not fit this model, and then changes nothing."""
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
