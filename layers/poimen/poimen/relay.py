"""The inbox relay: MSK dispatch records become POST /v1/runs calls over HTTP, bad ones dead letters.

It knows only the HTTP contract: it never imports the store or admission (a test enforces it), and its
IAM role has no DynamoDB permission. Redelivered records are absorbed by admission's dispatch_key
deduplication alone; the relay keeps no idempotency state of its own.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import random
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any

import boto3
import botocore.config
import botocore.session
import urllib3
from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.data_classes.kafka_event import KafkaEvent, KafkaEventRecord
from aws_lambda_powertools.utilities.typing import LambdaContext
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest

from poimen.config import RelaySettings
from poimen.contract import TENANT_HEADER
from poimen.kafka import tenant_of_dispatch_topic
from poimen.observability import logger, metrics

RETRYABLE_STATUSES = frozenset({408, 429}) | frozenset(range(500, 600))
# The answers that blame the record itself: dead-letter it and drain on. Any other refusal (401, 403,
# 404, 405, 3xx, ...) says the relay or the API is misconfigured, which every record would hit alike:
# the batch fails instead, so a fix lets the same records through rather than into the DLQ.
RECORD_FAULT_STATUSES = frozenset({400, 413, 415, 422})
# SQS takes messages up to 1 MiB; a dead letter keeps the record's coordinates even when its value
# must be left out (the value can then be read again from Kafka at that partition and offset).
MAX_DEAD_LETTER_BYTES = 1024 * 1024 - 4096


class AdmissionApiUnavailable(Exception):
    """The API could not be reached within the invocation's budget; the event source retries the batch."""


class _Aborted(Exception):
    """A record stopped retrying because another record already failed the batch."""


class AdmissionApiRefused(Exception):
    """The API refused the relay itself (authorization, URL); the event source retries the batch."""


@dataclass(frozen=True)
class DeadLetterReason:
    kind: str  # invalid-topic | empty-value | undecodable | invalid-json | rejected
    detail: str
    status: int | None = None
    problem: Any = None


@dataclass
class BatchOutcome:
    """What one invocation did; published as EMF metrics even when the invocation fails."""

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
        metrics.add_metric(name="DispatchRelayed", unit=MetricUnit.Count, value=self.relayed)
        metrics.add_metric(name="DispatchReplayed", unit=MetricUnit.Count, value=self.replayed)
        metrics.add_metric(name="DispatchDeadLettered", unit=MetricUnit.Count, value=self.dead_lettered)
        metrics.add_metric(name="RelayRetries", unit=MetricUnit.Count, value=self.retries)
        if self.max_lag_ms is not None:
            metrics.add_metric(name="InboxLag", unit=MetricUnit.Milliseconds, value=self.max_lag_ms)


