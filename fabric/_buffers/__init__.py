"""One-sided buffers: register memory, pass a small descriptor, the peer reads or writes it.

- ``_transport``: the contract (:class:`~._transport.BufferTransport`, descriptors, regions,
  counters); ``_fallback``: choosing a backend under the fallback policy; ``_scope``: the
  spans a scoped buffer reaches; ``_handle``: the user's :class:`~orchestr.fabric.Buffer`;
- backends: ``_inproc``, ``_shm`` (``process_vm_readv``), ``_tcp`` and ``_rdma`` (pyverbs) with
  the ``_sidechannel`` their owners serve, ``_nixl`` (optional);
- ``_memfd`` and ``_segments``: anonymous shared memory and the segment pools that carry the
  call path's large values on one host, and :func:`~orchestr.fabric.empty`;
- ``_conformance``: the one-sided checks every backend passes.
"""
