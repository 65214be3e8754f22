"""Argument types for the simulator's command line and the simulator benches (`bench/sim_*.py`,
`bench/hot_tail_bound.py`): each turns a bad value into argparse's usage error (exit 2), never
a traceback from deep inside a run."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def shares(text: str) -> list[float]:
    """Comma-separated shares of the catalogue, each in (0, 1]."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(not 0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"capacities are shares of the catalogue in (0, 1], got {text!r}")
    return values


def positive_floats(text: str) -> list[float]:
    values = [positive_float(x) for x in text.split(",") if x.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")
    return values


def int_from(low: int | None) -> Callable[[str], int]:
    """A whole number, at least `low` (None: any)."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if low is not None and n < low:
            bound = "0 or more" if low == 0 else f"at least {low}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {n}")
        return n

    return parse


positive_int = int_from(1)
non_negative_int = int_from(0)
whole = int_from(None)


def positive_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < x < math.inf:  # NaN and infinity too: a rate or a speed must be a number
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return x


def bounded(low: float, high: float, flag: str, include_low: bool = False) -> Callable[[str], float]:
    """A number in (low, high] (or [low, high]): beyond, sizes or popularity overflow into nonsense."""

    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (math.isfinite(x) and (low <= x if include_low else low < x) and x <= high):
            opening = "[" if include_low else "("
            raise argparse.ArgumentTypeError(f"{flag} must be in {opening}{low:g}, {high:g}], got {text!r}")
        return x

    return parse


def non_negative_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= x < float("inf"):
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text!r}")
    return x


def non_negative_floats(text: str) -> list[float]:
    values = [non_negative_float(x) for x in text.split(",") if x.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")
    return values
