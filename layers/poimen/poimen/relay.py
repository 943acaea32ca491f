"""The inbox relay: MSK dispatch records become POST /v1/runs calls over HTTP, bad ones dead letters.

It knows only the HTTP contract: it never imports the store or admission (a test enforces it), and its
IAM role has no DynamoDB permission. Redelivered records are absorbed by admission's dispatch_key
deduplication alone; the relay keeps no idempotency state of its own. No record stalls a batch: only
the API (unreachable, or refusing the relay itself), the dead-letter queue, or time running out fail it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import random
import re
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any

import botocore.config
import botocore.exceptions
import botocore.session
import urllib3
from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.data_classes.kafka_event import KafkaEvent, KafkaEventRecord
from aws_lambda_powertools.utilities.typing import LambdaContext
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest

from poimen.config import RelaySettings
from poimen.kafka import tenant_of_dispatch_topic
from poimen.observability import logger, metrics
from poimen.wire import TENANT_HEADER

RETRYABLE_STATUSES = frozenset({408, 429}) | frozenset(range(500, 600))
# The answers that blame the record itself: dead-letter it and drain on. Any other refusal (401, 403,
# 404, 405, 3xx, ...) says the relay or the API is misconfigured, which every record would hit alike:
# the batch fails instead, so a fix lets the same records through rather than into the DLQ.
RECORD_FAULT_STATUSES = frozenset({400, 413, 415, 422})
# SQS takes message bodies of up to 1 MiB (the queue's MaximumMessageSize in template.yaml). A dead
# letter that would not fit leaves out these parts, in this order, until it does; its coordinates always
# stay, so the record can be read again from Kafka at that partition and offset.
MAX_DEAD_LETTER_BYTES = 1024 * 1024
OMITTED_IN_ORDER = (("record", "value"), ("record", "headers"), ("record", "key"), ("reason", "problem"))
MAX_DETAIL_CHARS = 1000
# W3C Trace Context: version-traceid-parentid-flags in lowercase hex; version ff and all-zero ids are invalid.
TRACEPARENT = re.compile(r"(?!ff)[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")


class BatchFailed(Exception):
    """The event source must retry the whole batch; no record is dead-lettered for this cause."""


class AdmissionApiUnavailable(BatchFailed):
    """The API could not be reached within the invocation's budget."""


class AdmissionApiRefused(BatchFailed):
    """The API refused the relay itself (authorization, URL)."""


class DeadLetterQueueUnavailable(BatchFailed):
    """A dead letter could not be sent before the deadline, or the queue refused it."""


class _Aborted(BatchFailed):
    """A record stopped because another record already failed the batch."""


@dataclass(frozen=True)
class DeadLetterReason:
    kind: str  # invalid-topic | empty-value | undecodable | invalid-json | rejected | relay-error
    detail: str
    status: int | None = None
    problem: Any = None


@dataclass
class BatchOutcome:
    """What one invocation did; published as EMF metrics even when the invocation fails, with the batch's
    tenant as a dimension (one event source mapping per tenant: a batch is one tenant's topic)."""

    tenant: str | None = None
    relayed: int = 0
    replayed: int = 0
    dead_lettered: int = 0
    retries: int = 0
    max_lag_ms: float | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def admitted(self, replayed: bool, lag_ms: float | None) -> None:
        with self._lock:
            if replayed:
                self.replayed += 1
            else:
                self.relayed += 1
            if lag_ms is not None:
                self.max_lag_ms = lag_ms if self.max_lag_ms is None else max(self.max_lag_ms, lag_ms)

    def count(self, name: str, amount: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + amount)

    def publish(self) -> None:
        if self.tenant is not None:
            metrics.add_dimension(name="tenant", value=self.tenant)
        metrics.add_metric(name="DispatchRelayed", unit=MetricUnit.Count, value=self.relayed)
        metrics.add_metric(name="DispatchReplayed", unit=MetricUnit.Count, value=self.replayed)
        metrics.add_metric(name="DispatchDeadLettered", unit=MetricUnit.Count, value=self.dead_lettered)
        metrics.add_metric(name="RelayRetries", unit=MetricUnit.Count, value=self.retries)
        if self.max_lag_ms is not None:
            metrics.add_metric(name="InboxLag", unit=MetricUnit.Milliseconds, value=self.max_lag_ms)


@dataclass(frozen=True)
class _Batch:
    """What the records of one invocation share: its deadline, its outcome, and whether it already failed."""

    deadline: float
    outcome: BatchOutcome
    abort: threading.Event


