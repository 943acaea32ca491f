"""What `poimen dlq` handles: dead letters, the parcels holding them (an SQS message, an S3 object), and
the dispatch a record stands for, read as the relay reads it."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from poimen.contract import RunRequest, parse_json
from poimen.dead_letter import RELAY_KINDS, DeadLetterReason, age_text, value_digest
from poimen.dead_letter import holds_value as record_holds_value
from poimen.inbox_rule import HeldBack, Spawn, judge
from poimen.retention import RunRetention

OUTCOME_UNKNOWN = "outcome-unknown"  # a keyless record the API may have admitted: its letter names the run
FAILED_BATCH = "failed-batch"
UNRECOGNISED = "unrecognised"  # a message or object that is neither; listed, never touched
KINDS = (*RELAY_KINDS, FAILED_BATCH, UNRECOGNISED)


@dataclass(frozen=True)
class DeadLetter:
    """One record that did not become a run, wherever it is kept."""

    id: str
    kind: str
    parcel_id: str  # the SQS message or S3 object holding it
    at: datetime | None  # when it was dead-lettered (or its batch failed)
    reason: dict[str, Any]  # {kind, detail, status, problem}, as the relay writes it
    record: dict[str, Any] | None = None  # as MSK delivered it (key and value base64); None: metadata only
    blocked: str | None = None  # why it cannot be sent from here; None: it can be tried
    # The record's identity, the same in every copy of it (poimen.dead_letter.record_id: coordinates,
    # timestamp, value digest): copies are sent once, and a parked record's progress marker is named by it.
    # None: no record.
    record_id: str | None = None
    # The run retention its relay held the record to; None: none recorded (a parked record, an older letter).
    run_retention: RunRetention | None = None

    @property
    def coordinates(self) -> str:
        """`topic/partition/offset`: where to read the record again in Kafka."""
        return "" if self.record is None else coordinates(self.record)


@dataclass
class Parcel:
    """What holds dead letters: one SQS message (one letter) or one S3 object (one failed batch)."""

    id: str
    kind: str
    at: datetime | None
    letters: list[DeadLetter]
    records: int  # records it stands for (a metadata-only failed batch counts its batch size)
    receipt_handle: str | None = None  # SQS
    document: dict[str, Any] | None = None  # S3: the on-failure record, kept to rewrite it
    note: str | None = None  # why it is unrecognised
    # S3: records of the object an interrupted redrive already finished (its progress markers); they are
    # not among `letters`, and go when the object is next rewritten or deleted.
    done: frozenset[str] = frozenset()

    @property
    def in_queue(self) -> bool:
        return self.id.startswith("sqs:")


def coordinates(record: dict[str, Any]) -> str:
    return f"{record.get('topic')}/{record.get('partition')}/{record.get('offset')}"


def older(written: datetime | None, aws_time: datetime | None) -> datetime | None:
    """The time of a copy (a letter, a parked batch): the older of the time it says it was written at and the
    time AWS received it (SQS's SentTimestamp, S3's LastModified), so that a writer's clock running ahead never
    makes its record look younger than it is."""
    return min((at for at in (written, aws_time) if at is not None), default=None)


def timestamp(value: Any) -> datetime | None:
    """An ISO 8601 time (UTC if it names no zone), or None."""
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


# The dispatch_key a record without one is sent with: the same for every copy of the record and every
# redrive of it, so sending it again (after a crash, an unknown outcome) replays the run it admitted.
DERIVED_KEY_PREFIX = "poimen-redrive/"


@dataclass(frozen=True)
class Dispatch:
    """A record that is a dispatch: the tenant of its topic and the spawn request its value holds."""

    tenant: str
    request: RunRequest
    record_key: str  # the dispatch_key to send: the request's own, else one derived from the record
    traceparent: str | None
    # A keyless record's key as redrive derived it before it held the value's digest (legacy_key); None for
    # a record with its own key. A run it admitted is this record's if the API replays it.
    legacy_key: str | None = None

    @property
    def dispatch_key(self) -> str | None:
        """The request's own dispatch_key (None: the publisher set none)."""
        return self.request.dispatch_key


