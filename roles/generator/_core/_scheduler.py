"""The engine's scheduler over the paged KV cache, sans-IO (no torch, no clock): it runs the
same on virtual time in a simulator as behind the torch executor.

Each :meth:`Scheduler.schedule` picks what the next model step computes, within a budget of
tokens shared by decodes and prefill chunks (chunked prefill: a long prompt is computed a
chunk per step and never stalls the running decodes):

1. the running sequences first, in admission order: each the tokens it has not computed yet
   (one for a decode), as far as the budget goes. When the pool has no block for one, the
   sequence admitted last is preempted (its blocks freed, its KV to be recomputed) until it
   fits;
2. then waiting sequences, first come first served, while the batch and the budget have room
   and nothing was preempted in this step: each takes the longest cached prefix of full
   blocks (a prefix hit; never its last token, which must be computed for its logits) and
   blocks for the chunk it computes now.

:meth:`Scheduler.update` records what the step computed and the token each sequence that
reached its end sampled, enters the blocks that became full into the prefix cache, and
finishes sequences at a stop token or their token limit. A finished or cancelled sequence
gives its blocks back at once.

Blocks computed elsewhere (a KV store, a prefill generator) enter the prefix cache through
:meth:`Scheduler.adopt`, or :meth:`Scheduler.reserve` and :meth:`Scheduler.enter_reserved` when
they are filled in between; :meth:`Scheduler.prompt_keys` names them as admission does.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

from ._blocks import BlockPool, chain_hashes

__all__ = ["Scheduler", "Seq", "Step"]

Status = Literal["waiting", "running", "finished"]


@dataclasses.dataclass(eq=False)
class Seq:
    """One request in the scheduler: its tokens so far and its place in the KV cache."""

    id: str
    prompt: list[int]
    max_tokens: int
    stop_ids: frozenset[int] = frozenset()
    #: Keeps this request's cached blocks apart from other requests' (``None``: shared).
    cache_salt: str | None = None
    output: list[int] = dataclasses.field(default_factory=list)
    #: Tokens whose keys and values are in the cache.
    num_computed: int = 0
    blocks: list[int] = dataclasses.field(default_factory=list)
    #: The keys of its full blocks entered (or found) in the prefix cache, in order.
    keys: list[bytes] = dataclasses.field(default_factory=list)
    #: Tokens found in the prefix cache at its last admission.
    cached_tokens: int = 0
    status: Status = "waiting"
    finish_reason: str | None = None
    preemptions: int = 0
    #: Whether the blocks it fills enter the prefix cache (not once its keys and values mix
    #: two weight versions; again after it is recomputed).
    cacheable: bool = True
    #: Its prompt's block keys, when the caller had them already (a router hashed the prompt:
    #: :meth:`Scheduler.keyed`), with the extra keys they were made under. Used while those
    #: are still the scheduler's; the keys are made again otherwise.
    known_keys: tuple[tuple[Any, ...], list[bytes]] | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)


@dataclasses.dataclass
class Step:
    """What one model step computes: ``(sequence, tokens)`` from each one's ``num_computed``;
    a sequence whose chunk reaches its last token samples one."""

    scheduled: list[tuple[Seq, int]]
    preempted: list[Seq]

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def samples(self, seq: Seq, n: int) -> bool:
        return seq.num_computed + n == seq.num_tokens


class Scheduler:
    """Continuous batching over a :class:`BlockPool`: at most ``max_batch`` running
    sequences and ``token_budget`` tokens per step. ``extra_keys`` (the model, the weight
    version) go into every block key, so blocks of other weights never match.
    ``cache_outputs`` False keeps blocks holding generated tokens out of the prefix cache (a
    simulator's outputs are placeholders: cached, every sample of a prompt would share
    them, as real samples do not)."""

    def __init__(
        self,
        pool: BlockPool,
        *,
        max_batch: int,
        token_budget: int,
        extra_keys: Sequence[Any] = (),
        cache_outputs: bool = True,
    ) -> None:
        if max_batch < 1 or token_budget < 1:
            raise ValueError(
                f"max_batch and token_budget must be >= 1: {max_batch}, {token_budget}"
            )
        self.pool = pool
        self.max_batch = max_batch
        self.token_budget = token_budget
        self.extra_keys = tuple(extra_keys)
        self.cache_outputs = cache_outputs
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.queries = 0  # prompt tokens looked up in the prefix cache
        self.hits = 0  # of which found there
        self.preemptions = 0

    # -- requests ----------------------------------------------------------------------------
    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.pool.block_size)

    def add(self, seq: Seq) -> None:
        """Queue ``seq``. Raises ``ValueError`` when it could never fit (:meth:`check`)."""
        self.check(seq)
        seq.status = "waiting"
        self.waiting.append(seq)

    def check(self, seq: Seq) -> None:
        """Raise ``ValueError`` for a request :meth:`add` refuses: an empty prompt, no tokens
        to generate, or a prompt and token limit needing more blocks than the pool has."""
        if not seq.prompt:
            raise ValueError(f"request {seq.id!r} has an empty prompt")
        if seq.max_tokens < 1:
            raise ValueError(f"request {seq.id!r}: max_tokens must be >= 1, got {seq.max_tokens}")
        need = self.blocks_for(len(seq.prompt) + seq.max_tokens)
        if need > self.pool.num_blocks:
            raise ValueError(
                f"request {seq.id!r} can never fit: {len(seq.prompt)} prompt tokens and up to "
                f"{seq.max_tokens} more need {need} blocks of {self.pool.block_size} tokens; "
                f"the cache has {self.pool.num_blocks}"
            )

    def preempt_all(self) -> None:
        """Preempt every running sequence: each is recomputed from scratch (new weights)."""
        while self.running:
            self._preempt(self.running.pop())

    def finish(self, seq: Seq, reason: str) -> None:
        """End ``seq`` (``stop``, ``length``, ``cancelled``, ...) and free its blocks."""
        if seq.status == "finished":
            return
        if seq.status == "running":
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._free(seq)
        seq.status, seq.finish_reason = "finished", reason

    def load(self) -> tuple[int, int]:
        """Blocks of work queued, as a router weighs it: of prompt tokens still to compute
        (waiting requests and running ones mid-prefill), and held by the running sequences."""
        prefill = decode = 0
        for seq in self.waiting:
            prefill += self.blocks_for(seq.num_tokens)
        for seq in self.running:
            if seq.num_computed < len(seq.prompt):
                prefill += self.blocks_for(len(seq.prompt) - seq.num_computed)
            decode += len(seq.blocks)
        return prefill, decode

    # -- steps -------------------------------------------------------------------------------
    def schedule(self) -> Step:
        budget = self.token_budget
        scheduled: list[tuple[Seq, int]] = []
        preempted: list[Seq] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            while not self._grow(seq, seq.num_computed + n):
                victim = self.running.pop()  # admitted last; never one already scheduled
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status != "running":
                break
            scheduled.append((seq, n))
            budget -= n
            i += 1
        while self.waiting and not preempted and budget > 0:
            if len(self.running) >= self.max_batch:
                break
            seq = self.waiting[0]
            n = self._admit(seq, budget)
            if n == 0:
                break  # no room for it now: first come, first served
            self.waiting.popleft()
            self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n
        return Step(scheduled, preempted)

    def update(self, step: Step, sampled: Mapping[str, int]) -> list[Seq]:
        """Record ``step``: every scheduled sequence computed its tokens; one that reached its
        end appended ``sampled[id]``. Returns the sequences that finished."""
        finished = []
        for seq, n in step.scheduled:
            if seq.status != "running":
                continue  # cancelled since
            reached = step.samples(seq, n)
            seq.num_computed += n
            self._cache_full(seq)
            if not reached:
                continue
            token = sampled[seq.id]
            seq.output.append(token)
            if token in seq.stop_ids:
                self.finish(seq, "stop")
            elif len(seq.output) >= seq.max_tokens:
                self.finish(seq, "length")
            else:
                continue
            finished.append(seq)
        return finished

    # -- runs of decode steps, in one go (a simulator's closed form) ------------------------
    def decode_run(self, limit: int) -> int:
        """How many of the next steps (at most ``limit``) are alike: every running sequence
        decodes one token, nothing is admitted or preempted, and none ends before the last
        of them (the last may end some), provided no stop token is sampled. 0 when the next
        step is not such a step."""
        running = self.running
        if not running or len(running) > self.token_budget or limit < 1:
            return 0
        if self.waiting and len(running) < self.max_batch and len(running) < self.token_budget:
            return 0  # the next step may admit one
        k = limit
        for seq in running:
            if seq.num_tokens - seq.num_computed != 1 or seq.num_computed < len(seq.prompt):
                return 0  # a prefill chunk is left
            k = min(k, seq.max_tokens - len(seq.output))
        free = self.pool.num_free

        def fits(steps: int) -> bool:
            need = sum(self.blocks_for(s.num_computed + steps) - len(s.blocks) for s in running)
            return need <= free

        if fits(k):
            return k
        low, high = 0, k  # fits(low), not fits(high)
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if fits(mid) else (low, mid)
        return low

    def advance_decodes(self, steps: int, token: int) -> list[Seq]:
        """Run ``steps`` decode steps at once, each sampling ``token`` for every running
        sequence: the state that many ``schedule()`` and ``update()`` calls leave, block for
        block (blocks are taken and entered into the prefix cache in the order those steps
        would). ``steps`` must be at most :meth:`decode_run`'s answer, and ``token`` no
        running sequence's stop token (``ValueError`` otherwise). Returns the sequences that
        finished, in the order ``update()`` would."""
        if not 1 <= steps <= self.decode_run(steps):
            raise ValueError(f"the next {steps} steps are not a run of alike decode steps")
        running = list(self.running)
        if any(token in seq.stop_ids for seq in running):
            raise ValueError(f"token {token} stops a running sequence")
        size = self.pool.block_size
        # (step, 0 = a block taken / 1 = a block entered, rank, blocks after it)
        changes: list[tuple[int, int, int, int]] = []
        for i, seq in enumerate(running):
            c = seq.num_computed
            for count in range(len(seq.blocks) + 1, self.blocks_for(c + steps) + 1):
                changes.append((max(0, (count - 1) * size - c), 0, i, count))
            if self.cache_outputs and seq.cacheable:
                for full in range(c // size + 1, (c + steps) // size + 1):
                    changes.append((full * size - c - 1, 1, i, full))
            seq.output.extend([token] * steps)
            seq.num_computed += steps
        changes.sort()
        for _, kind, i, count in changes:
            if kind == 0:
                self._grow(running[i], (count - 1) * size + 1)
            else:
                self._cache_upto(running[i], count)
        finished = []
        for seq in running:
            if len(seq.output) >= seq.max_tokens:
                self.finish(seq, "length")
                finished.append(seq)
        return finished

    # -- blocks from elsewhere: a KV store, a prefill generator --------------------------------
    def prompt_keys(self, prompt: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """The keys of ``prompt``'s blocks that a prefix hit may cover (the full ones before
        its last token), chained as :meth:`_admit` computes them."""
        size, extra = self.pool.block_size, (*self.extra_keys, cache_salt)
        return list(chain_hashes(None, prompt, size, extra, range((len(prompt) - 1) // size)))

    def keyed(
        self, prompt: Sequence[int], cache_salt: str | None = None
    ) -> tuple[tuple[Any, ...], list[bytes]]:
        """:meth:`prompt_keys` with the extra keys they are made under: a ``Seq``'s
        ``known_keys``, so admitting it does not hash the prompt again."""
        return (*self.extra_keys, cache_salt), self.prompt_keys(prompt, cache_salt)

    def cached_run(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, are in the prefix cache."""
        n = 0
        while n < len(keys) and self.pool.lookup(keys[n]) is not None:
            n += 1
        return n

    def adopt(
        self, keys: Sequence[bytes], prompt: Sequence[int], start: int, count: int
    ) -> tuple[int, list[int]]:
        """Enter blocks whose keys and values come from elsewhere into the prefix cache:
        those of ``keys[start : start + count]`` (``prompt_keys(prompt)``) not cached yet,
        after ``keys[:start]``. Returns the index of the first key entered and its blocks
        (fill them before the next step; they are free and cached, as blocks a finished
        request left). Nothing when a key before ``start`` is not cached (any more): they
        could not be reached. At most the free blocks are used; the prefix is held
        meanwhile, so they never evict it."""
        first, prefix, blocks = self.reserve(keys, start, count)
        self.enter_reserved(keys, prompt, first, prefix, blocks, keep=True)
        return first, blocks

    def reserve(
        self, keys: Sequence[bytes], start: int, count: int
    ) -> tuple[int, list[int], list[int]]:
        """The first half of :meth:`adopt`, for blocks to fill before they are entered: the
        index of the first key of ``keys[start : start + count]`` not cached, the cached
        blocks before it and blocks for those from it on, all held (the new ones in no
        cache) until :meth:`enter_reserved`."""
        first = self.cached_run(keys[: start + count])
        if first < start or first >= start + count:
            return first, [], []
        prefix = [b for b in map(self.pool.lookup, keys[:first]) if b is not None]
        free_prefix = sum(1 for b in prefix if self.pool.refs[b] == 0)
        n = min(start + count - first, self.pool.num_free - free_prefix)
        if n <= 0:
            return first, [], []
        self.pool.take(prefix)
        return first, prefix, self.pool.allocate(n)

    def enter_reserved(
        self,
        keys: Sequence[bytes],
        prompt: Sequence[int],
        first: int,
        prefix: list[int],
        blocks: list[int],
        *,
        keep: bool,
    ) -> None:
        """End a :meth:`reserve`: with ``keep``, ``blocks`` (filled) enter the prefix cache
        under ``keys[first:]`` (a key cached meanwhile keeps its block); all are let go."""
        if keep and blocks:
            size = self.pool.block_size
            parent = keys[first - 1] if first else None
            tokens = list(prompt[first * size : (first + len(blocks)) * size])
            self.pool.commit(blocks, keys[first : first + len(blocks)], parent, tokens, log=False)
        self.pool.release(reversed(prefix + blocks))  # the tail is evicted first

    # -- the cache ---------------------------------------------------------------------------
    def _extra(self, seq: Seq) -> tuple[Any, ...]:
        return (*self.extra_keys, seq.cache_salt)

    def _chain(self, seq: Seq, parent: bytes | None, blocks: range) -> Iterator[bytes]:
        """The keys of ``seq``'s blocks numbered ``blocks`` (``parent``: the one before):
        from its known keys as far as they go and are this scheduler's, made after."""
        extra = self._extra(seq)
        known = seq.known_keys
        if known is not None and known[0] == extra and blocks.start < len(known[1]):
            stop = min(blocks.stop, len(known[1]))
            yield from known[1][blocks.start : stop]
            parent, blocks = known[1][stop - 1], range(stop, blocks.stop)
        yield from chain_hashes(parent, seq.tokens, self.pool.block_size, extra, blocks)

    def _admit(self, seq: Seq, budget: int) -> int:
        """Give ``seq`` its cached prefix and blocks for its first chunk; the chunk's size, or
        0 when the pool cannot hold it now (nothing changes then)."""
        size, tokens = self.pool.block_size, seq.tokens
        hits: list[int] = []
        keys: list[bytes] = []
        full = range((len(tokens) - 1) // size)  # the last token is always computed
        for key in self._chain(seq, None, full):
            block = self.pool.lookup(key)
            if block is None:
                break
            hits.append(block)
            keys.append(key)
        computed = len(hits) * size
        n = min(len(tokens) - computed, budget)
        need = self.blocks_for(computed + n) - len(hits)
        free_hits = sum(1 for b in hits if self.pool.refs[b] == 0)
        if need > self.pool.num_free - free_hits:
            return 0
        self.pool.take(hits)
        seq.blocks = hits + self.pool.allocate(need)
        seq.keys, seq.num_computed, seq.cached_tokens = keys, computed, computed
        seq.status, seq.cacheable = "running", True
        self.queries += len(tokens)
        self.hits += computed
        return n

    def _grow(self, seq: Seq, tokens: int) -> bool:
        need = self.blocks_for(tokens) - len(seq.blocks)
        if need > self.pool.num_free:
            return False
        if need > 0:
            seq.blocks += self.pool.allocate(need)
        return True

    def _cache_full(self, seq: Seq) -> None:
        self._cache_upto(seq, seq.num_computed // self.pool.block_size)

    def _cache_upto(self, seq: Seq, full: int) -> None:
        """Enter ``seq``'s first ``full`` blocks (those not entered yet) into the cache."""
        size = self.pool.block_size
        if not self.cache_outputs:
            full = min(full, len(seq.prompt) // size)
        if full <= len(seq.keys) or not seq.cacheable:
            return
        tokens = seq.tokens
        parent = seq.keys[-1] if seq.keys else None
        first = len(seq.keys)
        keys = list(self._chain(seq, parent, range(first, full)))
        self.pool.commit(seq.blocks[first:full], keys, parent, tokens[first * size : full * size])
        seq.keys += keys

    def _preempt(self, seq: Seq) -> None:
        self._free(seq)
        seq.status, seq.num_computed = "waiting", 0
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _free(self, seq: Seq) -> None:
        self.pool.release(reversed(seq.blocks))  # the tail is evicted first
        seq.blocks, seq.keys = [], []
