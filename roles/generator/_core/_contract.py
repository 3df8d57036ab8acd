"""The generator's engine contract, named: what the actor, the KV movers and the simulator
may ask of an engine.

- :class:`Engine`: what every engine does (the recompute engine, the paged engine, vLLM's,
  and wrappers such as the KV-store link): take requests, step, cancel, report, and load
  weights under a version. An engine is not thread-safe: one caller at a time, and the
  generator calls it under its lock, a step in a worker thread.
- :class:`PagedKV`: an :class:`Engine` over a paged KV cache with a prefix cache, and what it
  lends to the code that moves blocks between engines (the prefill/decode handoff, the direct
  copy, the KV-store link, attention offload): holding and releasing blocks, prefix plans,
  adopting blocks read elsewhere, reserving blocks and copying them in, the pool's memory and
  layout, per-layer watches, the queued load and the prefix cache's events and offload.

Both are ``runtime_checkable``: a capability check is ``isinstance(engine, PagedKV)``, never a
probe for one attribute. Neither imports torch at run time; the simulator types against them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from .._engines._requests import Live
    from ._scheduler import Seq, Step
    from ._types import Completion, EngineStats, Request

__all__ = ["Engine", "PagedKV"]


@runtime_checkable
class Engine(Protocol):
    """A continuous-batching engine. Every method is called between steps, one caller at a
    time (the generator holds its lock); :meth:`step` may run in a worker thread."""

    @property
    def version(self) -> int:
        """The policy version of the weights in use (each token records its own)."""
        ...

    @property
    def paused(self) -> bool: ...

    def pause(self) -> None:
        """Stop stepping (``step`` does nothing) until :meth:`resume`. Idempotent."""
        ...

    def resume(self) -> None: ...

    def submit(self, requests: Iterable[Request]) -> None:
        """Queue ``requests``; raises ``ValueError`` for a bad one, and then queues none."""
        ...

    def cancel(self, request_id: str) -> Completion:
        """Stop a waiting or running request and return what it made; ``KeyError`` if it is
        neither."""
        ...

    def drop_all(self) -> int:
        """Forget every request, waiting or running; how many there were."""
        ...

    def request_ids(self) -> list[str]:
        """The ids of the requests waiting or running."""
        ...

    def live(self, request_id: str) -> Live | None:
        """The record of a waiting or running request (its tokens so far), else ``None``."""
        ...

    def has_work(self) -> bool:
        """Whether :meth:`step` would do anything (there are requests and it is not paused)."""
        ...

    def step(self) -> list[Completion]:
        """Run one step of the batch; the completions that finished in it."""
        ...

    def load_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy ``state`` into the model and make ``version`` current; ``ValueError`` (nothing
        changed) for a state that does not fit or an older version."""
        ...

    def set_version(self, version: int, *, rewind: bool = False) -> None:
        """Make ``version`` current after its weights were written in place; versions never go
        back unless ``rewind``."""
        ...

    def stats(self) -> EngineStats: ...

    def close(self) -> None:
        """Release what the engine holds outside this process (a tensor-parallel model's
        other ranks). Idempotent; the engine takes no more calls after it."""

    def metrics(self) -> dict[str, Any]:
        """Counters and gauges by their exported names (:mod:`._metrics`)."""
        ...

    def take_latencies(self) -> tuple[list[float], list[float]]:
        """Times to first token and between tokens (seconds) since the last call."""
        ...


@runtime_checkable
class PagedKV(Engine, Protocol):
    """An :class:`Engine` whose keys and values live in a pool of blocks with a prefix cache,
    lent to the code that moves blocks: every method is called between steps, except that
    :meth:`hold_blocks` may be called from :meth:`watch_layers`' hook."""

    @property
    def block_nbytes(self) -> int:
        """The bytes of one block's keys and values, all layers."""
        ...

    @property
    def num_layers(self) -> int: ...

    @property
    def kv_memory(self) -> torch.Tensor:
        """The region holding every block, to register as a buffer peers read blocks from."""
        ...

    def lend(self, blocks: list[int]) -> tuple[torch.Tensor, list[int], tuple[int, int, int]]:
        """Memory a peer may read ``blocks`` from, their ids in it and its layout (the pool
        itself, or a copy of the blocks where the pool is not in one region)."""
        ...

    @property
    def kv_layout(self) -> tuple[int, int, int]:
        """Where a block lies in :attr:`kv_memory` (planes, bytes a plane, bytes a row)."""
        ...

    # -- load and the prefix cache, for routers and readers --------------------------------
    def load(self) -> tuple[int, int]:
        """Blocks of work queued: prefill and decode."""
        ...

    def cache_keys(self) -> tuple[int, list[Any]]:
        """The block size and the extra keys a block hash carries now."""
        ...

    def cached_hashes(self) -> list[bytes]:
        """The hashes of every block in the prefix cache now."""
        ...

    def take_kv_events(self) -> list[Any]:
        """The prefix cache's stored/removed/cleared events since the last call."""
        ...

    # -- blocks to and from a store ----------------------------------------------------------
    def keep_offload(self, on: bool) -> None:
        """Whether :meth:`take_offload` gives the blocks that enter the prefix cache."""
        ...

    def take_offload(self) -> tuple[int, list[bytes], list[torch.Tensor]]:
        """The version, keys and copies of the blocks cached since the last call."""
        ...

    def prefix_plan(self, prompt: list[int]) -> tuple[list[bytes], int]:
        """The keys of ``prompt``'s blocks, and how many of them, from the first, are cached."""
        ...

    def adopt(
        self,
        prompt: list[int],
        keys: list[bytes],
        start: int,
        data: list[torch.Tensor] | torch.Tensor,
    ) -> int:
        """Enter blocks of ``prompt`` read elsewhere (``keys[start:]``); the tokens entered."""
        ...

    def reserve(
        self, keys: list[bytes], start: int, count: int
    ) -> tuple[int, list[int], list[int]]:
        """Hold blocks for those of ``keys[start : start + count]`` not cached here."""
        ...

    def copy_blocks_in(
        self, blocks: list[int], source: torch.Tensor, theirs: list[int], plane_bytes: int
    ) -> None:
        """Copy blocks ``theirs`` of a peer's memory of this layout into ``blocks``."""
        ...

    def enter_reserved(
        self,
        prompt: list[int],
        keys: list[bytes],
        reserved: tuple[int, list[int], list[int]],
        *,
        keep: bool,
    ) -> int:
        """End a :meth:`reserve`: with ``keep`` its blocks enter the prefix cache."""
        ...

    # -- blocks handed to another engine -----------------------------------------------------
    def hold_prefix(self, prompt: list[int]) -> tuple[list[bytes], list[int]]:
        """Hold the cached blocks of ``prompt``'s prefix: their keys and ids."""
        ...

    def hold_blocks(self, blocks: list[int]) -> None:
        """Hold ``blocks`` once more, until :meth:`release_blocks`."""
        ...

    def release_blocks(self, blocks: list[int]) -> None:
        """End a :meth:`hold_prefix` or :meth:`hold_blocks`."""
        ...

    def watch_layers(self, hook: Callable[[Step, int], None] | None) -> None:
        """Have ``hook(step, layer)`` called once each layer of a step is in the pool."""
        ...

    def seq_of(self, request_id: str) -> Seq | None:
        """The scheduler's record of a waiting or running request, else ``None``."""
        ...