def named_run(letter: DeadLetter) -> str | None:
    """The run an `outcome-unknown` letter's answer names (the API may have admitted it), else None."""
    problem = letter.reason.get("problem")
    if letter.kind != OUTCOME_UNKNOWN or not isinstance(problem, dict):
        return None
    run_id = problem.get("run_id")
    return run_id if isinstance(run_id, str) and run_id else None


def derived_key(record: dict[str, Any]) -> str:
    """`poimen-redrive/` and the SHA-256 of the record's topic, partition, offset, timestamp and value digest
    (`poimen.dead_letter.value_digest`): two records at one position (a topic recreated) are two keys."""
    identity = "\n".join([*_position(record), value_digest(record)])
    return DERIVED_KEY_PREFIX + hashlib.sha256(identity.encode("utf-8", "surrogatepass")).hexdigest()


def legacy_key(record: dict[str, Any]) -> str:
    """The key redrive derived before it held the value digest: of topic, partition, offset and timestamp."""
    identity = "\n".join(_position(record))
    return DERIVED_KEY_PREFIX + hashlib.sha256(identity.encode("utf-8", "surrogatepass")).hexdigest()


def _position(record: dict[str, Any]) -> list[str]:
    return [str(record.get(name)) for name in ("topic", "partition", "offset", "timestamp")]


@dataclass(frozen=True)
class Held:
    """A dispatch the relay holds back though it is a spawn (`poimen.inbox_rule.HeldBack`): dead-lettered
    with `reason`, and sent by redrive only when its kind is asked for by name (`--kind`)."""

    reason: DeadLetterReason
    dispatch: Dispatch | DeadLetterReason  # what sending it would send, or why the API would refuse it


# The reasons of Held: the relay's, for a record that is a spawn all the same.
EXPIRED = "expired"
FUTURE_TIMESTAMP = "future-timestamp"
HELD_KINDS = (EXPIRED, FUTURE_TIMESTAMP, "keyless-replica")
# Redrive's own: a record old enough to have outlived its run under some retention a stack can have, when
# no retention is known for it (neither the operator's nor one a copy records). Never a kind of letter:
# giving a retention (--run-retention-days) is how it is judged.
RETENTION_UNKNOWN = "retention-unknown"
# The shortest run retention a stack can have (template RunRetentionDays: 1 to 3650 days).
SHORTEST_RETENTION = RunRetention(1)


# A value's validation errors printed in a reason: the first few, and how many there are.
MAX_ERRORS_SHOWN = 5


def judged(
    record: dict[str, Any], now_ms: float, *retentions: RunRetention, seen_by_ms: float | None = None
) -> Dispatch | Held | DeadLetterReason:
    """The record judged by the relay's rule (`poimen.inbox_rule.judge`) at `now_ms`, as old as its timestamp or
    `seen_by_ms` (when its letter was dead-lettered or its batch failed), whichever is older: a dispatch to
    send, one the relay holds back, or why the relay dead-letters it. A value that is no spawn request by the
    API's contract (`poimen.contract.RunRequest`) is refused as the API would refuse it, without sending it."""
    try:
        verdict = judge(record, now_ms, *retentions, seen_by_ms=seen_by_ms)
    except (TypeError, ValueError, AttributeError) as error:  # as the relay: a fault of the record's own
        return DeadLetterReason("relay-error", f"{type(error).__name__}: {error}")
    if isinstance(verdict, DeadLetterReason):
        return verdict
    if isinstance(verdict, HeldBack):
        return Held(verdict.reason, _request(record, verdict.spawn))
    return _request(record, verdict)


