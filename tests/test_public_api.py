"""Pins the public surface: a change here is a change users see."""

from __future__ import annotations

import orchestr
import orchestr.fabric
import orchestr.roles

EXPECTED = {
    "Actor", "ActorDiedError", "ActorError", "AuthenticationError", "BrokenResourceError",
    "CallError", "CallTimeoutError", "ClosedResourceError", "Config", "ConfigError",
    "ControlPlaneError", "Endpoint", "JobContext", "Mesh", "MeshError", "MessageTooLargeError",
    "OrchestrError", "PlacementError", "ProtocolError", "SerializationError", "SpawnError",
    "__version__", "endpoint", "load_config", "open_local_cluster", "register", "run",
}  # fmt: skip


def test_orchestr_exports() -> None:
    assert set(orchestr.__all__) == EXPECTED
    for name in EXPECTED:
        assert hasattr(orchestr, name), name


def test_every_error_derives_from_the_root() -> None:
    errors = [getattr(orchestr, n) for n in EXPECTED if n.endswith("Error")]
    assert all(issubclass(e, orchestr.OrchestrError) for e in errors)
    assert issubclass(orchestr.CallTimeoutError, TimeoutError)


def test_subpackages() -> None:
    assert set(orchestr.fabric.__all__) >= {
        "register_stream_transport",
        "connect_stream",
        "listen_stream",
    }
    assert "tcp" in orchestr.fabric.stream_transports()
    assert orchestr.roles.__all__ == []
