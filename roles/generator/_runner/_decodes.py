"""A step's decodes attending on the paged kernel, the long ones on attention servers.

With an offload (:class:`orchestr.roles.attention.AttentionOffload`, set on the runner by
``Generator(attention=...)``), decodes whose context has ``min_tokens`` or more
attend there and the others here, in one kernel call over their rows of the block tables.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["decode_attention"]


def decode_attention(
    ops: Any,
    offload: Any,
    layer: int,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The decodes' core attention ``[n, heads, dim]``."""
    if offload is None or int(lengths.max()) < offload.min_tokens:
        out: torch.Tensor = ops.decode_attention(q, keys, values, tables, lengths, scale)
        return out
    far = lengths >= offload.min_tokens
    near = ~far
    out = q.new_empty(q.shape)
    if bool(near.any()):
        out[near] = ops.decode_attention(
            q[near].contiguous(),
            keys,
            values,
            tables[near].contiguous(),
            lengths[near].contiguous(),
            scale,
        )
    out[far] = offload.run(layer, q[far], tables[far], lengths[far], scale)
    return out
