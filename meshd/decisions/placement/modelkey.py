"""meshd's per-model policy, read from the `"meshd"` object inside ModelInfo.key.

Owns the one place meshd reads its own settings out of a model's key string (upstream's
opaque `encKey`, which modelmesh-serving fills with JSON such as
`{"model_type": {...}, "disk_size_bytes": 10, "storage_key": ...}`). meshd adds::

    {"meshd": {"min_copies": 2, "max_copies": 3, "size_bytes": 123456}}

Every field is optional. `min_copies` >= 0 (default 1), `max_copies` >= 0 (default 0: one
per instance) and not below `min_copies` when set, `size_bytes` > 0 (the model's memory
size, used to place and admit it before the runtime reports one). Anything else in the key
is left alone and ignored; a key that is not a JSON object, or has no `"meshd"`, gives the
default policy. A `"meshd"` value that is malformed (not an object, an unknown field, a
wrong type, a negative count, min above max) raises ValueError naming the problem, which
registerModel answers as INVALID_ARGUMENT.

Size precedence: `meshd.size_bytes` (declared by the user) > upstream's top-level
`disk_size_bytes` (a hint the runtime adapters use) > none. `disk_size_bytes` is not
meshd's field, so an unusable value there (not a positive integer) is ignored, not an error.
"""

from __future__ import annotations

import json
from typing import Any

from meshd.core.model_types import key_object
from meshd.decisions.placement.scaling import DEFAULT_POLICY, ModelPolicy

__all__ = ["key_object", "policy_from_key"]

MESHD_KEY = "meshd"
DISK_SIZE_KEY = "disk_size_bytes"  # written by modelmesh-serving's controller
FIELDS = ("min_copies", "max_copies", "size_bytes", "base_model")  # base_model: a LoRA adapter's (core.model_types)


def _count(raw: Any, name: str) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise ValueError(f'"meshd".{name} must be a whole number, got {json.dumps(raw)[:60]}')
    return raw


def policy_from_key(key: str) -> ModelPolicy:
    """The model's policy from its key string (defaults when the key carries none)."""
    obj = key_object(key)
    if obj is None:
        return DEFAULT_POLICY
    disk = obj.get(DISK_SIZE_KEY)
    disk_size = disk if isinstance(disk, int) and not isinstance(disk, bool) and disk > 0 else None
    if MESHD_KEY not in obj:
        return ModelPolicy(disk_size_bytes=disk_size)
    raw = obj[MESHD_KEY]
    if not isinstance(raw, dict):
        raise ValueError(f'"meshd" in the model key must be an object, got {type(raw).__name__}')
    unknown = sorted(set(raw) - set(FIELDS))
    if unknown:
        raise ValueError(f'unknown field(s) in "meshd": {", ".join(unknown)} (known: {", ".join(FIELDS)})')
    min_copies = _count(raw.get("min_copies", DEFAULT_POLICY.min_copies), "min_copies")
    max_copies = _count(raw.get("max_copies", DEFAULT_POLICY.max_copies), "max_copies")
    size = raw.get("size_bytes")
    size_bytes = None if size is None else _count(size, "size_bytes")
    if min_copies < 0:
        raise ValueError(f'"meshd".min_copies must be >= 0, got {min_copies}')
    if max_copies < 0:
        raise ValueError(f'"meshd".max_copies must be >= 0 (0 = one per instance), got {max_copies}')
    if max_copies and min_copies > max_copies:
        raise ValueError(f'"meshd".min_copies ({min_copies}) exceeds max_copies ({max_copies})')
    base = raw.get("base_model")
    if base is not None and (not isinstance(base, str) or not base):
        raise ValueError(f'"meshd".base_model must be a model id, got {json.dumps(base)[:60]}')
    if size_bytes is not None and size_bytes <= 0:
        raise ValueError(f'"meshd".size_bytes must be > 0, got {size_bytes}')
    return ModelPolicy(min_copies, max_copies, size_bytes, disk_size)


def at_max_copies(key: str, holders: int) -> bool:
    """Whether `holders` copies already use all the copies the key's policy allows (a key
    that does not parse caps nothing: registration refused it)."""
    try:
        cap = policy_from_key(key).max_copies
    except ValueError:
        return False
    return 0 < cap <= holders
