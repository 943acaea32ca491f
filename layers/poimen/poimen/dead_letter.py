"""The inbox relay's dead letter, a contract between the relay (its writer) and `poimen dlq` (its reader, which
writes one again when a redriven record fails anew): the reasons, the SQS message (body and attributes) within
SQS's size limit, and how the record it holds is identified.

Standard library only, as the relay's cold path wants it: records are the mappings MSK delivers (key and value
base64, headers as lists of byte values).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from poimen.retention import InvalidRetention, RunRetention, parse_run_retention_days, with_change
from poimen.wire import rfc3339

# Why the relay dead-letters a record (DeadLetterReason.kind), in the order `poimen dlq` lists them.
RELAY_KINDS = (
    "invalid-topic",  # the topic is no tenant's dispatch topic
    "empty-value",  # a tombstone (null value)
    "undecodable",  # the value is not base64 of UTF-8
    "invalid-json",  # the value is not a JSON object
    "expired",  # older than the run retention: its run may have expired
    "future-timestamp",  # under a run retention, a timestamp ahead of the relay's clock: its age cannot be told
    "keyless-replica",  # a keyless spawn replicated from another Region: relayed only in its own
    "rejected",  # the admission API refused it (400, 413, 415, 422)
    "outcome-unknown",  # keyless, and the API could not tell whether it admitted it: the letter names the run
    # on-demand pollers: its lane's calls still failed (the API down, or refusing the relay) once its oldest record
    # was RELAY_MAX_RECORD_AGE_SECONDS old (23 h when only throttled); a spawn all the same, for redrive once fixed
    "retries-exhausted",
    "relay-error",  # a fault nobody foresaw
)
INVALID_TOPIC_DETAIL = "topic is neither poimen.<tenant>.dispatch nor <alias>.poimen.<tenant>.dispatch"
# SQS takes messages of up to 1 MiB (the queue's MaximumMessageSize in template.yaml), body and message
# attributes together. A dead letter that would not fit keeps of these parts as many as fit, the more
# useful first: the value whenever it fits alone, the API's answer last. Its coordinates always stay, so
# the record can be read again from Kafka at that partition and offset.
MAX_DEAD_LETTER_BYTES = 1024 * 1024
KEPT_IN_ORDER = (("record", "value"), ("record", "key"), ("record", "headers"), ("reason", "problem"))
MAX_DETAIL_CHARS = 1000


@dataclass(frozen=True)
class DeadLetterReason:
    kind: str  # one of RELAY_KINDS
    detail: str
    status: int | None = None
    problem: Any = None


def dead_letter_message(
    record: Mapping[str, Any],
    reason: DeadLetterReason,
    run_retention: RunRetention,
    dead_lettered_at: str | None = None,
) -> dict[str, Any]:
    """The original record (as MSK delivered it: key and value base64), why it was dead-lettered, when
    (`dead_lettered_at`, RFC 3339: when it was first, for a letter redrive writes again; default now), and the
    run retention its writer held records to (`{"days": null}`: runs kept forever; after a change of
    RunRetentionDays also `previousDays` and `changedAt`, `"pending"` while the change is not settled), so
    that `poimen dlq redrive` holds the record to it too."""
    return {
        "record": {
            "topic": record.get("topic"),
            "partition": record.get("partition"),
            "offset": record.get("offset"),
            "timestamp": record.get("timestamp"),
            "timestampType": record.get("timestampType"),
            "key": record.get("key"),
            "value": record.get("value"),
            "headers": record.get("headers"),
        },
        "reason": {
            "kind": reason.kind,
            "detail": reason.detail[:MAX_DETAIL_CHARS],
            "status": reason.status,
            "problem": reason.problem,
        },
        "deadLetteredAt": dead_lettered_at or rfc3339(),
        "runRetention": retention_document(run_retention),
    }


def dead_letter_body(
    record: Mapping[str, Any],
    reason: DeadLetterReason,
    run_retention: RunRetention,
    dead_lettered_at: str | None = None,
) -> str:
    """The SQS message body of a dead letter: with its attributes (dead_letter_attributes), at most
    MAX_DEAD_LETTER_BYTES (ASCII JSON: bytes = characters).

    If the whole letter is too large, every part of KEPT_IN_ORDER is left out, then put back in that order
    whenever the letter still fits with it. Each part left out becomes null beside `<part>Omitted`
    (`{"reason": "too large for SQS", "length": <its length as delivered>}`) and `<part>Sha256`, the
    SHA-256 of that text: the base64 of key and value, compact JSON otherwise.
    """
    letter = dead_letter_message(record, reason, run_retention, dead_lettered_at)
    budget = MAX_DEAD_LETTER_BYTES - _attributes_size(dead_letter_attributes(record))
    body = _compact(letter)
    if len(body) <= budget:
        return body
    left_out: list[tuple[dict[str, Any], str, Any]] = []
    for section, part in KEPT_IN_ORDER:
        value = letter[section][part]
        if value is not None:
            left_out.append((letter[section], part, value))
            _leave_out(letter[section], part, value)
    body = _compact(letter)
    for section_of, part, value in left_out:
        omitted = section_of.pop(f"{part}Omitted"), section_of.pop(f"{part}Sha256")
        section_of[part] = value
        trial = _compact(letter)
        if len(trial) <= budget:
            body = trial
        else:
            _leave_out(section_of, part, value, omitted)
    return body


def dead_letter_attributes(record: Mapping[str, Any]) -> dict[str, dict[str, str]]:
    """The SQS message attributes of a record's dead letter: its coordinates, so that copies of one record
    are told apart without reading their bodies."""
    return {
        "topic": {"DataType": "String", "StringValue": str(record.get("topic"))},
        "partition": {"DataType": "Number", "StringValue": str(record.get("partition"))},
        "offset": {"DataType": "Number", "StringValue": str(record.get("offset"))},
    }


def is_dead_letter(document: Any) -> bool:
    """Whether a parsed SQS message body is a relay dead letter."""
    return (
        isinstance(document, dict)
        and isinstance(document.get("record"), dict)
        and isinstance(document.get("reason"), dict)
        and isinstance(document["reason"].get("kind"), str)
    )


def holds_value(record: Mapping[str, Any]) -> bool:
    """Whether a dead letter's record keeps its value (a null value is a value: a tombstone's)."""
    return "valueOmitted" not in record


def recorded_retention(document: Mapping[str, Any]) -> RunRetention | None:
    """The run retention a dead letter records (its writer's); None for a letter written before letters
    recorded it, or whose record of it is unreadable."""
    recorded = document.get("runRetention")
    if not isinstance(recorded, dict):
        return None
    try:
        days = _days(recorded.get("days"))
        changed_at = recorded.get("changedAt")
        if changed_at is None:
            return RunRetention(days)
        return with_change(days, _days(recorded.get("previousDays")), str(changed_at))
    except InvalidRetention:
        return None


def retention_document(retention: RunRetention) -> dict[str, Any]:
    """A run retention as a dead letter records it (`runRetention`)."""
    if retention.changed_at is None:
        return {"days": retention.days}
    return {"days": retention.days, "previousDays": retention.previous_days, "changedAt": retention.changed_at}


def _days(value: Any) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRetention(f"not a number of days: {value!r}")
    return parse_run_retention_days(str(value))


def record_id(record: Mapping[str, Any]) -> str:
    """A Kafka record's identity, the same in every copy of it (a dead letter, a parked batch):
    `<topic>-<partition>@<offset>~<timestamp>~<value digest>`, the first 32 hex digits of the SHA-256 of its
    value as delivered (base64; `valueSha256` where a letter left the value out; `null` for a tombstone).
    Coordinates alone are not one: offsets start again when a topic is recreated or a cluster rebuilt, while
    dead letters and parked batches outlive both."""
    return f"{coordinates_id(record)}~{record.get('timestamp')}~{value_digest(record)[:32]}"


def coordinates_id(record: Mapping[str, Any]) -> str:
    """`<topic>-<partition>@<offset>`: where the record is in Kafka (unique within one batch only), the name of
    a parked record's progress marker before markers were named by its identity."""
    return f"{record.get('topic')}-{record.get('partition')}@{record.get('offset')}"


def value_digest(record: Mapping[str, Any]) -> str:
    """The SHA-256 of the record's value as delivered (base64 text), in hex; as the letter says it when it
    left the value out; `null` for a null value (a tombstone)."""
    if not holds_value(record):
        return str(record.get("valueSha256"))
    value = record.get("value")
    if value is None:
        return "null"
    text = value if isinstance(value, str) else _compact(value)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def age_text(ms: float) -> str:
    """An age in its largest units: `4 days 2 h`, `3 h 5 min`, `42 s`."""
    seconds = max(0, int(ms // 1000))
    days, hours, minutes = seconds // 86_400, seconds % 86_400 // 3600, seconds % 3600 // 60
    if days:
        return f"{days} day{'s' if days != 1 else ''}" + (f" {hours} h" if hours else "")
    if hours:
        return f"{hours} h" + (f" {minutes} min" if minutes else "")
    return f"{minutes} min" if minutes else f"{seconds} s"


def _attributes_size(attributes: dict[str, dict[str, str]]) -> int:
    """What message attributes count towards SQS's size limit: each one's name, data type and value."""
    return sum(
        len(name.encode()) + len(attribute["DataType"].encode()) + len(attribute["StringValue"].encode())
        for name, attribute in attributes.items()
    )


def _leave_out(section: dict[str, Any], part: str, value: Any, omitted: tuple[Any, Any] | None = None) -> None:
    if omitted is None:
        text = value if isinstance(value, str) else _compact(value)
        length, digest = len(text), hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
        omitted = {"reason": "too large for SQS", "length": length}, digest
    section[part] = None
    section[f"{part}Omitted"], section[f"{part}Sha256"] = omitted


def _compact(value: Any) -> str:
    # ASCII only: SQS refuses some characters (U+FFFE, U+FFFF, lone surrogates), and bytes equal characters.
    return json.dumps(value, separators=(",", ":"), ensure_ascii=True)
