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
# RunRetentionChangedAt): the retention before it (empty: forever), and when it took effect (RFC 3339, UTC),
# or PENDING while the deploy that makes it is not known to have completed.
PREVIOUS_RUN_RETENTION_ENV = "PREVIOUS_RUN_RETENTION_DAYS"
RUN_RETENTION_CHANGED_ENV = "RUN_RETENTION_CHANGED_AT"
# A change deployed but not yet settled: until make deploy records when the stack's update completed, runs
# may still be written under either retention, so every record is held to the shorter.
PENDING = "pending"
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
    old from before the raise may have lost its run, and is held to 1 day. While the change is `pending`
    (deployed, the time it took effect not yet recorded) every record is held to the shorter."""

    days: int | None = None
    previous_days: int | None = None
    changed_at_ms: int | None = None  # None: no change recorded (`previous_days` unused), or one pending
    pending: bool = False

    def days_for(self, created_at_ms: float) -> int | None:
        """The retention that holds something created at `created_at_ms`."""
        if self._before_change(created_at_ms):
            return shortest(self.days, self.previous_days)
        return self.days

    def _before_change(self, created_at_ms: float) -> bool:
        return self.pending or (self.changed_at_ms is not None and created_at_ms < self.changed_at_ms)

    def settled(self, at_ms: int) -> RunRetention:
        """This retention with a pending change recorded as taking effect at `at_ms` (itself if none is
        pending)."""
        return RunRetention(self.days, self.previous_days, at_ms) if self.pending else self

    def expired(self, created_at_ms: float, now_ms: float) -> bool:
        return expired(created_at_ms, now_ms, self.days_for(created_at_ms))

    @property
    def changed_at(self) -> str | None:
        """When the change took effect, as RUN_RETENTION_CHANGED_AT writes it (PENDING: not yet known)."""
        if self.pending:
            return PENDING
        if self.changed_at_ms is None:
            return None
        return rfc3339(datetime.fromtimestamp(self.changed_at_ms / 1000, UTC))

    def describe(self, created_at_ms: float) -> str:
        """`the run retention of 3 days`, and, for a record older than a change, which one holds it."""
        days = self.days_for(created_at_ms)
        text = "no run retention" if days is None else f"the run retention of {days} day{'s' if days != 1 else ''}"
        if self.pending:
            text += (
                f" (it was {_days_text(self.previous_days)}, and is {_days_text(self.days)} by a deploy not yet"
                " settled: every record is held to the shorter until make deploy records when it took effect)"
            )
        elif self._before_change(created_at_ms):
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
    previous = env.get(PREVIOUS_RUN_RETENTION_ENV, "")
    changed_at = env.get(RUN_RETENTION_CHANGED_ENV, "")
    if not changed_at.strip() and previous.strip():
        raise InvalidRetention(f"{PREVIOUS_RUN_RETENTION_ENV} needs {RUN_RETENTION_CHANGED_ENV}, when it changed")
    return with_change(run_retention_days(env), parse_run_retention_days(previous), changed_at)


def with_change(days: int | None, previous_days: int | None, changed_at: str) -> RunRetention:
    """A run retention of `days` whose last change is `changed_at` as RUN_RETENTION_CHANGED_AT writes it (empty:
    none, and `previous_days` unused; PENDING; else an RFC 3339 UTC time), from `previous_days`."""
    if changed_at.strip() == PENDING:
        return RunRetention(days, previous_days, pending=True)
    changed_at_ms = parse_changed_at(changed_at)
    if changed_at_ms is None:
        return RunRetention(days)
    return RunRetention(days, previous_days, changed_at_ms)


def after_change(deployed: RunRetention | None, days: int | None, now_ms: int, *, settled: bool = True) -> RunRetention:
    """The retention to deploy when RunRetentionDays becomes `days` at `now_ms` on a stack deployed with
    `deployed` (None: a new stack, nothing to remember). `settled`: the stack's last update went forward
    (`*_COMPLETE`, not rolled back), so every function runs the deployed parameters.

    A pending change of the deployed stack took effect by `now_ms` at the latest if its update went forward,
    and is recorded so first; after a rollback (or a cancelled update) it stays pending, never counted as
    settled. Unchanged, the last change stays recorded. Changed, the change is pending (the stack's admission
    writes runs under the deployed retention until its update completes, an unbounded wait when the change
    set awaits confirmation), its previous retention being the deployed one; and if the deployed stack's own
    last change still matters (pending, or a record from before it could still be young enough to be
    admitted under the longer of its two retentions), the shorter of that change's two retentions, so that
    one recorded change never holds a record to more than any retention its run may have been written under.
    A change to a retention shorter than the deployed stack holds records to is made only once `hold_first`
    has been deployed.
    """
    if deployed is None:
        return RunRetention(days)
    if settled:
        deployed = deployed.settled(now_ms)
    if days == deployed.days:
        return deployed
    previous = deployed.days
    if deployed.pending or (deployed.changed_at_ms is not None and now_ms < _change_matters_until(deployed)):
        previous = shortest(deployed.days, deployed.previous_days)
    return RunRetention(days, previous, pending=True)


def hold_first(
    deployed: RunRetention | None, days: int | None, now_ms: int, *, settled: bool = True
) -> RunRetention | None:
    """What to deploy, and see completed, before RunRetentionDays becomes `days` on a stack deployed with
    `deployed`, when `days` is shorter than the retention the stack holds a record written now to (a
    lowering, or turning retention on); None when it is not.

    The hold keeps the deployed `days` (admission goes on writing runs under it) and passes the lowered one as
    the other retention of a pending change, so that every record is held to it. Only once the hold's update
    has completed is the lowering deployed: whatever becomes of that second update (completed, rolled back,
    cancelled, failing to roll back and leaving functions of both versions, interrupted), every version of
    the relay that can run holds every record to the lowered retention, since a rollback returns the stack
    to the hold, a completed update whose parameters no rollback erases."""
    if deployed is None or days is None:
        return None
    holding = deployed.days_for(now_ms)
    if holding is not None and holding <= days:
        return None
    change = after_change(deployed, days, now_ms, settled=settled)
    return RunRetention(deployed.days, shortest(days, change.previous_days), pending=True)


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
