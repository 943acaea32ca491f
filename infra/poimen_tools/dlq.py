"""`poimen dlq`: inspect and redrive the dispatch records that did not become runs.

Two places hold them. The inbox relay's dead-letter queue (SQS): one relay dead letter per message, the
record as MSK delivered it and why it was dead-lettered. The failed-batch bucket (S3): one object per
batch that failed every retry, Lambda's on-failure invocation record with the whole MSK event as its
payload. `redrive` sends each record again through `POST /v1/runs`, signed as the caller, and removes a
dead letter only once the API has confirmed its run (201 or 200).

Dead-letter IDs: `sqs:<MessageId>` (one relay dead letter), `s3:<key>` (one failed batch, every record
of it), `s3:<key>#<topic>-<partition>@<offset>` (one record of a failed batch).

Redriving is idempotent through admission's dispatch_key alone: a keyed record sent twice is a replay
(200) of the run it admitted. A record without a dispatch_key becomes a new run each time it is
sent; it is deleted right after its 201, so only a crash between the two can send it twice.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import inspect
import json
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TextIO

import boto3
import botocore.config
import botocore.exceptions
import botocore.session
import urllib3
from aws_lambda_powertools.utilities.data_classes.kafka_event import KafkaEventRecord
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from poimen.kafka import tenant_of_dispatch_topic
from poimen.relay import RECORD_FAULT_STATUSES, RETRYABLE_STATUSES, TRACEPARENT, DeadLetterReason, dead_letter_body
from poimen.wire import TENANT_HEADER
from poimen_tools.credentials import local_credentials
from poimen_tools.local.sigv4 import DEV_ACCESS_KEY, DEV_SECRET_KEY

RELAY_KINDS = ("invalid-topic", "empty-value", "undecodable", "invalid-json", "rejected", "relay-error")
FAILED_BATCH = "failed-batch"
UNRECOGNISED = "unrecognised"  # a message or object that is neither; listed, never touched
KINDS = (*RELAY_KINDS, FAILED_BATCH, UNRECOGNISED)

# SQS cannot peek: reading a message hides it for its visibility timeout. `list` and `show` hide what they
# read for 30 s and make it visible again as soon as they are done (if killed, it reappears by itself).
# `redrive` holds every message it read for 5 minutes, so that no message is read twice while it works.
LIST_VISIBILITY_SECONDS = 30
REDRIVE_VISIBILITY_SECONDS = 300
# Long polling asks every SQS server, so an empty answer means an empty queue (short polling samples).
SQS_WAIT_SECONDS = 1
HTTP_CONNECT_TIMEOUT_SECONDS = 3.0
# Longer than API Gateway holds a request (30 s): redrive always gets the answer (or its 504).
HTTP_READ_TIMEOUT_SECONDS = 35.0
CONFIRMED = (200, 201)

EXIT_OK = 0
EXIT_REMAINING = 1  # some dead letters of the chosen kinds are still there: failing again, or not sendable
EXIT_USAGE = 2  # bad arguments, unknown ID, or redrive refused / not confirmed
EXIT_UNREACHABLE = 3  # AWS or the admission API unreachable, or refusing the caller

_RECORD_FRAGMENT = re.compile(r"(?P<topic>.+)-(?P<partition>\d+)@(?P<offset>\d+)")


class DlqError(Exception):
    """Ends `poimen dlq` with one line (the cause and the fix) and `exit_code`."""

    exit_code = EXIT_UNREACHABLE


class UsageError(DlqError):
    exit_code = EXIT_USAGE


class DeadLetterNotFound(UsageError):
    """No dead letter has this ID."""


class AwsUnavailable(DlqError):
    """SQS or S3 could not be reached, or refused the caller."""


class ApiUnavailable(DlqError):
    """The admission API could not be reached, or answered 408, 429 or 5xx: stop, try again later."""


class ApiRefused(DlqError):
    """The admission API refused the caller itself (401, 403, 404, 405, a redirect): every record would."""


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

    @property
    def coordinates(self) -> str:
        """`topic/partition/offset`: where to read the record again in Kafka."""
        if self.record is None:
            return ""
        return f"{self.record.get('topic')}/{self.record.get('partition')}/{self.record.get('offset')}"


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

    @property
    def in_queue(self) -> bool:
        return self.id.startswith("sqs:")


# -- reading dead letters ----------------------------------------------------------------------------


def parse_message(message_id: str, body: str, sent_at: datetime | None = None) -> Parcel:
    """One SQS message of the relay's queue: a relay dead letter, or an on-failure record sent to SQS
    (metadata only, as Lambda sends to SQS destinations), or something else (unrecognised)."""
    parcel_id = f"sqs:{message_id}"
    try:
        document = json.loads(body)
    except ValueError:
        return _unrecognised(parcel_id, sent_at, "the message body is not JSON")
    if _is_relay_dead_letter(document):
        record: dict[str, Any] = document["record"]
        reason: dict[str, Any] = document["reason"]
        kind = str(reason["kind"])
        at = _timestamp(document.get("deadLetteredAt")) or sent_at
        blocked = None
        if record.get("value") is None and "valueOmitted" in record:
            blocked = f"value omitted; read it again from Kafka at {_coordinates(record)}"
        letter = DeadLetter(parcel_id, kind, parcel_id, at, reason, record, blocked)
        return Parcel(parcel_id, kind, at, [letter], 1)
    if _is_on_failure_record(document):
        return _failed_batch(parcel_id, document, sent_at)
    return _unrecognised(parcel_id, sent_at, "neither a relay dead letter nor a Lambda on-failure record")


def parse_object(key: str, body: bytes, last_modified: datetime | None = None) -> Parcel:
    """One S3 object of the failed-batch bucket: Lambda's on-failure invocation record, whose `payload`
    is the whole MSK event as a JSON string (Lambda Developer Guide, kafka-on-failure.html)."""
    parcel_id = f"s3:{key}"
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return _unrecognised(parcel_id, last_modified, "the object is not JSON")
    if not _is_on_failure_record(document):
        return _unrecognised(parcel_id, last_modified, "not a Lambda on-failure invocation record")
    return _failed_batch(parcel_id, document, last_modified)


def _is_relay_dead_letter(document: Any) -> bool:
    return (
        isinstance(document, dict)
        and isinstance(document.get("record"), dict)
        and isinstance(document.get("reason"), dict)
        and isinstance(document["reason"].get("kind"), str)
    )


def _is_on_failure_record(document: Any) -> bool:
    return isinstance(document, dict) and "requestContext" in document and "KafkaBatchInfo" in document


def _failed_batch(parcel_id: str, document: dict[str, Any], fallback_at: datetime | None) -> Parcel:
    at = _timestamp(document.get("timestamp")) or fallback_at
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
        # SQS and SNS destinations get the metadata only: the records stay in Kafka.
        blocked = f"metadata only; read the batch again from Kafka at {_ranges(info)}"
        letter = DeadLetter(parcel_id, FAILED_BATCH, parcel_id, at, reason, None, blocked)
        size = info.get("batchSize")
        return Parcel(parcel_id, FAILED_BATCH, at, [letter], size if isinstance(size, int) else 1, document=document)
    try:
        event = json.loads(payload) if isinstance(payload, str) else payload
        records = [record for group in event["records"].values() for record in group]
        letters = [
            DeadLetter(
                f"{parcel_id}#{record['topic']}-{int(record['partition'])}@{int(record['offset'])}",
                FAILED_BATCH,
                parcel_id,
                at,
                reason,
                record,
            )
            for record in records
        ]
    except (ValueError, TypeError, KeyError, AttributeError):
        return _unrecognised(parcel_id, at, "its payload is not an aws:kafka event")
    letters.sort(key=lambda letter: _order(letter.record))
    return Parcel(parcel_id, FAILED_BATCH, at, letters, len(letters), document=document)


def _unrecognised(parcel_id: str, at: datetime | None, note: str) -> Parcel:
    reason = {"kind": UNRECOGNISED, "detail": note, "status": None, "problem": None}
    letter = DeadLetter(parcel_id, UNRECOGNISED, parcel_id, at, reason, None, f"{note}; inspect it by hand")
    return Parcel(parcel_id, UNRECOGNISED, at, [letter], 0, note=note)


def _order(record: dict[str, Any] | None) -> tuple[str, int, int]:
    assert record is not None
    return str(record["topic"]), int(record["partition"]), int(record["offset"])


def _coordinates(record: dict[str, Any]) -> str:
    return f"{record.get('topic')}/{record.get('partition')}/{record.get('offset')}"


def _ranges(info: dict[str, Any]) -> str:
    ranges = info.get("recordsInfo") or {}
    described = [
        f"{name} offsets {entry.get('firstRecordOffset', '?')}..{entry.get('lastRecordOffset', '?')}"
        for name, entry in sorted(ranges.items())
        if isinstance(entry, dict)
    ]
    return ", ".join(described) or "(no offsets recorded)"


def _timestamp(value: Any) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


@contextmanager
def _aws(action: str, fix: str) -> Iterator[None]:
    """Turns a failed AWS call into one line: what could not be done, why, and what to check."""
    try:
        yield
    except botocore.exceptions.NoCredentialsError as error:
        raise AwsUnavailable(
            f"no AWS credentials to {action}: configure them (AWS_PROFILE, aws sso login), "
            "or against poimen dev add --dev-key"
        ) from error
    except botocore.exceptions.ClientError as error:
        detail = error.response.get("Error", {})
        raise AwsUnavailable(
            f"AWS refused to {action} ({detail.get('Code', '?')}: {detail.get('Message', '')}): {fix}"
        ) from error
    except botocore.exceptions.BotoCoreError as error:
        raise AwsUnavailable(f"cannot {action} ({error}): check --aws-endpoint, --region and the network") from error


_QUEUE_FIX = (
    "check --queue-url (stack output RelayDeadLetterQueueUrl) and that you may Receive, Send, Delete and "
    "ChangeMessageVisibility on it"
)
_BUCKET_FIX = (
    "check --bucket (stack output FailedBatchesBucketName) and that you may ListBucket, GetObject, "
    "PutObject and DeleteObject on it"
)


class DeadLetterQueue:
    """The relay's dead-letter queue. Every message read stays hidden until deleted or released."""

    def __init__(self, sqs: Any, url: str) -> None:
        self._sqs = sqs
        self.url = url
        self._held: dict[str, str] = {}  # MessageId -> latest receipt handle

    def read_all(self, visibility: int) -> list[Parcel]:
        """Every message, each read once and hidden for `visibility` seconds (SQS cannot peek)."""
        parcels: dict[str, Parcel] = {}
        while True:
            with _aws(f"read the dead-letter queue {self.url}", _QUEUE_FIX):
                answer = self._sqs.receive_message(
                    QueueUrl=self.url,
                    MaxNumberOfMessages=10,
                    VisibilityTimeout=visibility,
                    WaitTimeSeconds=SQS_WAIT_SECONDS,
                    MessageSystemAttributeNames=["SentTimestamp"],
                )
            fresh = 0
            for message in answer.get("Messages", []):
                message_id = message["MessageId"]
                # Seen again only if the scan outlived the visibility timeout: keep the newest handle.
                self._held[message_id] = message["ReceiptHandle"]
                if message_id in parcels:
                    parcels[message_id].receipt_handle = message["ReceiptHandle"]
                    continue
                fresh += 1
                sent = message.get("Attributes", {}).get("SentTimestamp")
                sent_at = datetime.fromtimestamp(int(sent) / 1000, UTC) if sent else None
                parcel = parse_message(message_id, message["Body"], sent_at)
                parcel.receipt_handle = message["ReceiptHandle"]
                parcels[message_id] = parcel
            if not fresh:
                return list(parcels.values())

    def delete(self, parcel: Parcel) -> None:
        message_id = parcel.id.removeprefix("sqs:")
        with _aws(f"delete {parcel.id} from {self.url}", _QUEUE_FIX):
            self._sqs.delete_message(QueueUrl=self.url, ReceiptHandle=self._held.get(message_id, parcel.receipt_handle))
        self._held.pop(message_id, None)

    def send(self, body: str) -> str:
        with _aws(f"send a dead letter to {self.url}", _QUEUE_FIX):
            message_id: str = self._sqs.send_message(QueueUrl=self.url, MessageBody=body)["MessageId"]
        return message_id

    def release(self) -> None:
        """Make every message still held visible again, at once rather than when its timeout ends.
        Best effort: whatever is not released reappears by itself."""
        held = list(self._held.values())
        self._held.clear()
        for start in range(0, len(held), 10):
            entries = [
                {"Id": str(index), "ReceiptHandle": handle, "VisibilityTimeout": 0}
                for index, handle in enumerate(held[start : start + 10])
            ]
            try:
                self._sqs.change_message_visibility_batch(QueueUrl=self.url, Entries=entries)
            except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
                return


