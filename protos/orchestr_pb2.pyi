from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Ack(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Resources(_message.Message):
    __slots__ = ("amounts",)
    class AmountsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    AMOUNTS_FIELD_NUMBER: _ClassVar[int]
    amounts: _containers.ScalarMap[str, float]
    def __init__(self, amounts: _Optional[_Mapping[str, float]] = ...) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "address", "total", "free", "labels", "last_heartbeat_unix", "alive", "transports", "devices", "workers")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_UNIX_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    total: Resources
    free: Resources
    labels: _containers.ScalarMap[str, str]
    last_heartbeat_unix: float
    alive: bool
    transports: _containers.RepeatedScalarFieldContainer[str]
    devices: _containers.RepeatedScalarFieldContainer[str]
    workers: int
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., total: _Optional[_Union[Resources, _Mapping]] = ..., free: _Optional[_Union[Resources, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ..., last_heartbeat_unix: _Optional[float] = ..., alive: _Optional[bool] = ..., transports: _Optional[_Iterable[str]] = ..., devices: _Optional[_Iterable[str]] = ..., workers: _Optional[int] = ...) -> None: ...

class RegisterNodeRequest(_message.Message):
    __slots__ = ("node_id", "address", "total", "labels", "transports", "devices", "workers", "rejoin")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    REJOIN_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    total: Resources
    labels: _containers.ScalarMap[str, str]
    transports: _containers.RepeatedScalarFieldContainer[str]
    devices: _containers.RepeatedScalarFieldContainer[str]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    rejoin: bool
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., total: _Optional[_Union[Resources, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ..., transports: _Optional[_Iterable[str]] = ..., devices: _Optional[_Iterable[str]] = ..., workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., rejoin: _Optional[bool] = ...) -> None: ...

class RegisterNodeReply(_message.Message):
    __slots__ = ("epoch", "stop_workers")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STOP_WORKERS_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    stop_workers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, epoch: _Optional[str] = ..., stop_workers: _Optional[_Iterable[str]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "workers", "suspended")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    SUSPENDED_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    workers: int
    suspended: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node_id: _Optional[str] = ..., workers: _Optional[int] = ..., suspended: _Optional[_Iterable[str]] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("epoch", "register_again")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REGISTER_AGAIN_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    register_again: bool
    def __init__(self, epoch: _Optional[str] = ..., register_again: _Optional[bool] = ...) -> None: ...

class WorkerExit(_message.Message):
    __slots__ = ("node_id", "worker_id", "pid", "exit_code", "signal", "last_output")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    LAST_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    worker_id: str
    pid: int
    exit_code: int
    signal: int
    last_output: str
    def __init__(self, node_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., pid: _Optional[int] = ..., exit_code: _Optional[int] = ..., signal: _Optional[int] = ..., last_output: _Optional[str] = ...) -> None: ...

class SpawnMeshRequest(_message.Message):
    __slots__ = ("class_path", "init_args", "size", "resources", "labels", "name", "restart", "per_process", "python_path", "strategy", "reservation_id")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CLASS_PATH_FIELD_NUMBER: _ClassVar[int]
    INIT_ARGS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    RESTART_FIELD_NUMBER: _ClassVar[int]
    PER_PROCESS_FIELD_NUMBER: _ClassVar[int]
    PYTHON_PATH_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    class_path: str
    init_args: bytes
    size: int
    resources: Resources
    labels: _containers.ScalarMap[str, str]
    name: str
    restart: RestartPolicy
    per_process: int
    python_path: _containers.RepeatedScalarFieldContainer[str]
    strategy: str
    reservation_id: str
    def __init__(self, class_path: _Optional[str] = ..., init_args: _Optional[bytes] = ..., size: _Optional[int] = ..., resources: _Optional[_Union[Resources, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ..., name: _Optional[str] = ..., restart: _Optional[_Union[RestartPolicy, _Mapping]] = ..., per_process: _Optional[int] = ..., python_path: _Optional[_Iterable[str]] = ..., strategy: _Optional[str] = ..., reservation_id: _Optional[str] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("bundles", "resources", "labels", "strategy", "name")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    BUNDLES_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    bundles: int
    resources: Resources
    labels: _containers.ScalarMap[str, str]
    strategy: str
    name: str
    def __init__(self, bundles: _Optional[int] = ..., resources: _Optional[_Union[Resources, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ..., strategy: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class ReservationInfo(_message.Message):
    __slots__ = ("reservation_id", "name", "resources", "node_ids")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    name: str
    resources: Resources
    node_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, reservation_id: _Optional[str] = ..., name: _Optional[str] = ..., resources: _Optional[_Union[Resources, _Mapping]] = ..., node_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("reservation_id",)
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    def __init__(self, reservation_id: _Optional[str] = ...) -> None: ...

class MeshTraffic(_message.Message):
    __slots__ = ("src_mesh_id", "dst_mesh_id", "nbytes")
    SRC_MESH_ID_FIELD_NUMBER: _ClassVar[int]
    DST_MESH_ID_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    src_mesh_id: str
    dst_mesh_id: str
    nbytes: float
    def __init__(self, src_mesh_id: _Optional[str] = ..., dst_mesh_id: _Optional[str] = ..., nbytes: _Optional[float] = ...) -> None: ...

class SwitchTraffic(_message.Message):
    __slots__ = ("src", "dst", "nbytes")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    src: str
    dst: str
    nbytes: float
    def __init__(self, src: _Optional[str] = ..., dst: _Optional[str] = ..., nbytes: _Optional[float] = ...) -> None: ...

class FabricHintRequest(_message.Message):
    __slots__ = ("job_id", "phase", "traffic", "collective", "collective_mesh_id", "collective_bytes", "expected_s", "repeats", "dry_run", "demand", "lead_s")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_MESH_ID_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_S_FIELD_NUMBER: _ClassVar[int]
    REPEATS_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    DEMAND_FIELD_NUMBER: _ClassVar[int]
    LEAD_S_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    phase: str
    traffic: _containers.RepeatedCompositeFieldContainer[MeshTraffic]
    collective: str
    collective_mesh_id: str
    collective_bytes: float
    expected_s: float
    repeats: float
    dry_run: bool
    demand: _containers.RepeatedCompositeFieldContainer[SwitchTraffic]
    lead_s: float
    def __init__(self, job_id: _Optional[str] = ..., phase: _Optional[str] = ..., traffic: _Optional[_Iterable[_Union[MeshTraffic, _Mapping]]] = ..., collective: _Optional[str] = ..., collective_mesh_id: _Optional[str] = ..., collective_bytes: _Optional[float] = ..., expected_s: _Optional[float] = ..., repeats: _Optional[float] = ..., dry_run: _Optional[bool] = ..., demand: _Optional[_Iterable[_Union[SwitchTraffic, _Mapping]]] = ..., lead_s: _Optional[float] = ...) -> None: ...

class FabricHistoryRequest(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: int
    def __init__(self, limit: _Optional[int] = ...) -> None: ...

class CircuitCount(_message.Message):
    __slots__ = ("a", "b", "count")
    A_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    a: str
    b: str
    count: int
    def __init__(self, a: _Optional[str] = ..., b: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class FabricPlan(_message.Message):
    __slots__ = ("seq", "at_unix", "job_id", "phase", "add", "remove", "keep", "predicted_s_static", "predicted_s_with", "saving_s", "reconfig_cost_s", "port_changes", "commit", "reason", "status", "generation", "timings", "events", "dry_run", "demand")
    class TimingsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SEQ_FIELD_NUMBER: _ClassVar[int]
    AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    ADD_FIELD_NUMBER: _ClassVar[int]
    REMOVE_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_S_STATIC_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_S_WITH_FIELD_NUMBER: _ClassVar[int]
    SAVING_S_FIELD_NUMBER: _ClassVar[int]
    RECONFIG_COST_S_FIELD_NUMBER: _ClassVar[int]
    PORT_CHANGES_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    DEMAND_FIELD_NUMBER: _ClassVar[int]
    seq: int
    at_unix: float
    job_id: str
    phase: str
    add: _containers.RepeatedCompositeFieldContainer[CircuitCount]
    remove: _containers.RepeatedCompositeFieldContainer[CircuitCount]
    keep: _containers.RepeatedCompositeFieldContainer[CircuitCount]
    predicted_s_static: float
    predicted_s_with: float
    saving_s: float
    reconfig_cost_s: float
    port_changes: int
    commit: bool
    reason: str
    status: str
    generation: int
    timings: _containers.ScalarMap[str, float]
    events: _containers.RepeatedScalarFieldContainer[str]
    dry_run: bool
    demand: _containers.RepeatedCompositeFieldContainer[SwitchTraffic]
    def __init__(self, seq: _Optional[int] = ..., at_unix: _Optional[float] = ..., job_id: _Optional[str] = ..., phase: _Optional[str] = ..., add: _Optional[_Iterable[_Union[CircuitCount, _Mapping]]] = ..., remove: _Optional[_Iterable[_Union[CircuitCount, _Mapping]]] = ..., keep: _Optional[_Iterable[_Union[CircuitCount, _Mapping]]] = ..., predicted_s_static: _Optional[float] = ..., predicted_s_with: _Optional[float] = ..., saving_s: _Optional[float] = ..., reconfig_cost_s: _Optional[float] = ..., port_changes: _Optional[int] = ..., commit: _Optional[bool] = ..., reason: _Optional[str] = ..., status: _Optional[str] = ..., generation: _Optional[int] = ..., timings: _Optional[_Mapping[str, float]] = ..., events: _Optional[_Iterable[str]] = ..., dry_run: _Optional[bool] = ..., demand: _Optional[_Iterable[_Union[SwitchTraffic, _Mapping]]] = ...) -> None: ...

class FabricPlans(_message.Message):
    __slots__ = ("plans",)
    PLANS_FIELD_NUMBER: _ClassVar[int]
    plans: _containers.RepeatedCompositeFieldContainer[FabricPlan]
    def __init__(self, plans: _Optional[_Iterable[_Union[FabricPlan, _Mapping]]] = ...) -> None: ...

class OcsCircuit(_message.Message):
    __slots__ = ("port_a", "port_b", "a", "b")
    PORT_A_FIELD_NUMBER: _ClassVar[int]
    PORT_B_FIELD_NUMBER: _ClassVar[int]
    A_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    port_a: int
    port_b: int
    a: str
    b: str
    def __init__(self, port_a: _Optional[int] = ..., port_b: _Optional[int] = ..., a: _Optional[str] = ..., b: _Optional[str] = ...) -> None: ...

class OcsState(_message.Message):
    __slots__ = ("name", "radix", "wired", "circuits")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RADIX_FIELD_NUMBER: _ClassVar[int]
    WIRED_FIELD_NUMBER: _ClassVar[int]
    CIRCUITS_FIELD_NUMBER: _ClassVar[int]
    name: str
    radix: int
    wired: int
    circuits: _containers.RepeatedCompositeFieldContainer[OcsCircuit]
    def __init__(self, name: _Optional[str] = ..., radix: _Optional[int] = ..., wired: _Optional[int] = ..., circuits: _Optional[_Iterable[_Union[OcsCircuit, _Mapping]]] = ...) -> None: ...

class FabricState(_message.Message):
    __slots__ = ("hosts", "accelerators", "switches", "endpoints", "circuit_gbps", "generation", "ocs")
    class SwitchesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    ACCELERATORS_FIELD_NUMBER: _ClassVar[int]
    SWITCHES_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    CIRCUIT_GBPS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    OCS_FIELD_NUMBER: _ClassVar[int]
    hosts: int
    accelerators: int
    switches: _containers.ScalarMap[str, int]
    endpoints: _containers.RepeatedScalarFieldContainer[str]
    circuit_gbps: float
    generation: int
    ocs: _containers.RepeatedCompositeFieldContainer[OcsState]
    def __init__(self, hosts: _Optional[int] = ..., accelerators: _Optional[int] = ..., switches: _Optional[_Mapping[str, int]] = ..., endpoints: _Optional[_Iterable[str]] = ..., circuit_gbps: _Optional[float] = ..., generation: _Optional[int] = ..., ocs: _Optional[_Iterable[_Union[OcsState, _Mapping]]] = ...) -> None: ...

class RestartPolicy(_message.Message):
    __slots__ = ("max_restarts", "backoff_s", "backoff_max_s", "retry")
    MAX_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    BACKOFF_S_FIELD_NUMBER: _ClassVar[int]
    BACKOFF_MAX_S_FIELD_NUMBER: _ClassVar[int]
    RETRY_FIELD_NUMBER: _ClassVar[int]
    max_restarts: int
    backoff_s: float
    backoff_max_s: float
    retry: str
    def __init__(self, max_restarts: _Optional[int] = ..., backoff_s: _Optional[float] = ..., backoff_max_s: _Optional[float] = ..., retry: _Optional[str] = ...) -> None: ...

class ActorInfo(_message.Message):
    __slots__ = ("actor_id", "mesh_id", "name", "rank", "class_path", "node_id", "worker_id", "call_address", "state", "pid", "exit_code", "signal", "endpoints", "restarts", "last_output", "max_restarts", "suspended")
    ACTOR_ID_FIELD_NUMBER: _ClassVar[int]
    MESH_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    CLASS_PATH_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CALL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    LAST_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    MAX_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    SUSPENDED_FIELD_NUMBER: _ClassVar[int]
    actor_id: str
    mesh_id: str
    name: str
    rank: int
    class_path: str
    node_id: str
    worker_id: str
    call_address: str
    state: str
    pid: int
    exit_code: int
    signal: int
    endpoints: _containers.RepeatedScalarFieldContainer[str]
    restarts: int
    last_output: str
    max_restarts: int
    suspended: bool
    def __init__(self, actor_id: _Optional[str] = ..., mesh_id: _Optional[str] = ..., name: _Optional[str] = ..., rank: _Optional[int] = ..., class_path: _Optional[str] = ..., node_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., call_address: _Optional[str] = ..., state: _Optional[str] = ..., pid: _Optional[int] = ..., exit_code: _Optional[int] = ..., signal: _Optional[int] = ..., endpoints: _Optional[_Iterable[str]] = ..., restarts: _Optional[int] = ..., last_output: _Optional[str] = ..., max_restarts: _Optional[int] = ..., suspended: _Optional[bool] = ...) -> None: ...

class MeshInfo(_message.Message):
    __slots__ = ("mesh_id", "name", "class_path", "members")
    MESH_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CLASS_PATH_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    mesh_id: str
    name: str
    class_path: str
    members: _containers.RepeatedCompositeFieldContainer[ActorInfo]
    def __init__(self, mesh_id: _Optional[str] = ..., name: _Optional[str] = ..., class_path: _Optional[str] = ..., members: _Optional[_Iterable[_Union[ActorInfo, _Mapping]]] = ...) -> None: ...

class HostActorRequest(_message.Message):
    __slots__ = ("name", "class_path", "call_address", "endpoints", "pid", "actor_id", "mesh_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CLASS_PATH_FIELD_NUMBER: _ClassVar[int]
    CALL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ACTOR_ID_FIELD_NUMBER: _ClassVar[int]
    MESH_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    class_path: str
    call_address: str
    endpoints: _containers.RepeatedScalarFieldContainer[str]
    pid: int
    actor_id: str
    mesh_id: str
    def __init__(self, name: _Optional[str] = ..., class_path: _Optional[str] = ..., call_address: _Optional[str] = ..., endpoints: _Optional[_Iterable[str]] = ..., pid: _Optional[int] = ..., actor_id: _Optional[str] = ..., mesh_id: _Optional[str] = ...) -> None: ...

class StopMeshRequest(_message.Message):
    __slots__ = ("mesh_id",)
    MESH_ID_FIELD_NUMBER: _ClassVar[int]
    mesh_id: str
    def __init__(self, mesh_id: _Optional[str] = ...) -> None: ...

class GetActorRequest(_message.Message):
    __slots__ = ("actor_id", "wait_for_exit_s", "wait_for_restart_s", "address")
    ACTOR_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_FOR_EXIT_S_FIELD_NUMBER: _ClassVar[int]
    WAIT_FOR_RESTART_S_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    actor_id: str
    wait_for_exit_s: float
    wait_for_restart_s: float
    address: str
    def __init__(self, actor_id: _Optional[str] = ..., wait_for_exit_s: _Optional[float] = ..., wait_for_restart_s: _Optional[float] = ..., address: _Optional[str] = ...) -> None: ...

class WatchActorsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ActorEvent(_message.Message):
    __slots__ = ("kind", "actor")
    KIND_FIELD_NUMBER: _ClassVar[int]
    ACTOR_FIELD_NUMBER: _ClassVar[int]
    kind: str
    actor: ActorInfo
    def __init__(self, kind: _Optional[str] = ..., actor: _Optional[_Union[ActorInfo, _Mapping]] = ...) -> None: ...

class RestartActorRequest(_message.Message):
    __slots__ = ("actor_id", "state", "has_state")
    ACTOR_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    HAS_STATE_FIELD_NUMBER: _ClassVar[int]
    actor_id: str
    state: bytes
    has_state: bool
    def __init__(self, actor_id: _Optional[str] = ..., state: _Optional[bytes] = ..., has_state: _Optional[bool] = ...) -> None: ...

class AbandonActorRequest(_message.Message):
    __slots__ = ("actor_id",)
    ACTOR_ID_FIELD_NUMBER: _ClassVar[int]
    actor_id: str
    def __init__(self, actor_id: _Optional[str] = ...) -> None: ...

class NodeList(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ...) -> None: ...

class ActorList(_message.Message):
    __slots__ = ("actors",)
    ACTORS_FIELD_NUMBER: _ClassVar[int]
    actors: _containers.RepeatedCompositeFieldContainer[ActorInfo]
    def __init__(self, actors: _Optional[_Iterable[_Union[ActorInfo, _Mapping]]] = ...) -> None: ...

class SubmitJobRequest(_message.Message):
    __slots__ = ("package", "entrypoint", "args")
    PACKAGE_FIELD_NUMBER: _ClassVar[int]
    ENTRYPOINT_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    package: bytes
    entrypoint: str
    args: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, package: _Optional[bytes] = ..., entrypoint: _Optional[str] = ..., args: _Optional[_Iterable[str]] = ...) -> None: ...

class JobInfo(_message.Message):
    __slots__ = ("job_id", "entrypoint", "state", "exit_code", "submitted_unix", "ended_unix", "pid", "args", "reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ENTRYPOINT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_UNIX_FIELD_NUMBER: _ClassVar[int]
    ENDED_UNIX_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    entrypoint: str
    state: str
    exit_code: int
    submitted_unix: float
    ended_unix: float
    pid: int
    args: _containers.RepeatedScalarFieldContainer[str]
    reason: str
    def __init__(self, job_id: _Optional[str] = ..., entrypoint: _Optional[str] = ..., state: _Optional[str] = ..., exit_code: _Optional[int] = ..., submitted_unix: _Optional[float] = ..., ended_unix: _Optional[float] = ..., pid: _Optional[int] = ..., args: _Optional[_Iterable[str]] = ..., reason: _Optional[str] = ...) -> None: ...

class JobList(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobInfo]
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobInfo, _Mapping]]] = ...) -> None: ...

class JobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class JobLogsRequest(_message.Message):
    __slots__ = ("job_id", "offset", "max_bytes")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    offset: int
    max_bytes: int
    def __init__(self, job_id: _Optional[str] = ..., offset: _Optional[int] = ..., max_bytes: _Optional[int] = ...) -> None: ...

class JobLogs(_message.Message):
    __slots__ = ("data", "offset", "job")
    DATA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    offset: int
    job: JobInfo
    def __init__(self, data: _Optional[bytes] = ..., offset: _Optional[int] = ..., job: _Optional[_Union[JobInfo, _Mapping]] = ...) -> None: ...

class JobEventsRequest(_message.Message):
    __slots__ = ("job_id", "title", "offset", "data", "state")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    title: str
    offset: int
    data: bytes
    state: str
    def __init__(self, job_id: _Optional[str] = ..., title: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., state: _Optional[str] = ...) -> None: ...

class JobEventsReply(_message.Message):
    __slots__ = ("offset",)
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    offset: int
    def __init__(self, offset: _Optional[int] = ...) -> None: ...

class DaemonLogRequest(_message.Message):
    __slots__ = ("name", "offset", "max_bytes", "node_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    max_bytes: int
    node_id: str
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ..., max_bytes: _Optional[int] = ..., node_id: _Optional[str] = ...) -> None: ...

class DaemonLog(_message.Message):
    __slots__ = ("data", "offset", "names")
    DATA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    offset: int
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, data: _Optional[bytes] = ..., offset: _Optional[int] = ..., names: _Optional[_Iterable[str]] = ...) -> None: ...

class StartWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "python_path")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PYTHON_PATH_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    python_path: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, worker_id: _Optional[str] = ..., python_path: _Optional[_Iterable[str]] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "pid", "control_address", "call_address")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    CONTROL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CALL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    pid: int
    control_address: str
    call_address: str
    def __init__(self, worker_id: _Optional[str] = ..., pid: _Optional[int] = ..., control_address: _Optional[str] = ..., call_address: _Optional[str] = ...) -> None: ...

class StopWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "grace_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    grace_s: float
    def __init__(self, worker_id: _Optional[str] = ..., grace_s: _Optional[float] = ...) -> None: ...

class CreateActorRequest(_message.Message):
    __slots__ = ("actor_id", "class_path", "init_args", "name", "rank", "mesh_id", "state", "has_state")
    ACTOR_ID_FIELD_NUMBER: _ClassVar[int]
    CLASS_PATH_FIELD_NUMBER: _ClassVar[int]
    INIT_ARGS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    MESH_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    HAS_STATE_FIELD_NUMBER: _ClassVar[int]
    actor_id: str
    class_path: str
    init_args: bytes
    name: str
    rank: int
    mesh_id: str
    state: bytes
    has_state: bool
    def __init__(self, actor_id: _Optional[str] = ..., class_path: _Optional[str] = ..., init_args: _Optional[bytes] = ..., name: _Optional[str] = ..., rank: _Optional[int] = ..., mesh_id: _Optional[str] = ..., state: _Optional[bytes] = ..., has_state: _Optional[bool] = ...) -> None: ...

class CreateActorReply(_message.Message):
    __slots__ = ("endpoints",)
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    endpoints: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, endpoints: _Optional[_Iterable[str]] = ...) -> None: ...

class EndpointStats(_message.Message):
    __slots__ = ("endpoint", "calls", "errors")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    calls: int
    errors: int
    def __init__(self, endpoint: _Optional[str] = ..., calls: _Optional[int] = ..., errors: _Optional[int] = ...) -> None: ...

class ActorStats(_message.Message):
    __slots__ = ("actor_id", "label", "queue_depth", "in_flight", "endpoints")
    ACTOR_ID_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    actor_id: str
    label: str
    queue_depth: int
    in_flight: int
    endpoints: _containers.RepeatedCompositeFieldContainer[EndpointStats]
    def __init__(self, actor_id: _Optional[str] = ..., label: _Optional[str] = ..., queue_depth: _Optional[int] = ..., in_flight: _Optional[int] = ..., endpoints: _Optional[_Iterable[_Union[EndpointStats, _Mapping]]] = ...) -> None: ...

class TransportStats(_message.Message):
    __slots__ = ("kind", "transport", "bytes_sent", "bytes_received", "ops", "fallbacks")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    transport: str
    bytes_sent: int
    bytes_received: int
    ops: int
    fallbacks: int
    def __init__(self, kind: _Optional[str] = ..., transport: _Optional[str] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., ops: _Optional[int] = ..., fallbacks: _Optional[int] = ...) -> None: ...

class MetricSeries(_message.Message):
    __slots__ = ("tags", "value", "bucket_counts")
    class TagsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TAGS_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    BUCKET_COUNTS_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.ScalarMap[str, str]
    value: float
    bucket_counts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tags: _Optional[_Mapping[str, str]] = ..., value: _Optional[float] = ..., bucket_counts: _Optional[_Iterable[int]] = ...) -> None: ...

class MetricFamily(_message.Message):
    __slots__ = ("name", "kind", "description", "boundaries", "series")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    BOUNDARIES_FIELD_NUMBER: _ClassVar[int]
    SERIES_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    description: str
    boundaries: _containers.RepeatedScalarFieldContainer[float]
    series: _containers.RepeatedCompositeFieldContainer[MetricSeries]
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., description: _Optional[str] = ..., boundaries: _Optional[_Iterable[float]] = ..., series: _Optional[_Iterable[_Union[MetricSeries, _Mapping]]] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "actors", "transports", "metrics")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ACTORS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    actors: _containers.RepeatedCompositeFieldContainer[ActorStats]
    transports: _containers.RepeatedCompositeFieldContainer[TransportStats]
    metrics: _containers.RepeatedCompositeFieldContainer[MetricFamily]
    def __init__(self, worker_id: _Optional[str] = ..., actors: _Optional[_Iterable[_Union[ActorStats, _Mapping]]] = ..., transports: _Optional[_Iterable[_Union[TransportStats, _Mapping]]] = ..., metrics: _Optional[_Iterable[_Union[MetricFamily, _Mapping]]] = ...) -> None: ...
