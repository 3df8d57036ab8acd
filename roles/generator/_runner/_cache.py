"""The paged engine's KV cache: per layer, keys and values as ``[blocks, block_size, kv_heads,
head_dim]``, every plane end to end in one region (shared memory on the CPU, so peers read
blocks one-sided); a token at position ``p`` of a sequence lives in block
``table[p // size]`` at offset ``p % size``. A tensor-parallel rank's cache holds its
key/value heads only."""

from __future__ import annotations

import math

import torch

from orchestr import fabric
from orchestr.roles._common._hf._layers import CausalLM

__all__ = ["KVCache", "as_planes"]


class KVCache:
    """The cache's tensors for ``model``: ``num_blocks`` blocks of ``block_size`` tokens.

    Every layer's keys, then every layer's values, lie end to end in one region,
    :attr:`memory`: on the CPU it is shared memory (:func:`orchestr.fabric.empty`), so a
    :class:`~orchestr.Buffer` over it lets a peer read blocks one-sided (:func:`~._spans.block_spans`
    of its :attr:`layout` says where they are) while this process keeps computing."""

    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        cfg = model.config
        weight = model.lm_head.weight
        shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        dtype, device = dtype or weight.dtype, torch.device(device or weight.device)
        self.block_size = block_size
        layers = cfg.num_hidden_layers
        per = num_blocks * block_size * cfg.num_key_value_heads * cfg.head_dim
        self.memory: torch.Tensor
        if device.type == "cpu":
            self.memory = fabric.empty(2 * layers * per, dtype=dtype).zero_()
        else:
            self.memory = torch.zeros(2 * layers * per, dtype=dtype, device=device)
        planes = [self.memory[i * per : (i + 1) * per].view(shape) for i in range(2 * layers)]
        self.keys, self.values = planes[:layers], planes[layers:]

    @property
    def layout(self) -> tuple[int, int, int]:
        """``(planes, plane_bytes, row_bytes)`` of :attr:`memory`, as :func:`~._spans.block_spans`
        takes them: every layer's keys then values, and one block's share of each."""
        plane = self.keys[0]
        row = plane[0].numel() * plane.element_size()
        return 2 * len(self.keys), plane.shape[0] * row, row

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    @property
    def block_nbytes(self) -> int:
        """The bytes of one block's keys and values in every layer (what :meth:`export`
        gives per block)."""
        return self.nbytes // self.keys[0].shape[0]

    def export(self, blocks: list[int]) -> list[torch.Tensor]:
        """Copies of ``blocks``' keys and values, each a flat ``uint8`` CPU tensor of
        :attr:`block_nbytes`: every layer's keys, then every layer's values."""
        if not blocks:
            return []
        flat = self.rows(blocks).cpu().view(torch.uint8).reshape(len(blocks), -1)
        return list(flat.unbind(0))

    def rows(self, blocks: list[int]) -> torch.Tensor:
        """A copy of ``blocks``' keys and values, ``[blocks, planes, block_size, kv_heads,
        head_dim]`` on the cache's device (planes: every layer's keys, then values)."""
        first = self.keys[0]
        index = torch.tensor(blocks, device=first.device)
        planes = (*self.keys, *self.values)
        # each plane's rows gathered straight into their place in the blocks (one copy; a
        # stack of gathers copied twice, at twice the time)
        rows = torch.empty(
            (len(blocks), len(planes), *first.shape[1:]), dtype=first.dtype, device=first.device
        )
        for p, plane in enumerate(planes):
            torch.index_select(plane, 0, index, out=rows[:, p])
        return rows

    def planes_of(self, data: list[torch.Tensor] | torch.Tensor) -> torch.Tensor:
        """Blocks' keys and values as ``[planes, blocks, block_size, kv_heads, head_dim]``:
        ``data`` is what :meth:`export` gave (a tensor per block, copied into one) or one
        copy laid out as :func:`~._spans.block_spans` reads the pool (viewed as it is). Raises
        ``ValueError`` for data that is not whole blocks of this cache."""
        first = self.keys[0]
        return as_planes(data, 2 * len(self.keys), first.shape[1:], first.dtype)

    def write(self, blocks: list[int], planes: torch.Tensor) -> None:
        """Write ``planes`` (:meth:`planes_of`, one block of each plane per id in
        ``blocks``) into ``blocks``."""
        if not blocks:
            return
        first = self.keys[0]
        planes = planes.to(first.device)
        index = torch.tensor(blocks, device=first.device)
        for plane, t in zip(planes, (*self.keys, *self.values), strict=True):
            t.index_copy_(0, index, plane)


def as_planes(
    data: list[torch.Tensor] | torch.Tensor, planes: int, row: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """Blocks of ``planes`` planes, each block's row in a plane ``row`` (``[block_size,
    kv_heads, head_dim]``) of ``dtype``, as ``[planes, blocks, *row]``: ``data`` is a tensor
    per block (each every plane's row in turn; copied into one) or one copy laid out plane by
    plane (viewed as it is). Raises ``ValueError`` for data that is not whole blocks."""
    size = planes * math.prod(row) * dtype.itemsize
    if isinstance(data, torch.Tensor):
        nbytes = data.numel() * data.element_size()
        if nbytes % size:
            raise ValueError(f"a block of this engine is {size} bytes, not part of {nbytes}")
        flat = data.reshape(-1).view(torch.uint8).view(dtype)
        return flat.view(planes, nbytes // size, *row)
    if any(d.numel() * d.element_size() != size for d in data):
        raise ValueError(f"a block of this engine is {size} bytes")
    if not data:
        return torch.empty((planes, 0, *row), dtype=dtype)
    raw = torch.stack([d.reshape(-1).view(torch.uint8) for d in data]).view(dtype)
    return raw.view(len(data), planes, *row).transpose(0, 1)
