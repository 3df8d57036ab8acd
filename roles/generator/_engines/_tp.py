"""A tensor-parallel generator's other ranks: processes this one starts, as vLLM's and SGLang's
executors start theirs on one host, each holding its share of the model and of the KV pool
(:mod:`orchestr.roles._common._hf._tp`) and running what the leader sends it
(:mod:`.._runner._tp`).

A rank process (``python -m orchestr.roles.generator._engines._tp_rank``) reads its orders as
JSON on stdin, loads its slices, says it is ready (a file in the group's private folder),
joins the group and runs steps until the leader says stop or goes away: it watches its parent
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

from .._runner._tp import TPGroup

__all__ = ["TPRanks", "rank_device"]

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

    # -- internals ---------------------------------------------------------------------------
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
