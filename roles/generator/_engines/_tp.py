"""A tensor-parallel generator's other ranks: processes this one starts, as vLLM's and SGLang's
executors start theirs on one host, each holding its share of the model and of the KV pool
(:mod:`orchestr.roles._common._hf._tp`) and running what the leader sends it
(:mod:`.._runner._tp`).

A rank process (``python -m orchestr.roles.generator._engines._tp_rank``) reads its orders as
JSON on stdin, loads its slices, says it is ready (a file in the group's private folder),
joins the group and runs steps (and takes its slices of new weights, or sends its share for a
digest) until the leader says stop or goes away: it watches its parent
and leaves when the leader's process ends, however it ended. Its output goes to a log file in
that folder, whose tail a failure to start quotes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from typing import Any

import torch

import orchestr as oc
from orchestr.roles._common._hf._layers import CausalLM
from orchestr.roles._common._hf._tp import TPShard, build_shard
from orchestr.roles._common._weightplan import weight_tensors

from .._runner._tp import TPGroup

__all__ = ["TPRanks", "give_weights", "rank_device", "take_weights", "whole_like"]

#: How long the ranks may take to load their slices and join.
START_TIMEOUT_S = 600.0


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Where rank ``rank`` computes when the leader computes on ``device``: the next CUDA
    devices after the leader's, or the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


class TPRanks:
    """Ranks ``1 .. tp - 1`` of a generator whose leader (this process) holds rank 0; the
    group (:attr:`group`) is joined when the constructor returns. ``load_leader`` is called
    while the ranks load theirs (this process's share). Raises :class:`ConfigError` when a
    rank fails to start, quoting its log."""

    def __init__(
        self,
        checkpoint: str,
        tp: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        num_blocks: int,
        block_size: int,
        packed: bool | None,
        attention: str,
        threads: int,
    ) -> None:
        self.tp = tp
        self.folder = tempfile.mkdtemp(prefix="orchestr-tp-")  # mode 0700: this user's only
        store = os.path.join(self.folder, "store")
        self._procs: list[subprocess.Popen[bytes]] = []
        self._closed = False
        self._reaper = weakref.finalize(self, _reap, self._procs, self.folder)
        for rank in range(1, tp):
            order = {
                "checkpoint": os.path.abspath(checkpoint),
                "tp": tp,
                "rank": rank,
                "store": store,
                "ready": self._ready(rank),
                "dtype": str(dtype).removeprefix("torch."),
                "device": str(rank_device(device, rank)),
                "num_blocks": num_blocks,
                "block_size": block_size,
                "packed": packed,
                "attention": attention,
                "threads": threads,
            }
            with open(self._log(rank), "wb") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "orchestr.roles.generator._engines._tp_rank"],
                    stdin=subprocess.PIPE,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    close_fds=True,
                )
            self._procs.append(proc)
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(order).encode())
            proc.stdin.close()
        self._store = store
        self._device = device
        self.group: TPGroup | None = None

    def join(self) -> TPGroup:
        """Wait for every rank to load its share, then join the group as rank 0. Raises
        :class:`ConfigError` (after stopping the others) when a rank exits first."""
        deadline = time.monotonic() + START_TIMEOUT_S
        waiting = set(range(1, self.tp))
        while waiting:
            for rank in sorted(waiting):
                proc = self._procs[rank - 1]
                if os.path.exists(self._ready(rank)):
                    waiting.discard(rank)
                elif proc.poll() is not None:
                    tail = self._tail(rank)
                    self.close()
                    raise oc.ConfigError(
                        f"tensor-parallel rank {rank} exited ({proc.returncode}) before it "
                        f"joined: {tail}"
                    )
            if waiting and time.monotonic() > deadline:
                self.close()
                raise oc.ConfigError(
                    f"tensor-parallel ranks {sorted(waiting)} did not load their shares in "
                    f"{START_TIMEOUT_S:.0f} s"
                )
            if waiting:
                time.sleep(0.02)
        self.group = TPGroup(self._store, 0, self.tp, self._device)
        return self.group

    def alive(self) -> bool:
        return all(p.poll() is None for p in self._procs)

    def close(self) -> None:
        """Tell the ranks to stop and wait for them (killing those that do not go within
        ten seconds). Idempotent."""
        if self._closed:
            return
        self._closed = True
        group = self.group
        if group is not None and self.alive():
            try:
                group.send({"op": "stop"})
            except RuntimeError:  # a rank is gone: the group is broken, kill the rest
                pass
        _reap(self._procs, self.folder, grace_s=10.0)
        if group is not None:
            group.close()
        self._reaper.detach()

    # -- weights -----------------------------------------------------------------------------
    def write(self, model: CausalLM, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Write whole tensors (the checkpoint's names, the shapes of :func:`whole_like`)
        into every rank's share: each other rank is sent its slices of all of them in one
        buffer, and this one copies its own. Raises ``ValueError`` (before anything moves)
        for a name the model does not have."""
        group, shard = self.joined(), _shard_of(model)
        own = model.state_dict(keep_vars=True)
        unknown = [n for n, _ in tensors if n not in own]
        if unknown:
            raise ValueError(f"the model has no tensor {unknown[0]!r}")
        group.send({"op": "weights", "names": [n for n, _ in tensors]})
        for rank in range(1, self.tp):
            theirs = TPShard(shard.full, self.tp, rank)
            parts = [theirs.part_of(n, t) for n, t in tensors]
            group.send_tensor(_flat(parts, own[tensors[0][0]]), rank)
        with torch.no_grad():
            for name, t in tensors:
                own[name].copy_(shard.part_of(name, t))

    def gather(self, model: CausalLM) -> dict[str, torch.Tensor]:
        """Every tensor of the whole model (the names and shapes of :func:`whole_like`),
        put together here from every rank's share: for a digest."""
        group, shard = self.joined(), _shard_of(model)
        group.send({"op": "gather"})
        like = whole_like(model)
        whole = {n: torch.empty(t.shape, dtype=t.dtype) for n, t in like.items()}
        shares = [weight_tensors(model)]
        for rank in range(1, self.tp):
            with torch.device("meta"):
                theirs = weight_tensors(build_shard(TPShard(shard.full, self.tp, rank)), meta=True)
            first = next(iter(shares[0].values()))
            flat = torch.empty(sum(t.numel() for t in theirs.values()), dtype=first.dtype,
                               device=first.device)  # fmt: skip
            group.receive_tensor(flat, rank)
            shares.append(_unflat(flat, theirs))
        for rank, share in enumerate(shares):
            cuts = TPShard(shard.full, self.tp, rank)
            for name, t in share.items():
                cuts.part_of(name, whole[name]).copy_(t.detach().cpu())
        return whole

    # -- internals ---------------------------------------------------------------------------
    def joined(self) -> TPGroup:
        """The group, once joined (:meth:`join`)."""
        if self.group is None:
            raise RuntimeError("the tensor-parallel ranks have not joined")
        return self.group

    def _ready(self, rank: int) -> str:
        return os.path.join(self.folder, f"rank{rank}.ready")

    def _log(self, rank: int) -> str:
        return os.path.join(self.folder, f"rank{rank}.log")

    def _tail(self, rank: int) -> str:
        try:
            with open(self._log(rank), "rb") as f:
                lines = f.read().decode(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(lines[-3:]) or "(no output)"


def _reap(procs: list[subprocess.Popen[Any]], folder: str, grace_s: float = 0.0) -> None:
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    shutil.rmtree(folder, ignore_errors=True)


def whole_like(model: CausalLM) -> dict[str, torch.Tensor]:
    """The whole model's tensors as a sync moves them (:func:`weight_tensors`'s names: tied
    ones once), as meta tensors of the share's dtype."""
    with torch.device("meta"):
        whole = CausalLM(_shard_of(model).full).to(model.lm_head.weight.dtype)
    return {n: t.detach() for n, t in weight_tensors(whole, meta=True).items()}


def take_weights(group: TPGroup, model: CausalLM, names: list[str]) -> None:
    """(A rank) receive its slices of the tensors ``names`` and write them into ``model``."""
    own = model.state_dict(keep_vars=True)
    first = own[names[0]]
    flat = torch.empty(sum(own[n].numel() for n in names), dtype=first.dtype, device=first.device)
    group.receive_tensor(flat)
    with torch.no_grad():
        for name, t in _unflat(flat, {n: own[n] for n in names}).items():
            own[name].copy_(t)


def give_weights(group: TPGroup, model: CausalLM) -> None:
    """(A rank) send the leader its share of every tensor (:meth:`TPRanks.gather`)."""
    group.send_tensor(_flat(list(weight_tensors(model).values()), model.lm_head.weight), 0)


def _shard_of(model: CausalLM) -> TPShard:
    if model.shard is None:
        raise ValueError("the model is whole, not a tensor-parallel rank's share")
    return model.shard


def _flat(parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """``parts`` end to end in one tensor of ``like``'s dtype on its device."""
    return torch.cat([p.detach().reshape(-1).to(like.device, like.dtype) for p in parts])


def _unflat(flat: torch.Tensor, shapes: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``flat`` cut into views shaped as ``shapes``' tensors, in its order."""
    out, at = {}, 0
    for name, t in shapes.items():
        n = t.numel()
        out[name] = flat[at : at + n].view(t.shape)
        at += n
    return out