class FailedBatches:
    """The bucket Lambda parks failed batches in. Every object is read; the key format is not relied on."""

    def __init__(self, s3: Any, bucket: str) -> None:
        self._s3 = s3
        self.bucket = bucket

    def read_all(self) -> list[Parcel]:
        parcels = []
        with _aws(f"list the failed-batch bucket {self.bucket}", _BUCKET_FIX):
            for page in self._s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket):
                for entry in page.get("Contents", []):
                    parcels.append(self.read(entry["Key"]))
        return parcels

    def read(self, key: str) -> Parcel:
        with _aws(f"read s3://{self.bucket}/{key}", _BUCKET_FIX):
            try:
                answer = self._s3.get_object(Bucket=self.bucket, Key=key)
            except botocore.exceptions.ClientError as error:
                if error.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                    raise DeadLetterNotFound(
                        f"no object s3://{self.bucket}/{key}: see poimen dlq list --ids"
                    ) from error
                raise
            body: bytes = answer["Body"].read()
        return parse_object(key, body, answer.get("LastModified"))

    def delete(self, parcel: Parcel) -> None:
        key = parcel.id.removeprefix("s3:")
        with _aws(f"delete s3://{self.bucket}/{key}", _BUCKET_FIX):
            self._s3.delete_object(Bucket=self.bucket, Key=key)

    def rewrite(self, parcel: Parcel, keep: list[dict[str, Any]]) -> None:
        """The same on-failure record, holding only the records in `keep`."""
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
        with _aws(f"rewrite s3://{self.bucket}/{key}", _BUCKET_FIX):
            self._s3.put_object(
                Bucket=self.bucket, Key=key, Body=json.dumps(document).encode(), ContentType="application/json"
            )


