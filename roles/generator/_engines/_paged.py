"""The paged engine: :class:`~._recompute.Engine`'s contract (``submit``, ``step``, ``cancel``,
weight loads and versions, per-token log-probs) over a KV cache of blocks, for Hugging Face
format models (:class:`orchestr.roles.models.CausalLM`).

Each :meth:`PagedEngine.step` asks the sans-IO :class:`~.._core._scheduler.Scheduler` what to compute
(decodes and prefill chunks within ``token_budget`` tokens, prefix hits, preemptions), runs it
with :class:`~._paged.PagedRunner` and samples one token for each sequence whose chunk reached
its end, exactly as the recompute engine samples (:func:`~.._runner._token_choice.choose_tokens`: a request's
tokens do not depend on its batch).

**New weights while requests are in flight** (``on_new_weights``):

- ``"keep"`` (the default): the keys and values already computed stay; tokens from then on
  carry the new version (each token's version is recorded either way). The blocks a
  sequence fills after the change hold keys of both versions, so they are not entered into
  the prefix cache.
- ``"recompute"``: every running sequence is preempted and recomputed under the new weights
  (counted as preemptions); its tokens so far keep the versions that made them.

Block keys carry ``(model_id, version)``: a block computed under other weights never
matches. Metrics follow vLLM's names where the meaning is the same (:meth:`metrics`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import torch

from orchestr import clock as _clock
from orchestr.roles._common._alloc import keep_freed_memory
from orchestr.roles._common._hf._layers import CausalLM

from .._core._blocks import BlockPool
from .._core._scheduler import Scheduler, Seq, Step
from .._core._types import Completion, EngineStats, Request
from .._runner._cache import KVCache
from .._runner._microbatch import MicroBatches
from .._runner._paged import AttentionMode, PagedRunner
from .._runner._spans import copy_blocks
from .._runner._token_choice import choose_tokens
from ._requests import Detokenize, Intake, Latencies, Live, Pausable, check_state, engine_stats
from ._tp import TPRanks, whole_like
from ._tp_kv import SplitKV

__all__ = ["PagedEngine"]

KVPolicy = Literal["keep", "recompute"]


class PagedEngine(Pausable):
    """Continuous batching of ``model`` over ``num_blocks`` KV blocks of ``block_size``
    tokens. ``detokenize`` (token ids to text: the checkpoint's tokenizer) lets requests
    name stop strings. ``packed``: multiply with weights packed for the CPU
    (:mod:`.._runner._linears`; ``None``, the default: wherever they can run). ``attention``: how
    decodes attend (:data:`~._paged.AttentionMode`; by default orchestr's paged kernel where it
    runs). ``micro_batches`` > 1 runs each step's sequences as that many micro-batches at
    once (:mod:`.._runner._microbatch`: ping-pong against experts on other hosts). On the CPU the engine
    also keeps freed memory in the process
    (:func:`~orchestr.roles._common._alloc.keep_freed_memory`). Not thread-safe: one caller
    at a time."""

    def __init__(
        self,
        model: CausalLM,
        *,
        num_blocks: int = 512,
        block_size: int = 16,
        max_batch: int = 32,
        token_budget: int = 512,
        version: int = 0,
        seed: int = 0,
        model_id: str = "model",
        on_new_weights: KVPolicy = "keep",
        clock: Callable[[], float] = _clock.monotonic,
        detokenize: Detokenize | None = None,
        packed: bool | None = None,
        attention: AttentionMode = "auto",
        micro_batches: int = 1,
        ranks: TPRanks | None = None,
    ) -> None:
        if on_new_weights not in ("keep", "recompute"):
            raise ValueError(f"on_new_weights is 'keep' or 'recompute', got {on_new_weights!r}")
        self.model = model.eval()
        cfg = model.config
        self._intake = Intake(
            vocab=cfg.vocab_size,
            max_len=cfg.max_position_embeddings,
            eos=frozenset(cfg.eos_token_ids),
            seed=seed,
            detokenize=detokenize,
        )
        self._pool = BlockPool(num_blocks, block_size)
        self._kv = KVCache(model, num_blocks, block_size)
        self._ranks = ranks
        group = None
        if ranks is not None:
            if micro_batches != 1:
                ranks.close()
                raise ValueError("a tensor-parallel generator runs each step as one batch")
            group = ranks.join()
        #: a split model's blocks as a whole one's engine lays them out, else ``None``
        self._split = None if ranks is None else SplitKV(self._kv, ranks, model.shard)  # type: ignore[arg-type]
        self._runner = PagedRunner(model, self._kv, packed=packed, attention=attention, group=group)
        self._batches = MicroBatches(self._runner, micro_batches)
        if self._kv.keys[0].device.type == "cpu":
            keep_freed_memory()
        self._model_id = model_id
        super().__init__(version)
        self._sched = Scheduler(
            self._pool,
            max_batch=max_batch,
            token_budget=token_budget,
            extra_keys=(model_id, version),
        )
        self._policy = on_new_weights
        self._clock = clock
        self._live: dict[str, tuple[Live, Seq]] = {}
        self._steps = self._tokens = self._finished = 0
        self._busy_s = 0.0
        self._latencies = Latencies()

    @property
    def tp(self) -> int:
        """The ranks the model is split over (1: it is whole here)."""
        return 1 if self._ranks is None else self._ranks.tp

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any. Idempotent."""
        if self._ranks is not None:
            self._ranks.close()

    # -- requests ----------------------------------------------------------------------------
    def submit(self, requests: Iterable[Request]) -> None:
        """Queue ``requests`` (FIFO). All are checked first: on a ``ValueError`` (a bad
        request, a duplicate id, one that can never fit the cache) none is queued."""
        checked: list[tuple[Live, Seq]] = []
        now = self._clock()
        for r in requests:
            live = self._intake.check(r, now)
            if r.id in self._live or any(c.request.id == r.id for c, _ in checked):
                raise ValueError(f"request id {r.id!r} is already waiting or running")
            checked.append((live, self._seq(live)))
        for live, seq in checked:  # the pool size check cannot fail once all passed
            self._sched.add(seq)
            self._live[live.request.id] = (live, seq)

    def cancel(self, request_id: str) -> Completion:
        """Remove a waiting or running request, its blocks freed; returns what it generated
        so far (``finish_reason="cancelled"``). Raises ``KeyError`` for an unknown id."""
        entry = self._live.pop(request_id, None)
        if entry is None:
            raise KeyError(f"no request {request_id!r} is waiting or running")
        live, seq = entry
        self._sched.finish(seq, "cancelled")
        self._finished += 1
        return live.finish("cancelled", self._version, self._clock())

    def drop_all(self) -> int:
        """Drop every request without completions, their blocks freed; returns how many."""
        dropped = len(self._live)
        for rid in list(self._live):
            self._sched.finish(self._live.pop(rid)[1], "dropped")
        self._finished += dropped
        return dropped

    def request_ids(self) -> list[str]:
        """Ids of the running requests, then the waiting ones in queue order."""
        return [s.id for s in self._sched.running] + [s.id for s in self._sched.waiting]

    def live(self, request_id: str) -> Live | None:
        """The record of a waiting or running request (its tokens so far), else ``None``."""
        entry = self._live.get(request_id)
        return None if entry is None else entry[0]

    def load(self) -> tuple[int, int]:
        """Blocks of work queued: :meth:`Scheduler.load`."""
        return self._sched.load()

    def cache_keys(self) -> tuple[int, list[Any]]:
        """The block size and the extra keys every block hash of a request without a cache
        salt carries now (:func:`~.._core._blocks.hash_block`), for a router that hashes prompts."""
        return self._pool.block_size, [*self._sched.extra_keys, None]

    def cached_hashes(self) -> list[bytes]:
        """The hashes of every block in the prefix cache now."""
        return list(self._pool.cached)

    # -- blocks to and from a KV store -------------------------------------------------------
    @property
    def block_nbytes(self) -> int:
        """The bytes of one block's keys and values (all layers)."""
        return (self._split or self._kv).block_nbytes

    def keep_offload(self, on: bool) -> None:
        """Whether :meth:`take_offload` gives the blocks that enter the prefix cache."""
        self._pool.keep_stored(on)

    def take_offload(self) -> tuple[int, list[bytes], list[torch.Tensor]]:
        """The weights version, keys and copies of the blocks entered into the prefix cache
        since the last call (and still there), to offload to a store. Call between steps."""
        stored = self._pool.take_stored()
        copies = (self._split or self._kv).export([b for _, b in stored])
        return self._version, [key for key, _ in stored], copies

    def prefix_plan(self, prompt: list[int]) -> tuple[list[bytes], int]:
        """The keys of ``prompt``'s blocks a prefix hit may cover, and how many of them, from
        the first, are cached here now: a store may hold the rest."""
        keys = self._sched.prompt_keys(prompt)
        return keys, self._sched.cached_run(keys)

    def adopt(
        self,
        prompt: list[int],
        keys: list[bytes],
        start: int,
        data: list[torch.Tensor] | torch.Tensor,
    ) -> int:
        """Enter blocks of ``prompt`` read from elsewhere: ``data`` holds the keys and values
        of ``keys[start:]`` (:meth:`prefix_plan`'s keys, under the current weights), one
        tensor per block as :meth:`take_offload` gives them, or one copy of all of them laid
        out as a peer reads them from :attr:`kv_memory` (:func:`~.._runner._spans.block_spans`).
        Those cached here meanwhile are skipped; none when the blocks before ``start`` are
        not cached any more, fewer when the pool has fewer free blocks. Returns the tokens
        entered. Raises ``ValueError`` for data that is not whole blocks. Call between
        steps."""
        planes = (self._split or self._kv).planes_of(data)
        first, blocks = self._sched.adopt(keys, prompt, start, planes.shape[1])
        (self._split or self._kv).write(
            blocks, planes[:, first - start : first - start + len(blocks)]
        )
        return len(blocks) * self._pool.block_size

    def reserve(
        self, keys: list[bytes], start: int, count: int
    ) -> tuple[int, list[int], list[int]]:
        """Blocks for those of ``keys[start : start + count]`` not cached here, to fill
        (:meth:`copy_blocks_in`) and then enter or let go (:meth:`enter_reserved`): the
        index of the first such key, the cached blocks before it and the new blocks, all
        held meanwhile (:meth:`Scheduler.reserve`). Call between steps."""
        return self._sched.reserve(keys, start, count)

    def copy_blocks_in(
        self, blocks: list[int], source: torch.Tensor, theirs: list[int], plane_bytes: int
    ) -> None:
        """Copy blocks ``theirs`` of a peer's :attr:`kv_memory` of this layout (``source``,
        ``plane_bytes`` to a plane) into ``blocks`` (:func:`~.._runner._spans.copy_blocks`)."""
        if self._split is not None:
            self._split.copy_in(blocks, source, theirs, plane_bytes)
        else:
            copy_blocks((*self._kv.keys, *self._kv.values), blocks, source, theirs, plane_bytes)

    def enter_reserved(
        self,
        prompt: list[int],
        keys: list[bytes],
        reserved: tuple[int, list[int], list[int]],
        *,
        keep: bool,
    ) -> int:
        """End a :meth:`reserve`: with ``keep``, its blocks enter the prefix cache; the
        tokens entered. Call between steps."""
        first, prefix, blocks = reserved
        self._sched.enter_reserved(keys, prompt, first, prefix, blocks, keep=keep)
        return len(blocks) * self._pool.block_size if keep else 0

    # -- blocks handed to another engine (prefill -> decode) -------------------------------
    @property
    def kv_memory(self) -> torch.Tensor:
        """The region holding every block (:attr:`KVCache.memory`): register it as a
        :class:`~orchestr.Buffer` for peers to read blocks from. A split model's is this
        rank's heads only: :meth:`lend` gives whole blocks."""
        return self._kv.memory

    @property
    def kv_layout(self) -> tuple[int, int, int]:
        """:attr:`KVCache.layout` of :attr:`kv_memory`: where a block lies in it (a split
        model's: where it would lie, whole)."""
        return (self._split or self._kv).layout

    def lend(self, blocks: list[int]) -> tuple[torch.Tensor, list[int], tuple[int, int, int]]:
        """Memory a peer may read ``blocks`` from: :attr:`kv_memory`, the blocks' ids and
        :attr:`kv_layout`; a split model's, a whole copy of just those blocks in shared memory
        (:meth:`SplitKV.lend`). Call between steps."""
        if self._split is not None:
            return self._split.lend(blocks)
        return self._kv.memory, blocks, self._kv.layout

    def hold_prefix(self, prompt: list[int]) -> tuple[list[bytes], list[int]]:
        """Hold the blocks of ``prompt``'s prefix cached here (the full blocks before its
        last token, as far as they are cached), so nothing evicts or rewrites them until
        :meth:`release_blocks`: their keys and block ids. Call between steps."""
        keys, cached = self.prefix_plan(prompt)
        blocks = [self._pool.lookup(k) for k in keys[:cached]]
        held = [b for b in blocks if b is not None]
        self._pool.take(held)
        return keys[: len(held)], held

    def release_blocks(self, blocks: list[int]) -> None:
        """End a :meth:`hold_prefix` or :meth:`hold_blocks`. Call between steps."""
        self._pool.release(reversed(blocks))

    def hold_blocks(self, blocks: list[int]) -> None:
        """Hold ``blocks`` (in use) once more, so nothing frees or rewrites them until
        :meth:`release_blocks`, whatever becomes of their request. Call between steps, or
        from :meth:`watch_layers`' hook."""
        self._pool.take(blocks)

    def watch_layers(self, hook: Callable[[Step, int], None] | None) -> None:
        """Have ``hook(step, layer)`` called from the stepping thread once each layer's keys
        and values of a step are in the pool (``None``: no more), to hand blocks over layer
        by layer (:mod:`.._kv._streamed`). Several micro-batches may call it at once."""
        self._runner.on_layer = hook

    def seq_of(self, request_id: str) -> Seq | None:
        """The scheduler's record of a waiting or running request, else ``None``."""
        entry = self._live.get(request_id)
        return None if entry is None else entry[1]

    @property
    def num_layers(self) -> int:
        return len(self._kv.keys)

    # -- weights -----------------------------------------------------------------------------
    def load_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy ``state`` (the model's ``state_dict`` keys and shapes) into the model and make
        ``version`` current; checked first, so a ``ValueError`` changes nothing."""
        if version < self._version:
            raise ValueError(f"version {version} is older than the loaded {self._version}")
        if self._ranks is None:
            check_state(self.model, state)
            self.model.load_state_dict(dict(state), strict=True)
        else:
            assert self.model.shard is not None  # a split model is a rank's share
            with torch.device("meta"):
                check_state(CausalLM(self.model.shard.full), state)
            self.write_whole([(n, state[n]) for n in whole_like(self.model)])
        self.set_version(version)

    # -- a split model's weights, whole ------------------------------------------------------
    def whole_like(self) -> dict[str, torch.Tensor]:
        """The whole model's tensors as a sync moves them, as meta tensors (the model's own
        when it is whole)."""
        if self._ranks is None:
            return {n: t.detach() for n, t in self.model.state_dict(keep_vars=True).items()}
        return whole_like(self.model)

    def write_whole(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Write whole tensors into a split model: every rank its slices
        (:meth:`TPRanks.write`). Call between steps, then :meth:`set_version`."""
        if self._ranks is None:
            raise ValueError("write_whole writes a split model's slices; this one is whole")
        self._ranks.write(self.model, tensors)

    def gather_whole(self) -> dict[str, torch.Tensor]:
        """The whole model's tensors, put together from every rank's share (for a
        digest); the model's own when it is whole."""
        if self._ranks is None:
            return dict(self.model.state_dict())
        return self._ranks.gather(self.model)

    def set_version(self, version: int, *, rewind: bool = False) -> None:
        """Make ``version`` current after its weights were written into the model in place;
        applies ``on_new_weights`` to the requests in flight. Versions never go back unless
        ``rewind``."""
        if version < self._version and not rewind:
            raise ValueError(f"version {version} is older than the loaded {self._version}")
        if version != self._version or rewind:  # after a reset one number may name other weights
            self._runner.weights_changed()
        if version == self._version:
            return
        self._version = version
        self._sched.extra_keys = (self._model_id, version)
        if self._policy == "recompute":
            self._sched.preempt_all()
        else:
            for seq in self._sched.running:
                seq.cacheable = False

    # -- stepping ----------------------------------------------------------------------------
    def has_work(self) -> bool:
        return not self._paused and bool(self._live)

    def step(self) -> list[Completion]:
        """One model step: decodes and prefill chunks within the token budget; returns the
        completions that finished. Does nothing while paused or idle."""
        if self._paused or not self._live:
            return []
        start = self._clock()
        step = self._sched.schedule()
        for seq, _ in step.scheduled:
            live = self._live[seq.id][0]
            if live.admitted is None:
                live.admitted = start
        logits = self._batches.run(step)
        order = list(logits)
        tokens: dict[str, int] = {}
        ended: list[tuple[Seq, str]] = []  # what the records ended
        if order:
            entries = [self._live[sid] for sid in order]
            lives = [live for live, _ in entries]
            last = torch.stack([logits[sid] for sid in order])
            chosen = choose_tokens(last, [x.request for x in lives], [x.generator for x in lives])
            now = self._clock()
            for (live, seq), tok, lp, slp, top in zip(entries, *chosen, strict=True):
                reason = live.record(tok, lp, slp, top, self._version)
                tokens[live.request.id] = tok
                if reason is not None:
                    ended.append((seq, reason))
                self._latencies.token(live, now)
        finished = self._sched.update(step, tokens)
        for seq, reason in ended:  # a stop string ends what the scheduler cannot see end
            if seq.status == "running":
                self._sched.finish(seq, reason)
                finished.append(seq)
        now = self._clock()
        done = []
        for seq in finished:
            live, _ = self._live.pop(seq.id)
            done.append(live.finish(live.ended or seq.finish_reason or "stop", self._version, now))
        self._steps += 1
        self._tokens += step.num_tokens
        self._finished += len(done)
        self._busy_s += now - start
        return done

    def stats(self) -> EngineStats:
        return engine_stats(
            version=self._version,
            paused=self._paused,
            waiting=len(self._sched.waiting),
            running=len(self._sched.running),
            finished=self._finished,
            steps=self._steps,
            tokens=self._tokens,
            busy_s=self._busy_s,
        )

    def metrics(self) -> dict[str, Any]:
        """Counters and gauges under vLLM's names where the meaning is the same: prompt
        tokens looked up in the prefix cache and found there, the fraction of KV blocks in
        use, preemptions (the latencies: :meth:`take_latencies`)."""
        return {
            "vllm:prefix_cache_queries": self._sched.queries,
            "vllm:prefix_cache_hits": self._sched.hits,
            "vllm:kv_cache_usage_perc": self._pool.usage,
            "vllm:num_preemptions": self._sched.preemptions,
        }

    def take_latencies(self) -> tuple[list[float], list[float]]:
        """The times to first token and between tokens (seconds) since the last call."""
        return self._latencies.take()

    def take_kv_events(self) -> list[Any]:
        """The block pool's stored/removed/cleared events since the last call."""
        return self._pool.take_events()

    # -- internals ---------------------------------------------------------------------------
    def _seq(self, live: Live) -> Seq:
        r = live.request
        need = self._sched.blocks_for(len(r.prompt) + r.max_new_tokens)
        if need > self._pool.num_blocks:
            raise ValueError(
                f"request {r.id!r} can never fit: it needs {need} blocks of "
                f"{self._pool.block_size} tokens; the cache has {self._pool.num_blocks}"
            )
        salt = r.cache_salt
        return Seq(r.id, list(r.prompt), r.max_new_tokens, stop_ids=live.stop_ids, cache_salt=salt)
