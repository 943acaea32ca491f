"""Optional run retention (template parameter RunRetentionDays): its one environment variable, parsed the
same way by admission, the relays and the CLI, and the rule for when a run has expired.

Standard library only, so the inbox relay and poimen_tools may import it without the store's dependencies.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

RUN_RETENTION_ENV = "RUN_RETENTION_DAYS"
# The template's AllowedPattern for RunRetentionDays: empty (keep runs forever) or 1 to 3650 days.
MAX_RUN_RETENTION_DAYS = 3650
SECONDS_PER_DAY = 86_400
_DAYS = re.compile(r"[0-9]{1,4}")


class InvalidRetention(ValueError):
    """The value is neither empty nor a whole number of days from 1 to MAX_RUN_RETENTION_DAYS."""


def parse_run_retention_days(value: str) -> int | None:
    """None (keep runs forever) for empty or blank text; else the number of days, 1 to 3650."""
    text = value.strip()
    if not text:
        return None
    if not _DAYS.fullmatch(text) or not 1 <= int(text) <= MAX_RUN_RETENTION_DAYS:
        raise InvalidRetention(
            f"{RUN_RETENTION_ENV} must be empty (keep runs forever) or a whole number of days "
            f"from 1 to {MAX_RUN_RETENTION_DAYS}, got {value!r}"
        )
    return int(text)


def run_retention_days(env: Mapping[str, str]) -> int | None:
    """RUN_RETENTION_DAYS of `env`: None when absent or empty (keep runs forever)."""
    return parse_run_retention_days(env.get(RUN_RETENTION_ENV, ""))


def expires_at(created_at_ms: float, days: int) -> int:
    """The TTL attribute of an item created at `created_at_ms`: epoch seconds, `days` later (rounded up, so an
    item never expires before its full retention)."""
    return math.ceil(created_at_ms / 1000) + days * SECONDS_PER_DAY


def expired(created_at_ms: float, now_ms: float, days: int | None) -> bool:
    """Whether something created at `created_at_ms` is past a retention of `days` at `now_ms`; never without
    retention."""
    return days is not None and now_ms > created_at_ms + days * SECONDS_PER_DAY * 1000