@contextmanager
def holding(queue: DeadLetterQueue | None, batches: FailedBatches | None, visibility: int) -> Iterator[list[Parcel]]:
    """Every dead letter, oldest first; the queue's messages are released when the block ends."""
    try:
        parcels = (queue.read_all(visibility) if queue else []) + (batches.read_all() if batches else [])
        yield sorted(parcels, key=lambda p: (p.at.timestamp() if p.at else float("inf"), p.id))
    finally:
        if queue:
            queue.release()


# -- sending records again -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Dispatch:
    """A record that is a dispatch: the tenant of its topic and its value, to be POSTed verbatim."""

    tenant: str
    body: bytes
    dispatch_key: Any
    traceparent: str | None


def dispatch_of(record: dict[str, Any]) -> Dispatch | DeadLetterReason:
    """The record as the relay sees it: a dispatch to send, or why the relay dead-letters it."""
    tenant = tenant_of_dispatch_topic(str(record.get("topic")))
    if tenant is None:
        return DeadLetterReason("invalid-topic", "topic is not poimen.<tenant>.dispatch")
    if record.get("value") is None:
        return DeadLetterReason("empty-value", "the record has no value")
    try:
        body = base64.b64decode(record["value"], validate=True)
        spawn = json.loads(body.decode("utf-8"))
    except (binascii.Error, TypeError) as error:
        return DeadLetterReason("undecodable", f"value is not base64: {error}")
    except UnicodeDecodeError as error:
        return DeadLetterReason("undecodable", f"value is not UTF-8: {error}")
    except (ValueError, RecursionError) as error:
        return DeadLetterReason("invalid-json", f"value is not JSON: {error}")
    if not isinstance(spawn, dict):
        return DeadLetterReason("invalid-json", "value is not a JSON object")
    return Dispatch(tenant, body, spawn.get("dispatch_key"), _traceparent(record))


