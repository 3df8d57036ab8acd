"""Tensor parallelism's runtime: the ranks of one generator as one process group, and what the
leader (rank 0, where the scheduler is) sends the others each step.

Every rank runs the same :class:`~._paged.PagedRunner` over its share of the model
(:mod:`orchestr.roles._common._hf._tp`) and of the KV pool (its key/value heads, the same
blocks). The leader's scheduler decides a step; the leader sends its :func:`plan` (per
sequence: the tokens, where they go, the blocks it reads, whether it samples) and every rank
runs it. Within a step the ranks meet at each row-parallel product (one all-reduce after the
attention's output projection and one after the feed-forward part), after the
vocabulary-parallel embedding, and at the logits (gathered).

Two groups join the ranks: ``control``, over which the leader's messages go and on which the
other ranks wait between steps (its timeout is long: a generator may be idle for hours), and
``compute`` for the step's collectives (gloo on the CPU, NCCL on CUDA devices; a rank that
stops answering fails the step after :data:`COMPUTE_TIMEOUT`). Messages are JSON, never
pickles. The ranks meet through a :class:`torch.distributed.FileStore` in a folder only the
generator's user can open, and the groups listen on the loopback address, so no other user
on the host can join them.
"""

from __future__ import annotations

import datetime
import json
import weakref
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import FileStore, PrefixStore, Store

from .._core._scheduler import Seq, Step

__all__ = ["COMPUTE_TIMEOUT", "TPGroup", "Work", "plan"]

COMPUTE_TIMEOUT = datetime.timedelta(minutes=5)
CONTROL_TIMEOUT = datetime.timedelta(days=30)


class Work(NamedTuple):
    """One sequence's part of a step."""

    seq: Seq  # its num_computed is where the part starts
    n: int
    tokens: list[int]  # its tokens at positions num_computed .. num_computed + n - 1
    blocks: list[int]  # its blocks holding positions 0 .. num_computed + n - 1
    samples: bool  # the part reaches its last token: a token is sampled after it


def plan(step: Step, block_size: int) -> list[Work]:
    """``step``'s work, in its order."""
    out = []
    for seq, n in step.scheduled:
        start = seq.num_computed
        out.append(
            Work(
                seq,
                n,
                seq.tokens[start : start + n],
                seq.blocks[: -(-(start + n) // block_size)],
                step.samples(seq, n),
            )
        )
    return out


def _gloo(store: Store, rank: int, size: int, timeout: datetime.timedelta) -> Any:
    options: Any = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    options._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, size, options)


class TPGroup:
    """Rank ``rank`` of ``size`` ranks meeting at ``store_path`` (a file in a private
    folder), computing on ``device``. Blocks until every rank has joined."""

    def __init__(self, store_path: str, rank: int, size: int, device: torch.device) -> None:
        self.rank, self.size = rank, size
        store = FileStore(store_path, size)
        self._control = _gloo(PrefixStore("control", store), rank, size, CONTROL_TIMEOUT)
        self._compute: Any
        if device.type == "cuda":  # pragma: no cover - needs CUDA devices
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = COMPUTE_TIMEOUT
            self._compute = dist.ProcessGroupNCCL(
                PrefixStore("compute", store), rank, size, options
            )
        else:
            self._compute = _gloo(PrefixStore("compute", store), rank, size, COMPUTE_TIMEOUT)
        self._keys: weakref.WeakKeyDictionary[Seq, int] = weakref.WeakKeyDictionary()
        self._next = 0
        self._shadows: dict[int, Seq] = {}

    # -- the step's collectives -------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``t`` (in place; returned)."""
        t = t.contiguous()
        self._compute.allreduce([t]).wait()
        return t

    def gather_vocab(self, logits: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Every rank's logits ``[n, its vocabulary rows]`` side by side, in rank order
        (``sizes``: each rank's rows): ``[n, vocab]``."""
        width = max(sizes)
        mine = logits
        if logits.shape[-1] < width:
            mine = torch.nn.functional.pad(logits, (0, width - logits.shape[-1]))
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        self._compute.allgather([parts], [mine.contiguous()]).wait()
        return torch.cat([p[:, :s] for p, s in zip(parts, sizes, strict=True)], dim=-1)

    def send_tensor(self, t: torch.Tensor, rank: int) -> None:
        """Send ``t`` to ``rank`` (which receives it with :meth:`receive_tensor`)."""
        self._compute.send([t.contiguous()], rank, 0).wait()

    def receive_tensor(self, into: torch.Tensor, rank: int = 0) -> torch.Tensor:
        """Receive into ``into`` (contiguous, its size and dtype agreed) what ``rank``
        sends."""
        self._compute.recv([into], rank, 0).wait()
        return into

    # -- the leader's messages ---------------------------------------------------------------
    def send(self, message: dict[str, Any]) -> None:
        """(The leader) send ``message`` to every other rank."""
        assert self.rank == 0
        data = json.dumps(message, separators=(",", ":")).encode()
        self._broadcast(data)

    def receive(self) -> dict[str, Any]:
        """(Another rank) wait for the leader's next message."""
        assert self.rank != 0
        message: dict[str, Any] = json.loads(self._broadcast(None))
        return message

    def send_work(self, work: list[Work]) -> None:
        """(The leader) send a step's :func:`plan`."""
        rows = [[self._key(w.seq), w.seq.num_computed, w.seq.preemptions, w.n, w.tokens,
                 w.blocks, w.samples] for w in work]  # fmt: skip
        self.send({"op": "work", "work": rows})

    def work_of(self, message: dict[str, Any]) -> list[Work]:
        """(Another rank) the work of a ``"work"`` message, each sequence a stand-in kept for
        as long as the leader's runs, so the decode mirror knows it again."""
        shadows, out = {}, []
        for key, computed, preemptions, n, tokens, blocks, samples in message["work"]:
            seq = self._shadows.get(key)
            if seq is None:
                seq = Seq(str(key), [], 0)
            seq.num_computed, seq.preemptions, seq.blocks = computed, preemptions, blocks
            shadows[key] = seq
            out.append(Work(seq, n, tokens, blocks, bool(samples)))
        self._shadows = shadows
        return out

    def close(self) -> None:
        for group in (self._compute, self._control):
            try:
                group.shutdown()
            except (RuntimeError, AttributeError):  # already broken: nothing to close
                pass

    # -- internals ---------------------------------------------------------------------------
    def _key(self, seq: Seq) -> int:
        """A number for ``seq`` no other sequence of this leader ever has."""
        key = self._keys.get(seq)
        if key is None:
            key = self._keys[seq] = self._next
            self._next += 1
        return key

    def _broadcast(self, data: bytes | None) -> bytes:
        size = torch.tensor([0 if data is None else len(data)], dtype=torch.int64)
        self._control.broadcast(size, 0).wait()
        buf = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if data is not None
            else torch.empty(int(size), dtype=torch.uint8)
        )
        if len(buf):
            self._control.broadcast(buf, 0).wait()
        return buf.numpy().tobytes()
