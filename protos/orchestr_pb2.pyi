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
    __slots__ = ("node_id", "address", "total", "free", "labels", "last_heartbeat_unix", "alive")
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
    node_id: str
    address: str
    total: Resources
    free: Resources
    labels: _containers.ScalarMap[str, str]
    last_heartbeat_unix: float
    alive: bool
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., total: _Optional[_Union[Resources, _Mapping]] = ..., free: _Optional[_Union[Resources, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ..., last_heartbeat_unix: _Optional[float] = ..., alive: _Optional[bool] = ...) -> None: ...

class RegisterNodeRequest(_message.Message):
    __slots__ = ("node_id", "address", "total", "labels")
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
    node_id: str
    address: str
    total: Resources
    labels: _containers.ScalarMap[str, str]
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., total: _Optional[_Union[Resources, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "workers")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    workers: int
    def __init__(self, node_id: _Optional[str] = ..., workers: _Optional[int] = ...) -> None: ...

class WorkerExit(_message.Message):
    __slots__ = ("node_id", "worker_id", "pid", "exit_code", "signal")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    worker_id: str
    pid: int
    exit_code: int
    signal: int
    def __init__(self, node_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., pid: _Optional[int] = ..., exit_code: _Optional[int] = ..., signal: _Optional[int] = ...) -> None: ...

class SpawnMeshRequest(_message.Message):
    __slots__ = ("class_path", "init_args", "size", "resources", "labels", "name")
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
    class_path: str
    init_args: bytes
    size: int
    resources: Resources
    labels: _containers.ScalarMap[str, str]
    name: str
    def __init__(self, class_path: _Optional[str] = ..., init_args: _Optional[bytes] = ..., size: _Optional[int] = ..., resources: _Optional[_Union[Resources, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ..., name: _Optional[str] = ...) -> None: ...

class ActorInfo(_message.Message):
    __slots__ = ("actor_id", "mesh_id", "name", "rank", "class_path", "node_id", "worker_id", "call_address", "state", "pid", "exit_code", "signal", "endpoints")
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
    def __init__(self, actor_id: _Optional[str] = ..., mesh_id: _Optional[str] = ..., name: _Optional[str] = ..., rank: _Optional[int] = ..., class_path: _Optional[str] = ..., node_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., call_address: _Optional[str] = ..., state: _Optional[str] = ..., pid: _Optional[int] = ..., exit_code: _Optional[int] = ..., signal: _Optional[int] = ..., endpoints: _Optional[_Iterable[str]] = ...) -> None: ...

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

class StopMeshRequest(_message.Message):
    __slots__ = ("mesh_id",)
    MESH_ID_FIELD_NUMBER: _ClassVar[int]
    mesh_id: str
    def __init__(self, mesh_id: _Optional[str] = ...) -> None: ...

class GetActorRequest(_message.Message):
    __slots__ = ("actor_id", "wait_for_exit_s")
    ACTOR_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_FOR_EXIT_S_FIELD_NUMBER: _ClassVar[int]
    actor_id: str
    wait_for_exit_s: float
    def __init__(self, actor_id: _Optional[str] = ..., wait_for_exit_s: _Optional[float] = ...) -> None: ...

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

class StartWorkerRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("actor_id", "class_path", "init_args", "name", "rank", "mesh_id")
    ACTOR_ID_FIELD_NUMBER: _ClassVar[int]
    CLASS_PATH_FIELD_NUMBER: _ClassVar[int]
    INIT_ARGS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    MESH_ID_FIELD_NUMBER: _ClassVar[int]
    actor_id: str
    class_path: str
    init_args: bytes
    name: str
    rank: int
    mesh_id: str
    def __init__(self, actor_id: _Optional[str] = ..., class_path: _Optional[str] = ..., init_args: _Optional[bytes] = ..., name: _Optional[str] = ..., rank: _Optional[int] = ..., mesh_id: _Optional[str] = ...) -> None: ...

class CreateActorReply(_message.Message):
    __slots__ = ("endpoints",)
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    endpoints: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, endpoints: _Optional[_Iterable[str]] = ...) -> None: ...
