"""A :class:`~.._core._contract.PagedKV` that forwards every call to the engine it wraps: the base
of a wrapper that changes a few (:class:`~.._kv._store_link.StoreEngine`), so the contract stays
whole and what the wrapper changes is what it defines."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from .._core._contract import PagedKV
    from .._core._scheduler import Seq, Step
    from .._core._types import Completion, EngineStats, Request
    from ._requests import Live

__all__ = ["Forwarding"]


class Forwarding:
    """Every :class:`~.._core._contract.PagedKV` member of ``inner``, forwarded."""

    def __init__(self, inner: PagedKV) -> None:
        self.inner = inner

    @property
    def version(self) -> int:
        return self.inner.version

    @property
    def paused(self) -> bool:
        return self.inner.paused

    def pause(self) -> None:
        self.inner.pause()

    def resume(self) -> None:
        self.inner.resume()

    def submit(self, requests: Iterable[Request]) -> None:
        self.inner.submit(requests)

    def cancel(self, request_id: str) -> Completion:
        return self.inner.cancel(request_id)

    def drop_all(self) -> int:
        return self.inner.drop_all()

    def close(self) -> None:
        self.inner.close()

    def request_ids(self) -> list[str]:
        return self.inner.request_ids()

    def live(self, request_id: str) -> Live | None:
        return self.inner.live(request_id)

    def has_work(self) -> bool:
        return self.inner.has_work()

    def step(self) -> list[Completion]:
        return self.inner.step()

    def load_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        self.inner.load_weights(state, version)

    def set_version(self, version: int, *, rewind: bool = False) -> None:
        self.inner.set_version(version, rewind=rewind)

    def stats(self) -> EngineStats:
        return self.inner.stats()

    def metrics(self) -> dict[str, Any]:
        return self.inner.metrics()

    def take_latencies(self) -> tuple[list[float], list[float]]:
        return self.inner.take_latencies()

    @property
    def block_nbytes(self) -> int:
        return self.inner.block_nbytes

    @property
    def num_layers(self) -> int:
        return self.inner.num_layers

    @property
    def kv_memory(self) -> torch.Tensor:
        return self.inner.kv_memory

    @property
    def kv_layout(self) -> tuple[int, int, int]:
        return self.inner.kv_layout

    def lend(self, blocks: list[int]) -> tuple[torch.Tensor, list[int], tuple[int, int, int]]:
        return self.inner.lend(blocks)

    def load(self) -> tuple[int, int]:
        return self.inner.load()

    def cache_keys(self) -> tuple[int, list[Any]]:
        return self.inner.cache_keys()

    def cached_hashes(self) -> list[bytes]:
        return self.inner.cached_hashes()

    def take_kv_events(self) -> list[Any]:
        return self.inner.take_kv_events()

    def keep_offload(self, on: bool) -> None:
        self.inner.keep_offload(on)

    def take_offload(self) -> tuple[int, list[bytes], list[torch.Tensor]]:
        return self.inner.take_offload()

    def prefix_plan(self, prompt: list[int]) -> tuple[list[bytes], int]:
        return self.inner.prefix_plan(prompt)

    def adopt(
        self,
        prompt: list[int],
        keys: list[bytes],
        start: int,
        data: list[torch.Tensor] | torch.Tensor,
    ) -> int:
        return self.inner.adopt(prompt, keys, start, data)

    def reserve(
        self, keys: list[bytes], start: int, count: int
    ) -> tuple[int, list[int], list[int]]:
        return self.inner.reserve(keys, start, count)

    def copy_blocks_in(
        self, blocks: list[int], source: torch.Tensor, theirs: list[int], plane_bytes: int
    ) -> None:
        self.inner.copy_blocks_in(blocks, source, theirs, plane_bytes)

    def enter_reserved(
        self,
        prompt: list[int],
        keys: list[bytes],
        reserved: tuple[int, list[int], list[int]],
        *,
        keep: bool,
    ) -> int:
        return self.inner.enter_reserved(prompt, keys, reserved, keep=keep)

    def hold_prefix(self, prompt: list[int]) -> tuple[list[bytes], list[int]]:
        return self.inner.hold_prefix(prompt)

    def hold_blocks(self, blocks: list[int]) -> None:
        self.inner.hold_blocks(blocks)

    def release_blocks(self, blocks: list[int]) -> None:
        self.inner.release_blocks(blocks)

    def watch_layers(self, hook: Callable[[Step, int], None] | None) -> None:
        self.inner.watch_layers(hook)

    def seq_of(self, request_id: str) -> Seq | None:
        return self.inner.seq_of(request_id)