def _traceparent(record: dict[str, Any]) -> str | None:
    """Forwarded as the relay forwards it: only if it is well-formed W3C Trace Context."""
    for header in record.get("headers") or []:
        if isinstance(header, dict) and isinstance(header.get("traceparent"), list):
            try:
                text = bytes(header["traceparent"]).decode("ascii", "replace")
            except (TypeError, ValueError):
                return None
            return text if TRACEPARENT.fullmatch(text) else None
    return None


class AdmissionApi:
    """`POST /v1/runs`, SigV4-signed (execute-api) as the caller, as the relay signs as itself."""

    def __init__(self, base_url: str, credentials: Any, region: str, http: urllib3.PoolManager | None = None) -> None:
        self.runs_url = f"{base_url.rstrip('/')}/v1/runs"
        self._credentials = credentials
        self._region = region
        self._http = http or urllib3.PoolManager(retries=False)

    @property
    def access_key(self) -> str:
        return str(self._frozen().access_key)

    def spawn(self, dispatch: Dispatch) -> tuple[int, Any]:
        """The API's status and answer for 201, 200 and the statuses that blame the record; raises
        ApiUnavailable or ApiRefused for anything else."""
        headers = {"Content-Type": "application/json", TENANT_HEADER: dispatch.tenant}
        if dispatch.traceparent:
            headers["traceparent"] = dispatch.traceparent
        request = AWSRequest(method="POST", url=self.runs_url, data=dispatch.body, headers=headers)
        SigV4Auth(self._frozen(), "execute-api", self._region).add_auth(request)
        try:
            response = self._http.request(
                "POST",
                self.runs_url,
                body=dispatch.body,
                headers=dict(request.headers.items()),
                timeout=urllib3.Timeout(connect=HTTP_CONNECT_TIMEOUT_SECONDS, read=HTTP_READ_TIMEOUT_SECONDS),
                redirect=False,
            )
        except urllib3.exceptions.HTTPError as error:
            raise ApiUnavailable(
                f"cannot reach the admission API at {self.runs_url} ({type(error).__name__}): "
                "check --api-url and that the API is up, then run redrive again"
            ) from error
        answer = _json_or_text(response.data)
        if response.status in CONFIRMED or response.status in RECORD_FAULT_STATUSES:
            return response.status, answer
        if response.status in RETRYABLE_STATUSES:
            raise ApiUnavailable(
                f"the admission API answered {response.status} ({_problem_summary(answer)}): "
                "it is unavailable; run redrive again once it is healthy"
            )
        raise ApiRefused(
            f"the admission API refused the caller with {response.status} ({_problem_summary(answer)}): "
            "grant your principal the tenant (poimen grants add), check your credentials (--dev-key for "
            "poimen dev) and --api-url"
        )

    def _frozen(self) -> Any:
        try:
            return self._credentials.get_frozen_credentials()
        except botocore.exceptions.BotoCoreError as error:
            raise AwsUnavailable(f"cannot sign admission API calls ({error}): refresh your AWS credentials") from error


