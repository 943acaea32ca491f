"""Optional run retention (template parameter RunRetentionDays): its environment variables, parsed the same
way by admission, the relays and the CLI; the rule for when a run has expired; and what a change of the
retention leaves behind (RunRetention): runs admitted under a shorter retention expire by it, whatever the
retention is now.

Standard library only, so the inbox relay and poimen_tools may import it without the store's dependencies.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

from poimen.wire import rfc3339

RUN_RETENTION_ENV = "RUN_RETENTION_DAYS"
# The last change of RunRetentionDays, as `make deploy` records it (template PreviousRunRetentionDays and
# RunRetentionChangedAt): the retention before it (empty: forever), and when it took effect (RFC 3339, UTC).
PREVIOUS_RUN_RETENTION_ENV = "PREVIOUS_RUN_RETENTION_DAYS"
RUN_RETENTION_CHANGED_ENV = "RUN_RETENTION_CHANGED_AT"
# The template's AllowedPattern for RunRetentionChangedAt, without its empty alternative.
CHANGED_AT_PATTERN = r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,3})?Z$"
# The template's AllowedPattern for RunRetentionDays: empty (keep runs forever) or 1 to 3650 days.
MAX_RUN_RETENTION_DAYS = 3650
SECONDS_PER_DAY = 86_400
_DAYS = re.compile(r"[0-9]{1,4}")
_CHANGED_AT = re.compile(CHANGED_AT_PATTERN)


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


def parse_changed_at(value: str) -> int | None:
    """An RFC 3339 UTC time (`2026-11-29T12:00:00.000Z`) in epoch milliseconds; None for empty text."""
    text = value.strip()
    if not text:
        return None
    if not _CHANGED_AT.fullmatch(text):
        raise InvalidRetention(
            f"{RUN_RETENTION_CHANGED_ENV} must be an RFC 3339 UTC time like 2026-11-29T12:00:00Z, got {value!r}"
        )
    try:
        return int(datetime.fromisoformat(text).timestamp() * 1000)
    except ValueError as error:
        raise InvalidRetention(f"{RUN_RETENTION_CHANGED_ENV}: {error}") from error


@dataclass(frozen=True)
class RunRetention:
    """The run retention a record is held to: `days` (None: runs are kept forever), and, once RunRetentionDays
    has changed, for a record from before the change (`changed_at_ms`) the shorter of `days` and the
    retention before it (`previous_days`, None: forever). Each run's expiry is fixed when it is written, so
    a run admitted under a shorter retention expires by it: after a raise from 1 to 7 days, a record 2 days
    old from before the raise may have lost its run, and is held to 1 day."""

    days: int | None = None
    previous_days: int | None = None
    changed_at_ms: int | None = None  # None: no change recorded (`previous_days` unused)

    def days_for(self, created_at_ms: float) -> int | None:
        """The retention that holds something created at `created_at_ms`."""
        if self.changed_at_ms is None or created_at_ms >= self.changed_at_ms:
            return self.days
        return shortest(self.days, self.previous_days)

    def expired(self, created_at_ms: float, now_ms: float) -> bool:
        return expired(created_at_ms, now_ms, self.days_for(created_at_ms))

    @property
    def changed_at(self) -> str | None:
        """When the change took effect, as RUN_RETENTION_CHANGED_AT writes it."""
        if self.changed_at_ms is None:
            return None
        return rfc3339(datetime.fromtimestamp(self.changed_at_ms / 1000, UTC))

    def describe(self, created_at_ms: float) -> str:
        """`the run retention of 3 days`, and, for a record older than a change, which one holds it."""
        days = self.days_for(created_at_ms)
        text = "no run retention" if days is None else f"the run retention of {days} day{'s' if days != 1 else ''}"
        if self.changed_at_ms is not None and created_at_ms < self.changed_at_ms:
            text += (
                f" (it was {_days_text(self.previous_days)} until {self.changed_at}, now {_days_text(self.days)}:"
                " a record from before the change is held to the shorter)"
            )
        return text


def shortest(*days: int | None) -> int | None:
    """The shortest of these retentions (None: kept forever)."""
    return min((day for day in days if day is not None), default=None)


def run_retention(env: Mapping[str, str]) -> RunRetention:
    """RUN_RETENTION_DAYS, PREVIOUS_RUN_RETENTION_DAYS and RUN_RETENTION_CHANGED_AT of `env`."""
    days = run_retention_days(env)
    previous = env.get(PREVIOUS_RUN_RETENTION_ENV, "")
    changed_at_ms = parse_changed_at(env.get(RUN_RETENTION_CHANGED_ENV, ""))
    if changed_at_ms is None:
        if previous.strip():
            raise InvalidRetention(f"{PREVIOUS_RUN_RETENTION_ENV} needs {RUN_RETENTION_CHANGED_ENV}, when it changed")
        return RunRetention(days)
    return RunRetention(days, parse_run_retention_days(previous), changed_at_ms)


def after_change(deployed: RunRetention | None, days: int | None, now_ms: int) -> RunRetention:
    """The retention to deploy when RunRetentionDays becomes `days` at `now_ms` on a stack deployed with
    `deployed` (None: a new stack, nothing to remember).

    Unchanged, the last change stays recorded. Changed, the change is recorded now, its previous retention
    being the deployed one; and if the deployed stack's own last change still matters (a record from before
    it could still be young enough to be admitted under the longer of its two retentions), the shorter of
    that change's two retentions, so that one recorded change never holds a record to more than any
    retention its run may have been written under.
    """
    if deployed is None:
        return RunRetention(days)
    if days == deployed.days:
        return deployed
    previous = deployed.days
    if deployed.changed_at_ms is not None and now_ms < _change_matters_until(deployed):
        previous = shortest(deployed.days, deployed.previous_days)
    return RunRetention(days, previous, now_ms)


def _change_matters_until(retention: RunRetention) -> float:
    """Until when a record from before the retention's last change may be young enough to be admitted under
    the longer of the change's two retentions (epoch milliseconds; infinite if either is forever)."""
    assert retention.changed_at_ms is not None
    if retention.days is None or retention.previous_days is None:
        return math.inf
    return retention.changed_at_ms + max(retention.days, retention.previous_days) * SECONDS_PER_DAY * 1000


def _days_text(days: int | None) -> str:
    return "forever" if days is None else f"{days} day{'s' if days != 1 else ''}"


def expires_at(created_at_ms: float, days: int) -> int:
    """The TTL attribute of an item created at `created_at_ms`: epoch seconds, `days` later (rounded up, so an
    item never expires before its full retention)."""
    return math.ceil(created_at_ms / 1000) + days * SECONDS_PER_DAY


def expired(created_at_ms: float, now_ms: float, days: int | None) -> bool:
    """Whether something created at `created_at_ms` is past a retention of `days` at `now_ms`; never without
    retention."""
    return days is not None and now_ms > created_at_ms + days * SECONDS_PER_DAY * 1000
