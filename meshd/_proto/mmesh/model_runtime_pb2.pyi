from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoadModelRequest(_message.Message):
    __slots__ = ("modelId", "modelType", "modelPath", "modelKey")
    MODELID_FIELD_NUMBER: _ClassVar[int]
    MODELTYPE_FIELD_NUMBER: _ClassVar[int]
    MODELPATH_FIELD_NUMBER: _ClassVar[int]
    MODELKEY_FIELD_NUMBER: _ClassVar[int]
    modelId: str
    modelType: str
    modelPath: str
    modelKey: str
    def __init__(self, modelId: _Optional[str] = ..., modelType: _Optional[str] = ..., modelPath: _Optional[str] = ..., modelKey: _Optional[str] = ...) -> None: ...

class LoadModelResponse(_message.Message):
    __slots__ = ("sizeInBytes", "maxConcurrency")
    SIZEINBYTES_FIELD_NUMBER: _ClassVar[int]
    MAXCONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    sizeInBytes: int
    maxConcurrency: int
    def __init__(self, sizeInBytes: _Optional[int] = ..., maxConcurrency: _Optional[int] = ...) -> None: ...

class UnloadModelRequest(_message.Message):
    __slots__ = ("modelId",)
    MODELID_FIELD_NUMBER: _ClassVar[int]
    modelId: str
    def __init__(self, modelId: _Optional[str] = ...) -> None: ...

class UnloadModelResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PredictModelSizeRequest(_message.Message):
    __slots__ = ("modelId", "modelType", "modelPath", "modelKey")
    MODELID_FIELD_NUMBER: _ClassVar[int]
    MODELTYPE_FIELD_NUMBER: _ClassVar[int]
    MODELPATH_FIELD_NUMBER: _ClassVar[int]
    MODELKEY_FIELD_NUMBER: _ClassVar[int]
    modelId: str
    modelType: str
    modelPath: str
    modelKey: str
    def __init__(self, modelId: _Optional[str] = ..., modelType: _Optional[str] = ..., modelPath: _Optional[str] = ..., modelKey: _Optional[str] = ...) -> None: ...

class PredictModelSizeResponse(_message.Message):
    __slots__ = ("sizeInBytes",)
    SIZEINBYTES_FIELD_NUMBER: _ClassVar[int]
    sizeInBytes: int
    def __init__(self, sizeInBytes: _Optional[int] = ...) -> None: ...

class ModelSizeRequest(_message.Message):
    __slots__ = ("modelId",)
    MODELID_FIELD_NUMBER: _ClassVar[int]
    modelId: str
    def __init__(self, modelId: _Optional[str] = ...) -> None: ...

class ModelSizeResponse(_message.Message):
    __slots__ = ("sizeInBytes",)
    SIZEINBYTES_FIELD_NUMBER: _ClassVar[int]
    sizeInBytes: int
    def __init__(self, sizeInBytes: _Optional[int] = ...) -> None: ...

class RuntimeStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RuntimeStatusResponse(_message.Message):
    __slots__ = ("status", "capacityInBytes", "maxLoadingConcurrency", "modelLoadingTimeoutMs", "defaultModelSizeInBytes", "runtimeVersion", "numericRuntimeVersion", "methodInfos", "limitModelConcurrency", "allowAnyMethod")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STARTING: _ClassVar[RuntimeStatusResponse.Status]
        READY: _ClassVar[RuntimeStatusResponse.Status]
        FAILING: _ClassVar[RuntimeStatusResponse.Status]
    STARTING: RuntimeStatusResponse.Status
    READY: RuntimeStatusResponse.Status
    FAILING: RuntimeStatusResponse.Status
    class MethodInfo(_message.Message):
        __slots__ = ("idInjectionPath",)
        IDINJECTIONPATH_FIELD_NUMBER: _ClassVar[int]
        idInjectionPath: _containers.RepeatedScalarFieldContainer[int]
        def __init__(self, idInjectionPath: _Optional[_Iterable[int]] = ...) -> None: ...
    class MethodInfosEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: RuntimeStatusResponse.MethodInfo
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[RuntimeStatusResponse.MethodInfo, _Mapping]] = ...) -> None: ...
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CAPACITYINBYTES_FIELD_NUMBER: _ClassVar[int]
    MAXLOADINGCONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    MODELLOADINGTIMEOUTMS_FIELD_NUMBER: _ClassVar[int]
    DEFAULTMODELSIZEINBYTES_FIELD_NUMBER: _ClassVar[int]
    RUNTIMEVERSION_FIELD_NUMBER: _ClassVar[int]
    NUMERICRUNTIMEVERSION_FIELD_NUMBER: _ClassVar[int]
    METHODINFOS_FIELD_NUMBER: _ClassVar[int]
    LIMITMODELCONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    ALLOWANYMETHOD_FIELD_NUMBER: _ClassVar[int]
    status: RuntimeStatusResponse.Status
    capacityInBytes: int
    maxLoadingConcurrency: int
    modelLoadingTimeoutMs: int
    defaultModelSizeInBytes: int
    runtimeVersion: str
    numericRuntimeVersion: int
    methodInfos: _containers.MessageMap[str, RuntimeStatusResponse.MethodInfo]
    limitModelConcurrency: bool
    allowAnyMethod: bool
    def __init__(self, status: _Optional[_Union[RuntimeStatusResponse.Status, str]] = ..., capacityInBytes: _Optional[int] = ..., maxLoadingConcurrency: _Optional[int] = ..., modelLoadingTimeoutMs: _Optional[int] = ..., defaultModelSizeInBytes: _Optional[int] = ..., runtimeVersion: _Optional[str] = ..., numericRuntimeVersion: _Optional[int] = ..., methodInfos: _Optional[_Mapping[str, RuntimeStatusResponse.MethodInfo]] = ..., limitModelConcurrency: bool = ..., allowAnyMethod: bool = ...) -> None: ...
