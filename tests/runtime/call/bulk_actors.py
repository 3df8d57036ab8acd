"""Actors for the data-plane tests; workers import them by path."""

from __future__ import annotations

import os
import zlib
from typing import Any

import numpy as np
import torch

import orchestr as oc
from orchestr import fabric
from orchestr._call._wire import traffic


def shared_mapping_of(address: int) -> str | None:
    """The name of the shared-memory mapping of this process that contains ``address``."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= address < hi:
                return parts[5] if len(parts) > 5 else ""
    return None


class Sink(oc.Actor):
    def __init__(self) -> None:
        self.kept: list[Any] = []

    @oc.endpoint
    def where(self, t: torch.Tensor, keep: bool = False) -> list[Any]:
        """Where ``t``'s memory lives in this process, and its checksum."""
        if keep:
            self.kept.append(t)
        return [shared_mapping_of(t.data_ptr()), float(t.double().sum()), list(t.shape)]

    @oc.endpoint
    async def where_async(self, t: torch.Tensor) -> float:
        return float(t[0])

    @oc.endpoint
    def where_array(self, a: np.ndarray) -> list[Any]:
        return [shared_mapping_of(a.ctypes.data), float(a.sum()), str(a.dtype)]

    @oc.endpoint
    def echo(self, value: Any) -> Any:
        return value

    @oc.endpoint
    def fill(self, t: torch.Tensor, value: float) -> None:
        t.fill_(value)  # lands in the sender's memory when t was sent from fabric.empty
        self.kept.append(t)

    @oc.endpoint
    def drop(self) -> int:
        n = len(self.kept)
        self.kept.clear()
        return n

    @oc.endpoint
    def make(self, n: int, value: float) -> torch.Tensor:
        return torch.full((n,), value)

    @oc.endpoint
    def pid(self) -> int:
        return os.getpid()

    @oc.endpoint
    def pool_stats(self) -> dict[str, int]:
        from orchestr.fabric.lowlevel import pool

        return pool.stats()

    @oc.endpoint
    def connections(self) -> list[dict[str, Any]]:
        return fabric.connections()


class Owner(oc.Actor):
    """Registers tensors as one-sided buffers and hands out their handles."""

    def __init__(self) -> None:
        self.buffers: list[oc.Buffer] = []

    @oc.endpoint
    def share(self, n: int, value: float) -> oc.Buffer:
        buf = oc.Buffer(torch.full((n,), value))
        self.buffers.append(buf)
        return buf

    @oc.endpoint
    def share_shared(self, n: int) -> oc.Buffer:
        """``0 .. n-1`` as float32, in shared memory (orchestr.fabric.empty)."""
        t = fabric.empty(n)
        t.copy_(torch.arange(n, dtype=torch.float32))
        buf = oc.Buffer(t)
        self.buffers.append(buf)
        return buf

    @oc.endpoint
    def value_at(self, i: int, k: int) -> float:
        return float(self.buffers[i]._data[k])

    @oc.endpoint
    def release(self, i: int) -> None:
        self.buffers[i].release()

    @oc.endpoint
    def pid(self) -> int:
        return os.getpid()


class Reader(oc.Actor):
    @oc.endpoint
    async def pull(self, buf: oc.Buffer) -> list[Any]:
        dst = torch.empty(buf.nbytes // 4)
        used = await buf.read_into(dst)
        return [used, float(dst.double().sum())]

    @oc.endpoint
    async def pull_pieces(self, buf: oc.Buffer, piece: int) -> list[Any]:
        """The transport, each piece's CRC-32 (computed where read_pieces runs it) and the
        whole destination's sum."""
        dst = torch.empty(buf.nbytes // 4)
        used, sums = await buf.read_pieces(dst, piece, zlib.crc32)
        return [used, sums, float(dst.double().sum())]

    @oc.endpoint
    async def pull_spans(
        self,
        buf: oc.Buffer,
        spans: list[list[int]],
        transport: str | None = None,
        arrays: bool = False,
    ) -> list[Any]:
        """The transport and, per ``(offset, float32 count)`` span, the floats read (into
        tensors, or with ``arrays`` numpy arrays)."""
        dsts = [torch.empty(n) for _, n in spans]
        into = [d.numpy() for d in dsts] if arrays else dsts
        used = await buf.read_spans(
            [(offset, d) for (offset, _), d in zip(spans, into, strict=True)], transport=transport
        )
        return [used, [d.tolist() for d in dsts]]

    @oc.endpoint
    async def push_spans(self, buf: oc.Buffer, spans: list[list[Any]]) -> str:
        """Write each ``(offset, float32 count, value)`` span (from tensors) at once."""
        return await buf.write_spans([(o, torch.full((n,), v)) for o, n, v in spans])

    @oc.endpoint
    async def push(self, buf: oc.Buffer, value: float) -> str:
        return await buf.write_from(torch.full((buf.nbytes // 4,), value))

    @oc.endpoint
    def received(self) -> int:
        return traffic["received"]

    @oc.endpoint
    def counters(self) -> dict[str, Any]:
        return {r["scheme"]: r.get("counters", {}) for r in fabric.transport_report()}

    @oc.endpoint
    def mapped_bytes(self) -> int:
        (shm,) = [
            r for r in fabric.transport_report() if r["scheme"] == "shm" and r["kind"] == "buffer"
        ]
        return int(shm["mapped_bytes_read"])


class Router(oc.Actor):
    """Passes buffer handles on to a reader; must never touch the bytes."""

    @oc.endpoint
    async def forward(self, reader: oc.Mesh, buf: oc.Buffer) -> list[Any]:
        result: list[Any] = await reader.pull.call_one(buf)
        return result

    @oc.endpoint
    def received(self) -> int:
        return traffic["received"]
