"""The disk tier as placement sees it (issue 42): which models an instance holds on its disk, as
its instance record says, and what a pull costs. Pure.

A runtime with a disk tier (the storage helper, docs/storage.md) keeps pulled model files
after an unload; meshd asks it for its inventory (`meshd.disk.DiskTier/diskInventory`) and
publishes it in its instance record under `meshdDisk` (an added key: upstream readers ignore
it). A list of ids would make a record holding thousands of models tens of KB, written every
2 s and sent to every watcher; placement only asks "are model m's files on instance i's disk"
and "what would a pull cost". So the record carries a Bloom filter of the ids
(`BITS_PER_MODEL` bits and `HASHES` hashes a model: about 1 % false positives, 1.7 bytes a
model once in base64) and the inventory's pull time per GiB. A false positive costs at worst
the pull placement thought it saved. Where a load is ready soonest, given this, is
`loading.ready_soonest`.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

from meshd.core.records import DISK_TIER
from meshd.decisions.cache import UNIT_BYTES

GIB = 1 << 30
# 10 bits and 7 hashes a model: 0.8 % false positives (k = bits x ln 2, rounded); each model
# costs 1.25 bytes, 1.7 in base64. 5,000 models on a disk: an 8.4 KB record key.
BITS_PER_MODEL = 10
HASHES = 7
MIN_BITS = 64  # an empty or small filter still has a few bytes, so its format is the same
_DIGEST_CACHE = 1 << 16  # model ids whose hashes are remembered (the simulator builds filters often)


@functools.lru_cache(maxsize=_DIGEST_CACHE)
def _hashes(model_id: str) -> tuple[int, int]:
    """Two 64-bit hashes of a model id; the filter's `HASHES` positions are h1 + i x h2
    (double hashing, Kirsch and Mitzenmacher), so one digest serves every position."""
    d = hashlib.blake2b(model_id.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    return int.from_bytes(d[:8], "little"), int.from_bytes(d[8:], "little") | 1


@dataclass(frozen=True, slots=True)
class DiskSet:
    """The models an instance holds on disk, as a Bloom filter (`model_id in disk`), and what a
    pull costs there (`pull_ms_per_gib`; 0: not measured, or every pull was free)."""

    bits: bytes
    count: int
    pull_ms_per_gib: float = 0.0
    hashes: int = HASHES

    @classmethod
    def of(cls, model_ids: Iterable[str], pull_ms_per_gib: float = 0.0) -> DiskSet:
        ids = list(model_ids)
        nbits = max(MIN_BITS, len(ids) * BITS_PER_MODEL)
        nbits = -(-nbits // 8) * 8  # whole bytes
        bits = bytearray(nbits // 8)
        for mid in ids:
            h1, h2 = _hashes(mid)
            for i in range(HASHES):
                pos = (h1 + i * h2) % nbits
                bits[pos >> 3] |= 1 << (pos & 7)
        return cls(bytes(bits), len(ids), pull_ms_per_gib)

    def __contains__(self, model_id: object) -> bool:
        if not isinstance(model_id, str) or not self.count:
            return False
        bits = self.bits
        nbits = len(bits) * 8
        h1, h2 = _hashes(model_id)
        for i in range(self.hashes):
            pos = (h1 + i * h2) % nbits
            if not bits[pos >> 3] >> (pos & 7) & 1:
                return False
        return True

    def encode(self) -> dict[str, Any]:
        """The record's `meshdDisk` value."""
        return {
            "models": self.count,
            "hashes": self.hashes,
            "bloom": base64.b64encode(self.bits).decode("ascii"),
            "pullMsPerGiB": round(self.pull_ms_per_gib),
        }


def disk_value(models: Iterable[tuple[str, int, int]]) -> dict[str, Any]:
    """The record's `meshdDisk` value for an inventory of `(model id, size bytes, pull ms)`:
    the ids' filter and the pull time per GiB over the models whose pull took time (a link to a
    PVC takes none, and would make every pull look free)."""
    ids: list[str] = []
    nbytes = ms = 0
    for model_id, size, pull_ms in models:
        ids.append(model_id)
        if pull_ms > 0 and size > 0:
            nbytes += size
            ms += pull_ms
    rate = ms * GIB / nbytes if nbytes else 0.0
    return DiskSet.of(ids, rate).encode()


def disk_reading(extra: Mapping[str, Any]) -> DiskSet | None:
    """An instance record's disk tier; None when it has none (no key: a runtime without a disk
    tier, or an older meshd) or the value is malformed (placement then does without it)."""
    raw = extra.get(DISK_TIER)
    if not isinstance(raw, dict):
        return None
    bloom, count, hashes, rate = (
        raw.get("bloom"),
        _whole(raw.get("models")),
        _whole(raw.get("hashes")),
        raw.get("pullMsPerGiB"),
    )
    if not isinstance(bloom, str) or count is None or hashes is None or not _number(rate):
        return None
    return _decoded(bloom, count, hashes, float(rate))


@functools.lru_cache(maxsize=256)
def _decoded(bloom: str, count: int, hashes: int, rate: float) -> DiskSet | None:
    """Decoded once per distinct value: every view of the fleet is rebuilt when any record changes."""
    try:
        bits = base64.b64decode(bloom, validate=True)
    except (binascii.Error, ValueError):
        return None
    if (count and not bits) or not 1 <= hashes <= 64:
        return None
    return DiskSet(bits, count, rate, hashes)


def _whole(value: object) -> int | None:
    """A count (a JSON integer, not a bool, not negative), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def pull_estimate_ms(disks: Iterable[DiskSet | None], size_units: int) -> float | None:
    """What pulling a model of `size_units` is expected to take: at the median of the rates the
    instances measured (None: none measured one, so placement does not weigh disks)."""
    rates = sorted(d.pull_ms_per_gib for d in disks if d is not None and d.pull_ms_per_gib > 0)
    if not rates:
        return None
    return rates[len(rates) // 2] * size_units * UNIT_BYTES / GIB
