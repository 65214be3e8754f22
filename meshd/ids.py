"""Validation of model and vmodel ids and of ModelInfo (pure)."""

from __future__ import annotations

from dataclasses import dataclass

from meshd.errors import InvalidArgument

# Ids become etcd keys and gRPC header values; bound them so a bogus id is refused
# clearly instead of failing deep in etcd (whose default request limit is 1.5 MiB).
MAX_ID_BYTES = 1024


def check_id(value: str, what: str = "model id") -> str:
    if not value:
        raise InvalidArgument(f"{what} must not be empty")
    encoded = value.encode("utf-8", "surrogatepass")
    if len(encoded) > MAX_ID_BYTES:
        raise InvalidArgument(f"{what} is {len(encoded)} bytes long; the limit is {MAX_ID_BYTES}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgument(f"{what} is not valid UTF-8") from None
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise InvalidArgument(f"{what} must not contain control characters")
    return value


def decode_id(raw: bytes, what: str = "model id") -> str:
    try:
        return check_id(raw.decode("utf-8"), what)
    except UnicodeDecodeError:
        raise InvalidArgument(f"{what} is not valid UTF-8") from None


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """Opaque to meshd: passed as is to the runtime's loadModel."""

    type: str
    path: str = ""
    key: str = ""

    def check(self) -> ModelInfo:
        if not self.type:
            raise InvalidArgument("modelInfo.type must not be empty")
        return self
