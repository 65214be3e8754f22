"""Upstream's run-time settings under `<key prefix>/config/`: what each stored value means.

ModelMesh (its `DynamicConfig` on `<kv prefix>/<service>/config`) follows three keys there, so
operators change them for the whole fleet without a restart:

- `logger_level`: a log4j level name (OFF, FATAL, ERROR, WARN, INFO, DEBUG, TRACE, ALL; any
  case). meshd also takes Python's WARNING and CRITICAL. It sets the level of meshd's loggers.
- `log_each_invocation`: `true` or `false` (any case): one INFO record per inference call, as
  MM_LOG_EACH_INVOKE.
- `scaleup_rpm_threshold`: an integer of at least 10, the per-copy requests/min above which
  copies are added, as MM_SCALEUP_RPM_THRESHOLD.

A key that is absent means the value meshd was started with (its environment or flags). So does
an invalid value, which is reported (`Rejected`): upstream falls back to its default on an
invalid level or threshold too, so every instance, whenever it started, reads the same stored
value the same way. Where meshd is stricter than upstream: upstream reads any
`log_each_invocation` other than `true` as false, and meshd reports it instead (as it refuses
such a MM_LOG_EACH_INVOKE); upstream's `send_destination_id` and `disable` keys are reported as
not followed rather than ignored in silence.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass

# ModelMesh tasConfigPath: ZKPaths.makePath(KV_STORE_PREFIX, slotName, "config"), beside
# registry/, vmodels/, instances/ and leaderLatch/ under `Config.key_prefix`.
CONFIG_DIR = "config/"
# ModelMesh LOGGER_LEVEL_PARAM, LOG_EACH_INVOCATION, SCALEUP_RPM_PARAM (keys under CONFIG_DIR).
LOGGER_LEVEL = "logger_level"
LOG_EACH_INVOCATION = "log_each_invocation"
SCALEUP_RPM_THRESHOLD = "scaleup_rpm_threshold"
FOLLOWED = (LOGGER_LEVEL, LOG_EACH_INVOCATION, SCALEUP_RPM_THRESHOLD)
# ModelMesh SEND_DEST_ID_PARAM and DISABLE_SLOT_PARAM: upstream's other keys there, not followed.
NOT_FOLLOWED = ("send_destination_id", "disable")
# ModelMesh's scaleup_rpm_threshold listener: a stored value below 10 rpm is invalid.
MIN_SCALEUP_RPM = 10
MAX_INT32 = 2**31 - 1  # the threshold is a Java int upstream
_INTEGER = re.compile(r"[+-]?[0-9]+")

# log4j level names (upstream's Level.valueOf) and Python's own, as Python levels. TRACE is
# below DEBUG (meshd logs nothing finer than DEBUG); ALL is the lowest level that is not
# NOTSET (NOTSET would mean "inherit"); OFF is above CRITICAL, so nothing is logged.
LOG_LEVELS: Mapping[str, int] = {
    "OFF": logging.CRITICAL + 10,
    "FATAL": logging.CRITICAL,
    "CRITICAL": logging.CRITICAL,
    "ERROR": logging.ERROR,
    "WARN": logging.WARNING,
    "WARNING": logging.WARNING,
    "INFO": logging.INFO,
    "DEBUG": logging.DEBUG,
    "TRACE": 5,
    "ALL": 1,
}


@dataclass(frozen=True, slots=True)
class Settings:
    """What the three keys control. `log_level` None: the level meshd was started with."""

    log_level: int | None
    log_each_invoke: bool
    scaleup_rpm_threshold: int


@dataclass(frozen=True, slots=True)
class Rejected:
    """A stored value that changes nothing (the setting keeps its configured value)."""

    key: str
    value: str
    why: str

    def message(self) -> str:
        return f"{CONFIG_DIR}{self.key} value {self.value!r} ignored: {self.why}"


def parse_log_level(text: str) -> int:
    """A level name (see LOG_LEVELS) as a Python level; ValueError otherwise."""
    level = LOG_LEVELS.get(text.strip().upper())
    if level is None:
        raise ValueError(f"not a log level (one of {', '.join(LOG_LEVELS)})")
    return level


def parse_log_each(text: str) -> bool:
    value = text.strip().lower()
    if value not in ("true", "false"):
        raise ValueError("must be true or false")
    return value == "true"


def parse_scaleup_rpm(text: str) -> int:
    """Requests/min as upstream's Integer.parseInt reads them (a 32-bit signed integer), at
    least MIN_SCALEUP_RPM; ValueError otherwise."""
    if _INTEGER.fullmatch(text.strip()) is None:
        raise ValueError("not a whole number of requests per minute")
    rpm = int(text.strip())
    if rpm < MIN_SCALEUP_RPM or rpm > MAX_INT32:
        raise ValueError(f"must be from {MIN_SCALEUP_RPM} to {MAX_INT32} requests per minute")
    return rpm


def resolve(stored: Mapping[str, str], configured: Settings) -> tuple[Settings, tuple[Rejected, ...]]:
    """The settings in force given the values under `config/` (key -> text, keys relative to
    it) and those meshd was started with, and the stored values that changed nothing."""
    rejected: list[Rejected] = []
    level = configured.log_level
    log_each = configured.log_each_invoke
    threshold = configured.scaleup_rpm_threshold
    for key, text in sorted(stored.items()):
        try:
            if key == LOGGER_LEVEL:
                level = parse_log_level(text)
            elif key == LOG_EACH_INVOCATION:
                log_each = parse_log_each(text)
            elif key == SCALEUP_RPM_THRESHOLD:
                threshold = parse_scaleup_rpm(text)
            elif key in NOT_FOLLOWED:
                rejected.append(Rejected(key, text, "an upstream setting meshd does not follow"))
        except ValueError as e:
            rejected.append(Rejected(key, text, f"{e}; the configured value stays"))
    return Settings(level, log_each, threshold), tuple(rejected)
