"""Streams: ordered frames with backpressure between two processes (the call path rides them).

- ``_transport``: the seam (a registry by URL scheme) and the built-in ``tcp://`` with TLS;
- ``_inproc`` and ``_shm`` (with ``_shmring``, ``_shmsetup``): the in-host streams, sharing
  the flow control of ``_flow``;
- ``_conformance`` and ``_harness``: the stream checks every backend passes
  (:func:`orchestr.fabric.testing.check_transport`).
"""
