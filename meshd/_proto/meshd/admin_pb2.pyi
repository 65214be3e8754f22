from meshd._proto.mmesh import model_mesh_pb2 as _model_mesh_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListModelsRequest(_message.Message):
    __slots__ = ("modelIds",)
    MODELIDS_FIELD_NUMBER: _ClassVar[int]
    modelIds: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, modelIds: _Optional[_Iterable[str]] = ...) -> None: ...

class ModelCopy(_message.Message):
    __slots__ = ("instanceId", "state", "sinceMs", "sizeBytes", "lastUsedMs", "error")
    INSTANCEID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SINCEMS_FIELD_NUMBER: _ClassVar[int]
    SIZEBYTES_FIELD_NUMBER: _ClassVar[int]
    LASTUSEDMS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    instanceId: str
    state: _model_mesh_pb2.ModelStatusInfo.ModelStatus
    sinceMs: int
    sizeBytes: int
    lastUsedMs: int
    error: str
    def __init__(self, instanceId: _Optional[str] = ..., state: _Optional[_Union[_model_mesh_pb2.ModelStatusInfo.ModelStatus, str]] = ..., sinceMs: _Optional[int] = ..., sizeBytes: _Optional[int] = ..., lastUsedMs: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class ModelSummary(_message.Message):
    __slots__ = ("modelId", "type", "path", "status", "copies", "sizeBytes", "lastUsedMs", "refs", "autoDelete", "errors")
    MODELID_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    SIZEBYTES_FIELD_NUMBER: _ClassVar[int]
    LASTUSEDMS_FIELD_NUMBER: _ClassVar[int]
    REFS_FIELD_NUMBER: _ClassVar[int]
    AUTODELETE_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    modelId: str
    type: str
    path: str
    status: _model_mesh_pb2.ModelStatusInfo.ModelStatus
    copies: _containers.RepeatedCompositeFieldContainer[ModelCopy]
    sizeBytes: int
    lastUsedMs: int
    refs: int
    autoDelete: bool
    errors: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, modelId: _Optional[str] = ..., type: _Optional[str] = ..., path: _Optional[str] = ..., status: _Optional[_Union[_model_mesh_pb2.ModelStatusInfo.ModelStatus, str]] = ..., copies: _Optional[_Iterable[_Union[ModelCopy, _Mapping]]] = ..., sizeBytes: _Optional[int] = ..., lastUsedMs: _Optional[int] = ..., refs: _Optional[int] = ..., autoDelete: bool = ..., errors: _Optional[_Iterable[str]] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models", "nowMs", "unreachable")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    NOWMS_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelSummary]
    nowMs: int
    unreachable: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelSummary, _Mapping]]] = ..., nowMs: _Optional[int] = ..., unreachable: _Optional[_Iterable[str]] = ...) -> None: ...

class ListInstancesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InstanceSummary(_message.Message):
    __slots__ = ("instanceId", "location", "zone", "labels", "capacityBytes", "usedBytes", "modelCount", "rpm", "lruTimeMs", "shutdown", "startTimeMs", "version", "loadingThreads", "loadingInProgress", "leader", "runtimeDown", "upstream")
    INSTANCEID_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    ZONE_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    CAPACITYBYTES_FIELD_NUMBER: _ClassVar[int]
    USEDBYTES_FIELD_NUMBER: _ClassVar[int]
    MODELCOUNT_FIELD_NUMBER: _ClassVar[int]
    RPM_FIELD_NUMBER: _ClassVar[int]
    LRUTIMEMS_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    STARTTIMEMS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LOADINGTHREADS_FIELD_NUMBER: _ClassVar[int]
    LOADINGINPROGRESS_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    RUNTIMEDOWN_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_FIELD_NUMBER: _ClassVar[int]
    instanceId: str
    location: str
    zone: str
    labels: _containers.RepeatedScalarFieldContainer[str]
    capacityBytes: int
    usedBytes: int
    modelCount: int
    rpm: int
    lruTimeMs: int
    shutdown: bool
    startTimeMs: int
    version: int
    loadingThreads: int
    loadingInProgress: int
    leader: bool
    runtimeDown: bool
    upstream: bool
    def __init__(self, instanceId: _Optional[str] = ..., location: _Optional[str] = ..., zone: _Optional[str] = ..., labels: _Optional[_Iterable[str]] = ..., capacityBytes: _Optional[int] = ..., usedBytes: _Optional[int] = ..., modelCount: _Optional[int] = ..., rpm: _Optional[int] = ..., lruTimeMs: _Optional[int] = ..., shutdown: bool = ..., startTimeMs: _Optional[int] = ..., version: _Optional[int] = ..., loadingThreads: _Optional[int] = ..., loadingInProgress: _Optional[int] = ..., leader: bool = ..., runtimeDown: bool = ..., upstream: bool = ...) -> None: ...

class ListInstancesResponse(_message.Message):
    __slots__ = ("instances", "nowMs")
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    NOWMS_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[InstanceSummary]
    nowMs: int
    def __init__(self, instances: _Optional[_Iterable[_Union[InstanceSummary, _Mapping]]] = ..., nowMs: _Optional[int] = ...) -> None: ...
