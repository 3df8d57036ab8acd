"""The trainer role: a model and its optimizer, GRPO steps, data parallel, versioned weights.

Each member of a trainer mesh holds a full replica. After ``ctx.init_distributed(trainers)``
the members are one ``torch.distributed`` group: every step averages the gradients across it
(one all-reduce over a flat bucket), so the replicas stay bitwise equal when they start equal
(the same ``seed``). The policy version is the number of optimizer steps taken.

A step takes a batch the controller assembled (sequences, where the completion starts, which
tokens are the completion's, the behaviour log-probs the generator recorded, rewards and the
group size) and runs the clipped-ratio GRPO loss against the behaviour log-probs
(:mod:`._grpo`). Weights leave by the data plane: :meth:`Trainer.publish` returns a small
:class:`~._weights.WeightsRef` that generators load from directly.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import torch

import orchestr as oc

from ._grpo import group_advantages, grpo_loss
from ._weightplan import weights_digest
from ._weights import WeightPublisher, WeightsRef

__all__ = ["Trainer", "build_model"]

DEFAULT_MODEL = "orchestr.roles._model:TinyLM"


def build_model(factory: str, kwargs: dict[str, Any] | None, seed: int) -> torch.nn.Module:
    """``factory`` (``"module:callable"``) called with ``kwargs`` under ``torch.manual_seed(seed)``,
    so replicas built with one seed start bitwise equal. A ``TinyLM`` gets its config from
    ``kwargs``."""
    module_name, sep, name = factory.partition(":")
    if not sep:
        raise oc.ConfigError(f"a model factory is named 'package.module:callable', got {factory!r}")
    try:
        fn: Any = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise oc.ConfigError(f"cannot import model factory {factory!r}: {exc}") from exc
    torch.manual_seed(seed)
    if factory == DEFAULT_MODEL:
        from ._model import TinyLM, TinyLMConfig

        model: torch.nn.Module = TinyLM(TinyLMConfig(**(kwargs or {})))
    else:
        model = fn(**(kwargs or {}))
    if not isinstance(model, torch.nn.Module):
        raise oc.ConfigError(f"{factory} returned {type(model).__name__}, not a torch nn.Module")
    return model


def _distributed() -> tuple[int, int]:
    from torch import distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Trainer(oc.Actor):
    """A replica of the policy and its optimizer (Adam)."""

    def __init__(
        self,
        model_factory: str = DEFAULT_MODEL,
        model_kwargs: dict[str, Any] | None = None,
        *,
        seed: int = 0,
        lr: float = 1e-3,
        clip_eps: float = 0.2,
        max_grad_norm: float = 1.0,
        torch_threads: int | None = None,
        bucket_bytes: int = 64 << 20,
    ) -> None:
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        if not lr > 0 or not clip_eps > 0 or not max_grad_norm > 0:
            raise oc.ConfigError("lr, clip_eps and max_grad_norm must be positive")
        self.model = build_model(model_factory, model_kwargs, seed)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.clip_eps = clip_eps
        self.max_grad_norm = max_grad_norm
        self.version = 0
        self.publisher = WeightPublisher(bucket_bytes=bucket_bytes)

    @oc.endpoint
    def train_step(self, batch: dict[str, Any]) -> dict[str, float]:
        """One optimizer step on ``batch``:

        - ``tokens`` ``[N, T]`` (ints): prompt and completion, padded;
        - ``start``: the column where completions start;
        - ``mask`` ``[N, T - start]``: 1 for completion tokens that count;
        - ``behaviour`` ``[N, T - start]``: the generator's log-probs of those tokens;
        - ``rewards`` ``[N]`` and ``group_size``: samples of one prompt are consecutive;
        - ``advantage_scale`` (default 1; 0 or -1 for the controls).

        With a process group, gradients are averaged over its members before the step.
        Returns the loss statistics, the mean reward and the new ``version``."""
        tokens = torch.as_tensor(batch["tokens"], dtype=torch.long)
        start = int(batch["start"])
        mask = torch.as_tensor(batch["mask"], dtype=torch.float32)
        behaviour = torch.as_tensor(batch["behaviour"], dtype=torch.float32)
        rewards = torch.as_tensor(batch["rewards"], dtype=torch.float32)
        scale = float(batch.get("advantage_scale", 1.0))
        advantages = group_advantages(rewards, int(batch["group_size"]), scale=scale)
        from ._generate import token_logprobs

        self.model.train()
        logp = token_logprobs(self.model, tokens, start)
        loss, stats = grpo_loss(logp, behaviour, advantages, mask, self.clip_eps)
        self.optimizer.zero_grad(set_to_none=False)
        loss.backward()  # type: ignore[no-untyped-call]
        self._average_gradients()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.version += 1
        stats.update(
            reward_mean=float(rewards.mean()), grad_norm=float(grad_norm), version=self.version
        )
        return stats

    def _average_gradients(self) -> None:
        _, world = _distributed()
        if world == 1:
            return
        from torch import distributed as dist

        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= world
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    @oc.endpoint
    def logprobs(self, tokens: Any, start: int) -> list[list[float]]:
        """The current policy's log-probs of ``tokens[:, start:]`` (no gradient), to compare
        with what a generator recorded."""
        self.model.eval()
        with torch.no_grad():
            from ._generate import token_logprobs

            t = torch.as_tensor(tokens, dtype=torch.long)
            out: list[list[float]] = token_logprobs(self.model, t, int(start)).tolist()
            return out

    @oc.endpoint
    def publish(self) -> WeightsRef:
        """Copy the weights into the publisher's buffers as ``version``; generators load them
        from this actor with the returned ref."""
        return self.publisher.publish(self.model, self.version)

    @oc.endpoint
    def digest(self) -> dict[str, Any]:
        """The weights' digest (equal digests: bitwise-equal weights), version and rank."""
        rank, world = _distributed()
        return {
            "digest": weights_digest(self.model),
            "version": self.version,
            "rank": rank,
            "world_size": world,
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
    def restore(self, path: str) -> int:
        """Load what :meth:`checkpoint` wrote; returns the restored version. Raises
        ValueError when the checkpoint does not fit this model."""
        state = torch.load(path, map_location="cpu", weights_only=True)
        try:
            self.model.load_state_dict(state["model"])
        except RuntimeError as exc:
            raise ValueError(f"checkpoint {path} does not fit this model: {exc}") from exc
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        return self.version
