"""Argument types the `poimen` commands share: argparse turns their ArgumentTypeError into the one-line
usage error (exit 2)."""

from __future__ import annotations

import argparse
from typing import Any

from poimen.contract import parse_json


def json_object(text: str) -> dict[str, Any]:
    try:
        value = parse_json(text)
    except (ValueError, RecursionError) as error:  # RecursionError: nested too deep to parse at all
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from error
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, like '{\"key\": 1}'")
    return value


def positive_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from error
    if not 0 < seconds <= 3600:
        raise argparse.ArgumentTypeError(f"{text} is not between 0 and 3600 seconds")
    return seconds
