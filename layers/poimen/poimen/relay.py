"""The inbox relay: MSK dispatch records become POST /v1/runs calls over HTTP, bad ones dead letters.

It knows only the HTTP contract: it never imports the store or admission (a test enforces it), and its
IAM role has no DynamoDB permission. Redelivered records are absorbed by admission's dispatch_key
deduplication alone; the relay keeps no idempotency state of its own. No record stalls a batch: only
the API (unreachable, or refusing the relay itself), the dead-letter queue, or time running out fail it.
Dead letters are sent only by an invocation that relayed its whole batch, so a batch retried or parked
for an outage does not dead-letter its bad records once per attempt. Under on-demand event pollers, which
retry a failed batch until it succeeds or its records leave the topic, the relay bounds that itself, per lane (a
partition, or a Kafka key): a lane whose calls fail once its oldest record is RELAY_MAX_RECORD_AGE_SECONDS old (23 h
for a lane the API only throttles) has its records not yet admitted dead-lettered as `retries-exhausted` instead,
and the other lanes go on.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal, TypeVar

import botocore.config
import botocore.exceptions
import urllib3
import urllib3.connection
from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.data_classes.kafka_event import KafkaEvent, KafkaEventRecord
from aws_lambda_powertools.utilities.typing import LambdaContext
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSPreparedRequest, AWSRequest, AWSResponse
from botocore.compat import HTTPHeaders

from poimen.aws_session import bounded_session
from poimen.config import MAX_RECORD_AGE_SECONDS, RelaySettings
from poimen.dead_letter import (
    MAX_DETAIL_CHARS,
    DeadLetterReason,
    age_text,
    dead_letter_attributes,
    dead_letter_body,
)
from poimen.inbox_rule import RECORD_FAULT_STATUSES, RETRYABLE_STATUSES, HeldBack, Spawn, header, judge, rejected
from poimen.kafka import tenant_of_dispatch_topic
from poimen.observability import logger, metrics
from poimen.wire import (
    ENVELOPE_REFUSED_STATUSES,
    MAX_BATCH_BODY_BYTES,
    MAX_BODY_BYTES,
    SPAWNS_MEDIA_TYPE,
    TENANT_HEADER,
    asks_to_slow_down,
    retry_after_seconds,
)

# The 503 the API answers when a run may have been admitted: retried for a keyed record (it can only admit
# that run), dead-lettered naming the run for a keyless one.
OUTCOME_UNKNOWN = "urn:poimen:problem:outcome-unknown"
# The envelope's bytes besides its spawns: `{"spawns":[`, `],"traceparents":[`, `],"ordering_keys":[`, `]}`;
# each spawn adds its value, a comma, its traceparent (at most 55 characters, quoted) or null and a comma, and its
# ordering key (a number below MAX_BATCH_SPAWNS, quoted) or null and a comma.
_ENVELOPE_BYTES = 64
_SPAWN_OVERHEAD_BYTES = 66


class BatchFailed(Exception):
    """The event source must retry the whole batch; no record is dead-lettered for this cause."""


# Why a lane's calls ended unanswered (AdmissionApiUnavailable.cause): an attempt failed (unreachable, a timeout, a
# 5xx or an outcome unknown); the API's last answers asked the relay to slow down (poimen.wire.asks_to_slow_down);
# or its time ran out before any attempt of the call failed (a lane that waited for a worker, or a slow API).
Cause = Literal["failing", "throttled", "out-of-time"]


class AdmissionApiUnavailable(BatchFailed):
    """The API could not be reached within the invocation's budget, for `cause`."""

    def __init__(self, message: str, *, cause: Cause = "failing") -> None:
        super().__init__(message)
        self.cause: Cause = cause


class AdmissionApiRefused(BatchFailed):
    """The API refused the relay itself (authorization, URL)."""


class DeadLetterQueueUnavailable(BatchFailed):
    """A dead letter could not be sent before the deadline, or the queue refused it."""


class _Aborted(BatchFailed):
    """A record stopped because another record already failed the batch."""


@dataclass
class BatchOutcome:
    """What one invocation did; published as EMF metrics even when the invocation fails, with the batch's
    tenant as a dimension (one event source mapping per tenant: a batch is one tenant's topic)."""

    tenant: str | None = None
    relayed: int = 0
    replayed: int = 0
    dead_lettered: int = 0
    retries: int = 0
    # Records relayed without a dispatch_key (delivered at least once: their producer should key them), counted as
    # `relayed` is, once the invocation admitted or dead-lettered them: not for a try of a batch that failed.
    keyless: int = 0
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
        # Only when there are any: a tenant's series costs a custom metric while it is sent, and it is there to
        # show the producer that sends keyless records.
        if self.keyless:
            metrics.add_metric(name="DispatchKeyless", unit=MetricUnit.Count, value=self.keyless)


@dataclass(frozen=True)
class _DeadLetter:
    """A dead letter made while its batch is relayed, sent once the whole batch is."""

    body: str
    attributes: dict[str, dict[str, str]]
    log: dict[str, Any]
    keyless: bool = False  # a keyless record the API answered: counted (BatchOutcome.keyless) once it is sent


