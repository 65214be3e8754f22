"""What upstream's run-time settings under `config/` mean (meshd.decisions.dynamic_config)."""

from __future__ import annotations

import logging

import pytest

from meshd.decisions.dynamic_config import (
    LOG_EACH_INVOCATION,
    LOGGER_LEVEL,
    SCALEUP_RPM_THRESHOLD,
    Rejected,
    Settings,
    parse_log_each,
    parse_log_level,
    parse_scaleup_rpm,
    resolve,
)

CONFIGURED = Settings(None, False, 2000)


@pytest.mark.parametrize(
    ("text", "level"),
    [
        ("DEBUG", logging.DEBUG),
        ("debug", logging.DEBUG),
        (" Info\n", logging.INFO),
        ("WARN", logging.WARNING),
        ("warning", logging.WARNING),
        ("ERROR", logging.ERROR),
        ("FATAL", logging.CRITICAL),
        ("critical", logging.CRITICAL),
        ("TRACE", 5),
        ("ALL", 1),
    ],
)
def test_log4j_and_python_level_names(text: str, level: int) -> None:
    assert parse_log_level(text) == level


def test_off_logs_nothing() -> None:
    assert parse_log_level("OFF") > logging.CRITICAL


@pytest.mark.parametrize("text", ["", "verbose", "10", "DEBUG2", "NOTSET"])
def test_other_levels_are_invalid(text: str) -> None:
    with pytest.raises(ValueError):
        parse_log_level(text)


def test_log_each_is_true_or_false_in_any_case() -> None:
    assert parse_log_each("true") and parse_log_each(" TRUE ") and not parse_log_each("False")
    for text in ("yes", "1", "", "on"):
        with pytest.raises(ValueError):
            parse_log_each(text)


@pytest.mark.parametrize(("text", "rpm"), [("10", 10), ("2500", 2500), (" 300\n", 300), ("+40", 40)])
def test_thresholds_from_ten_rpm(text: str, rpm: int) -> None:
    assert parse_scaleup_rpm(text) == rpm


@pytest.mark.parametrize("text", ["9", "0", "-100", "", "12.5", "1e3", "1_000", "lots", "٣٠٠", str(2**31)])
def test_thresholds_below_ten_or_not_java_ints_are_invalid(text: str) -> None:
    with pytest.raises(ValueError):
        parse_scaleup_rpm(text)


def test_nothing_stored_is_the_configured_settings() -> None:
    assert resolve({}, CONFIGURED) == (CONFIGURED, ())


def test_stored_values_replace_the_configured_ones() -> None:
    stored = {LOGGER_LEVEL: "debug", LOG_EACH_INVOCATION: "true", SCALEUP_RPM_THRESHOLD: "120"}
    assert resolve(stored, CONFIGURED) == (Settings(logging.DEBUG, True, 120), ())


def test_an_invalid_value_keeps_the_configured_one_and_is_named() -> None:
    configured = Settings(logging.WARNING, True, 500)
    stored = {LOGGER_LEVEL: "loud", LOG_EACH_INVOCATION: "yes", SCALEUP_RPM_THRESHOLD: "5"}
    settings, rejected = resolve(stored, configured)
    assert settings == configured
    assert [(r.key, r.value) for r in rejected] == [
        (LOG_EACH_INVOCATION, "yes"),
        (LOGGER_LEVEL, "loud"),
        (SCALEUP_RPM_THRESHOLD, "5"),
    ]
    assert all(f"config/{r.key}" in r.message() and repr(r.value) in r.message() for r in rejected)


def test_one_invalid_value_leaves_the_others_applied() -> None:
    settings, rejected = resolve({LOGGER_LEVEL: "info", SCALEUP_RPM_THRESHOLD: "x"}, CONFIGURED)
    assert settings == Settings(logging.INFO, False, 2000)
    assert rejected == (Rejected(SCALEUP_RPM_THRESHOLD, "x", rejected[0].why),)


def test_upstreams_other_keys_are_reported_and_unknown_ones_ignored() -> None:
    settings, rejected = resolve({"disable": "true", "send_destination_id": "true", "mine": "x"}, CONFIGURED)
    assert settings == CONFIGURED
    assert {r.key for r in rejected} == {"disable", "send_destination_id"}