class Relay:
    """Relays batches to one admission API; built once per execution environment."""

    def __init__(
        self,
        settings: RelaySettings,
        *,
        sqs: Any | None = None,
        http: urllib3.PoolManager | None = None,
        credentials: Any | None = None,
    ) -> None:
        self._settings = settings
        self._runs_url = f"{settings.admission_api_url}/v1/runs"
        self._http = http or urllib3.PoolManager(maxsize=settings.max_concurrency, block=True, retries=False)
        # botocore, not boto3: boto3 would import s3transfer and multiprocessing on the cold path for nothing.
        session = botocore.session.get_session()
        # AWS endpoints come from the standard SDK configuration (AWS_ENDPOINT_URL_SQS, ...). One attempt
        # per call, bounded by its timeouts: the relay retries itself, and only while an attempt still
        # fits before the deadline.
        self._sqs: Any = sqs or session.create_client(
            "sqs",
            region_name=settings.region,
            config=botocore.config.Config(
                connect_timeout=settings.dlq_timeout_seconds,
                read_timeout=settings.dlq_timeout_seconds,
                retries={"mode": "standard", "total_max_attempts": 1},
                max_pool_connections=settings.max_concurrency,
            ),
        )
        found = credentials or session.get_credentials()
        if found is None:
            raise RuntimeError("no AWS credentials to sign admission API calls with")
        self._credentials: Any = found

    def relay_batch(self, event: KafkaEvent, remaining_ms: Callable[[], int], outcome: BatchOutcome) -> None:
        """Relay every record; raise BatchFailed if the batch must be retried (the API down past the budget
        or refusing the relay, a dead letter that could not be sent). Nothing is dead-lettered for those."""
        deadline = time.monotonic() + remaining_ms() / 1000 - self._settings.time_margin_seconds
        batch = _Batch(deadline, outcome, threading.Event())
        groups = _ordered_groups(event.records)
        tenants = {tenant_of_dispatch_topic(record.topic) for group in groups for record in group}
        if len(tenants) == 1:
            outcome.tenant = tenants.pop()  # None for a topic that is no tenant's: no tenant dimension

        def relay_group(records: list[KafkaEventRecord]) -> None:
            for record in records:
                if batch.abort.is_set():
                    return  # the batch will be retried whole; later records must not overtake
                try:
                    self._relay_or_dead_letter(record, batch)
                except BaseException:
                    batch.abort.set()
                    raise

        workers = max(1, min(self._settings.max_concurrency, len(groups)))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            failures = [f.exception() for f in [pool.submit(relay_group, group) for group in groups]]
        errors = [error for error in failures if error is not None]
        if errors:
            # The first cause, not the groups that merely stopped because of it.
            raise next((e for e in errors if not isinstance(e, _Aborted)), errors[0])

    def _relay_or_dead_letter(self, record: KafkaEventRecord, batch: _Batch) -> None:
        """Relay one record. A fault of the record's own, foreseen or not, ends as its dead letter."""
        try:
            self._relay_record(record, batch)
        except BatchFailed:
            raise
        except Exception as error:
            logger.exception("relaying the record failed", topic=record.topic, offset=record.offset)
            self._dead_letter(record, DeadLetterReason("relay-error", f"{type(error).__name__}: {error}"), batch)

    def _relay_record(self, record: KafkaEventRecord, batch: _Batch) -> None:
        tenant_id = tenant_of_dispatch_topic(record.topic)
        if tenant_id is None:
            self._dead_letter(record, DeadLetterReason("invalid-topic", "topic is not poimen.<tenant>.dispatch"), batch)
            return
        if record.get("value") is None:  # a tombstone: Kafka's null value
            self._dead_letter(record, DeadLetterReason("empty-value", "the record has no value"), batch)
            return
        try:
            body = base64.b64decode(record.value, validate=True)
            spawn = json.loads(body.decode("utf-8"))
        except binascii.Error as error:
            self._dead_letter(record, DeadLetterReason("undecodable", f"value is not base64: {error}"), batch)
            return
        except UnicodeDecodeError as error:
            self._dead_letter(record, DeadLetterReason("undecodable", f"value is not UTF-8: {error}"), batch)
            return
        except (ValueError, RecursionError) as error:
            self._dead_letter(record, DeadLetterReason("invalid-json", f"value is not JSON: {error}"), batch)
            return
        if not isinstance(spawn, dict):
            self._dead_letter(record, DeadLetterReason("invalid-json", "value is not a JSON object"), batch)
            return
        dispatch_key = spawn.get("dispatch_key")
        if dispatch_key is None:
            # Relayed, as the API admits keyless spawns; but a retry after a lost answer, or of the
            # batch, can then admit it twice. Publishers should always set a dispatch_key.
            logger.warning("dispatch without dispatch_key: delivered at least once", topic=record.topic)
        status, answer = self._post(tenant_id, body, _traceparent(record), batch)
        if status in (200, 201):
            # A record without a timestamp (-1) has no lag to tell.
            lag_ms = max(0.0, time.time() * 1000 - record.timestamp) if record.timestamp > 0 else None
            batch.outcome.admitted(replayed=status == 200, lag_ms=lag_ms)
            logger.info(
                "dispatch replayed" if status == 200 else "dispatch relayed",
                tenant_id=tenant_id,
                dispatch_key=dispatch_key,
                run_id=answer.get("run_id") if isinstance(answer, dict) else None,
                topic=record.topic,
                partition=record.partition,
                offset=record.offset,
            )
            return
        if status not in RECORD_FAULT_STATUSES:
            raise AdmissionApiRefused(f"the admission API refused the relay with {status}: {answer}")
        reason = DeadLetterReason("rejected", f"the admission API answered {status}", status, answer)
        self._dead_letter(record, reason, batch, tenant_id=tenant_id, dispatch_key=dispatch_key)

    def _post(self, tenant_id: str, body: bytes, traceparent: str | None, batch: _Batch) -> tuple[int, Any]:
        """POST the body verbatim, retrying transient failures with full-jitter backoff until the deadline."""
        headers = {"Content-Type": "application/json", TENANT_HEADER: tenant_id}
        if traceparent:
            headers["traceparent"] = traceparent
        attempt = 0
        while True:
            timeout = min(self._settings.http_timeout_seconds, batch.deadline - time.monotonic())
            if timeout <= 0:
                raise AdmissionApiUnavailable("no time left to call the admission API")
            retry_after = 0.0
            try:
                response = self._http.request(
                    "POST",
                    self._runs_url,
                    body=body,
                    headers=self._signed(headers, body),
                    # total: a slow answer must not outlive the deadline (connect/read alone bound each read).
                    timeout=urllib3.Timeout(total=timeout, connect=self._settings.http_connect_timeout_seconds),
                )
            except urllib3.exceptions.HTTPError as error:
                failure = f"{type(error).__name__}: {error}"
            else:
                if response.status not in RETRYABLE_STATUSES:
                    return response.status, _json_or_text(response.data)
                failure = f"HTTP {response.status}"
                retry_after = _retry_after_seconds(response.headers.get("Retry-After"))
            delay = max(retry_after, self._jitter(attempt))
            if time.monotonic() + delay >= batch.deadline:
                raise AdmissionApiUnavailable(f"admission API unavailable after {attempt + 1} attempts: {failure}")
            logger.warning("admission API call failed; retrying", failure=failure, delay_seconds=round(delay, 3))
            batch.outcome.count("retries")
            attempt += 1
            if batch.abort.wait(delay):
                raise _Aborted("another record failed the batch")

    def _jitter(self, attempt: int) -> float:
        """Full jitter; not security-relevant randomness."""
        ceiling = min(self._settings.retry_cap_seconds, self._settings.retry_base_seconds * 2 ** min(attempt, 30))
        return random.uniform(0, ceiling)  # noqa: S311

    def _signed(self, headers: dict[str, str], body: bytes) -> dict[str, str]:
        """SigV4 (service execute-api) with the function's own credentials, as IAM authorization expects."""
        request = AWSRequest(method="POST", url=self._runs_url, data=body, headers=headers)
        try:
            credentials = self._credentials.get_frozen_credentials()
        except botocore.exceptions.BotoCoreError as error:
            # Every record would hit it alike: the relay cannot present itself, so the batch fails.
            raise AdmissionApiRefused(f"no credentials to sign admission API calls with: {error}") from error
        SigV4Auth(credentials, "execute-api", self._settings.region).add_auth(request)
        return dict(request.headers.items())

    def _dead_letter(self, record: KafkaEventRecord, reason: DeadLetterReason, batch: _Batch, **context: Any) -> None:
        self._send_dead_letter(dead_letter_body(record, reason), batch)
        batch.outcome.count("dead_lettered")
        logger.warning(
            "dispatch dead-lettered",
            reason=reason.kind,
            detail=reason.detail[:MAX_DETAIL_CHARS],
            status=reason.status,
            topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            **context,
        )

    def _send_dead_letter(self, body: str, batch: _Batch) -> None:
        """SendMessage, retried while a whole attempt (connect and read timeouts) still fits before the
        deadline. Past it, or refused, the batch fails and is retried whole: no record is lost for want of
        its dead letter."""
        attempt_seconds = 2 * self._settings.dlq_timeout_seconds
        attempts = 0
        failure = "no time left for an attempt"
        while time.monotonic() + attempt_seconds <= batch.deadline:
            attempts += 1
            try:
                self._sqs.send_message(QueueUrl=self._settings.dlq_url, MessageBody=body)
                return
            except (botocore.exceptions.ConnectionError, botocore.exceptions.HTTPClientError) as error:
                failure = f"{type(error).__name__}: {error}"
            except botocore.exceptions.ClientError as error:
                if not _transient_sqs_error(error):
                    raise DeadLetterQueueUnavailable(f"the dead-letter queue refused a message: {error}") from error
                failure = str(error)
            except Exception as error:
                raise DeadLetterQueueUnavailable(f"a dead letter could not be sent: {error!r}") from error
            logger.warning("dead-letter queue call failed; retrying", failure=failure)
            if batch.abort.wait(self._jitter(attempts - 1)):
                raise _Aborted("another record failed the batch")
        raise DeadLetterQueueUnavailable(f"dead-letter queue unavailable after {attempts} attempts: {failure}")


