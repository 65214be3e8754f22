from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class HttpCall(_message.Message):
    __slots__ = ("model_id", "path", "body", "body_names_model", "where")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    BODY_NAMES_MODEL_FIELD_NUMBER: _ClassVar[int]
    WHERE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    path: str
    body: bytes
    body_names_model: bool
    where: bool
    def __init__(self, model_id: _Optional[str] = ..., path: _Optional[str] = ..., body: _Optional[bytes] = ..., body_names_model: bool = ..., where: bool = ...) -> None: ...

class HttpChunk(_message.Message):
    __slots__ = ("status", "content_type", "data", "engine_url")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CONTENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    ENGINE_URL_FIELD_NUMBER: _ClassVar[int]
    status: int
    content_type: str
    data: bytes
    engine_url: str
    def __init__(self, status: _Optional[int] = ..., content_type: _Optional[str] = ..., data: _Optional[bytes] = ..., engine_url: _Optional[str] = ...) -> None: ...