def _json_or_text(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return data.decode("utf-8", "replace")


def _problem_summary(answer: Any) -> str:
    if isinstance(answer, dict):
        return str(answer.get("type") or answer.get("message") or answer.get("title") or answer)[:200]
    return str(answer)[:200] or "no body"


@dataclass
class RedriveSummary:
    redriven: int = 0  # 201: a run admitted now
    replayed: int = 0  # 200: the run already existed (the record was admitted before)
    still_failing: int = 0  # refused again (or not a dispatch), kept with the new reason
    skipped: int = 0  # cannot be sent from here: left as it is
    would_send: int = 0  # --dry-run
    not_attempted: int = 0  # left when redrive stopped
    stopped: DlqError | None = None

    def rows(self, dry_run: bool) -> list[tuple[str, int]]:
        if dry_run:
            return [("would send", self.would_send), ("skipped", self.skipped)]
        rows = [
            ("redriven (201)", self.redriven),
            ("replayed (200)", self.replayed),
            ("still failing", self.still_failing),
            ("skipped", self.skipped),
        ]
        return [*rows, ("not attempted", self.not_attempted)] if self.stopped else rows

    @property
    def exit_code(self) -> int:
        if self.stopped:
            return self.stopped.exit_code
        return EXIT_REMAINING if self.still_failing or self.skipped else EXIT_OK


class Progress:
    """A counter line on stderr, redrawn in place on a terminal; notices printed above it."""

    def __init__(self, total: int, stream: TextIO) -> None:
        self._total, self._done, self._stream = total, 0, stream
        self._live = stream.isatty()

    def advance(self) -> None:
        self._done += 1
        self._draw()

    def note(self, line: str) -> None:
        if self._live:
            self._stream.write("\r\033[K")  # clear the bar, print the line, draw the bar again below it
        self._stream.write(line + "\n")
        self._draw()

    def _draw(self) -> None:
        if self._live:
            width = 30
            filled = width * self._done // max(1, self._total)
            self._stream.write(f"\rredrive [{'#' * filled}{'.' * (width - filled)}] {self._done}/{self._total}")
        self._stream.flush()

    def finish(self) -> None:
        if self._live:
            self._stream.write("\n")
        else:
            self._stream.write(f"redrive: {self._done}/{self._total} dead letters handled\n")
        self._stream.flush()


class Redrive:
    """Sends dead letters through `POST /v1/runs` one at a time, oldest first; within a failed batch in
    (topic, partition, offset) order, so records of one key keep their order.

    - 201 / 200: the dead letter is deleted (an object once none of its records is left).
    - 400, 413, 415, 422 (the record is at fault): a relay dead letter is replaced by a new message with
      the new reason (left as it is, age included, if the reason is the same); a record of a failed batch
      moves to the queue as a relay dead letter with that reason (without --queue-url, or if it would not
      fit SQS whole, it stays in its object).
    - a failed-batch record the relay would dead-letter (invalid topic, null value, not JSON) moves to the
      queue the same way; a relay dead letter of those kinds cannot be sent and is skipped.
    - anything else: stop. What was not confirmed stays; an object is rewritten without what was.
    """

    def __init__(
        self,
        api: AdmissionApi | None,
        queue: DeadLetterQueue | None,
        batches: FailedBatches | None,
        progress: Progress,
        plan_line: Callable[[str], None],
    ) -> None:
        self._api, self._queue, self._batches = api, queue, batches
        self._progress, self._plan_line = progress, plan_line
        self.summary = RedriveSummary()

    @property
    def _dry_run(self) -> bool:
        return self._api is None

    def run(self, parcels: Iterable[Parcel]) -> RedriveSummary:
        for parcel in parcels:
            try:
                if parcel.in_queue:
                    self._message(parcel)
                else:
                    self._object(parcel)
            except DlqError as error:  # SQS or S3 failed: stop as for the API, counting what is left
                self.summary.stopped = error
        self._progress.finish()
        return self.summary

    def _message(self, parcel: Parcel) -> None:
        (letter,) = parcel.letters
        dispatch = self._sendable(letter)
        if dispatch is None:
            return
        if isinstance(dispatch, DeadLetterReason):
            self._skip(letter, f"{dispatch.kind}: {dispatch.detail}; it cannot be sent as it is")
            return
        reason = self._send(letter, dispatch)
        if reason is None:
            if not self._dry_run and not self.summary.stopped:
                assert self._queue is not None
                self._queue.delete(parcel)
            return
        assert self._queue is not None
        assert letter.record is not None
        if _same_reason(letter.reason, reason):
            self._failing(letter, reason, "unchanged")  # kept as it is, with its age
            return
        new_id = self._queue.send(dead_letter_body(KafkaEventRecord(letter.record), reason))
        self._queue.delete(parcel)
        self._failing(letter, reason, f"now sqs:{new_id}")

    def _object(self, parcel: Parcel) -> None:
        keep: list[dict[str, Any]] = []
        changed = False
        for letter in parcel.letters:
            record = letter.record
            dispatch = self._sendable(letter)
            if record is None:
                return  # metadata only, or unrecognised: nothing in it can be sent
            if dispatch is None:
                keep.append(record)
                continue
            reason = dispatch if isinstance(dispatch, DeadLetterReason) else self._send(letter, dispatch)
            if reason is None:
                if self._dry_run or self.summary.stopped:
                    keep.append(record)
                else:
                    changed = True
                continue
            if self._dry_run:
                self._skip(letter, f"{reason.kind}: {reason.detail}; would move to the dead-letter queue")
                keep.append(record)
                continue
            try:
                moved = self._move(letter, reason)
            except DlqError as error:  # the queue failed: stop, but still take out what was confirmed
                self.summary.stopped, moved = error, None
            if moved is None:
                keep.append(record)
            else:
                changed = True
            self._failing(letter, reason, f"now {moved}" if moved else "kept in its object")
        if self._dry_run or not changed:
            return
        assert self._batches is not None
        if keep:
            self._batches.rewrite(parcel, keep)
        else:
            self._batches.delete(parcel)

    def _sendable(self, letter: DeadLetter) -> Dispatch | DeadLetterReason | None:
        """What to do with the letter; None when it is left as it is (blocked, or redrive stopped)."""
        if self.summary.stopped:
            self.summary.not_attempted += 1
            return None
        self._progress.advance()
        if letter.blocked or letter.record is None:
            self._skip(letter, letter.blocked or "nothing to send")
            return None
        return dispatch_of(letter.record)

    def _send(self, letter: DeadLetter, dispatch: Dispatch) -> DeadLetterReason | None:
        """None when confirmed (or, in a dry run, planned) or when redrive stopped; else the new reason."""
        if self._api is None:
            key = "(none: a new run)" if dispatch.dispatch_key is None else json.dumps(dispatch.dispatch_key)
            self._plan_line(f"would send {letter.id}  tenant {dispatch.tenant}  dispatch_key {key}")
            self.summary.would_send += 1
            return None
        try:
            status, answer = self._api.spawn(dispatch)
        except DlqError as error:
            self.summary.stopped = error
            self.summary.not_attempted += 1
            return None
        if status == 201:
            self.summary.redriven += 1
            return None
        if status == 200:
            self.summary.replayed += 1
            return None
        return DeadLetterReason("rejected", f"the admission API answered {status}", status, answer)

    def _move(self, letter: DeadLetter, reason: DeadLetterReason) -> str | None:
        """The record as a relay dead letter in the queue; None if there is no queue or it would not fit."""
        if self._queue is None or letter.record is None:
            return None
        body = dead_letter_body(KafkaEventRecord(letter.record), reason)
        if json.loads(body)["record"].get("valueOmitted"):
            return None  # its value would be lost: it stays in the object
        return f"sqs:{self._queue.send(body)}"

    def _failing(self, letter: DeadLetter, reason: DeadLetterReason, where: str) -> None:
        self.summary.still_failing += 1
        problem = f" {_problem_summary(reason.problem)}" if reason.problem is not None else ""
        self._progress.note(f"still failing: {letter.id}: {reason.kind}: {reason.detail}{problem} ({where})")

    def _skip(self, letter: DeadLetter, why: str) -> None:
        self.summary.skipped += 1
        self._progress.note(f"skipped: {letter.id}: {why}")


def _same_reason(kept: dict[str, Any], new: DeadLetterReason) -> bool:
    return (kept.get("kind"), kept.get("status"), kept.get("problem")) == (new.kind, new.status, new.problem)


@dataclass(frozen=True)
class Plan:
    letters: int
    sendable: int
    keyless: int


def plan(parcels: Iterable[Parcel]) -> Plan:
    letters = sendable = keyless = 0
    for parcel in parcels:
        for letter in parcel.letters:
            letters += 1
            dispatch = None if letter.blocked or letter.record is None else dispatch_of(letter.record)
            if isinstance(dispatch, Dispatch):
                sendable += 1
                keyless += dispatch.dispatch_key is None
    return Plan(letters, sendable, keyless)


# -- presenting ----------------------------------------------------------------------------------------


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
    records: int = 0
    oldest: datetime | None = None
    newest: datetime | None = None


def count_by_kind(parcels: Iterable[Parcel]) -> dict[str, KindCount]:
    """Counts by kind, in the order of KINDS (then any other kind a message names)."""
    kinds: dict[str, KindCount] = {}
    for parcel in parcels:
        count = kinds.setdefault(parcel.kind, KindCount())
        count.letters += 1
        count.records += parcel.records
        if parcel.at is not None:
            count.oldest = parcel.at if count.oldest is None else min(count.oldest, parcel.at)
            count.newest = parcel.at if count.newest is None else max(count.newest, parcel.at)
    order = sorted(kinds, key=lambda kind: (KINDS.index(kind) if kind in KINDS else len(KINDS), kind))
    return {kind: kinds[kind] for kind in order}


def inventory(parcels: list[Parcel], now: datetime) -> dict[str, Any]:
    """`list --json`: counts by kind with oldest and newest, and every dead letter."""
    return {
        "kinds": {
            kind: {
                "letters": count.letters,
                "records": count.records,
                "oldest": _iso(count.oldest),
                "newest": _iso(count.newest),
                "oldestAgeSeconds": _seconds(count.oldest, now),
                "newestAgeSeconds": _seconds(count.newest, now),
            }
            for kind, count in count_by_kind(parcels).items()
        },
        "deadLetters": [
            {
                "id": letter.id,
                "kind": letter.kind,
                "deadLetteredAt": _iso(letter.at),
                "where": letter.coordinates or None,
                "redrivable": letter.blocked is None,
                "note": letter.blocked or _reason_line(letter.reason),
            }
            for parcel in parcels
            for letter in parcel.letters
        ],
    }


def render_inventory(parcels: list[Parcel], now: datetime, ids: bool) -> str:
    if not parcels:
        return "no dead letters\n"
    rows = [("kind", "letters", "records", "oldest", "newest")]
    for kind, count in count_by_kind(parcels).items():
        rows.append((kind, str(count.letters), str(count.records), age(count.oldest, now), age(count.newest, now)))
    rows.append(("total", str(len(parcels)), str(sum(parcel.records for parcel in parcels)), "", ""))
    text = _table(rows, right=(1, 2))
    if ids:
        lines = [
            (letter.id, letter.kind, age(letter.at, now), letter.blocked or _reason_line(letter.reason))
            for parcel in parcels
            for letter in parcel.letters
        ]
        text += "\n" + _table([("id", "kind", "age", "note"), *lines])
    return text


def letter_document(letter: DeadLetter, now: datetime) -> dict[str, Any]:
    """`show --json`: one dead letter, its key, value and headers decoded."""
    record = letter.record or {}
    dispatch = None if letter.blocked or letter.record is None else dispatch_of(letter.record)
    if isinstance(dispatch, Dispatch):
        redrive = f"POST /v1/runs for tenant {dispatch.tenant}, " + (
            "without dispatch_key: a new run each time it is sent"
            if dispatch.dispatch_key is None
            else f"dispatch_key {json.dumps(dispatch.dispatch_key)}: a replay if it was admitted meanwhile"
        )
    elif isinstance(dispatch, DeadLetterReason):
        redrive = f"not possible: {dispatch.kind}: {dispatch.detail}"
    else:
        redrive = f"not possible: {letter.blocked}"
    document: dict[str, Any] = {
        "id": letter.id,
        "kind": letter.kind,
        "deadLetteredAt": _iso(letter.at),
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
        ("reason", _reason_line(reason)),
        ("status", str(reason.get("status") if reason.get("status") is not None else "-")),
        ("redrive", document["redrive"]),
        ("key", _show(document["key"])),
        ("headers", _show(document["headers"])),
    ]
    width = max(len(name) for name, _ in lines) + 1
    text = "".join(f"{name + ':':<{width}} {value}\n" for name, value in lines)
    text += f"problem:\n{_show(reason.get('problem'), indent=True)}\n"
    return text + f"value:\n{_show(document['value'], indent=True)}\n"


def _reason_line(reason: dict[str, Any]) -> str:
    text = f"{reason.get('kind')}: {reason.get('detail')}"
    if "problemOmitted" in reason:
        text += " (problem omitted: too large for SQS)"
    return text


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


def _table(rows: Sequence[tuple[str, ...]], right: tuple[int, ...] = ()) -> str:
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return "".join(
        "  ".join(
            cell.rjust(widths[column]) if column in right else cell.ljust(widths[column])
            for column, cell in enumerate(row)
        ).rstrip()
        + "\n"
        for row in rows
    )


def _iso(at: datetime | None) -> str | None:
    return None if at is None else at.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _seconds(at: datetime | None, now: datetime) -> int | None:
    return None if at is None else max(0, int((now - at).total_seconds()))


# -- the command line ----------------------------------------------------------------------------------

EPILOG = """\
IDs: sqs:<MessageId> (a relay dead letter), s3:<key> (a failed batch), s3:<key>#<topic>-<partition>@<offset>
(one record of a failed batch); `poimen dlq list --ids` shows them.

exit codes: 0 done; 1 some dead letters of the chosen kinds remain (failing again, or not sendable);
2 usage error, unknown ID, or redrive refused / not confirmed; 3 AWS or the admission API unreachable,
or refusing the caller (nothing unconfirmed is removed)."""


def add_dlq_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`poimen dlq list|show|redrive`, with the options every action shares."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--api-url", metavar="URL", help="admission API base URL (stack output AdmissionApiUrl)")
    common.add_argument(
        "--queue-url", metavar="URL", help="the relay's dead-letter queue (stack output RelayDeadLetterQueueUrl)"
    )
    common.add_argument(
        "--bucket", metavar="NAME", help="the failed-batch bucket (stack output FailedBatchesBucketName)"
    )
    common.add_argument(
        "--region",
        default=os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
        help="(default: AWS_REGION, AWS_DEFAULT_REGION, else us-east-1)",
    )
    common.add_argument(
        "--aws-endpoint", metavar="URL", help="one endpoint for SQS and S3, e.g. poimen dev's moto (default: the SDK's)"
    )
    common.add_argument(
        "--dev-key",
        action="store_true",
        help="local only: sign API, SQS and S3 calls with poimen dev's documented dev key, not your AWS credentials",
    )
    common.add_argument("--debug", action="store_true", help="a traceback instead of the one-line error")
    formatter = argparse.RawDescriptionHelpFormatter
    dlq = commands.add_parser(
        "dlq",
        help="inspect and redrive dispatch records that did not become runs",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=formatter,
    )
    actions = dlq.add_subparsers(dest="action", required=True)
    listing = actions.add_parser(
        "list",
        parents=[common],
        help="counts by kind, oldest and newest",
        description=f"Counts by kind. Reads each SQS message with a {LIST_VISIBILITY_SECONDS} s visibility "
        "timeout (SQS cannot peek) and releases it when done; deletes nothing.",
        epilog=EPILOG,
        formatter_class=formatter,
    )
    listing.add_argument("--json", action="store_true", help="machine-readable, with every dead letter")
    listing.add_argument("--ids", action="store_true", help="also one line per dead letter")
    show = actions.add_parser(
        "show", parents=[common], help="one dead letter, decoded", epilog=EPILOG, formatter_class=formatter
    )
    show.add_argument("id", metavar="ID")
    show.add_argument("--json", action="store_true")
    redrive = actions.add_parser(
        "redrive",
        parents=[common],
        help="send dead letters again through POST /v1/runs, signed as you",
        description=inspect.cleandoc(Redrive.__doc__ or ""),
        epilog=EPILOG,
        formatter_class=formatter,
    )
    redrive.add_argument(
        "--kind",
        action="append",
        choices=KINDS,
        metavar="KIND",
        help=f"only this kind (repeatable; default: all): {', '.join(KINDS)}",
    )
    redrive.add_argument("--dry-run", action="store_true", help="say what would be sent; change nothing")
    redrive.add_argument("--yes", action="store_true", help="do not ask for confirmation")