def dead_letter_message(record: KafkaEventRecord, reason: DeadLetterReason) -> dict[str, Any]:
    """The original record (as MSK delivered it: key and value base64) and why it was dead-lettered."""
    return {
        "record": {
            "topic": record.topic,
            "partition": record.partition,
            "offset": record.offset,
            "timestamp": record.timestamp,
            "timestampType": record.timestamp_type,
            "key": record.get("key"),
            "value": record.get("value"),
            "headers": record.headers,
        },
        "reason": {
            "kind": reason.kind,
            "detail": reason.detail[:MAX_DETAIL_CHARS],
            "status": reason.status,
            "problem": reason.problem,
        },
        "deadLetteredAt": datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
    }


def dead_letter_body(record: KafkaEventRecord, reason: DeadLetterReason) -> str:
    """The SQS message body of a dead letter, at most MAX_DEAD_LETTER_BYTES (ASCII JSON: bytes = characters).

    Each part left out (OMITTED_IN_ORDER) becomes null beside `<part>Omitted` (its length as delivered)
    and `<part>Sha256`, the SHA-256 of that text: the base64 of key and value, compact JSON otherwise.
    """
    letter = dead_letter_message(record, reason)
    body = _compact(letter)
    for section, part in OMITTED_IN_ORDER:
        if len(body.encode()) <= MAX_DEAD_LETTER_BYTES:
            break
        kept = letter[section][part]
        if kept is None:
            continue
        text = kept if isinstance(kept, str) else _compact(kept)
        letter[section][part] = None
        letter[section][f"{part}Omitted"] = {"reason": "too large for SQS", "length": len(text)}
        letter[section][f"{part}Sha256"] = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
        body = _compact(letter)
    return body


