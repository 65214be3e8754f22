from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModelInfo(_message.Message):
    __slots__ = ("type", "path", "key")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    type: str
    path: str
    key: str
    def __init__(self, type: _Optional[str] = ..., path: _Optional[str] = ..., key: _Optional[str] = ...) -> None: ...

class RegisterModelRequest(_message.Message):
    __slots__ = ("modelId", "modelInfo", "loadNow", "sync", "lastUsedTime")
    MODELID_FIELD_NUMBER: _ClassVar[int]
    MODELINFO_FIELD_NUMBER: _ClassVar[int]
    LOADNOW_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    LASTUSEDTIME_FIELD_NUMBER: _ClassVar[int]
    modelId: str
    modelInfo: ModelInfo
    loadNow: bool
    sync: bool
    lastUsedTime: int
    def __init__(self, modelId: _Optional[str] = ..., modelInfo: _Optional[_Union[ModelInfo, _Mapping]] = ..., loadNow: bool = ..., sync: bool = ..., lastUsedTime: _Optional[int] = ...) -> None: ...

class UnregisterModelRequest(_message.Message):
    __slots__ = ("modelId",)
    MODELID_FIELD_NUMBER: _ClassVar[int]
    modelId: str
    def __init__(self, modelId: _Optional[str] = ...) -> None: ...

class UnregisterModelResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ("modelId",)
    MODELID_FIELD_NUMBER: _ClassVar[int]
    modelId: str
    def __init__(self, modelId: _Optional[str] = ...) -> None: ...

class EnsureLoadedRequest(_message.Message):
    __slots__ = ("modelId", "lastUsedTime", "sync")
    MODELID_FIELD_NUMBER: _ClassVar[int]
    LASTUSEDTIME_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    modelId: str
    lastUsedTime: int
    sync: bool
    def __init__(self, modelId: _Optional[str] = ..., lastUsedTime: _Optional[int] = ..., sync: bool = ...) -> None: ...

class ModelStatusInfo(_message.Message):
    __slots__ = ("status", "errors", "modelCopyInfos")
    class ModelStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        NOT_FOUND: _ClassVar[ModelStatusInfo.ModelStatus]
        NOT_LOADED: _ClassVar[ModelStatusInfo.ModelStatus]
        LOADING: _ClassVar[ModelStatusInfo.ModelStatus]
        LOADED: _ClassVar[ModelStatusInfo.ModelStatus]
        LOADING_FAILED: _ClassVar[ModelStatusInfo.ModelStatus]
        UNKNOWN: _ClassVar[ModelStatusInfo.ModelStatus]
    NOT_FOUND: ModelStatusInfo.ModelStatus
    NOT_LOADED: ModelStatusInfo.ModelStatus
    LOADING: ModelStatusInfo.ModelStatus
    LOADED: ModelStatusInfo.ModelStatus
    LOADING_FAILED: ModelStatusInfo.ModelStatus
    UNKNOWN: ModelStatusInfo.ModelStatus
    class ModelCopyInfo(_message.Message):
        __slots__ = ("location", "copyStatus", "time")
        LOCATION_FIELD_NUMBER: _ClassVar[int]
        COPYSTATUS_FIELD_NUMBER: _ClassVar[int]
        TIME_FIELD_NUMBER: _ClassVar[int]
        location: str
        copyStatus: ModelStatusInfo.ModelStatus
        time: int
        def __init__(self, location: _Optional[str] = ..., copyStatus: _Optional[_Union[ModelStatusInfo.ModelStatus, str]] = ..., time: _Optional[int] = ...) -> None: ...
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    MODELCOPYINFOS_FIELD_NUMBER: _ClassVar[int]
    status: ModelStatusInfo.ModelStatus
    errors: _containers.RepeatedScalarFieldContainer[str]
    modelCopyInfos: _containers.RepeatedCompositeFieldContainer[ModelStatusInfo.ModelCopyInfo]
    def __init__(self, status: _Optional[_Union[ModelStatusInfo.ModelStatus, str]] = ..., errors: _Optional[_Iterable[str]] = ..., modelCopyInfos: _Optional[_Iterable[_Union[ModelStatusInfo.ModelCopyInfo, _Mapping]]] = ...) -> None: ...

