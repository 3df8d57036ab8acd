"""orchestr.roles.attention: core attention apart from the model that needs it.

- :class:`Shard`, :func:`attend`, :func:`attend_batch` and :func:`merge`: attention over a
  shard of a sequence's keys with its log-sum-exp, many shards rebatched into one product,
  and shards merged exactly. Sans-IO.
- :class:`AttentionServer` runs core-attention tasks for other roles: queries with their
  keys inline or by reference to KV blocks in a generator's pool (read one-sided over the
  data plane), rebatched across tasks and concurrent calls into one product.
- A generator given ``attention=`` sends the core attention of its long decodes
  there, one shard per server, and merges (:class:`AttentionOffload`).
"""

from ._core import Shard, attend, attend_batch, merge
from ._offload import AttentionOffload
from ._server import AttentionServer, layer_spans

__all__ = [
    "AttentionOffload",
    "AttentionServer",
    "Shard",
    "attend",
    "attend_batch",
    "layer_spans",
    "merge",
]
