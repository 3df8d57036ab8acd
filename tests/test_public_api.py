"""Pins the public surface: a change here is a change users see."""

from __future__ import annotations

import orchestr
import orchestr.fabric
import orchestr.fabric.testing as fabric_testing
import orchestr.roles
import orchestr.roles.pipeline
import orchestr.tasks

EXPECTED = {
    "Actor",
    "ActorDiedError",
    "ActorError",
    "ActorInfo",
    "AuthenticationError",
    "BrokenResourceError",
    "Buffer",
    "CallError",
    "CallTimeoutError",
    "ClosedResourceError",
    "Collective",
    "Config",
    "ConfigError",
    "ControlPlaneError",
    "DescriptorError",
    "Endpoint",
    "FallbackError",
    "JobContext",
    "Mesh",
    "MeshError",
    "MessageTooLargeError",
    "NodeInfo",
    "OrchestrError",
    "PlacementError",
    "ProtocolError",
    "SerializationError",
    "SpawnError",
    "StaleDescriptorError",
    "TransportError",
    "TransportUnavailableError",
    "__version__",
    "endpoint",
    "load_config",
    "connect",
    "open_local_cluster",
    "register",
    "run",
    "Graph",
    "GraphNode",
    "GraphRun",
    "Staleness",
    "Versioned",
    "Failure",
    "RestartPolicy",
    "SupervisionError",
    "Reservation",
}

FABRIC = {
    "Borrowed",
    "Buffer",
    "BufferTransport",
    "Claim",
    "Descriptor",
    "Listener",
    "Region",
    "StreamTransport",
    "buffer_transport",
    "buffer_transports",
    "configure",
    "connect_stream",
    "connections",
    "empty",
    "host_id",
    "listen_stream",
    "process_key",
    "register_buffer_transport",
    "register_stream_transport",
    "release_all",
    "shutdown",
    "split_url",
    "stream_transports",
    "transport_report",
}

ROLES = {
    "DEMO_CONFIG",
    "MODES",
    "SMALL_CONFIG",
    "AttentionOptions",
    "AttentionServer",
    "Backend",
    "BackendError",
    "BackendSpec",
    "BackendUnavailableError",
    "ChecksumMismatchError",
    "Completion",
    "Engine",
    "EngineStats",
    "ExpertHost",
    "ExpertOptions",
    "ExpertUnavailableError",
    "GRPOConfig",
    "GRPOResult",
    "Generator",
    "Handoff",
    "HandoffError",
    "HandoffOptions",
    "KVNamespace",
    "KVOptions",
    "KVStore",
    "KVStoreError",
    "KVWriter",
    "LeaseExpiredError",
    "LengthRanker",
    "ManifestMismatchError",
    "PagedEngine",
    "PagedKV",
    "RecomputeEngine",
    "Request",
    "Reward",
    "RLConfig",
    "StaleWeightsError",
    "StepRecord",
    "TinyLM",
    "TinyLMConfig",
    "TokenDelta",
    "TrainConfig",
    "Trainer",
    "UpdateConfig",
    "Updates",
    "WeightLoader",
    "WeightPublisher",
    "WeightSyncError",
    "ShardedWeightsRef",
    "WeightsRef",
    "backend_report",
    "build_model",
    "choose_backend",
    "group_advantages",
    "grpo_loss",
    "grpo_update",
    "kv_block_bytes",
    "register_backend",
    "load_rl_config",
    "reverse_task",
    "run_grpo",
    "run_rl",
    "train",
}


PIPELINE = {
    "SCHEDULES",
    "Cost",
    "Link",
    "Op",
    "Pass",
    "Pipeline",
    "PipelineStage",
    "Report",
    "Schedule",
    "StepResult",
    "Timing",
    "bubble_theory",
    "build",
    "check",
    "gpipe",
    "interleaved_1f1b",
    "links",
    "one_f_one_b",
    "run",
    "zb_h1",
}


def test_orchestr_exports() -> None:
    assert set(orchestr.__all__) == EXPECTED
    for name in EXPECTED:
        assert hasattr(orchestr, name), name


def test_every_error_derives_from_the_root() -> None:
    errors = [getattr(orchestr, n) for n in EXPECTED if n.endswith("Error")]
    assert all(issubclass(e, orchestr.OrchestrError) for e in errors)
    assert issubclass(orchestr.CallTimeoutError, TimeoutError)


def test_subpackages() -> None:
    assert set(orchestr.fabric.__all__) == FABRIC
    for name in FABRIC:
        assert hasattr(orchestr.fabric, name), name
    assert orchestr.Buffer is orchestr.fabric.Buffer
    assert "tcp" in orchestr.fabric.stream_transports()
    assert {"inproc", "shm", "tcp", "rdma", "nixl"} <= set(orchestr.fabric.buffer_transports())
    assert {"inproc", "shm", "tcp"} <= set(orchestr.fabric.stream_transports())
    assert fabric_testing.__all__ == [
        "check_buffer_transport",
        "check_stream_transport",
        "check_transport",
    ]
    assert orchestr.tasks.__all__ == ["TaskOwner"]
    assert set(orchestr.roles.__all__) == ROLES
    for name in ROLES:
        assert hasattr(orchestr.roles, name), name
    assert issubclass(orchestr.roles.StaleWeightsError, orchestr.roles.WeightSyncError)
    assert set(orchestr.roles.pipeline.__all__) == PIPELINE
    for name in PIPELINE:
        assert hasattr(orchestr.roles.pipeline, name), name
