"""The two sides of a :class:`~._actor.KVStore`'s exchanges, in the writer's and the reader's
processes: :func:`put_blocks` (reserve, one vectored one-sided write into the slots
reserved, publish) and :func:`get_blocks` (lease, one vectored one-sided read of the leased
blocks, end the lease), and :class:`KVWriter`, a store as one writer uses it (with its key)."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import torch

import orchestr as oc
from orchestr.errors import StaleDescriptorError

from ._actor import MAX_KEY
from ._types import KVNamespace

__all__ = ["KVWriter", "get_blocks", "put_blocks", "writer_of"]

#: A reader trusts its own clock for a lease's time to live only with these margins: clocks of
#: two hosts may run at slightly different rates (NTP keeps them within parts per million).
CLOCK_RATE_MARGIN = 0.01
CLOCK_SLACK_S = 0.005


@oc.register
@dataclasses.dataclass(frozen=True)
class KVWriter:
    """A :class:`~._actor.KVStore` (a one-actor mesh) as one writer uses it: ``key`` is that writer's
    secret, shared by every process of the job that writes its namespaces (a generator given
    ``kv_store=KVWriter(store, key)`` puts and reads with it). The first put into a namespace
    makes its writer the owner: others are refused that namespace's puts and leases. Without
    a key (a plain mesh) writers share the empty key: fine inside one job, but any caller
    with the cluster token can then write those namespaces too."""

    __module__ = "orchestr.roles"  # its name on the wire and in the head's store (pinned)

    store: Any
    key: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or len(self.key) > MAX_KEY:
            raise oc.ConfigError(f"a writer key is a string of at most {MAX_KEY} characters")


def writer_of(store: Any) -> tuple[Any, str]:
    """``(the store's mesh, the writer's key)`` of a :class:`KVWriter` or a plain mesh."""
    if isinstance(store, KVWriter):
        return store.store, store.key
    return store, ""


async def put_blocks(
    store: Any, namespace: KVNamespace, hashes: Sequence[bytes], blocks: Sequence[torch.Tensor]
) -> int:
    """Store ``blocks`` (contiguous CPU tensors of the store's ``block_bytes`` each) under
    ``hashes`` in ``store`` (a one-actor mesh, or a :class:`KVWriter` to write with its key):
    one call to reserve, one vectored one-sided write into the slots reserved
    (:meth:`Buffer.write_spans`), one call to publish. Returns how many blocks were new; a
    block already stored is not written again. Aborts the put if a write fails. Raises
    ``ValueError`` for blocks of the wrong size, :class:`KVStoreError` (in an
    :class:`~orchestr.ActorError`) for a namespace of another writer."""
    if len(blocks) != len(hashes):
        raise ValueError(f"{len(hashes)} hashes for {len(blocks)} blocks")
    store, key = writer_of(store)
    grant = await store.begin_put.call_one(namespace, list(hashes), key)
    at = {h: i for i, h in enumerate(hashes)}
    try:
        _check_sizes(blocks, grant["block_bytes"])
        spans = [(offset, blocks[at[block_hash]]) for block_hash, offset in grant["writes"]]
        if spans:
            await grant["buffer"].write_spans(spans)
    except BaseException:
        with contextlib.suppress(Exception):
            await store.abort_put.call_one(grant["put"])
        raise
    return int(await store.end_put.call_one(grant["put"]))


async def get_blocks(
    store: Any, namespace: KVNamespace, hashes: Sequence[bytes], out: Sequence[torch.Tensor]
) -> int:
    """Read the longest stored prefix of ``hashes`` from ``store`` (a one-actor mesh, or a
    :class:`KVWriter` to read its own namespaces) into ``out`` (tensors of the store's
    ``block_bytes`` each, one per hash; those past the prefix are left as they were) and
    return its length in blocks. One call to lease, one vectored one-sided read of the leased
    blocks (:meth:`Buffer.read_spans`), then the lease is ended; a prefix of no block takes
    the first call only.

    The lease is known to have held through the read without asking when the read ended
    within its time to live as measured from before the lease was asked for (the store
    granted it later, and never ends a lease early but at its holder's word): the release is
    then sent without waiting. Otherwise one call ends it and confirms it (else
    :class:`LeaseExpiredError`, and what was read must not be used). A read refused because
    the lease ended before it (its buffer was revoked) asks the same call, which raises
    :class:`LeaseExpiredError` then."""
    if len(out) < len(hashes):
        raise ValueError(f"{len(hashes)} hashes but room for {len(out)} blocks")
    store, key = writer_of(store)
    asked = time.monotonic()
    lease = await store.lease.call_one(namespace, list(hashes), None, key)
    if not lease["offsets"]:
        return 0  # nothing stored: no lease was taken
    try:
        _check_sizes(out[: len(lease["offsets"])], lease["block_bytes"])
        await lease["buffer"].read_spans(list(zip(lease["offsets"], out, strict=False)))
    except StaleDescriptorError:
        # the lease's buffer was revoked: the lease ended before the read (the store says so)
        await store.end_read.call_one(lease["lease"])
        raise
    except BaseException:
        with contextlib.suppress(Exception):
            await store.release.call_one(lease["lease"])
        raise
    if time.monotonic() - asked < lease["ttl"] * (1 - CLOCK_RATE_MARGIN) - CLOCK_SLACK_S:
        store.release.broadcast(lease["lease"])  # one way: it held, nothing to confirm
    else:
        await store.end_read.call_one(lease["lease"])
    return len(lease["offsets"])


def _check_sizes(blocks: Sequence[torch.Tensor], size: int) -> None:
    for i, block in enumerate(blocks):
        nbytes = block.numel() * block.element_size()
        if nbytes != size or not block.is_contiguous() or block.device.type != "cpu":
            raise ValueError(
                f"block {i} is {nbytes} bytes ({block.dtype}, {block.device}, contiguous: "
                f"{block.is_contiguous()}); this store's blocks are contiguous CPU tensors of "
                f"{size} bytes"
            )