class Relay:
    """Relays batches to one admission API; built once per execution environment."""

    def __init__(
        self,
        settings: RelaySettings,
        *,
        sqs: Any | None = None,
        credentials: Any | None = None,
    ) -> None:
        self._settings = settings
        self._runs_url = f"{settings.admission_api_url}/v1/runs"
        self._http = urllib3.PoolManager(maxsize=settings.max_concurrency, block=True, retries=False)
        # AWS endpoints come from the standard SDK configuration (AWS_ENDPOINT_URL_SQS, ...). Short
        # timeouts: a dead letter must not hold the batch past the function's deadline.
        self._sqs = sqs or boto3.client(
            "sqs",
            region_name=settings.region,
            config=botocore.config.Config(
                connect_timeout=settings.http_timeout_seconds,
                read_timeout=settings.http_timeout_seconds,
                retries={"mode": "standard", "total_max_attempts": 3},
                max_pool_connections=settings.max_concurrency,
            ),
        )
        found = credentials or botocore.session.get_session().get_credentials()
        if found is None:
            raise RuntimeError("no AWS credentials to sign admission API calls with")
        self._credentials: Any = found

    def relay_batch(self, event: KafkaEvent, remaining_ms: Callable[[], int], outcome: BatchOutcome) -> None:
        """Relay every record; raise if the batch must be retried (API down past the budget or refusing
        the relay, a dead letter that could not be sent). Nothing is dead-lettered for those reasons."""
        deadline = time.monotonic() + remaining_ms() / 1000 - self._settings.time_margin_seconds
        groups = _ordered_groups(event.records)
        abort = threading.Event()

        def relay_group(records: list[KafkaEventRecord]) -> None:
            for record in records:
                if abort.is_set():
                    return  # the batch will be retried whole; later records must not overtake
                try:
                    self._relay_record(record, deadline, outcome, abort)
                except BaseException:
                    abort.set()
                    raise

        workers = max(1, min(self._settings.max_concurrency, len(groups)))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            failures = [f.exception() for f in [pool.submit(relay_group, group) for group in groups]]
        errors = [error for error in failures if error is not None]
        if errors:
            # The first cause, not the groups that merely stopped because of it.
            raise next((e for e in errors if not isinstance(e, _Aborted)), errors[0])

    def _relay_record(
        self, record: KafkaEventRecord, deadline: float, outcome: BatchOutcome, abort: threading.Event
    ) -> None:
        tenant_id = tenant_of_dispatch_topic(record.topic)
        if tenant_id is None:
            self._dead_letter(
                record, DeadLetterReason("invalid-topic", "topic is not poimen.<tenant>.dispatch"), outcome
            )
            return
        if record.get("value") is None:  # a tombstone: Kafka's null value
            self._dead_letter(record, DeadLetterReason("empty-value", "the record has no value"), outcome)
            return
        try:
            body = base64.b64decode(record.value, validate=True)
            spawn = json.loads(body.decode("utf-8"))
        except binascii.Error as error:
            self._dead_letter(record, DeadLetterReason("undecodable", f"value is not base64: {error}"), outcome)
            return
        except UnicodeDecodeError as error:
            self._dead_letter(record, DeadLetterReason("undecodable", f"value is not UTF-8: {error}"), outcome)
            return
        except (ValueError, RecursionError) as error:
            self._dead_letter(record, DeadLetterReason("invalid-json", f"value is not JSON: {error}"), outcome)
            return
        if not isinstance(spawn, dict):
            self._dead_letter(record, DeadLetterReason("invalid-json", "value is not a JSON object"), outcome)
            return
        dispatch_key = spawn.get("dispatch_key")
        if dispatch_key is None:
            # Relayed, as the API admits keyless spawns; but a retry after a lost answer, or of the
            # batch, can then admit it twice. Publishers should always set a dispatch_key.
            logger.warning("dispatch without dispatch_key: delivered at least once", topic=record.topic)
        status, answer = self._post(tenant_id, body, _traceparent(record), deadline, outcome, abort)
        if status in (200, 201):
            # A record without a timestamp (-1) has no lag to tell.
            lag_ms = max(0.0, time.time() * 1000 - record.timestamp) if record.timestamp > 0 else None
            outcome.admitted(replayed=status == 200, lag_ms=lag_ms)
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
        self._dead_letter(record, reason, outcome, tenant_id=tenant_id, dispatch_key=dispatch_key)

    def _post(
        self,
        tenant_id: str,
        body: bytes,
        traceparent: str | None,
        deadline: float,
        outcome: BatchOutcome,
        abort: threading.Event,
    ) -> tuple[int, Any]:
        """POST the body verbatim, retrying transient failures with full-jitter backoff until the deadline."""
        headers = {"Content-Type": "application/json", TENANT_HEADER: tenant_id}
        if traceparent:
            headers["traceparent"] = traceparent
        attempt = 0
        while True:
            timeout = min(self._settings.http_timeout_seconds, deadline - time.monotonic())
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
                    timeout=urllib3.Timeout(total=timeout),
                )
            except urllib3.exceptions.HTTPError as error:
                failure = f"{type(error).__name__}: {error}"
            else:
                if response.status not in RETRYABLE_STATUSES:
                    return response.status, _json_or_text(response.data)
                failure = f"HTTP {response.status}"
                retry_after = _retry_after_seconds(response.headers.get("Retry-After"))
            # Full jitter; not security-relevant randomness.
            jitter = random.uniform(0, min(self._settings.retry_cap_seconds, self._backoff(attempt)))  # noqa: S311
            delay = max(retry_after, jitter)
            if time.monotonic() + delay >= deadline:
                raise AdmissionApiUnavailable(f"admission API unavailable after {attempt + 1} attempts: {failure}")
            logger.warning("admission API call failed; retrying", failure=failure, delay_seconds=round(delay, 3))
            outcome.count("retries")
            attempt += 1
            if abort.wait(delay):
                raise _Aborted("another record failed the batch")

    def _backoff(self, attempt: int) -> float:
        return float(self._settings.retry_base_seconds * 2 ** min(attempt, 30))

    def _signed(self, headers: dict[str, str], body: bytes) -> dict[str, str]:
        """SigV4 (service execute-api) with the function's own credentials, as IAM authorization expects."""
        request = AWSRequest(method="POST", url=self._runs_url, data=body, headers=headers)
        SigV4Auth(self._credentials.get_frozen_credentials(), "execute-api", self._settings.region).add_auth(request)
        return dict(request.headers.items())

    def _dead_letter(
        self,
        record: KafkaEventRecord,
        reason: DeadLetterReason,
        outcome: BatchOutcome,
        **context: Any,
    ) -> None:
        message = json.dumps(dead_letter_message(record, reason), separators=(",", ":"))
        if len(message.encode()) > MAX_DEAD_LETTER_BYTES:
            message = json.dumps(dead_letter_message(record, reason, keep_value=False), separators=(",", ":"))
        # A failed send raises: the batch is retried and nothing is lost.
        self._sqs.send_message(QueueUrl=self._settings.dlq_url, MessageBody=message)
        outcome.count("dead_lettered")
        logger.warning(
            "dispatch dead-lettered",
            reason=reason.kind,
            detail=reason.detail,
            status=reason.status,
            topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            **context,
        )