@dataclass(frozen=True)
class _Batch:
    """What the records of one invocation share: its deadline (and the API calls', earlier when the dead letters
    of a batch given up need time after them), its outcome, whether it already failed, the dead letters its
    records made so far, and the records settled (admitted, or their letter held)."""

    deadline: float
    api_deadline: float  # when the API calls of a lane that may be given up must end (_Lane.api_deadline)
    outcome: BatchOutcome
    abort: threading.Event
    letters: list[_DeadLetter] = field(default_factory=list)
    settled: set[tuple[str, int, int]] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def hold(self, letter: _DeadLetter) -> None:
        with self._lock:
            self.letters.append(letter)

    def settle(self, record: KafkaEventRecord) -> None:
        with self._lock:
            self.settled.add(_coordinates(record))


@dataclass(frozen=True)
class _Lane:
    """Records relayed in offset order, concurrently with the other lanes of their batch, and given up (on-demand)
    or failed together: a partition's on the batch path, a Kafka key's on the per-record path. `gives_up_failing`:
    past RELAY_MAX_RECORD_AGE_SECONDS, a failure of its calls dead-letters its records not settled rather than fail
    the batch; `gives_up_throttled`: past MAX_RECORD_AGE_SECONDS, so does a throttle, and time running out."""

    batch: _Batch
    records: list[KafkaEventRecord]
    oldest_ms: int | None = None
    gives_up_failing: bool = False
    gives_up_throttled: bool = False

    @property
    def api_deadline(self) -> float:
        """When its API calls must end: early enough for its records' letters (the batch's `api_deadline`) if it may
        be given up, throttled or not (its next answer may be a failure); else with the invocation."""
        return self.batch.api_deadline if self.gives_up_failing else self.batch.deadline

    def gives_up_for(self, cause: Cause) -> bool:
        """Whether its calls ending so ends as its records' dead letters rather than as the batch's retry (time
        running out of a lane past only RELAY_MAX_RECORD_AGE_SECONDS: `Relay.relay_batch` decides)."""
        return self.gives_up_failing if cause == "failing" else self.gives_up_throttled


def _cause(failure: BatchFailed) -> Cause:
    return failure.cause if isinstance(failure, AdmissionApiUnavailable) else "failing"


_T = TypeVar("_T")


