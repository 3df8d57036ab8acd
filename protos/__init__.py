"""Control-plane protocol: ``orchestr.proto`` and its committed generated modules.

Regenerate with ``make protos``; ``tests/protos/test_generated.py`` fails when they are stale.
Protobuf types stay at the control-plane boundary: the runtime converts them at the edge.
"""

from . import orchestr_pb2, orchestr_pb2_grpc

__all__ = ["orchestr_pb2", "orchestr_pb2_grpc"]