def _compact(value: Any) -> str:
    # ASCII only: SQS refuses some characters (U+FFFE, U+FFFF, lone surrogates), and bytes equal characters.
    return json.dumps(value, separators=(",", ":"), ensure_ascii=True)


def _transient_sqs_error(error: botocore.exceptions.ClientError) -> bool:
    status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    code = error.response.get("Error", {}).get("Code", "")
    return status >= 500 or status == 429 or "Throttl" in code


def _ordered_groups(records: Iterable[KafkaEventRecord]) -> list[list[KafkaEventRecord]]:
    """Records sharing a Kafka key (per topic) in offset order; each keyless record on its own."""
    groups: dict[tuple[str, str | None, int], list[KafkaEventRecord]] = {}
    for index, record in enumerate(records):
        key = (record.topic, record.key, 0) if record.key is not None else (record.topic, None, index)
        groups.setdefault(key, []).append(record)
    return [sorted(group, key=lambda r: (r.partition, r.offset)) for group in groups.values()]


def _traceparent(record: KafkaEventRecord) -> str | None:
    """The record's traceparent header if it is well-formed W3C Trace Context; anything else stays behind
    (a CR or LF in a header value would make the HTTP client refuse the whole request)."""
    value = record.decoded_headers.get("traceparent")
    if value is None:
        return None
    text = value.decode("ascii", "replace")
    if TRACEPARENT.fullmatch(text):
        return text
    logger.warning("malformed traceparent header not forwarded", topic=record.topic, offset=record.offset)
    return None


def _json_or_text(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return data.decode("utf-8", "replace")


def _retry_after_seconds(value: str | None) -> float:
    try:
        return max(0.0, float(value)) if value else 0.0
    except ValueError:
        return 0.0


@lru_cache(maxsize=1)
def relay_service() -> Relay:
    """The relay built once per execution environment from the validated environment, on first use.

    Its HTTP pool, SQS client and credentials are per environment: after a SnapStart restore
    `relay_service.cache_clear()` drops them (functions/inbox_relay/app.py), and the next batch builds new ones.
    """
    return Relay(RelaySettings.from_env())


def handle_batch(event: KafkaEvent, context: LambdaContext) -> None:
    """The whole invocation: relay the batch, publish its metrics whether or not it succeeded."""
    outcome = BatchOutcome()
    try:
        relay_service().relay_batch(event, context.get_remaining_time_in_millis, outcome)
    finally:
        outcome.publish()