def dead_letter_message(record: KafkaEventRecord, reason: DeadLetterReason, keep_value: bool = True) -> dict[str, Any]:
    """The original record (as MSK delivered it: key and value base64) and why it was dead-lettered."""
    original: dict[str, Any] = {
        "topic": record.topic,
        "partition": record.partition,
        "offset": record.offset,
        "timestamp": record.timestamp,
        "timestampType": record.timestamp_type,
        "key": record.get("key"),
        "value": record.get("value"),
        "headers": record.headers,
    }
    if not keep_value:
        raw = (record.get("value") or "").encode()
        original["value"] = None
        original["valueOmitted"] = {"reason": "too large for SQS", "base64Length": len(raw)}
        original["valueSha256"] = hashlib.sha256(raw).hexdigest()
    return {
        "record": original,
        "reason": {
            "kind": reason.kind,
            "detail": reason.detail,
            "status": reason.status,
            "problem": reason.problem,
        },
        "deadLetteredAt": datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
    }


def _ordered_groups(records: Iterable[KafkaEventRecord]) -> list[list[KafkaEventRecord]]:
    """Records sharing a Kafka key (per topic) in offset order; each keyless record on its own."""
    groups: dict[tuple[str, str | None, int], list[KafkaEventRecord]] = {}
    for index, record in enumerate(records):
        key = (record.topic, record.key, 0) if record.key is not None else (record.topic, None, index)
        groups.setdefault(key, []).append(record)
    return [sorted(group, key=lambda r: (r.partition, r.offset)) for group in groups.values()]


def _traceparent(record: KafkaEventRecord) -> str | None:
    value = record.decoded_headers.get("traceparent")
    if value is None:
        return None
    try:
        return value.decode("ascii")
    except UnicodeDecodeError:
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
    """The relay built once per execution environment from the validated environment, on first use."""
    return Relay(RelaySettings.from_env())


def handle_batch(event: KafkaEvent, context: LambdaContext) -> None:
    """The whole invocation: relay the batch, publish its metrics whether or not it succeeded."""
    outcome = BatchOutcome()
    try:
        relay_service().relay_batch(event, context.get_remaining_time_in_millis, outcome)
    finally:
        outcome.publish()