class Relay:
    """Relays batches to one admission API; built once per execution environment.

    What each record may become is poimen.inbox_rule's: with a run retention (RelaySettings.run_retention:
    RUN_RETENTION_DAYS and its last change), a record whose Kafka timestamp is older than it is
    dead-lettered as `expired` instead of admitted (its run may have expired already, and admitting the
    record again would be a second run), and one too far in the future as `future-timestamp`. A record
    without a timestamp (-1) is admitted as always.
    """

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
        self._http = http or _deadline_bound_pool_manager(settings.max_concurrency)
        # botocore, not boto3: boto3 would import s3transfer and multiprocessing on the cold path for nothing.
        # A SnapStart function fetches its credentials from Lambda's container endpoint, after a restore and
        # again as they near expiry, inside a batch: bounded to CREDENTIALS_FETCH_SECONDS (poimen.aws_session),
        # not botocore's 8-15 s, so that a refresh begun before the deadline ends within the time margin.
        session = bounded_session()
        # AWS endpoints come from the standard SDK configuration (AWS_ENDPOINT_URL_SQS, ...). One attempt
        # per call, bounded by its timeouts: the relay retries itself, and only while an attempt still
        # fits before the deadline.
        self._sqs: Any = sqs
        if sqs is None:
            self._sqs = session.create_client(
                "sqs",
                region_name=settings.region,
                config=botocore.config.Config(
                    connect_timeout=settings.dlq_timeout_seconds,
                    read_timeout=settings.dlq_timeout_seconds,
                    retries={"mode": "standard", "total_max_attempts": 1},
                    max_pool_connections=settings.max_concurrency,
                ),
            )
            # botocore's timeouts bound each socket operation, not the exchange: an answer trickling in
            # would keep a send past the deadline. Its signed requests go out through a deadline-bound pool
            # instead (botocore's before-send event: a handler's answer is used in place of its own send).
            self._sqs_http = _deadline_bound_pool_manager(settings.max_concurrency)
            self._sqs.meta.events.register("before-send.sqs", self._send_within_deadline)
        found = credentials or session.get_credentials()
        if found is None:
            raise RuntimeError("no AWS credentials to sign admission API calls with")
        self._credentials: Any = found

    def relay_batch(self, event: KafkaEvent, remaining_ms: Callable[[], int], outcome: BatchOutcome) -> None:
        """Relay every record, then send the dead letters of the bad ones; raise BatchFailed if the batch must
        be retried (the API down past the budget or refusing the relay, a dead letter that could not be sent).

        The records go out in lanes (`_Lane`): a partition's on the batch path, a Kafka key's on the per-record
        path, each in offset order, lanes concurrently. A failing batch sends no dead letter: its retry, or the
        redrive of the batch once parked, makes them then, so each bad record is one dead letter however often
        its batch fails. (Only a dead-letter queue failing midway, or the function dying between a send and the
        event source's commit, repeats some.) Under on-demand pollers a lane that fails once its oldest record is
        past RELAY_MAX_RECORD_AGE_SECONDS is given up instead, alone: its records not yet settled are
        dead-lettered as `retries-exhausted`, and the other lanes go on. A lane the API only throttles (429, or a
        store-unavailable marked throttled: poimen.wire.asks_to_slow_down) is given up only past
        MAX_RECORD_AGE_SECONDS, the longest a topic is sure to keep its records; until then it fails the batch
        for its retry, as a young lane does. A lane whose time ran out before a call of it failed (it waited for a
        worker, or the API was slow) is given up only beside a lane of the batch given up for failing (an outage
        with more lanes than workers), or past MAX_RECORD_AGE_SECONDS; else the batch is retried. A lane that may
        be given up ends its calls early enough for its letters to be sent before the deadline (but has half the
        time at least: it may be a backlog the API admits).
        """
        deadline = time.monotonic() + remaining_ms() / 1000 - self._settings.time_margin_seconds
        batch_path = self._settings.batch_spawns > 1
        # On the batch path a partition's records in one call a chunk, in offset order, admitted in that order
        # (the batch's ordering keys keep a Kafka key's records in it: _envelope); on the per-record path a key's.
        groups = _partitions(event.records) if batch_path else _ordered_groups(event.records)
        records = [record for group in groups for record in group]
        workers = max(1, min(self._settings.max_concurrency, len(records)))
        # Every record may need its letter sent after the API calls: rounds of `workers` sends, each attempt
        # within twice the DLQ timeout, and one round more for a retried send. At most half the time left: a lane
        # past the age limit may be a backlog the API admits, and a batch too large for that worst case
        # (RelayBatchSize 1,000 by 16 workers would need 128 s of a 120 s invocation) must still be tried, not given
        # up unsent. Its letters take far less than the worst case (one SendMessage round trip a round); should the
        # DLQ be so slow that they do not fit, the batch fails and is retried, as for any DLQ failure.
        limits = [self._age_limits(group) for group in groups]
        worst_case = 2 * self._settings.dlq_timeout_seconds * (math.ceil(len(records) / workers) + 1)
        may_give_up = any(failing for _, failing, _ in limits)
        reserve = min(worst_case, (deadline - time.monotonic()) / 2) if may_give_up else 0
        batch = _Batch(deadline, deadline - reserve, outcome, threading.Event())
        lanes = [_Lane(batch, group, *limit) for group, limit in zip(groups, limits, strict=True)]
        tenants = {tenant_of_dispatch_topic(record.topic) for record in records}
        if len(tenants) == 1:
            outcome.tenant = tenants.pop()  # None for a topic that is no tenant's: no tenant dimension

        failed: list[_Lane] = []  # given up for failing: a sign of an outage
        out_of_time: list[tuple[_Lane, BatchFailed]] = []  # past the age limit, no call failed: decided after the rest

        def relay_lane(lane: _Lane) -> None:
            try:
                if batch_path:
                    self._relay_partition(lane)
                else:
                    for record in lane.records:
                        if batch.abort.is_set():
                            return  # the batch will be retried whole; later records must not overtake
                        self._relay_or_dead_letter(record, lane)
            except _Aborted:
                raise
            except BatchFailed as failure:
                cause = _cause(failure)
                if cause == "out-of-time" and lane.gives_up_failing and not lane.gives_up_throttled:
                    out_of_time.append((lane, failure))
                    return
                if not lane.gives_up_for(cause):
                    raise
                if cause == "failing":
                    failed.append(lane)
                self._give_up(lane, failure)

        with ThreadPoolExecutor(max_workers=workers) as pool:
            _each(pool, relay_lane, lanes, batch)
            if out_of_time and not failed:
                # Nothing failed: the API throttled, or was slow, and these lanes had no time left. Given up, they
                # would be a redrive job the API never refused; retried, they are relayed.
                raise out_of_time[0][1]
            for lane, failure in out_of_time:  # behind an outage that gave other lanes up, as theirs would
                self._give_up(lane, failure)
            _each(pool, lambda letter: self._send_dead_letter(letter, batch), batch.letters, batch)

    def _age_limits(self, records: list[KafkaEventRecord]) -> tuple[int | None, bool, bool]:
        """The lane of these records: its oldest record's timestamp, and whether it is given up rather than retried
        when it fails, and when it is only throttled (under on-demand pollers only, past the age limits; a lane of
        records without timestamps has no age: it is retried as under provisioned pollers, without a bound)."""
        oldest_ms = min((record.timestamp for record in records if record.timestamp >= 0), default=None)
        if not self._settings.bounds_failed_batches or oldest_ms is None:
            return oldest_ms, False, False
        age_ms = time.time() * 1000 - oldest_ms
        return oldest_ms, age_ms >= self._settings.max_record_age_seconds * 1000, age_ms >= self._throttled_limit_ms

    @property
    def _throttled_limit_ms(self) -> float:
        """The age past which a lane the API only throttles is given up: MAX_RECORD_AGE_SECONDS, an hour short of
        the shortest `.dispatch` retention (or RELAY_MAX_RECORD_AGE_SECONDS, were that longer)."""
        return max(self._settings.max_record_age_seconds, MAX_RECORD_AGE_SECONDS) * 1000

    def _give_up(self, lane: _Lane, failure: BatchFailed) -> None:
        """Hold a `retries-exhausted` letter for each record of the failed lane not settled, so that the batch
        succeeds (the partition moves on) and no record is lost once the topic's retention drops it."""
        limit = (
            f"{age_text(self._throttled_limit_ms)}, the longest the API's throttling is waited out"
            if _cause(failure) != "failing" and lane.gives_up_throttled
            else f"RELAY_MAX_RECORD_AGE_SECONDS ({age_text(self._settings.max_record_age_seconds * 1000)})"
        )
        oldest_ms = lane.oldest_ms if lane.oldest_ms is not None else time.time() * 1000
        detail = (
            f"its records failed with the oldest of its {'partition' if self._settings.batch_spawns > 1 else 'key'} "
            f"{age_text(time.time() * 1000 - oldest_ms)} old, past {limit}: on-demand event pollers would retry it "
            f"until its records leave the topic; redrive it once the cause is fixed. {type(failure).__name__}: "
            f"{failure}"
        )
        reason = DeadLetterReason("retries-exhausted", detail)
        batch = lane.batch
        given_up = [record for record in lane.records if _coordinates(record) not in batch.settled]
        logger.warning("records given up: those not admitted are dead-lettered", records=len(given_up))
        for record in given_up:
            # A record the lane never reached is judged first: one the relay would dead-letter for itself (not
            # a spawn, expired, a keyless replica) gets that letter, whose kind redrive chooses by, not this one.
            # Its line names the spawn's tenant and dispatch key, as every other spawn's letter does.
            own = self._own_reason(record)
            if isinstance(own, Spawn):
                self._dead_letter(record, reason, batch, tenant_id=own.tenant, dispatch_key=own.dispatch_key)
            else:
                self._dead_letter(record, own, batch)

    def _own_reason(self, record: KafkaEventRecord) -> DeadLetterReason | Spawn:
        """Why the relay dead-letters this record whatever the API says (poimen.inbox_rule), if it does; else the
        spawn it is."""
        try:
            verdict = judge(record.raw_event, time.time() * 1000, self._settings.run_retention)
        except Exception as error:  # as _relay_or_dead_letter: a fault of the record's own
            return DeadLetterReason("relay-error", f"{type(error).__name__}: {error}")
        return verdict.reason if isinstance(verdict, HeldBack) else verdict

    def _relay_or_dead_letter(self, record: KafkaEventRecord, lane: _Lane) -> None:
        """Relay one record. A fault of the record's own, foreseen or not, ends as its dead letter."""
        batch = lane.batch
        try:
            spawn = self._spawn_of(record, batch)
            if spawn is not None:
                self._post_spawn(record, spawn, lane)
        except BatchFailed:
            raise
        except Exception as error:
            logger.exception("relaying the record failed", topic=record.topic, offset=record.offset)
            self._dead_letter(record, DeadLetterReason("relay-error", f"{type(error).__name__}: {error}"), batch)
        batch.settle(record)

    def _post_spawn(self, record: KafkaEventRecord, spawn: Spawn, lane: _Lane) -> None:
        """The spawn alone in a POST /v1/runs (application/json), and what its answer makes of the record."""
        keyed = spawn.dispatch_key is not None
        status, answer = self._post(spawn.tenant, spawn.body, spawn.traceparent, lane, keyed=keyed)
        self._answered(record, spawn, status, answer, lane.batch)

    def _spawn_of(self, record: KafkaEventRecord, batch: _Batch) -> Spawn | None:
        """The record's spawn to send, by the one rule (poimen.inbox_rule); None once it is dead-lettered."""
        verdict = judge(record.raw_event, time.time() * 1000, self._settings.run_retention)
        if isinstance(verdict, DeadLetterReason):
            self._dead_letter(record, verdict, batch)
            return None
        if isinstance(verdict, HeldBack):
            spawn = verdict.spawn
            self._dead_letter(record, verdict.reason, batch, tenant_id=spawn.tenant, dispatch_key=spawn.dispatch_key)
            return None
        if verdict.dispatch_key is None:
            # Relayed, as the API admits keyless spawns; but a retry after a lost answer, or of the
            # batch, can then admit it twice. Publishers should always set a dispatch_key.
            logger.warning("dispatch without dispatch_key: delivered at least once", topic=record.topic)
        if verdict.traceparent is None and header(record.raw_event, "traceparent") is not None:
            logger.warning("malformed traceparent header not forwarded", topic=record.topic, offset=record.offset)
        return verdict

    def _answered(self, record: KafkaEventRecord, spawn: Spawn, status: int, answer: Any, batch: _Batch) -> None:
        """What the API's final answer for the spawn (alone, or its result in a batch) makes of the record:
        admitted, or dead-lettered with its reason; raises AdmissionApiRefused for an answer blaming the relay."""
        tenant_id, dispatch_key = spawn.tenant, spawn.dispatch_key
        if status in (200, 201):
            timestamp_ms = spawn.timestamp_ms
            lag_ms = None if timestamp_ms is None else max(0.0, time.time() * 1000 - timestamp_ms)
            batch.outcome.admitted(replayed=status == 200, lag_ms=lag_ms)
            if dispatch_key is None:
                batch.outcome.count("keyless")
            # DEBUG: at INFO a line a record would cost the relay's log group (text format, no level filtered) more
            # than the batch route saves (benchmarks/cost_model.py); the invocation's EMF line counts them, each
            # admission's audit line names its run, and a dead letter names its record's topic, partition and offset.
            logger.debug(
                "dispatch replayed" if status == 200 else "dispatch relayed",
                tenant_id=tenant_id,
                dispatch_key=dispatch_key,
                run_id=answer.get("run_id") if isinstance(answer, dict) else None,
                topic=record.topic,
                partition=record.partition,
                offset=record.offset,
            )
            return
        if status in RETRYABLE_STATUSES:  # outcome-unknown, keyless: sending it again could admit a second run
            run_id = answer.get("run_id") if isinstance(answer, dict) else None
            detail = f"the admission API may have admitted run {run_id}: GET /v1/runs/{run_id} before sending it again"
            reason = DeadLetterReason("outcome-unknown", detail, status, answer)
            self._dead_letter(
                record, reason, batch, keyless=True, tenant_id=tenant_id, dispatch_key=None, run_id=run_id
            )
            return
        if status not in RECORD_FAULT_STATUSES:
            raise AdmissionApiRefused(f"the admission API refused the relay with {status}: {answer}")
        self._dead_letter(
            record,
            rejected(status, answer),
            batch,
            keyless=dispatch_key is None,
            tenant_id=tenant_id,
            dispatch_key=dispatch_key,
        )

    def _relay_partition(self, lane: _Lane) -> None:
        """A partition's records in offset order: each judged (poimen.inbox_rule), the spawns sent in chunks of
        the batch limits, one call a chunk."""
        batch = lane.batch
        spawns: list[tuple[KafkaEventRecord, Spawn]] = []
        for record in lane.records:
            try:
                spawn = self._spawn_of(record, batch)
            except Exception as error:
                logger.exception("relaying the record failed", topic=record.topic, offset=record.offset)
                reason = DeadLetterReason("relay-error", f"{type(error).__name__}: {error}")
                self._dead_letter(record, reason, batch)
                spawn = None
            if spawn is None:
                batch.settle(record)  # its letter is held
            else:
                spawns.append((record, spawn))
        for chunk in _chunks(spawns, self._settings.batch_spawns):
            if batch.abort.is_set():
                return  # the batch will be retried whole; later records must not overtake
            if len(chunk[0][1].body) > MAX_BODY_BYTES:
                # Alone, as the per-record path sends it: its 413 is the single route's, whose limit is on the
                # body as sent, a batch's on each spawn as compact JSON (a value padded with whitespace or escapes).
                ((record, spawn),) = chunk
                self._post_spawn(record, spawn, lane)
                batch.settle(record)
                continue
            self._relay_chunk(chunk, lane)

    def _relay_chunk(self, chunk: list[tuple[KafkaEventRecord, Spawn]], lane: _Lane) -> None:
        """One POST /v1/runs of the chunk's spawns as a batch; each result judged as the answer to its spawn
        alone would be (`_answered`). A result worth sending again (as `_post` would send it alone) is, with
        the others of its kind, in the next call, after the backoff; an envelope the API refuses, each spawn
        alone; an API that takes no batch (415), the same. The records of a Kafka key share an ordering key in
        the envelope, so that the API admits them in offset order and none after one it did not admit (which
        it answers 503 `store-unavailable`, nothing written: it is sent again, after that one)."""
        batch = lane.batch
        pending, attempt = chunk, 0
        cause: Cause = "out-of-time"  # of the last round's spawns sent again, for a call the deadline then stops
        while pending:
            tenant = pending[0][1].tenant
            body = _envelope(pending)
            status, answer = self._post(tenant, body, None, lane, keyed=True, media=SPAWNS_MEDIA_TYPE, after=cause)
            if status in ENVELOPE_REFUSED_STATUSES:  # each spawn then sent alone
                for record, spawn in pending:
                    if batch.abort.is_set():
                        raise _Aborted("another record failed the batch")
                    self._post_spawn(record, spawn, lane)
                    batch.settle(record)
                return
            results = answer.get("results") if status == 200 and isinstance(answer, dict) else None
            if not isinstance(results, list) or len(results) != len(pending) or not all(map(_is_result, results)):
                # Not this API's answer (a proxy's, another version's): the relay is misdirected, as for a 404.
                raise AdmissionApiRefused(f"the admission API answered a batch with {status}: {str(answer)[:500]}")
            again: list[tuple[KafkaEventRecord, Spawn]] = []
            retry_after = 0.0
            slowed = True  # whether every spawn sent again was asked to slow down, none failed
            for (record, spawn), result in zip(pending, results, strict=True):
                item_status, item_answer = result["status"], result.get("run", result.get("problem"))
                keyed = spawn.dispatch_key is not None
                if item_status in RETRYABLE_STATUSES and (keyed or not _is_outcome_unknown(item_answer)):
                    again.append((record, spawn))
                    retry_after = max(retry_after, float(result.get("retry_after") or 0))
                    slowed = slowed and asks_to_slow_down(item_status, item_answer)
                else:
                    self._answered(record, spawn, item_status, item_answer, batch)
                    batch.settle(record)
            pending = again
            if pending:
                cause = "throttled" if slowed else "failing"
                delay = max(retry_after, self._jitter(attempt))
                if time.monotonic() + delay >= lane.api_deadline:
                    raise AdmissionApiUnavailable(
                        f"admission API unavailable after {attempt + 1} attempts: {len(pending)} spawns answered 5xx",
                        cause=cause,
                    )
                logger.warning("spawns of a batch failed; retrying", spawns=len(pending), delay_seconds=round(delay, 3))
                batch.outcome.count("retries")
                attempt += 1
                if batch.abort.wait(delay):
                    raise _Aborted("another record failed the batch")

    def _post(
        self,
        tenant_id: str,
        body: bytes,
        traceparent: str | None,
        lane: _Lane,
        *,
        keyed: bool,
        media: str = "application/json",
        after: Cause = "out-of-time",
    ) -> tuple[int, Any]:
        """POST the body verbatim, retrying transient failures with full-jitter backoff until the lane's deadline,
        then AdmissionApiUnavailable for the last attempt's cause (`after`, the caller's, if the deadline comes before
        an attempt fails). An outcome-unknown answer to a keyless body is returned, not retried: it may have
        admitted a run."""
        headers = {"Content-Type": media, TENANT_HEADER: tenant_id}
        if traceparent:
            headers["traceparent"] = traceparent
        attempt = 0
        cause = after
        while True:
            if lane.api_deadline <= time.monotonic():
                raise AdmissionApiUnavailable("no time left to call the admission API", cause=cause)
            signed = self._signed(headers, body)  # a credentials refresh counts against the deadline too
            timeout = min(self._settings.http_timeout_seconds, lane.api_deadline - time.monotonic())
            if timeout <= 0:
                raise AdmissionApiUnavailable("no time left to call the admission API", cause=cause)
            retry_after = 0.0
            # The whole exchange, connect to last byte, ends within `timeout`: urllib3's timeouts bound each
            # socket operation only, and an answer trickling in would outlive the invocation (_Watchdog).
            exchange = _EXCHANGE_DEADLINE.set(time.monotonic() + timeout)
            try:
                response = self._http.request(
                    "POST",
                    self._runs_url,
                    body=body,
                    headers=signed,
                    timeout=urllib3.Timeout(total=timeout, connect=self._settings.http_connect_timeout_seconds),
                )
            except urllib3.exceptions.HTTPError as error:
                failure, cause = f"{type(error).__name__}: {error}", "failing"
            else:
                answer = _json_or_text(response.data)
                if response.status not in RETRYABLE_STATUSES or (not keyed and _is_outcome_unknown(answer)):
                    return response.status, answer
                failure = f"HTTP {response.status}"
                cause = "throttled" if asks_to_slow_down(response.status, answer) else "failing"
                retry_after = retry_after_seconds(response.headers.get("Retry-After")) or 0.0
            finally:
                _EXCHANGE_DEADLINE.reset(exchange)
            delay = max(retry_after, self._jitter(attempt))
            if time.monotonic() + delay >= lane.api_deadline:
                raise AdmissionApiUnavailable(
                    f"admission API unavailable after {attempt + 1} attempts: {failure}", cause=cause
                )
            logger.warning("admission API call failed; retrying", failure=failure, delay_seconds=round(delay, 3))
            lane.batch.outcome.count("retries")
            attempt += 1
            if lane.batch.abort.wait(delay):
                raise _Aborted("another record failed the batch")

    def _send_within_deadline(self, request: AWSPreparedRequest, **_: Any) -> AWSResponse:
        """The SQS client's before-send handler: its signed request sent through the deadline-bound pool, the
        answer read whole by _EXCHANGE_DEADLINE (or the exchange ends with an error, as botocore's would)."""
        timeout = self._settings.dlq_timeout_seconds
        try:
            answer = self._sqs_http.urlopen(
                request.method,
                request.url,
                body=request.body,
                headers=dict(request.headers.items()),
                redirect=False,
                timeout=urllib3.Timeout(connect=timeout, read=timeout),
            )
        except urllib3.exceptions.HTTPError as error:
            raise _botocore_error(error, request.url) from error
        headers = HTTPHeaders.from_pairs(list(answer.headers.items()))
        return AWSResponse(request.url, answer.status, headers, _Read(answer.data))

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

    def _dead_letter(
        self,
        record: KafkaEventRecord,
        reason: DeadLetterReason,
        batch: _Batch,
        *,
        keyless: bool = False,
        **context: Any,
    ) -> None:
        """Hold the record's dead letter until the whole batch is relayed (see relay_batch); `keyless`: a keyless
        record the API answered, counted as such once its letter is sent."""
        log = {
            "reason": reason.kind,
            "detail": reason.detail[:MAX_DETAIL_CHARS],
            "status": reason.status,
            "topic": record.topic,
            "partition": record.partition,
            "offset": record.offset,
            **context,
        }
        raw = record.raw_event
        body = dead_letter_body(raw, reason, self._settings.run_retention)
        batch.hold(_DeadLetter(body, dead_letter_attributes(raw), log, keyless))

    def _send_dead_letter(self, letter: _DeadLetter, batch: _Batch) -> None:
        """SendMessage, retried while a whole attempt (connect and read timeouts) still fits before the
        deadline. Past it, or refused, the batch fails and is retried whole: no record is lost for want of
        its dead letter."""
        attempt_seconds = 2 * self._settings.dlq_timeout_seconds
        attempts = 0
        failure = "no time left for an attempt"
        while time.monotonic() + attempt_seconds <= batch.deadline:
            attempts += 1
            exchange = _EXCHANGE_DEADLINE.set(time.monotonic() + attempt_seconds)
            try:
                sent = self._sqs.send_message(
                    QueueUrl=self._settings.dlq_url, MessageBody=letter.body, MessageAttributes=letter.attributes
                )
                batch.outcome.count("dead_lettered")
                if letter.keyless:
                    batch.outcome.count("keyless")
                logger.warning("dispatch dead-lettered", message_id=(sent or {}).get("MessageId"), **letter.log)
                return
            except (botocore.exceptions.ConnectionError, botocore.exceptions.HTTPClientError) as error:
                failure = f"{type(error).__name__}: {error}"
            except botocore.exceptions.ClientError as error:
                if not _transient_sqs_error(error):
                    raise DeadLetterQueueUnavailable(f"the dead-letter queue refused a message: {error}") from error
                failure = str(error)
            except Exception as error:
                raise DeadLetterQueueUnavailable(f"a dead letter could not be sent: {error!r}") from error
            finally:
                _EXCHANGE_DEADLINE.reset(exchange)
            delay = self._jitter(attempts - 1)
            if time.monotonic() + delay + attempt_seconds > batch.deadline:
                break  # no attempt would fit after the wait: fail the batch now, not past its deadline
            logger.warning("dead-letter queue call failed; retrying", failure=failure)
            if batch.abort.wait(delay):
                raise _Aborted("another record failed the batch")
        raise DeadLetterQueueUnavailable(f"dead-letter queue unavailable after {attempts} attempts: {failure}")


