from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DiskInventoryRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DiskModel(_message.Message):
    __slots__ = ("model_id", "size_bytes", "pull_ms", "last_used_ms")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PULL_MS_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_MS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    size_bytes: int
    pull_ms: int
    last_used_ms: int
    def __init__(self, model_id: _Optional[str] = ..., size_bytes: _Optional[int] = ..., pull_ms: _Optional[int] = ..., last_used_ms: _Optional[int] = ...) -> None: ...

class Pull(_message.Message):
    __slots__ = ("model_id", "bytes_done", "bytes_total", "elapsed_ms", "idle_ms")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_MS_FIELD_NUMBER: _ClassVar[int]
    IDLE_MS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    bytes_done: int
    bytes_total: int
    elapsed_ms: int
    idle_ms: int
    def __init__(self, model_id: _Optional[str] = ..., bytes_done: _Optional[int] = ..., bytes_total: _Optional[int] = ..., elapsed_ms: _Optional[int] = ..., idle_ms: _Optional[int] = ...) -> None: ...

class DiskInventoryResponse(_message.Message):
    __slots__ = ("models", "budget_bytes", "used_bytes", "version", "pulls")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PULLS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[DiskModel]
    budget_bytes: int
    used_bytes: int
    version: int
    pulls: _containers.RepeatedCompositeFieldContainer[Pull]
    def __init__(self, models: _Optional[_Iterable[_Union[DiskModel, _Mapping]]] = ..., budget_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., version: _Optional[int] = ..., pulls: _Optional[_Iterable[_Union[Pull, _Mapping]]] = ...) -> None: ...