def main(argv: list[str], parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser) -> int:
    """`poimen dlq ...` (argv without `dlq`), parsed (by `parser_class`: the CLI's, one-line errors) and run."""
    parser = parser_class(prog="poimen")
    add_dlq_commands(parser.add_subparsers(dest="command", required=True))
    return run_dlq(parser.parse_args(["dlq", *argv]))


def run_dlq(
    args: argparse.Namespace,
    *,
    http: urllib3.PoolManager | None = None,
    credentials: Any | None = None,
    stdin: TextIO | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """`poimen dlq <action>`; errors end as one line on stderr and their exit code (--debug: traceback)."""
    out, err = stdout or sys.stdout, stderr or sys.stderr
    try:
        return _run(args, http, credentials, stdin or sys.stdin, out, err)
    except DlqError as error:
        if args.debug:
            raise
        print(f"poimen dlq {args.action}: {error}", file=err)
        return error.exit_code


def _run(
    args: argparse.Namespace,
    http: urllib3.PoolManager | None,
    credentials: Any | None,
    stdin: TextIO,
    out: TextIO,
    err: TextIO,
) -> int:
    if not args.queue_url and not args.bucket:
        raise UsageError("nothing to read: give --queue-url (the relay's dead-letter queue) and/or --bucket")
    queue = DeadLetterQueue(_aws_client("sqs", args), args.queue_url) if args.queue_url else None
    batches = FailedBatches(_aws_client("s3", args), args.bucket) if args.bucket else None
    now = datetime.now(UTC)
    if args.action == "list":
        with holding(queue, batches, LIST_VISIBILITY_SECONDS) as parcels:
            text = json.dumps(inventory(parcels, now), indent=2) + "\n" if args.json else None
            out.write(text or render_inventory(parcels, now, args.ids))
        return EXIT_OK
    if args.action == "show":
        found = _find(args.id, queue, batches)
        if args.json:
            letters = [letter_document(letter, now) for letter in found]
            out.write(json.dumps(letters[0] if len(letters) == 1 else letters, indent=2, ensure_ascii=False) + "\n")
        else:
            out.write("\n".join(render_letter(letter, now) for letter in found))
        return EXIT_OK
    api = None
    if not args.dry_run:
        if not args.api_url:
            raise UsageError("redrive needs --api-url (stack output AdmissionApiUrl), or --dry-run")
        signer = credentials or _caller_credentials(args.dev_key, args.api_url)
        api = AdmissionApi(args.api_url, signer, args.region, http)
    with holding(queue, batches, REDRIVE_VISIBILITY_SECONDS) as parcels:
        chosen = [parcel for parcel in parcels if not args.kind or parcel.kind in args.kind]
        planned = plan(chosen)
        if api is not None and planned.letters and not args.yes:
            _confirm(planned, api, stdin, err)
        redrive = Redrive(api, queue, batches, Progress(planned.letters, err), lambda line: print(line, file=out))
        summary = redrive.run(chosen)
    rows = [("outcome", "records"), *((name, str(count)) for name, count in summary.rows(api is None))]
    out.write(_table(rows, right=(1,)))
    if summary.stopped:
        print(f"poimen dlq redrive: stopped: {summary.stopped}", file=err)
    return EXIT_OK if api is None else summary.exit_code


def _find(dead_letter_id: str, queue: DeadLetterQueue | None, batches: FailedBatches | None) -> list[DeadLetter]:
    hint = "see poimen dlq list --ids"
    if dead_letter_id.startswith("s3:"):
        if batches is None:
            raise UsageError("an s3: ID needs --bucket")
        key, fragment = dead_letter_id[3:], None
        head, _, tail = key.rpartition("#")
        if head and _RECORD_FRAGMENT.fullmatch(tail):
            key, fragment = head, tail
        parcel = batches.read(key)
        letters = [letter for letter in parcel.letters if fragment is None or letter.id == dead_letter_id]
        if not letters:
            raise DeadLetterNotFound(f"s3://{batches.bucket}/{key} holds no record {fragment}: {hint}")
        return letters
    if dead_letter_id.startswith("sqs:"):
        if queue is None:
            raise UsageError("an sqs: ID needs --queue-url")
        with holding(queue, None, LIST_VISIBILITY_SECONDS) as parcels:
            for parcel in parcels:
                if parcel.id == dead_letter_id:
                    return parcel.letters
        raise DeadLetterNotFound(f"no message {dead_letter_id} in {queue.url}: {hint}")
    raise UsageError(f"{dead_letter_id!r} is not a dead-letter ID (sqs:<MessageId> or s3:<key>[#...]): {hint}")


def _confirm(planned: Plan, api: AdmissionApi, stdin: TextIO, err: TextIO) -> None:
    if not stdin.isatty():
        raise UsageError("refusing to redrive without confirmation: stdin is not a terminal; add --yes (or --dry-run)")
    keyless = f" {planned.keyless} have no dispatch_key: each becomes a new run." if planned.keyless else ""
    err.write(
        f"Send {planned.sendable} of {planned.letters} dead letters to {api.runs_url}, signed as "
        f"{api.access_key}?{keyless} [y/N] "
    )
    err.flush()
    if stdin.readline().strip().lower() not in ("y", "yes"):
        raise UsageError("redrive not confirmed: nothing was sent")


def _caller_credentials(dev_key: bool, api_url: str) -> Any:
    if dev_key or _local_credentials(api_url):
        return Credentials(DEV_ACCESS_KEY, DEV_SECRET_KEY)
    found = botocore.session.get_session().get_credentials()
    if found is None:
        raise AwsUnavailable(
            "no AWS credentials to sign admission API calls with: configure them (AWS_PROFILE, aws sso login), "
            "or add --dev-key against poimen dev"
        )
    return found


def _aws_client(service: str, args: argparse.Namespace) -> Any:
    options: dict[str, Any] = {
        "region_name": args.region,
        "config": botocore.config.Config(
            connect_timeout=5,
            read_timeout=30,
            retries={"mode": "standard", "max_attempts": 3},
            s3={"addressing_style": "path"} if args.aws_endpoint else None,
        ),
    }
    if args.aws_endpoint:
        options["endpoint_url"] = args.aws_endpoint
    endpoint = (
        args.aws_endpoint or os.environ.get(f"AWS_ENDPOINT_URL_{service.upper()}") or os.environ.get("AWS_ENDPOINT_URL")
    )
    if args.dev_key or _local_credentials(endpoint):
        # Local only, like the dev key itself: moto takes any key, so poimen dev needs no AWS credentials.
        # Without --aws-endpoint the SDK's AWS_ENDPOINT_URL_SQS / _S3 still name the local endpoints.
        options |= {"aws_access_key_id": DEV_ACCESS_KEY, "aws_secret_access_key": DEV_SECRET_KEY}
    return boto3.client(service, **options)  # type: ignore[call-overload]


def _local_credentials(endpoint: str | None) -> bool:
    """Whether `endpoint` is a loopback one the SDK's chain has no credentials for (then: the dev key)."""
    return local_credentials(endpoint) is not None