class SetVModelRequest(_message.Message):
    __slots__ = ("vModelId", "targetModelId", "updateOnly", "modelInfo", "autoDeleteTargetModel", "loadNow", "force", "sync", "expectedTargetModelId", "owner")
    VMODELID_FIELD_NUMBER: _ClassVar[int]
    TARGETMODELID_FIELD_NUMBER: _ClassVar[int]
    UPDATEONLY_FIELD_NUMBER: _ClassVar[int]
    MODELINFO_FIELD_NUMBER: _ClassVar[int]
    AUTODELETETARGETMODEL_FIELD_NUMBER: _ClassVar[int]
    LOADNOW_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    EXPECTEDTARGETMODELID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    vModelId: str
    targetModelId: str
    updateOnly: bool
    modelInfo: ModelInfo
    autoDeleteTargetModel: bool
    loadNow: bool
    force: bool
    sync: bool
    expectedTargetModelId: str
    owner: str
    def __init__(self, vModelId: _Optional[str] = ..., targetModelId: _Optional[str] = ..., updateOnly: bool = ..., modelInfo: _Optional[_Union[ModelInfo, _Mapping]] = ..., autoDeleteTargetModel: bool = ..., loadNow: bool = ..., force: bool = ..., sync: bool = ..., expectedTargetModelId: _Optional[str] = ..., owner: _Optional[str] = ...) -> None: ...

class DeleteVModelRequest(_message.Message):
    __slots__ = ("vModelId", "owner")
    VMODELID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    vModelId: str
    owner: str
    def __init__(self, vModelId: _Optional[str] = ..., owner: _Optional[str] = ...) -> None: ...

class DeleteVModelResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetVModelStatusRequest(_message.Message):
    __slots__ = ("vModelId", "owner")
    VMODELID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    vModelId: str
    owner: str
    def __init__(self, vModelId: _Optional[str] = ..., owner: _Optional[str] = ...) -> None: ...

class VModelStatusInfo(_message.Message):
    __slots__ = ("status", "activeModelId", "targetModelId", "activeModelStatus", "targetModelStatus", "owner")
    class VModelStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        NOT_FOUND: _ClassVar[VModelStatusInfo.VModelStatus]
        DEFINED: _ClassVar[VModelStatusInfo.VModelStatus]
        TRANSITIONING: _ClassVar[VModelStatusInfo.VModelStatus]
        TRANSITION_FAILED: _ClassVar[VModelStatusInfo.VModelStatus]
        UNKNOWN: _ClassVar[VModelStatusInfo.VModelStatus]
    NOT_FOUND: VModelStatusInfo.VModelStatus
    DEFINED: VModelStatusInfo.VModelStatus
    TRANSITIONING: VModelStatusInfo.VModelStatus
    TRANSITION_FAILED: VModelStatusInfo.VModelStatus
    UNKNOWN: VModelStatusInfo.VModelStatus
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ACTIVEMODELID_FIELD_NUMBER: _ClassVar[int]
    TARGETMODELID_FIELD_NUMBER: _ClassVar[int]
    ACTIVEMODELSTATUS_FIELD_NUMBER: _ClassVar[int]
    TARGETMODELSTATUS_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    status: VModelStatusInfo.VModelStatus
    activeModelId: str
    targetModelId: str
    activeModelStatus: ModelStatusInfo
    targetModelStatus: ModelStatusInfo
    owner: str
    def __init__(self, status: _Optional[_Union[VModelStatusInfo.VModelStatus, str]] = ..., activeModelId: _Optional[str] = ..., targetModelId: _Optional[str] = ..., activeModelStatus: _Optional[_Union[ModelStatusInfo, _Mapping]] = ..., targetModelStatus: _Optional[_Union[ModelStatusInfo, _Mapping]] = ..., owner: _Optional[str] = ...) -> None: ...