def _request(record: dict[str, Any], spawn: Spawn) -> Dispatch | DeadLetterReason:
    try:
        request = RunRequest.model_validate(parse_json(spawn.body.decode()))  # numbers exact, as the API reads them
    except ValidationError as error:
        errors = error.errors()
        problems = "; ".join(
            f"{'.'.join(str(part) for part in problem['loc']) or 'request'}: {str(problem['msg'])[:200]}"
            for problem in errors[:MAX_ERRORS_SHOWN]
        )
        if len(errors) > MAX_ERRORS_SHOWN:
            problems += f"; ... ({len(errors)} errors, the first {MAX_ERRORS_SHOWN} shown)"
        return DeadLetterReason("rejected", f"not a valid spawn request: {problems}")
    except (ValueError, RecursionError) as error:
        return DeadLetterReason("rejected", f"not JSON as the admission API reads it: {error}")
    if request.dispatch_key is not None:
        return Dispatch(spawn.tenant, request, request.dispatch_key, spawn.traceparent)
    return Dispatch(spawn.tenant, request, derived_key(record), spawn.traceparent, legacy_key(record))


def holds_value(letter: DeadLetter) -> bool:
    """Whether the letter keeps its record's value (a null value is a value: a tombstone's)."""
    return letter.record is not None and record_holds_value(letter.record)


def record_verdict(
    copies: Sequence[DeadLetter], now_ms: float, run_retention: RunRetention | None
) -> tuple[DeadLetter, Dispatch | Held | DeadLetterReason] | None:
    """What the record of these copies is (`judged`), from the first copy that can be tried (None if none can),
    held to the shortest of `run_retention` (the operator's) and the retentions the copies record, and at
    least as old as the oldest copy (its letter's deadLetteredAt, its batch's on-failure time), whatever its
    timestamp says. A record the relay dead-lettered as `expired` stays held back as expired, whatever the
    retention now: it only grew older."""
    source = next((copy for copy in copies if sendable(copy)), None)
    if source is None or source.record is None:
        return None
    retentions = [found for found in (run_retention, *(copy.run_retention for copy in copies)) if found is not None]
    seen_by_ms = min((copy.at.timestamp() * 1000 for copy in copies if copy.at is not None), default=None)
    verdict = judged(source.record, now_ms, *retentions, seen_by_ms=seen_by_ms)
    if not retentions and not isinstance(verdict, DeadLetterReason):
        verdict = _unknown_retention(source.record, now_ms, seen_by_ms) or verdict
    expired_letter = next((copy for copy in copies if copy.kind == EXPIRED), None)
    sent = verdict.dispatch if isinstance(verdict, Held) and verdict.reason.kind == RETENTION_UNKNOWN else verdict
    if expired_letter is not None and isinstance(sent, Dispatch):
        detail = f"dead-lettered as expired: {expired_letter.reason.get('detail')}"
        verdict = Held(DeadLetterReason(EXPIRED, detail), sent)
    return source, verdict


def _unknown_retention(record: dict[str, Any], now_ms: float, seen_by_ms: float | None) -> Held | None:
    """Held as RETENTION_UNKNOWN if the record, held to the shortest retention a stack can have, is one the
    relay would hold back for its age (or a timestamp too far ahead to tell it); else None."""
    verdict = judged(record, now_ms, SHORTEST_RETENTION, seen_by_ms=seen_by_ms)
    if not isinstance(verdict, Held) or verdict.reason.kind not in (EXPIRED, FUTURE_TIMESTAMP):
        return None
    stamp = record.get("timestamp")
    stamp_ms = stamp if isinstance(stamp, int) and not isinstance(stamp, bool) and stamp >= 0 else None
    born = min((moment for moment in (stamp_ms, seen_by_ms) if moment is not None), default=None)
    known = verdict.reason.kind == EXPIRED and born is not None
    age = f"is {age_text(now_ms - (born or 0))} old" if known else "'s age cannot be told"
    detail = (
        f"the record {age}, older than the shortest run retention a stack can have (1 day), and no run retention "
        "is known for it (a parked batch, or a letter of an earlier version): its run may have expired; give "
        "--run-retention-days (the stack's RunRetentionDays, or forever) to judge it"
    )
    return Held(DeadLetterReason(RETENTION_UNKNOWN, detail), verdict.dispatch)


def sendable(letter: DeadLetter) -> bool:
    """Whether the letter's record can be tried from here (not blocked, and held in full)."""
    return not letter.blocked and letter.record is not None
