"""A trainer and generators that sync weights over the data plane; workers import them by path."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import orchestr as oc
from orchestr._call._wire import traffic
from orchestr.roles._common._weightplan import weight_tensors, weights_digest
from orchestr.roles._common._weights import WeightLoader, WeightPublisher, WeightsRef


class Net(nn.Module):
    """Mixed dtypes on purpose: float32 layers, a bfloat16 embedding, a float64 buffer, an int64
    counter, and a tied head (one tensor under two names)."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, width)
        self.fc2 = nn.Linear(width, width)
        self.out = nn.Linear(width, 16)
        self.tied = self.out
        self.emb = nn.Parameter(torch.randn(16, 32).to(torch.bfloat16))
        self.register_buffer("scale", torch.randn(width, dtype=torch.float64))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("cache", torch.zeros(4), persistent=False)  # not synced


def make_net(seed: int, width: int = 64) -> Net:
    torch.manual_seed(seed)
    return Net(width)


class Trainer(oc.Actor):
    def __init__(
        self, seed: int = 0, width: int = 64, bucket_bytes: int = 16 << 10, slots: int = 2
    ) -> None:
        self.model: nn.Module = make_net(seed, width)
        self.publisher = WeightPublisher(bucket_bytes=bucket_bytes, slots=slots)
        self.rng = torch.Generator().manual_seed(seed + 1)

    @oc.endpoint
    def step(self, version: int) -> WeightsRef:
        """A random update of every tensor, then publish it as ``version``."""
        with torch.no_grad():
            for t in weight_tensors(self.model).values():
                if t.is_floating_point():
                    noise = torch.randn(t.shape, generator=self.rng, dtype=torch.float32)
                    t.add_(noise.to(t.dtype), alpha=0.01)
                else:
                    t.add_(1)
        return self.publisher.publish(self.model, version)

    @oc.endpoint
    def publish(self, version: int) -> WeightsRef:
        return self.publisher.publish(self.model, version)

    @oc.endpoint
    def digest(self) -> str:
        return weights_digest(self.model)

    @oc.endpoint
    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in weight_tensors(self.model).items()}

    @oc.endpoint
    async def corrupt(self, ref: WeightsRef, bucket: int, at: int) -> None:
        """Flip one byte of a published bucket through its handle, as a stray write would."""
        byte = torch.zeros(1, dtype=torch.uint8)
        buf = ref.buckets[bucket].buffer
        await buf.read_into(byte, offset=at)
        await buf.write_from(byte ^ 0xFF, offset=at)

    @oc.endpoint
    def close(self) -> None:
        self.publisher.close()


class CheckpointTrainer(Trainer):
    """:class:`Trainer`'s endpoints over a Hugging Face format checkpoint's model."""

    def __init__(self, folder: str, seed: int = 0) -> None:
        from orchestr.roles import models

        self.model = models.load_model(folder)
        self.publisher = WeightPublisher()
        self.rng = torch.Generator().manual_seed(seed + 1)


class Generator(oc.Actor):
    def __init__(self, seed: int = 100, width: int = 64, cast: str | None = None) -> None:
        self.model = make_net(seed + self.rank, width)
        if cast is not None:
            self.model.to(getattr(torch, cast))
        self.loader = WeightLoader()

    @oc.endpoint
    async def load(self, ref: WeightsRef) -> dict[str, Any]:
        loaded = await self.loader.load(self.model, ref)
        return {
            "loaded": loaded,
            "version": self.loader.version,
            "digest": weights_digest(self.model),
            "tied": self.model.tied.weight is self.model.out.weight,
            "transports": sorted(self.loader.transports),
        }

    @oc.endpoint
    def digest(self) -> str:
        return weights_digest(self.model)

    @oc.endpoint
    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in weight_tensors(self.model).items()}

    @oc.endpoint
    def received(self) -> int:
        """Bytes of call frames this process has received (the ref, never the weights)."""
        return int(traffic["received"])
