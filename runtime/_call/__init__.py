"""The call path, the hot path: actor calls and results as msgpack frames over a stream.

- ``_mesh``: mesh handles and the call adverbs (``call``, ``call_one``, ``choose``, ``stream``,
  ``broadcast``);
- ``_client`` (the caller), ``_connection`` (its connection to one worker), ``_server`` (the
  worker's side), ``_handshake`` (both ends prove the cluster token), ``_locality`` (whether a
  peer shares this host);
- ``_wire`` (message kinds and the protocol base) over ``_frames`` (sans-IO framing);
- ``_serde`` (values: msgpack and extension types, never pickle) and ``_bulk`` (large tensors
  through shared memory on one host, :class:`~orchestr.fabric.Buffer` handles).
"""
