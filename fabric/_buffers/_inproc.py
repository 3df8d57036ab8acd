"""``inproc://``: buffers and streams inside one process (tests, co-located actors)."""

from __future__ import annotations

from typing import Any

from orchestr.errors import DescriptorError
from orchestr.fabric import _local

from . import _transport
from ._transport import Descriptor, OneSided, Region

__all__ = ["InprocBuffers"]


class InprocBuffers(OneSided):
    scheme = "inproc"
    scoped = "owner"  # the region table checked is the owner's own

    def probe(self) -> str | None:
        return None

    def reaches(self, owner: str) -> bool:
        return owner == _local.process_key()

    def export(self, region: Region) -> tuple[Any, ...]:
        return ()

    def unexport(self, region: Region) -> None:
        pass

    def _span(self, desc: Descriptor, offset: int, nbytes: int) -> memoryview:
        if desc.owner != _local.process_key():
            raise DescriptorError(f"an inproc descriptor of {desc.owner} used in another process")
        desc.check_span(offset, nbytes)
        region = _transport.lookup(desc.region, desc.key)
        if region.mem.nbytes != desc.length:
            raise DescriptorError(
                f"descriptor says {desc.length} bytes; the region has {region.mem.nbytes}"
            )
        if not region.reaches(offset, nbytes):
            raise DescriptorError(_transport.outside_scope(offset, nbytes, desc.region, desc.owner))
        return region.mem[offset : offset + nbytes]

    async def move(self, write: bool, desc: Descriptor, offset: int, local: memoryview) -> None:
        span = self._span(desc, offset, local.nbytes)
        if not write:
            local[:] = span
        elif span.readonly:
            raise DescriptorError("the buffer was registered read-only")
        else:
            span[:] = local
