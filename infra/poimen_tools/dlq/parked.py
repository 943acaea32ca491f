"""Parked batches: Lambda's on-failure invocation records (one per batch that failed every retry), how
they are read, and the S3 bucket that keeps them, with the progress markers that let an interrupted
redrive resume without sending anything twice.

Progress markers: for each record of a parked object that a redrive has finished (admitted, or moved to
the dead-letter queue), a small object `<key>.progress/<record identity>` (poimen.dead_letter.record_id;
earlier versions named it `<topic>-<partition>@<offset>`, which is still read; its body a JSON note of the
outcome and when), written as soon as that outcome is confirmed. Reading the
bucket leaves those records out of their object; when a redrive is done with the object it rewrites or
deletes it and then deletes its markers.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

import botocore.exceptions

from poimen.dead_letter import coordinates_id, record_id
from poimen_tools.dlq.errors import DeadLetterNotFound, aws_call
from poimen_tools.dlq.model import FAILED_BATCH, UNRECOGNISED, DeadLetter, Parcel, older, timestamp

PROGRESS = ".progress/"  # a marker's key: <parked object's key>.progress/<record id>
_BUCKET_FIX = (
    "check --bucket (stack output FailedBatchesBucketName) and that you may ListBucket, GetObject, "
    "PutObject and DeleteObject on it"
)


def is_on_failure_record(document: Any) -> bool:
    """Lambda's on-failure invocation record of a Kafka (MSK) event source mapping."""
    return isinstance(document, dict) and "requestContext" in document and "KafkaBatchInfo" in document


def parse_object(key: str, body: bytes, last_modified: datetime | None = None) -> Parcel:
    """One S3 object of the failed-batch bucket: Lambda's on-failure invocation record, whose `payload`
    is the whole MSK event as a JSON string (Lambda Developer Guide, kafka-on-failure.html)."""
    parcel_id = f"s3:{key}"
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return unrecognised(parcel_id, last_modified, "the object is not JSON")
    if not is_on_failure_record(document):
        return unrecognised(parcel_id, last_modified, "not a Lambda on-failure invocation record")
    return failed_batch(parcel_id, document, last_modified)


def failed_batch(parcel_id: str, document: dict[str, Any], fallback_at: datetime | None) -> Parcel:
    """The records of an on-failure record, in (topic, partition, offset) order; without a payload (as
    Lambda sends to SQS and SNS destinations), one letter saying where in Kafka they are."""
    at = older(timestamp(document.get("timestamp")), fallback_at)
    request = document.get("requestContext") or {}
    response = document.get("responseContext") or {}
    error = f", {response['functionError']}" if response.get("functionError") else ""
    reason = {
        "kind": FAILED_BATCH,
        "detail": f"the batch failed {request.get('approximateInvokeCount', '?')} invocations "
        f"({request.get('condition', 'condition unknown')}{error})",
        "status": None,
        "problem": None,
    }
    info = document.get("KafkaBatchInfo") or {}
    payload = document.get("payload")
    if payload is None:
        blocked = f"metadata only; read the batch again from Kafka at {_ranges(info)}"
        letter = DeadLetter(parcel_id, FAILED_BATCH, parcel_id, at, reason, None, blocked)
        size = info.get("batchSize")
        return Parcel(parcel_id, FAILED_BATCH, at, [letter], size if isinstance(size, int) else 1, document=document)
    try:
        event = json.loads(payload) if isinstance(payload, str) else payload
        records = [record for group in event["records"].values() for record in group]
        places = [f"{record['topic']}-{int(record['partition'])}@{int(record['offset'])}" for record in records]
        letters = [
            DeadLetter(f"{parcel_id}#{place}", FAILED_BATCH, parcel_id, at, reason, record, record_id=record_id(record))
            for record, place in zip(records, places, strict=True)
        ]
    except (ValueError, TypeError, KeyError, AttributeError):
        return unrecognised(parcel_id, at, "its payload is not an aws:kafka event")
    letters.sort(key=_order)
    return Parcel(parcel_id, FAILED_BATCH, at, letters, len(letters), document=document)


def unrecognised(parcel_id: str, at: datetime | None, note: str) -> Parcel:
    reason = {"kind": UNRECOGNISED, "detail": note, "status": None, "problem": None}
    letter = DeadLetter(parcel_id, UNRECOGNISED, parcel_id, at, reason, None, f"{note}; inspect it by hand")
    return Parcel(parcel_id, UNRECOGNISED, at, [letter], 0, note=note)


def _order(letter: DeadLetter) -> tuple[str, int, int]:
    assert letter.record is not None
    return str(letter.record["topic"]), int(letter.record["partition"]), int(letter.record["offset"])


def _ranges(info: dict[str, Any]) -> str:
    ranges = info.get("recordsInfo") or {}
    described = [
        f"{name} offsets {entry.get('firstRecordOffset', '?')}..{entry.get('lastRecordOffset', '?')}"
        for name, entry in sorted(ranges.items())
        if isinstance(entry, dict)
    ]
    return ", ".join(described) or "(no offsets recorded)"