def _each(pool: ThreadPoolExecutor, work: Callable[[_T], None], items: Sequence[_T], batch: _Batch) -> None:
    """Run `work` on every item in the pool; the first failure aborts the others and is raised."""

    def guarded(item: _T) -> None:
        if batch.abort.is_set():
            raise _Aborted("another record failed the batch")
        try:
            work(item)
        except BaseException:
            batch.abort.set()
            raise

    failures = [future.exception() for future in [pool.submit(guarded, item) for item in items]]
    errors = [error for error in failures if error is not None]
    if errors:
        # The first cause, not the work that merely stopped because of it.
        raise next((e for e in errors if not isinstance(e, _Aborted)), errors[0])


def _transient_sqs_error(error: botocore.exceptions.ClientError) -> bool:
    status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    code = error.response.get("Error", {}).get("Code", "")
    return status >= 500 or status == 429 or "Throttl" in code


def _coordinates(record: KafkaEventRecord) -> tuple[str, int, int]:
    return (record.topic, record.partition, record.offset)


def _ordered_groups(records: Iterable[KafkaEventRecord]) -> list[list[KafkaEventRecord]]:
    """Records sharing a Kafka key (per topic) in offset order; each keyless record on its own."""
    groups: dict[tuple[str, str | None, int], list[KafkaEventRecord]] = {}
    for index, record in enumerate(records):
        key = (record.topic, record.key, 0) if record.key is not None else (record.topic, None, index)
        groups.setdefault(key, []).append(record)
    return [sorted(group, key=lambda r: (r.partition, r.offset)) for group in groups.values()]


