from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InternalOpRequest(_message.Message):
    __slots__ = ("modelId", "load", "sync", "lastUsed", "excludeInstances", "unload")
    MODELID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    LASTUSED_FIELD_NUMBER: _ClassVar[int]
    EXCLUDEINSTANCES_FIELD_NUMBER: _ClassVar[int]
    UNLOAD_FIELD_NUMBER: _ClassVar[int]
    modelId: str
    load: bool
    sync: bool
    lastUsed: int
    excludeInstances: _containers.RepeatedScalarFieldContainer[str]
    unload: bool
    def __init__(self, modelId: _Optional[str] = ..., load: bool = ..., sync: bool = ..., lastUsed: _Optional[int] = ..., excludeInstances: _Optional[_Iterable[str]] = ..., unload: bool = ...) -> None: ...

class InternalOpResponse(_message.Message):
    __slots__ = ("state", "instanceId", "message")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        NOT_HERE: _ClassVar[InternalOpResponse.State]
        LOADING: _ClassVar[InternalOpResponse.State]
        LOADED: _ClassVar[InternalOpResponse.State]
        FAILED: _ClassVar[InternalOpResponse.State]
    NOT_HERE: InternalOpResponse.State
    LOADING: InternalOpResponse.State
    LOADED: InternalOpResponse.State
    FAILED: InternalOpResponse.State
    STATE_FIELD_NUMBER: _ClassVar[int]
    INSTANCEID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    state: InternalOpResponse.State
    instanceId: str
    message: str
    def __init__(self, state: _Optional[_Union[InternalOpResponse.State, str]] = ..., instanceId: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class InstanceStatsRequest(_message.Message):
    __slots__ = ("withCopies", "modelIds")
    WITHCOPIES_FIELD_NUMBER: _ClassVar[int]
    MODELIDS_FIELD_NUMBER: _ClassVar[int]
    withCopies: bool
    modelIds: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, withCopies: bool = ..., modelIds: _Optional[_Iterable[str]] = ...) -> None: ...

class CopyStats(_message.Message):
    __slots__ = ("modelId", "state", "sizeBytes", "lastUsed", "since")
    MODELID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SIZEBYTES_FIELD_NUMBER: _ClassVar[int]
    LASTUSED_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    modelId: str
    state: InternalOpResponse.State
    sizeBytes: int
    lastUsed: int
    since: int
    def __init__(self, modelId: _Optional[str] = ..., state: _Optional[_Union[InternalOpResponse.State, str]] = ..., sizeBytes: _Optional[int] = ..., lastUsed: _Optional[int] = ..., since: _Optional[int] = ...) -> None: ...

class InstanceStatsResponse(_message.Message):
    __slots__ = ("instanceId", "requests", "hits", "misses", "loads", "loadFailures", "evictions", "capacityBytes", "usedBytes", "loadedModels", "leader", "modelsManagedTotal", "modelsLoadedTotal", "modelsWithFailureTotal", "copies", "copiesIncluded", "dataPlane", "nativeCarried")
    INSTANCEID_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    LOADFAILURES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    CAPACITYBYTES_FIELD_NUMBER: _ClassVar[int]
    USEDBYTES_FIELD_NUMBER: _ClassVar[int]
    LOADEDMODELS_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    MODELSMANAGEDTOTAL_FIELD_NUMBER: _ClassVar[int]
    MODELSLOADEDTOTAL_FIELD_NUMBER: _ClassVar[int]
    MODELSWITHFAILURETOTAL_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    COPIESINCLUDED_FIELD_NUMBER: _ClassVar[int]
    DATAPLANE_FIELD_NUMBER: _ClassVar[int]
    NATIVECARRIED_FIELD_NUMBER: _ClassVar[int]
    instanceId: str
    requests: int
    hits: int
    misses: int
    loads: int
    loadFailures: int
    evictions: int
    capacityBytes: int
    usedBytes: int
    loadedModels: _containers.RepeatedScalarFieldContainer[str]
    leader: bool
    modelsManagedTotal: int
    modelsLoadedTotal: int
    modelsWithFailureTotal: int
    copies: _containers.RepeatedCompositeFieldContainer[CopyStats]
    copiesIncluded: bool
    dataPlane: str
    nativeCarried: int
    def __init__(self, instanceId: _Optional[str] = ..., requests: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., loads: _Optional[int] = ..., loadFailures: _Optional[int] = ..., evictions: _Optional[int] = ..., capacityBytes: _Optional[int] = ..., usedBytes: _Optional[int] = ..., loadedModels: _Optional[_Iterable[str]] = ..., leader: bool = ..., modelsManagedTotal: _Optional[int] = ..., modelsLoadedTotal: _Optional[int] = ..., modelsWithFailureTotal: _Optional[int] = ..., copies: _Optional[_Iterable[_Union[CopyStats, _Mapping]]] = ..., copiesIncluded: bool = ..., dataPlane: _Optional[str] = ..., nativeCarried: _Optional[int] = ...) -> None: ...