def without_done(parcel: Parcel, done: Iterable[str]) -> Parcel:
    """The parcel less the records a redrive already finished (every marker of the object is kept in
    `done`, so that the next rewrite or delete takes them all away)."""
    finished = frozenset(done)
    if not finished or parcel.kind == UNRECOGNISED:
        return parcel
    parcel.letters = [letter for letter in parcel.letters if not _marked(letter, finished)]
    parcel.records = len(parcel.letters)
    parcel.done = finished
    return parcel


def _marked(letter: DeadLetter, markers: frozenset[str]) -> bool:
    """Whether a marker says the record is done: named by its identity, or, as markers of earlier versions
    were, by its coordinates (unique within the one batch an object holds)."""
    return letter.record_id in markers or (letter.record is not None and coordinates_id(letter.record) in markers)


class FailedBatches:
    """The bucket Lambda parks failed batches in. Every object is read; the key format is not relied on,
    except that keys with `.progress/` in them are this tool's progress markers."""

    def __init__(self, s3: Any, bucket: str) -> None:
        self._s3 = s3
        self.bucket = bucket
        self.orphans: list[str] = []  # markers whose object is gone (a redrive killed as it deleted it)

    def read_all(self) -> list[Parcel]:
        keys: list[str] = []
        markers: dict[str, set[str]] = {}
        with aws_call(f"list the failed-batch bucket {self.bucket}", _BUCKET_FIX):
            for page in self._s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket):
                for entry in page.get("Contents", []):
                    parent, marker, record = entry["Key"].partition(PROGRESS)
                    if marker:
                        markers.setdefault(parent, set()).add(record)
                    else:
                        keys.append(entry["Key"])
        self.orphans = [
            f"{parent}{PROGRESS}{record}" for parent in markers.keys() - set(keys) for record in markers[parent]
        ]
        return [self._parcel(key, markers.get(key, set())) for key in keys]

    def read(self, key: str) -> Parcel:
        prefix = f"{key}{PROGRESS}"
        with aws_call(f"list the progress markers of s3://{self.bucket}/{key}", _BUCKET_FIX):
            done = {
                entry["Key"].removeprefix(prefix)
                for page in self._s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
                for entry in page.get("Contents", [])
            }
        return self._parcel(key, done)

    def _parcel(self, key: str, done: set[str]) -> Parcel:
        with aws_call(f"read s3://{self.bucket}/{key}", _BUCKET_FIX):
            try:
                answer = self._s3.get_object(Bucket=self.bucket, Key=key)
            except botocore.exceptions.ClientError as error:
                if error.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                    raise DeadLetterNotFound(
                        f"no object s3://{self.bucket}/{key}: see poimen dlq list --ids"
                    ) from error
                raise
            body: bytes = answer["Body"].read()
        return without_done(parse_object(key, body, answer.get("LastModified")), done)

    def mark_done(self, letter: DeadLetter, outcome: str) -> None:
        """The progress marker of one record: from now on, reading the bucket leaves it out."""
        assert letter.record_id is not None
        marker = f"{letter.parcel_id.removeprefix('s3:')}{PROGRESS}{letter.record_id}"
        note = {"outcome": outcome, "at": datetime.now(UTC).isoformat(timespec="milliseconds")}
        with aws_call(f"write the progress marker s3://{self.bucket}/{marker}", _BUCKET_FIX):
            self._s3.put_object(
                Bucket=self.bucket, Key=marker, Body=json.dumps(note).encode(), ContentType="application/json"
            )

    def settle(self, parcel: Parcel, keep: list[dict[str, Any]], done: Iterable[str]) -> None:
        """Once a redrive is done with the object: the same on-failure record holding only `keep`
        (deleted if nothing is kept), then its progress markers (`done` and the parcel's earlier ones)."""
        key = parcel.id.removeprefix("s3:")
        if keep:
            self._rewrite(parcel, keep)
        else:
            with aws_call(f"delete s3://{self.bucket}/{key}", _BUCKET_FIX):
                self._s3.delete_object(Bucket=self.bucket, Key=key)
        self.delete_markers([f"{key}{PROGRESS}{record}" for record in {*parcel.done, *done}])

    def delete_markers(self, markers: list[str]) -> None:
        for start in range(0, len(markers), 1000):  # DeleteObjects takes up to 1,000 keys
            objects = [{"Key": marker} for marker in markers[start : start + 1000]]
            with aws_call(f"delete progress markers in s3://{self.bucket}", _BUCKET_FIX):
                self._s3.delete_objects(Bucket=self.bucket, Delete={"Objects": objects, "Quiet": True})

    def _rewrite(self, parcel: Parcel, keep: list[dict[str, Any]]) -> None:
        assert parcel.document is not None
        key = parcel.id.removeprefix("s3:")
        document = dict(parcel.document)
        event = json.loads(document["payload"]) if isinstance(document["payload"], str) else dict(document["payload"])
        grouped: dict[str, list[dict[str, Any]]] = {}
        for record in keep:
            grouped.setdefault(f"{record['topic']}-{record['partition']}", []).append(record)
        event["records"] = grouped
        document["payload"] = json.dumps(event, separators=(",", ":"))
        document["KafkaBatchInfo"] = {**(document.get("KafkaBatchInfo") or {}), "batchSize": len(keep)}
        with aws_call(f"rewrite s3://{self.bucket}/{key}", _BUCKET_FIX):
            self._s3.put_object(
                Bucket=self.bucket, Key=key, Body=json.dumps(document).encode(), ContentType="application/json"
            )
