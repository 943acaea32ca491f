"""The outbox relay: each admitted run, written into the table, becomes one event on `poimen.<tenant>.events`.

The table's stream (NEW_IMAGE) is its only input: it never imports admission or the store (a test enforces
it) and its role cannot write the table. An event is the run as GET /v1/runs/{id} answers it, keyed by the
run's partition key, with CloudEvents 1.0 attributes as Kafka headers (binary content mode). Delivery is at
least once: a batch succeeds only once the broker acknowledged every event of it (idempotent producer,
acks=all); otherwise the invocation fails and the event source retries the batch, so a duplicate only
follows a failure, and is identical (same key, `ce_id`, value). `ce_id` names the admission, not the run
(poimen.ids.admission_id): a run id admitted again once its first admission expired is another event.

An event no retry can deliver (UNDELIVERABLE: its topic does not exist or may not be written, the record is
refused as it is) would block its shard, every tenant's later runs with it, until the retries ran out: it
is set aside instead, in OutboxFailedBatchesBucket as Lambda's on-failure record of its stream record
(poimen.on_failure), counted per tenant (EventsParked), and the batch goes on. It is set aside only by an
invocation whose other events were all acknowledged, as one object at a key of its own (its admission's id),
which a retried batch writes again, and is counted only by the invocation that set aside every such event of
its batch: each event is one object, and counted once.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import datetime
from functools import lru_cache
from typing import Any

import botocore.session
from aws_lambda_powertools import Metrics
from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.typing import LambdaContext
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError
from confluent_kafka import KafkaError, KafkaException, Message, Producer

from poimen import on_failure
from poimen.config import OutboxSettings
from poimen.contract import run_json
from poimen.ids import admission_id
from poimen.kafka import events_topic, partition_key
from poimen.kafka_client import client_config, delivery_settings, quiet_client_settings
from poimen.observability import logger, metrics, metrics_disabled

RUN_PREFIX = "RUN#"
ADMITTED = "admitted"
EVENT_TYPE = "poimen.run.admitted"
# Stream records that admit a run: an INSERT, or a MODIFY when a run overwrote an expired one at its key
# (run retention; runs are never modified otherwise). A REMOVE (a TTL deletion) admits nothing.
ADMITTING_EVENTS = frozenset({"INSERT", "MODIFY"})
CONTENT_TYPE = "application/json"
# A run item's attributes that every run has (store.RunRecord's non-null ones; a test holds them equal),
# and the optional ones the event carries: the outbox reads the stream's image itself rather than import
# the store's write path.
REQUIRED_ATTRIBUTES = frozenset(
    {"pk", "run_id", "tenant_id", "workflow_ref", "input", "fingerprint", "attempt_id", "status", "created_at"}
)
OPTIONAL_ATTRIBUTES = frozenset({"goal_id", "dispatch_key", "traceparent"})
# The attribute of an item at a run's key that is no run (store.ITEM_TYPE; a test holds them equal).
NOT_A_RUN_MARKER = "item_type"
# librdkafka's answers (as delivery reports, or raised by produce()) that are the same for this record on
# this topic however often it is sent, until an operator acts: retrying the batch only blocks the shard.
UNDELIVERABLE = frozenset(
    {
        # No such topic: MSK creates none on demand (auto.create.topics.enable false), so it exists only once
        # `poimen topics ensure` made it. Broker side, or librdkafka's own once the metadata said so for
        # `topic.metadata.propagation.max.ms` (set below the delivery timeout, so it is said, not timed out).
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError._UNKNOWN_TOPIC,
        # A partition the topic does not have (partitions are never removed: the topic was recreated smaller).
        KafkaError._UNKNOWN_PARTITION,
        # The role may not write the topic (MSK IAM): a tenant outside the stack's Tenants; only a deploy
        # changes the role's policies.
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        # The record is larger than the topic, the broker or the client takes (max.message.bytes,
        # message.max.bytes); the event is a function of the stored run, so it is as large every time. The
        # broker's answer is about a whole record batch, though (a topic's max.message.bytes bounds the batch
        # librdkafka sends, up to its batch.size of 1 MB): an event it refused in a batch of several is sent
        # again alone (OutboxRelay.publish_batch), and is undeliverable only if refused alone too.
        KafkaError.MSG_SIZE_TOO_LARGE,
        # The broker refused this record on validation, or the topic's name: the same answer every time.
        KafkaError.INVALID_RECORD,
        KafkaError.TOPIC_EXCEPTION,
    }
)
# Not among them, as every tenant's events meet them alike and the batch must wait (it fails and is retried):
# time-outs and transport errors (the broker away), CLUSTER_AUTHORIZATION_FAILED and SASL failures (the role
# or its credentials), _FATAL (the producer's state: the retry gets a new one), not-enough-replicas.
PARKED_PREFIX = "undeliverable"
# RFC 3339's date-time (section 5.6), as admission writes created_at (poimen.wire.rfc3339).
_RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})", re.ASCII)
# Lambda's on-failure records say why in requestContext.condition; the outbox's own say this.
UNDELIVERABLE_CONDITION = "EventsUndeliverable"
# Set-aside writes in flight at once, one object per event (a batch of 100 of a tenant without its topic is 7
# rounds of S3's latency, not 100, while the shard waits): the S3 client's connection pool is as large.
_S3_CONCURRENCY = 16
# The S3 client of the parking: a few seconds at most, so that a failure still reaches the event source.
_S3_CONFIG = Config(
    connect_timeout=1,
    read_timeout=3,
    retries={"total_max_attempts": 2, "mode": "standard"},
    max_pool_connections=_S3_CONCURRENCY,
)
_S3_WORST_SECONDS = 2 * (1 + 3) + 1


class OutboxBatchFailed(Exception):
    """Some event of the batch was not acknowledged by the broker (or could not be set aside): the event
    source must retry the batch."""


class MalformedRun(OutboxBatchFailed):
    """An item that looks like an admitted run (pk RUN#..., status admitted) lacks what an event needs.

    Failing the batch (rather than skipping the item) keeps it: BisectBatchOnFunctionError isolates it, and
    past the retry budget the on-failure destination records it.
    """


@dataclass(frozen=True, slots=True)
class RunEvent:
    """One Kafka record on `poimen.<tenant>.events`: everything about it is a function of the stored run."""

    tenant_id: str
    run_id: str
    # The admission's id (poimen.ids.admission_id), its CloudEvents id: one per admission, not per run.
    event_id: str
    created_at: str
    topic: str
    key: bytes
    value: bytes
    headers: tuple[tuple[str, bytes], ...]
    # The stream record it was built from (None when built from an item, as backfill does): what is set
    # aside if it cannot be delivered.
    stream_record: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)


def event_source_uri(stack_name: str, tenant_id: str) -> str:
    """The CloudEvents `source` of a tenant's events in one stack: `urn:poimen:<stack>:<tenant>`."""
    return f"urn:poimen:{stack_name}:{tenant_id}"


def is_admitted_run(image: Mapping[str, Mapping[str, Any]]) -> bool:
    """What the event source mapping's FilterCriteria lets through, checked again: pk RUN#..., status admitted.
    Grants (`GRANT#...`) and any item that is not a run (a fence: `item_type`, no status) are not."""
    pk = _string(image, "pk")
    return (
        pk is not None
        and pk.startswith(RUN_PREFIX)
        and _string(image, "status") == ADMITTED
        and NOT_A_RUN_MARKER not in image
    )


def run_event(image: Mapping[str, Mapping[str, Any]], stack_name: str) -> RunEvent:
    """The event of one admitted run, from its stream image (DynamoDB JSON; every run attribute a string).

    Raises MalformedRun if a required attribute is missing or not a string.
    """
    missing = sorted(name for name in REQUIRED_ATTRIBUTES if _string(image, name) is None)
    if missing:
        raise MalformedRun(f"run item {_string(image, 'pk')!r} lacks string attributes {missing}")
    text: dict[str, str] = {name: _string(image, name) or "" for name in REQUIRED_ATTRIBUTES}
    tenant_id, run_id, created_at = text["tenant_id"], text["run_id"], text["created_at"]
    if not _is_rfc3339(created_at):  # the event's time, its lag's start and the key it is set aside at (parked_key)
        raise MalformedRun(f"run item {_string(image, 'pk')!r} has created_at {created_at!r}, not an RFC 3339 time")
    body = run_json(
        run_id=run_id,
        tenant_id=tenant_id,
        workflow_ref=text["workflow_ref"],
        input_json=text["input"],
        goal_id=_string(image, "goal_id"),
        dispatch_key=_string(image, "dispatch_key"),
        created_at=created_at,
    )
    event_id = admission_id(run_id, text["attempt_id"])
    headers: list[tuple[str, bytes]] = [
        ("ce_specversion", b"1.0"),
        ("ce_id", event_id.encode()),
        ("ce_source", event_source_uri(stack_name, tenant_id).encode()),
        ("ce_type", EVENT_TYPE.encode()),
        ("ce_subject", run_id.encode()),
        ("ce_time", created_at.encode()),
        ("content-type", CONTENT_TYPE.encode()),
    ]
    traceparent = _string(image, "traceparent")
    if traceparent:
        headers.append(("traceparent", traceparent.encode()))
    return RunEvent(
        tenant_id=tenant_id,
        run_id=run_id,
        event_id=event_id,
        created_at=created_at,
        topic=events_topic(tenant_id),
        key=partition_key(tenant_id, run_id),
        value=body.encode(),
        headers=tuple(headers),
    )


def _is_rfc3339(text: str) -> bool:
    """An RFC 3339 date-time, with its offset: `datetime.fromisoformat` alone would also take a date, an ISO week,
    or a time without an offset, which it reads in the process's own time zone."""
    if not _RFC3339.fullmatch(text):
        return False
    try:
        datetime.fromisoformat(text)
    except ValueError:  # a month 13, a day 32
        return False
    return True


def _string(image: Mapping[str, Mapping[str, Any]], name: str) -> str | None:
    value = image.get(name)
    text = value.get("S") if isinstance(value, Mapping) else None
    return text if isinstance(text, str) else None


def events_of_batch(event: Mapping[str, Any], stack_name: str) -> list[RunEvent]:
    """The events of a DynamoDB stream batch, in stream order: one per admitted run written (ADMITTING_EVENTS)."""
    events = []
    for record in event.get("Records", []):
        image = record.get("dynamodb", {}).get("NewImage")
        if (
            record.get("eventName") not in ADMITTING_EVENTS
            or not isinstance(image, Mapping)
            or not is_admitted_run(image)
        ):
            logger.debug("stream record is no admitted run; nothing to publish", event_id=record.get("eventID"))
            continue
        events.append(replace(run_event(image, stack_name), stream_record=record))
    return events


# --- publishing -------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SetAside:
    """An event no retry can deliver, and librdkafka's reason."""

    event: RunEvent
    error: KafkaError

    def describe(self) -> dict[str, str]:
        published = self.event
        return {
            "run_id": published.run_id,
            "tenant_id": published.tenant_id,
            "created_at": published.created_at,
            "topic": published.topic,
            "error": self.error.name(),
            "reason": str(self.error.str()),
        }


@dataclass
class BatchOutcome:
    """What one invocation published, per tenant; published as EMF metrics whether or not it succeeded."""

    published: dict[str, int] = field(default_factory=dict)
    # ms from a run's created_at to the broker's acknowledgement of its event, the worst of the batch.
    max_lag_ms: dict[str, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    # Events no retry can deliver, in stream order; `parked` counts, per tenant, those written aside.
    undeliverable: list[SetAside] = field(default_factory=list)
    # Events the broker refused as too large in a record batch that may have held others: to send alone.
    refused_in_batch: list[RunEvent] = field(default_factory=list)
    parked: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def acknowledged(self, published: RunEvent, acked_at: float) -> None:
        lag_ms = max(0.0, acked_at * 1000 - _epoch_ms(published.created_at))
        with self._lock:
            tenant = published.tenant_id
            self.published[tenant] = self.published.get(tenant, 0) + 1
            self.max_lag_ms[tenant] = max(self.max_lag_ms.get(tenant, 0.0), lag_ms)

    def failed(self, published: RunEvent, error: KafkaError, *, alone: bool = True) -> None:
        """`alone`: the answer is about this event by itself (produce() raised it, or it was sent alone)."""
        with self._lock:
            if error.code() == KafkaError.MSG_SIZE_TOO_LARGE and not alone:
                self.refused_in_batch.append(published)
            elif error.code() in UNDELIVERABLE:
                self.undeliverable.append(SetAside(published, error))
            else:
                self.failures.append(f"{published.run_id}: {error.str()}")

    def publish(self, metrics: Metrics) -> None:
        """One EMF document per tenant (a stream batch mixes tenants), each with its `tenant` dimension. None when
        metrics are disabled: Powertools' flush then clears nothing, and its add_metric prints the set at a metric's
        100th value whether or not they are, which a batch's 100th tenant would reach."""
        if metrics_disabled():
            return
        for tenant in sorted(self.published.keys() | self.parked.keys()):
            metrics.add_dimension(name="tenant", value=tenant)
            if tenant in self.published:
                metrics.add_metric(name="EventsPublished", unit=MetricUnit.Count, value=self.published[tenant])
                metrics.add_metric(name="OutboxLag", unit=MetricUnit.Milliseconds, value=self.max_lag_ms[tenant])
            if tenant in self.parked:
                metrics.add_metric(name="EventsParked", unit=MetricUnit.Count, value=self.parked[tenant])
            metrics.flush_metrics()


def _epoch_ms(timestamp: str) -> float:
    return datetime.fromisoformat(timestamp).timestamp() * 1000


class OutboxRelay:
    """Publishes stream batches to the tenants' events topics; built once per execution environment."""

    def __init__(self, settings: OutboxSettings, producer: Producer | None = None, s3: Any = None) -> None:
        self._settings = settings
        self._producer: Producer = producer or _kafka_producer(settings)
        self._producer.poll(0)  # serves oauth_cb (MSK IAM) before the first request
        self._s3 = s3  # built on the first event set aside: most environments never need it
        # Its metrics under its own service (a process may hold other functions' handlers: poimen dev).
        self.metrics = Metrics(service=settings.service_name)

    def publish_batch(self, event: Mapping[str, Any], remaining_ms: Callable[[], int], outcome: BatchOutcome) -> None:
        """Produce every event of the batch and wait for the broker's acknowledgement of each, until the
        invocation's deadline; raise OutboxBatchFailed unless every one was acknowledged or is undeliverable
        (UNDELIVERABLE: then it is in `outcome.undeliverable`, for `set_aside`)."""
        events = events_of_batch(event, self._settings.stack_name)
        deadline = time.monotonic() + remaining_ms() / 1000 - self._settings.time_margin_seconds
        for published in events:
            self._produce(published, outcome, alone=False)
            self._producer.poll(0)
        unacknowledged = self._producer.flush(max(0.0, deadline - time.monotonic())) if events else 0
        while outcome.refused_in_batch and not (unacknowledged or outcome.failures):
            # One at a time, nothing else queued: each is the only record of its batch.
            self._produce(outcome.refused_in_batch.pop(0), outcome, alone=True)
            unacknowledged = self._producer.flush(max(0.0, deadline - time.monotonic()))
        if unacknowledged or outcome.failures:
            self._drop_queued()
            raise OutboxBatchFailed(
                f"{unacknowledged} event(s) unacknowledged at the deadline, {len(outcome.failures)} failed "
                f"of {len(events)}: {outcome.failures[:3]}"
            )
        logger.info(
            "events published",
            events=len(events) - len(outcome.undeliverable),
            undeliverable=len(outcome.undeliverable),
            records=len(event.get("Records", [])),
        )

    def _produce(self, published: RunEvent, outcome: BatchOutcome, *, alone: bool) -> None:
        """Queue one event, its delivery reported to `outcome`; OutboxBatchFailed (the queue dropped) if the
        producer refuses it for a reason other than UNDELIVERABLE."""
        try:
            self._producer.produce(
                published.topic,
                value=published.value,
                key=published.key,
                headers=list(published.headers),
                on_delivery=_on_delivery(published, outcome, alone=alone),
            )
        except KafkaException as error:
            kafka_error: KafkaError = error.args[0]
            if kafka_error.code() in UNDELIVERABLE:  # e.g. a topic the metadata already said is unknown
                outcome.failed(published, kafka_error)
                return
            self._drop_queued()
            raise OutboxBatchFailed(f"the producer refused event {published.run_id}: {error}") from error
        except BufferError as error:  # its queue full
            self._drop_queued()
            raise OutboxBatchFailed(f"the producer refused event {published.run_id}: {error}") from error

    def set_aside(self, outcome: BatchOutcome, context: LambdaContext) -> None:
        """Write each of the batch's undeliverable events to OutboxFailedBatchesBucket, as an on-failure record
        of its stream record (and why it cannot be delivered) at a key of its own (`parked_key`), then count
        them in `outcome.parked`; OutboxBatchFailed if one cannot be written, or not surely before the deadline.

        A retried batch writes the same objects again (a retry may also be half of the batch, bisected), so
        each event is one object however often it is set aside, and is counted only by the invocation that
        wrote every one: an invocation that fails here counts none of the events it wrote. Up to
        `_S3_CONCURRENCY` are written at once; each write starts only while it surely ends before the deadline,
        and none starts once one failed.
        """
        bucket = self._settings.failed_batches_bucket
        if bucket is None:
            raise OutboxBatchFailed(
                f"{len(outcome.undeliverable)} undeliverable event(s), and no bucket to set them aside"
            )
        s3 = self._s3_client()  # built once, before the writers share it (botocore clients are thread-safe)
        failed = threading.Event()

        def write(undeliverable: SetAside) -> str | None:
            """The event's tenant once written; None if skipped, as another write failed."""
            if failed.is_set():
                return None
            published = undeliverable.event
            left = context.get_remaining_time_in_millis() / 1000 - self._settings.time_margin_seconds
            if left < _S3_WORST_SECONDS:
                failed.set()
                raise OutboxBatchFailed(
                    f"{left:.1f} s left: too little to set aside {len(outcome.undeliverable)} event(s)"
                )
            key = parked_key(published)
            try:
                s3.put_object(
                    Bucket=bucket,
                    Key=key,
                    Body=json.dumps(_parked_record(undeliverable, context)).encode(),
                    ContentType="application/json",
                )
            except (BotoCoreError, ClientError) as error:
                failed.set()
                raise OutboxBatchFailed(
                    f"could not set aside 1 event of {published.tenant_id} ({published.run_id}): {error}"
                ) from error
            logger.warning("event set aside: it cannot be delivered", extra={"key": key, **undeliverable.describe()})
            return published.tenant_id

        writers = max(1, min(_S3_CONCURRENCY, len(outcome.undeliverable)))
        with ThreadPoolExecutor(max_workers=writers, thread_name_prefix="outbox-set-aside") as pool:
            written = [pool.submit(write, undeliverable) for undeliverable in outcome.undeliverable]
        for future in written:
            error = future.exception()
            if error is not None:
                raise error
        parked: dict[str, int] = {}
        for future in written:
            tenant = future.result()
            if tenant is not None:
                parked[tenant] = parked.get(tenant, 0) + 1
        outcome.parked.update(parked)

    def _s3_client(self) -> Any:
        if self._s3 is None:
            session = botocore.session.get_session()
            self._s3 = session.create_client("s3", region_name=self._settings.region, config=_S3_CONFIG)
        return self._s3

    def _drop_queued(self) -> None:
        """What is still queued would go out after this invocation failed, beside the retry's copy: dropped."""
        self._producer.purge(in_queue=True, in_flight=False, blocking=True)
        self._producer.poll(0)


def _on_delivery(
    published: RunEvent, outcome: BatchOutcome, *, alone: bool
) -> Callable[[KafkaError | None, Message], None]:
    def delivered(error: KafkaError | None, _message: Message) -> None:
        if error is None:
            outcome.acknowledged(published, time.time())
        else:
            outcome.failed(published, error, alone=alone)

    return delivered


def parked_key(published: RunEvent) -> str:
    """Where an undeliverable event is set aside: `undeliverable/<tenant>/YYYY/MM/DD/<time>-<ce_id>`, the date
    and time its run's `created_at`, the id its admission's (`ce_id`): the same key for every copy of it."""
    created = datetime.fromisoformat(published.created_at)
    return on_failure.object_key(f"{PARKED_PREFIX}/{published.tenant_id}", created, published.event_id)


def _parked_record(undeliverable: SetAside, context: LambdaContext) -> dict[str, Any]:
    """Lambda's on-failure record (poimen.on_failure) of the stream record of one undeliverable event, as the
    event source would park it, with `undeliverable` saying why it could not be delivered."""
    records = [undeliverable.event.stream_record or {}]
    return {
        **on_failure.invocation_record(
            context.invoked_function_arn,
            1,
            condition=UNDELIVERABLE_CONDITION,
            request_id=context.aws_request_id,
            executed_version=context.function_version,
            function_error=None,
        ),
        "DDBStreamBatchInfo": on_failure.stream_batch_info(records, shard_id=None),
        "payload": json.dumps({"Records": records}),
        "undeliverable": [undeliverable.describe()],
    }


def _kafka_producer(settings: OutboxSettings) -> Producer:
    config = client_config(
        settings.bootstrap_servers,
        settings.region if settings.iam_auth else None,
        **{
            # Idempotent, acks=all: a record resent by the client is written once; murmur2, the dispatch
            # side's partitioner (poimen.dispatch), so a run's dispatch and its event share a partition number.
            "enable.idempotence": True,
            "acks": "all",
            "partitioner": "murmur2_random",
            # An unknown topic is reported as one (UNDELIVERABLE), not as a time-out that would fail the batch.
            **delivery_settings(settings.delivery_timeout_seconds),
            "linger.ms": 5,
            **quiet_client_settings(settings.delivery_timeout_seconds),
        },
    )
    return Producer(config)


@lru_cache(maxsize=1)
def outbox_service() -> OutboxRelay:
    """The outbox built once per execution environment; `outbox_service.cache_clear()` after a SnapStart
    restore drops its producer (functions/outbox_relay/app.py)."""
    return OutboxRelay(OutboxSettings.from_env())


def handle_batch(event: Mapping[str, Any], context: LambdaContext) -> None:
    """The whole invocation: publish the batch, set aside what cannot be delivered, then its metrics whether
    or not it succeeded."""
    outcome = BatchOutcome()
    relay: OutboxRelay | None = None
    try:
        relay = outbox_service()
        relay.publish_batch(event, context.get_remaining_time_in_millis, outcome)
        if outcome.undeliverable:
            relay.set_aside(outcome, context)
    except Exception:
        # Whatever failed the batch, the retry gets a new producer: an idempotent one may have met a fatal
        # error (its sequence state lost to the outage), after which it would refuse every later record.
        outbox_service.cache_clear()
        raise
    finally:
        outcome.publish(relay.metrics if relay is not None else metrics)
