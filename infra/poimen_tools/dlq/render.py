"""How `poimen dlq` shows dead letters: counts by kind, one letter decoded, tables, ages."""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from poimen.dead_letter import DeadLetterReason, retention_document
from poimen.wire import rfc3339
from poimen_tools.dlq.model import (
    KINDS,
    RETENTION_UNKNOWN,
    DeadLetter,
    Dispatch,
    Held,
    Parcel,
    record_verdict,
    sendable,
)


def age(at: datetime | None, now: datetime) -> str:
    if at is None:
        return "-"
    seconds = max(0, int((now - at).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


@dataclass
class KindCount:
    letters: int = 0  # messages or objects
    oldest: datetime | None = None
    newest: datetime | None = None
    record_ids: set[str] = field(default_factory=set)  # records held in full: two copies count once
    others: int = 0  # records known only by number (a metadata-only failed batch)

    @property
    def records(self) -> int:
        return len(self.record_ids) + self.others


def _count(count: KindCount, parcel: Parcel) -> None:
    count.letters += 1
    ids = [letter.record_id for letter in parcel.letters if letter.record_id is not None]
    if ids:
        count.record_ids.update(ids)
    else:
        count.others += parcel.records
    if parcel.at is not None:
        count.oldest = parcel.at if count.oldest is None else min(count.oldest, parcel.at)
        count.newest = parcel.at if count.newest is None else max(count.newest, parcel.at)


def count_by_kind(parcels: Iterable[Parcel]) -> dict[str, KindCount]:
    """Counts by kind, in the order of KINDS (then any other kind a message names)."""
    kinds: dict[str, KindCount] = {}
    for parcel in parcels:
        _count(kinds.setdefault(parcel.kind, KindCount()), parcel)
    order = sorted(kinds, key=lambda kind: (KINDS.index(kind) if kind in KINDS else len(KINDS), kind))
    return {kind: kinds[kind] for kind in order}


def inventory(parcels: list[Parcel], now: datetime) -> dict[str, Any]:
    """`list --json`: counts by kind with oldest and newest, and every dead letter."""
    return {
        "kinds": {
            kind: {
                "letters": count.letters,
                "records": count.records,
                "oldest": iso(count.oldest),
                "newest": iso(count.newest),
                "oldestAgeSeconds": _seconds(count.oldest, now),
                "newestAgeSeconds": _seconds(count.newest, now),
            }
            for kind, count in count_by_kind(parcels).items()
        },
        "deadLetters": [
            {
                "id": letter.id,
                "kind": letter.kind,
                "deadLetteredAt": iso(letter.at),
                "where": letter.coordinates or None,
                "redrivable": letter.blocked is None,
                "note": letter.blocked or reason_line(letter.reason),
            }
            for parcel in parcels
            for letter in parcel.letters
        ],
    }


def render_inventory(parcels: list[Parcel], now: datetime, ids: bool) -> str:
    if not parcels:
        return "no dead letters\n"
    rows = [("kind", "letters", "records", "oldest", "newest")]
    total = KindCount()
    for kind, count in count_by_kind(parcels).items():
        rows.append((kind, str(count.letters), str(count.records), age(count.oldest, now), age(count.newest, now)))
    for parcel in parcels:
        _count(total, parcel)
    rows.append(("total", str(total.letters), str(total.records), "", ""))
    text = table(rows, right=(1, 2))
    if ids:
        lines = [
            (
                letter.id,
                letter.kind,
                age(letter.at, now),
                letter.coordinates or "-",
                letter.blocked or reason_line(letter.reason),
            )
            for parcel in parcels
            for letter in parcel.letters
        ]
        text += "\n" + table([("id", "kind", "age", "record", "note"), *lines])
    return text


def letter_document(letter: DeadLetter, now: datetime) -> dict[str, Any]:
    """`show --json`: one dead letter, its key, value and headers decoded."""
    record = letter.record or {}
    # As redrive judges it without --run-retention-days (poimen_tools.dlq.model.record_verdict).
    found = record_verdict([letter], now.timestamp() * 1000, None) if sendable(letter) else None
    judgement = None if found is None else found[1]
    held = ""
    if isinstance(judgement, Held) and judgement.reason.kind == RETENTION_UNKNOWN:
        held = (
            "refused: held to no run retention, and older than the shortest a stack can have (1 day): sent only "
            "with --run-retention-days (the stack's RunRetentionDays, or forever) if it is not older than that; "
            "else "
        )
        judgement = judgement.dispatch
    elif isinstance(judgement, Held):
        kind = judgement.reason.kind
        held, judgement = f"held back ({kind}: sent only with --kind {kind}): ", judgement.dispatch
    if isinstance(judgement, Dispatch):
        redrive = f"{held}POST /v1/runs for tenant {judgement.tenant}, " + (
            f"without dispatch_key: a new run, sent as dispatch_key {judgement.record_key} (derived from the "
            "record: sent again, a replay)"
            if judgement.dispatch_key is None
            else f"dispatch_key {json.dumps(judgement.dispatch_key)}: a replay if it was admitted meanwhile"
        )
    elif isinstance(judgement, DeadLetterReason):
        redrive = f"not possible: {judgement.kind}: {judgement.detail}"
    else:
        redrive = f"not possible: {letter.blocked}"
    document: dict[str, Any] = {
        "id": letter.id,
        "kind": letter.kind,
        "deadLetteredAt": iso(letter.at),
        "age": age(letter.at, now),
        "topic": record.get("topic"),
        "partition": record.get("partition"),
        "offset": record.get("offset"),
        "timestamp": record.get("timestamp"),
        "timestampType": record.get("timestampType"),
        "key": _decoded_bytes(record.get("key"), as_json=False),
        "value": _decoded_bytes(record.get("value"), as_json=True),
        "headers": _decoded_headers(record.get("headers")),
        "reason": letter.reason,
        "runRetention": None if letter.run_retention is None else retention_document(letter.run_retention),
        "redrive": redrive,
    }
    for part in ("value", "headers", "key"):
        if f"{part}Omitted" in record:
            document[part] = {"omitted": record[f"{part}Omitted"], "sha256": record.get(f"{part}Sha256")}
    return document


def render_letter(letter: DeadLetter, now: datetime) -> str:
    document = letter_document(letter, now)
    reason = letter.reason
    lines = [
        ("id", letter.id),
        ("kind", letter.kind),
        ("dead-lettered", f"{document['deadLetteredAt'] or '-'} ({document['age']} ago)"),
        ("record", f"{letter.coordinates} (topic/partition/offset)" if letter.record else "-"),
        ("reason", reason_line(reason)),
        ("status", str(reason.get("status") if reason.get("status") is not None else "-")),
        ("retention", _retention_line(letter)),
        ("redrive", document["redrive"]),
        ("key", _show(document["key"])),
        ("headers", _show(document["headers"])),
    ]
    width = max(len(name) for name, _ in lines) + 1
    text = "".join(f"{name + ':':<{width}} {value}\n" for name, value in lines)
    text += f"problem:\n{_show(reason.get('problem'), indent=True)}\n"
    return text + f"value:\n{_show(document['value'], indent=True)}\n"


def _retention_line(letter: DeadLetter) -> str:
    """The run retention the letter records, as `show` prints it."""
    retention = letter.run_retention
    if retention is None:
        return (
            "- (not recorded: held to the shortest a stack can have, 1 day, unless redrive is given "
            "--run-retention-days)"
        )
    days = "runs kept forever" if retention.days is None else f"{retention.days} days"
    if retention.changed_at is None:
        return days
    before = "forever" if retention.previous_days is None else f"{retention.previous_days} days"
    if retention.pending:
        return f"{days} (was {before}: the change pending, every record held to the shorter)"
    return f"{days} (was {before} until {retention.changed_at})"


def reason_line(reason: dict[str, Any]) -> str:
    text = f"{reason.get('kind')}: {reason.get('detail')}"
    if "problemOmitted" in reason:
        text += " (problem omitted: too large for SQS)"
    return text


def problem_summary(answer: Any) -> str:
    if isinstance(answer, dict):
        return str(answer.get("type") or answer.get("message") or answer.get("title") or answer)[:200]
    return str(answer)[:200] or "no body"


def _decoded_bytes(value: Any, *, as_json: bool) -> Any:
    """Base64 text as JSON (values), else UTF-8 text, else {"base64": ...} as it was."""
    if not isinstance(value, str):
        return value
    try:
        raw = base64.b64decode(value, validate=True)
        text = raw.decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return {"base64": value}
    if as_json:
        try:
            return json.loads(text)
        except ValueError:
            return text
    return text


def _decoded_headers(headers: Any) -> Any:
    if not isinstance(headers, list):
        return headers
    decoded: dict[str, Any] = {}
    for header in headers:
        for name, value in header.items() if isinstance(header, dict) else []:
            try:
                decoded[name] = bytes(value).decode("utf-8")
            except (TypeError, ValueError):
                decoded[name] = {"bytes": value}
    return decoded


def _show(value: Any, indent: bool = False) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return json.dumps(value, indent=2 if indent else None, ensure_ascii=False)


def table(rows: Sequence[tuple[str, ...]], right: tuple[int, ...] = ()) -> str:
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return "".join(
        "  ".join(
            cell.rjust(widths[column]) if column in right else cell.ljust(widths[column])
            for column, cell in enumerate(row)
        ).rstrip()
        + "\n"
        for row in rows
    )


def iso(at: datetime | None) -> str | None:
    return None if at is None else rfc3339(at)


def _seconds(at: datetime | None, now: datetime) -> int | None:
    return None if at is None else max(0, int((now - at).total_seconds()))
