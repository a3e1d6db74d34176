"""argparse types of the `pegainfer` commands: each refuses a bad value as a usage error (exit status 2) that says
what was expected and what it got."""

import argparse
import json


def token_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1,2,3, got {text!r}") from None


def int_list(text: str) -> list[int]:
    """Sizes for bench: comma-separated like token ids, and each at least 1."""
    values = token_ids(text)
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def override(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def positive_int(text: str) -> int:
    return bounded_int(text, 1, None, "a positive integer")


def non_negative_int(text: str) -> int:
    return bounded_int(text, 0, None, "an integer >= 0")


def seed(text: str) -> int:
    """torch.manual_seed takes at most 64 bits."""
    return bounded_int(text, 0, 2 ** 64, "an integer in [0, 2**64)")


def bounded_int(text: str, low: int, end: int | None, expected: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < low or (end is not None and value >= end):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def port(text: str) -> int:
    return bounded_int(text, 0, 65536, "a port number in 0..65535")


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {text!r}")
    return value