def _json_or_text(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return data.decode("utf-8", "replace")


def _is_outcome_unknown(answer: Any) -> bool:
    return isinstance(answer, dict) and answer.get("type") == OUTCOME_UNKNOWN


def _is_result(result: Any) -> bool:
    """Whether a batch's result is one (poimen.contract.SpawnResults' item): an object with an integer status and,
    if any, a Retry-After of whole seconds."""
    if not isinstance(result, dict):
        return False
    status, retry_after = result.get("status"), result.get("retry_after")
    return _is_integer(status) and (retry_after is None or (_is_integer(retry_after) and retry_after >= 0))


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _partitions(records: Iterable[KafkaEventRecord]) -> list[list[KafkaEventRecord]]:
    """The records of each topic partition, in offset order."""
    partitions: dict[tuple[str, int], list[KafkaEventRecord]] = {}
    for record in records:
        partitions.setdefault((record.topic, record.partition), []).append(record)
    return [sorted(records, key=lambda r: r.offset) for records in partitions.values()]


def _chunks(spawns: list[tuple[KafkaEventRecord, Spawn]], limit: int) -> Iterator[list[tuple[KafkaEventRecord, Spawn]]]:
    """The spawns in order, in runs of at most `limit` whose envelope fits MAX_BATCH_BODY_BYTES; a spawn over
    MAX_BODY_BYTES as sent is a chunk alone (sent alone, for the single route's answer)."""
    chunk: list[tuple[KafkaEventRecord, Spawn]] = []
    size = _ENVELOPE_BYTES
    for item in spawns:
        cost = len(item[1].body) + _SPAWN_OVERHEAD_BYTES
        alone = len(item[1].body) > MAX_BODY_BYTES
        if chunk and (alone or len(chunk) == limit or size + cost > MAX_BATCH_BODY_BYTES):
            yield chunk
            chunk, size = [], _ENVELOPE_BYTES
        chunk.append(item)
        size += cost
        if alone:
            yield chunk
            chunk, size = [], _ENVELOPE_BYTES
    if chunk:
        yield chunk


def _envelope(pending: list[tuple[KafkaEventRecord, Spawn]]) -> bytes:
    """The batch body (poimen.contract.SpawnBatch): each record's value verbatim, the traceparents if any, and the
    ordering keys if a Kafka key has more than one record in it: each such record's key as a label of this body
    (the number of the key in it), so that the API admits them in order; null for every other."""
    spawns = [spawn for _, spawn in pending]
    body = b'{"spawns":[' + b",".join(spawn.body for spawn in spawns) + b"]"
    if any(spawn.traceparent is not None for spawn in spawns):
        body += (
            b',"traceparents":' + json.dumps([spawn.traceparent for spawn in spawns], separators=(",", ":")).encode()
        )
    keys = Counter((record.topic, record.key) for record, _ in pending if record.key is not None)
    repeated = {key: str(number) for number, key in enumerate(key for key, count in keys.items() if count > 1)}
    if repeated:
        labels = [repeated.get((record.topic, record.key)) if record.key is not None else None for record, _ in pending]
        body += b',"ordering_keys":' + _compact(labels)
    return body + b"}"


def _compact(values: list[str | None]) -> bytes:
    return json.dumps(values, separators=(",", ":")).encode()


def _botocore_error(error: urllib3.exceptions.HTTPError, url: str) -> botocore.exceptions.BotoCoreError:
    """The error botocore's own send raises for this urllib3 error (botocore.httpsession.URLLib3Session)."""
    if isinstance(error, urllib3.exceptions.SSLError):
        return botocore.exceptions.SSLError(endpoint_url=url, error=error)
    if isinstance(error, urllib3.exceptions.NewConnectionError):
        return botocore.exceptions.EndpointConnectionError(endpoint_url=url, error=error)
    if isinstance(error, urllib3.exceptions.ConnectTimeoutError):
        return botocore.exceptions.ConnectTimeoutError(endpoint_url=url, error=error)
    if isinstance(error, urllib3.exceptions.ReadTimeoutError):
        return botocore.exceptions.ReadTimeoutError(endpoint_url=url, error=error)
    if isinstance(error, urllib3.exceptions.ProtocolError):
        return botocore.exceptions.ConnectionClosedError(endpoint_url=url, error=error)
    return botocore.exceptions.HTTPClientError(error=error)


class _Read:
    """An answer read whole, as botocore reads a raw answer's body."""

    def __init__(self, data: bytes) -> None:
        self._data = data

    def stream(self, *_: Any, **__: Any) -> Iterator[bytes]:
        yield self._data


# When the HTTP exchange under way in this thread must end (time.monotonic()); None: no bound but urllib3's.
_EXCHANGE_DEADLINE: ContextVar[float | None] = ContextVar("exchange_deadline", default=None)


class _Watchdog:
    """Shuts a connection's socket down when the exchange's deadline passes, which ends a blocked send or
    read at once with an error (urllib3 then discards the connection)."""

    def __init__(self, connection: urllib3.connection.HTTPConnection, deadline: float) -> None:
        self._connection = connection
        self._lock = threading.Lock()
        self._over = False
        self.expired = False
        self._timer = threading.Timer(max(0.0, deadline - time.monotonic()), self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        with self._lock:
            if self._over:
                return
            self.expired = True
            self.enforce()

    def enforce(self) -> None:
        """Shut the socket down if the deadline has passed (the socket may not have existed then)."""
        sock = self._connection.sock
        if self.expired and sock is not None:
            with contextlib.suppress(OSError):  # already closed
                sock.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        with self._lock:
            self._over = True
        self._timer.cancel()


class _DeadlineBoundConnection(urllib3.connection.HTTPConnection):
    """An HTTP connection whose exchange (request sent, answer read to its last byte, preloaded inside
    getresponse) ends by _EXCHANGE_DEADLINE."""

    _watchdog: _Watchdog | None = None

    def request(self, *args: Any, **kwargs: Any) -> None:
        deadline = _EXCHANGE_DEADLINE.get()
        self._watchdog = None if deadline is None else _Watchdog(self, deadline)
        try:
            super().request(*args, **kwargs)
        except BaseException:
            self._stop_watchdog()
            raise

    def getresponse(self) -> urllib3.response.HTTPResponse:  # type: ignore[override]  # as urllib3's own
        try:
            if self._watchdog is not None:
                self._watchdog.enforce()  # it expired while the socket was being connected
            return super().getresponse()
        finally:
            self._stop_watchdog()

    def _stop_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None


class _DeadlineBoundHTTPSConnection(_DeadlineBoundConnection, urllib3.connection.HTTPSConnection):
    pass


class _DeadlineBoundPool(urllib3.HTTPConnectionPool):
    ConnectionCls = _DeadlineBoundConnection


class _DeadlineBoundHTTPSPool(urllib3.HTTPSConnectionPool):
    ConnectionCls = _DeadlineBoundHTTPSConnection


def _deadline_bound_pool_manager(maxsize: int) -> urllib3.PoolManager:
    """Keep-alive connections to the API, each exchange bounded by the wall clock (_EXCHANGE_DEADLINE)."""
    manager = urllib3.PoolManager(maxsize=maxsize, block=True, retries=False)
    manager.pool_classes_by_scheme = {"http": _DeadlineBoundPool, "https": _DeadlineBoundHTTPSPool}
    return manager


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
