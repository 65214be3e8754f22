"""Validation of model and vmodel ids and of ModelInfo (pure)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from meshd.core.errors import InvalidArgument
from meshd.decisions.placement.modelkey import policy_from_key

# Ids become etcd keys and gRPC header values; bound them so a bogus id is refused
# clearly instead of failing deep in etcd (whose default request limit is 1.5 MiB).
MAX_ID_BYTES = 1024
# A record holds path and key; keep the whole ModelInfo well under etcd's request limit.
MAX_MODEL_INFO_BYTES = 1 << 20
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")  # compiled: this runs on every request


def check_id(value: str, what: str = "model id") -> str:
    if not value:
        raise InvalidArgument(f"{what} must not be empty")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidArgument(f"{what} is not valid UTF-8") from None
    if size > MAX_ID_BYTES:
        raise InvalidArgument(f"{what} is {size} bytes long; the limit is {MAX_ID_BYTES}")
    if _CONTROL.search(value):
        raise InvalidArgument(f"{what} must not contain control characters")
    return value


# An instance id is an etcd key segment (`instances/<id>`), a peer-header value and a label
# in logs and tables: one path segment of printable ASCII, no spaces.
MAX_INSTANCE_ID_CHARS = 253  # a Kubernetes pod name's limit; upstream uses the last 12 characters
_INSTANCE_ID = re.compile(r"[A-Za-z0-9._:@-]+")


def instance_id_problem(value: str) -> str | None:
    """Why `value` cannot be an instance id, or None when it can."""
    if not value:
        return "must not be empty"
    if len(value) > MAX_INSTANCE_ID_CHARS:
        return f"is {len(value)} characters long; the limit is {MAX_INSTANCE_ID_CHARS}"
    if _INSTANCE_ID.fullmatch(value) is None:
        return "may hold only letters, digits and . _ : @ - (it is an etcd key segment)"
    return None


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
        size = sum(len(x.encode("utf-8", "surrogatepass")) for x in (self.type, self.path, self.key))
        if size > MAX_MODEL_INFO_BYTES:
            raise InvalidArgument(f"modelInfo is {size} bytes; the limit is {MAX_MODEL_INFO_BYTES}")
        try:
            policy_from_key(self.key)  # meshd's own "meshd" object must be valid; the rest is opaque
        except ValueError as e:
            raise InvalidArgument(f"modelInfo.key: {e}") from None
        return self
