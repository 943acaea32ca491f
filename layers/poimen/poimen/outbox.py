"""The outbox relay: each admitted run, written into the table, becomes one event on `poimen.<tenant>.events`.

The table's stream (NEW_IMAGE) is its only input: it never imports admission or the store (a test enforces
it) and its role cannot write the table. An event is the run as GET /v1/runs/{id} answers it, keyed by the
run's partition key, with CloudEvents 1.0 attributes as Kafka headers (binary content mode). Delivery is at
least once: a batch succeeds only once the broker acknowledged every event of it (idempotent producer,
acks=all); otherwise the invocation fails and the event source retries the batch, so a duplicate only
follows a failure, and is identical (same key, `ce_id`, value).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from typing import Any

from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.typing import LambdaContext
from confluent_kafka import KafkaError, KafkaException, Message, Producer

from poimen.config import OutboxSettings
from poimen.contract import run_json
from poimen.kafka import events_topic, partition_key
from poimen.kafka_client import client_config, quiet_client_settings
from poimen.observability import logger, metrics

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


class OutboxBatchFailed(Exception):
    """Some event of the batch was not acknowledged by the broker: the event source must retry the batch."""


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
    created_at: str
    topic: str
    key: bytes
    value: bytes
    headers: tuple[tuple[str, bytes], ...]


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
    body = run_json(
        run_id=run_id,
        tenant_id=tenant_id,
        workflow_ref=text["workflow_ref"],
        input_json=text["input"],
        goal_id=_string(image, "goal_id"),
        dispatch_key=_string(image, "dispatch_key"),
        created_at=created_at,
    )
    headers: list[tuple[str, bytes]] = [
        ("ce_specversion", b"1.0"),
        ("ce_id", run_id.encode()),
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
        created_at=created_at,
        topic=events_topic(tenant_id),
        key=partition_key(tenant_id, run_id),
        value=body.encode(),
        headers=tuple(headers),
    )


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
        events.append(run_event(image, stack_name))
    return events


# --- publishing -------------------------------------------------------------------------------------------


@dataclass
class BatchOutcome:
    """What one invocation published, per tenant; published as EMF metrics whether or not it succeeded."""

    published: dict[str, int] = field(default_factory=dict)
    # ms from a run's created_at to the broker's acknowledgement of its event, the worst of the batch.
    max_lag_ms: dict[str, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def acknowledged(self, published: RunEvent, acked_at: float) -> None:
        lag_ms = max(0.0, acked_at * 1000 - _epoch_ms(published.created_at))
        with self._lock:
            tenant = published.tenant_id
            self.published[tenant] = self.published.get(tenant, 0) + 1
            self.max_lag_ms[tenant] = max(self.max_lag_ms.get(tenant, 0.0), lag_ms)

    def failed(self, published: RunEvent, reason: str) -> None:
        with self._lock:
            self.failures.append(f"{published.run_id}: {reason}")

    def publish(self) -> None:
        """One EMF document per tenant (a stream batch mixes tenants), each with its `tenant` dimension."""
        for tenant, count in sorted(self.published.items()):
            metrics.add_dimension(name="tenant", value=tenant)
            metrics.add_metric(name="EventsPublished", unit=MetricUnit.Count, value=count)
            metrics.add_metric(name="OutboxLag", unit=MetricUnit.Milliseconds, value=self.max_lag_ms[tenant])
            metrics.flush_metrics()


def _epoch_ms(timestamp: str) -> float:
    return datetime.fromisoformat(timestamp).timestamp() * 1000


class OutboxRelay:
    """Publishes stream batches to the tenants' events topics; built once per execution environment."""

    def __init__(self, settings: OutboxSettings, producer: Producer | None = None) -> None:
        self._settings = settings
        self._producer: Producer = producer or _kafka_producer(settings)
        self._producer.poll(0)  # serves oauth_cb (MSK IAM) before the first request

    def publish_batch(self, event: Mapping[str, Any], remaining_ms: Callable[[], int], outcome: BatchOutcome) -> None:
        """Produce every event of the batch and wait for the broker's acknowledgement of each, until the
        invocation's deadline; raise OutboxBatchFailed unless every one was acknowledged."""
        events = events_of_batch(event, self._settings.stack_name)
        deadline = time.monotonic() + remaining_ms() / 1000 - self._settings.time_margin_seconds
        for published in events:
            try:
                self._producer.produce(
                    published.topic,
                    value=published.value,
                    key=published.key,
                    headers=list(published.headers),
                    on_delivery=_on_delivery(published, outcome),
                )
            except (KafkaException, BufferError) as error:  # its queue full, or a fatal producer state
                self._drop_queued()
                raise OutboxBatchFailed(f"the producer refused event {published.run_id}: {error}") from error
            self._producer.poll(0)
        unacknowledged = self._producer.flush(max(0.0, deadline - time.monotonic())) if events else 0
        if unacknowledged or outcome.failures:
            self._drop_queued()
            raise OutboxBatchFailed(
                f"{unacknowledged} event(s) unacknowledged at the deadline, {len(outcome.failures)} failed "
                f"of {len(events)}: {outcome.failures[:3]}"
            )
        logger.info("events published", events=len(events), records=len(event.get("Records", [])))

    def _drop_queued(self) -> None:
        """What is still queued would go out after this invocation failed, beside the retry's copy: dropped."""
        self._producer.purge(in_queue=True, in_flight=False, blocking=True)
        self._producer.poll(0)


def _on_delivery(published: RunEvent, outcome: BatchOutcome) -> Callable[[KafkaError | None, Message], None]:
    def delivered(error: KafkaError | None, _message: Message) -> None:
        if error is None:
            outcome.acknowledged(published, time.time())
        else:
            outcome.failed(published, str(error.str()))

    return delivered


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
            "message.timeout.ms": int(settings.delivery_timeout_seconds * 1000),
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
    """The whole invocation: publish the batch, then its metrics whether or not it succeeded."""
    outcome = BatchOutcome()
    try:
        outbox_service().publish_batch(event, context.get_remaining_time_in_millis, outcome)
    except Exception:
        # Whatever failed the batch, the retry gets a new producer: an idempotent one may have met a fatal
        # error (its sequence state lost to the outage), after which it would refuse every later record.
        outbox_service.cache_clear()
        raise
    finally:
        outcome.publish()
