"""argparse value types shared by the command lines (`hetnode ...` and `hetnode sim`)."""

from __future__ import annotations

import argparse


def positive(value: str) -> float:
    """A number > 0, or argparse's error naming the value."""
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if not x > 0:
        raise argparse.ArgumentTypeError(f"must be positive: {value!r}")
    return x


def non_negative(value: str) -> float:
    """A number >= 0, or argparse's error naming the value."""
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if not x >= 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0: {value!r}")
    return x


def positive_int(value: str) -> int:
    """A whole number >= 1, or argparse's error naming the value."""
    try:
        x = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None
    if x < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {value!r}")
    return x


def auto_or_count(value: str) -> int | str:
    """"auto", or a whole number >= 0 (0: none), or argparse's error naming the value."""
    if value == "auto":
        return value
    try:
        x = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not 'auto' or an integer: {value!r}") from None
    if x < 0:
        raise argparse.ArgumentTypeError(f"must be 'auto' or at least 0: {value!r}")
    return x
