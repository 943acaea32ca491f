"""What a pipeline left behind, read from a local stack into the pipeline checker's input
(tests/history/pipeline.py): the table's consistent scan, every record of the events topics, the relay's dead
letters, the parked batches and set-aside events in the failed-batches buckets; and which keyless records the
relay may have been given again after a disruption (a record past its group's committed offset when
`poimen dev` was killed or the broker stopped: its batch comes again, whatever became of its first POST).
A disruption whose committed offsets are not known allows no redelivery: it is reported as unobserved,
which fails the check."""

from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, Message

from poimen.dead_letter import is_dead_letter
from poimen.kafka import dispatch_topic, events_topic, tenant_of_dispatch_topic
from poimen.outbox import PARKED_PREFIX
from tests.history.pipeline import DeadLetter, EventRecord, Parked, Redelivery, Spawn, StoredRun, canonical

Partition = tuple[str, int]


@dataclass(frozen=True)
class Uncommitted:
    """A moment the relay's batches in flight were lost (a kill, the broker stopped): its group's committed
    offsets then (None: the look-up failed), and when."""

    what: str
    at_ms: float
    committed: dict[Partition, int] | None


@dataclass(frozen=True)
class Redeliveries:
    """The keyless records the relay may have been given again, by (tenant, marker), one reason for each time;
    and what could not be known, as (what, why): a disruption whose committed offsets were not looked up, or
    whose look-up left out a record's partition. By tenant too: a marker is unique in its tenant's stream only."""

    by_dispatch: dict[tuple[str, str], list[Redelivery]]
    unobserved: list[tuple[str, str]]


@dataclass(frozen=True)
class DispatchRecord:
    """A record of a dispatch topic: where it is, when it was produced, and the spawn it names."""

    partition: Partition
    offset: int
    timestamp_ms: int
    tenant: str
    key: str | None
    marker: str | None


def scan_runs(dynamodb: Any, table: str) -> list[StoredRun]:
    """Every run of the table (fences left out), read with one consistent scan."""
    pages = dynamodb.get_paginator("scan").paginate(
        TableName=table,
        ConsistentRead=True,
        FilterExpression="begins_with(pk, :p) AND attribute_not_exists(item_type)",
        ExpressionAttributeValues={":p": {"S": "RUN#"}},
    )
    runs = []
    for page in pages:
        for item in page["Items"]:
            fields = {name: value.get("S") for name, value in item.items()}
            run_input = json.loads(fields.get("input") or "null")
            marker = run_input.get("marker") if isinstance(run_input, dict) else None
            runs.append(
                StoredRun(
                    tenant=str(fields["tenant_id"]),
                    run_id=str(fields["run_id"]),
                    attempt_id=str(fields["attempt_id"]),
                    dispatch_key=fields.get("dispatch_key"),
                    marker=marker if isinstance(marker, str) else None,
                    created_at=str(fields["created_at"]),
                    spawn=Spawn(str(fields["workflow_ref"]), canonical(run_input), fields.get("goal_id")),
                    traceparent=fields.get("traceparent"),
                )
            )
    return runs


def read_topics(
    bootstrap: str, topics: list[str], done: Callable[[list[Message]], bool], timeout: float, quiet: float = 5.0
) -> list[Message]:
    """Every record of `topics` from the start, read until `done` says so (or `timeout`), then for `quiet`
    seconds more (late copies)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"pipeline-check-{os.getpid()}-{time.monotonic_ns()}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    messages: list[Message] = []
    deadline = time.monotonic() + timeout
    quiet_until: float | None = None
    try:
        consumer.subscribe(topics)
        while time.monotonic() < (quiet_until or deadline):
            message = consumer.poll(0.5)
            if message is None or message.error() is not None:
                if quiet_until is None and done(messages):
                    quiet_until = time.monotonic() + quiet
                continue
            messages.append(message)
    finally:
        consumer.close()
    return messages


def read_events(bootstrap: str, tenants: Iterable[str], runs: list[StoredRun], timeout: float) -> list[EventRecord]:
    """The tenants' events topics, read until every stored admission's event is in (or `timeout`), then for
    5 s more: the outbox of a live `poimen dev` may still be publishing the last runs' events."""
    admissions = {run.admission for run in runs}

    def every_admission(messages: list[Message]) -> bool:
        seen = {value for message in messages for name, value in _headers(message) if name == "ce_id"}
        return {admission.encode() for admission in admissions} <= seen

    messages = read_topics(bootstrap, [events_topic(tenant) for tenant in tenants], every_admission, timeout)
    return [
        EventRecord(message.topic() or "", message.key(), _headers(message), message.value()) for message in messages
    ]


def read_dispatches(bootstrap: str, tenants: Iterable[str], records: int, timeout: float) -> list[DispatchRecord]:
    """The `records` records of the tenants' dispatch topics, with where each is and what it names."""
    topics = [dispatch_topic(tenant) for tenant in tenants]
    messages = read_topics(bootstrap, topics, lambda read: len(read) >= records, timeout, quiet=1.0)
    found = []
    for message in messages:
        body = _json(message.value())
        topic = message.topic() or ""
        found.append(
            DispatchRecord(
                (topic, message.partition() or 0),
                message.offset() or 0,
                message.timestamp()[1],
                tenant_of_dispatch_topic(topic) or topic,
                _text(body.get("dispatch_key")),
                _marker(body),
            )
        )
    return found


def redeliveries(records: list[DispatchRecord], disruptions: list[Uncommitted]) -> Redeliveries:
    """Keyless records (by tenant and marker) the relay may have been given again: produced before a disruption and
    past its committed offset then, so its batch (handled or not) came again, once. Where that offset is not
    known, no record is taken to have come again (a guess would loosen the check): it is unobserved."""
    found: dict[tuple[str, str], list[Redelivery]] = {}
    unobserved: dict[str, str] = {}
    for disruption in disruptions:
        if disruption.committed is None:
            unobserved[disruption.what] = "the relay group's committed offsets could not be looked up"
    for record in records:
        if record.key is not None or record.marker is None:
            continue
        for disruption in disruptions:
            if disruption.committed is None or record.timestamp_ms > disruption.at_ms:
                continue
            committed = disruption.committed.get(record.partition)
            if committed is None:
                topic, partition = record.partition
                unobserved.setdefault(
                    disruption.what, f"the look-up of committed offsets left out {topic}[{partition}]"
                )
            elif record.offset >= committed:
                again = Redelivery(f"uncommitted at {disruption.what}", disruption.at_ms)
                found.setdefault((record.tenant, record.marker), []).append(again)
    return Redeliveries(found, sorted(unobserved.items()))


def read_dead_letters(sqs: Any, url: str) -> tuple[list[DeadLetter], int]:
    """Every letter in the queue (received, not deleted), and the queue's approximate count of them."""
    attributes = sqs.get_queue_attributes(
        QueueUrl=url, AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]
    )["Attributes"]
    approximate = int(attributes["ApproximateNumberOfMessages"]) + int(
        attributes["ApproximateNumberOfMessagesNotVisible"]
    )
    letters = []
    for _ in range(1000):  # bounded: 10 a receive
        messages = sqs.receive_message(
            QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=0, VisibilityTimeout=600
        ).get("Messages", [])
        if not messages:
            break
        letters += [_dead_letter(json.loads(message["Body"])) for message in messages]
    return letters, approximate


def read_parked(s3: Any, bucket: str, where: str) -> list[Parked]:
    """The bucket's parked batches (Lambda's on-failure records) and, in the outbox's, its set-aside events."""
    parked = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for entry in page.get("Contents", []):
            key = entry["Key"]
            document = json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
            if key.startswith(f"{PARKED_PREFIX}/"):
                for event in document.get("undeliverable", []):
                    name = f"{event.get('tenant_id')}/run:{event.get('run_id')}"
                    parked.append(Parked(where, key, (name,), set_aside=True, reason=str(event.get("reason"))))
                continue
            parked.append(Parked(where, key, _parked_names(json.loads(document.get("payload") or "{}"))))
    return parked


def _parked_names(payload: dict[str, Any]) -> tuple[str, ...]:
    """What a parked batch holds: the dispatches of an MSK event's records, the runs of a stream batch's."""
    names = []
    for records in (payload.get("records") or {}).values():
        for record in records:
            body = _json(base64.b64decode(record.get("value") or ""))
            tenant = tenant_of_dispatch_topic(str(record.get("topic")))
            key = _text(body.get("dispatch_key"))
            names.append(f"{tenant}/{key}" if key is not None else f"{tenant}/marker:{_marker(body)}")
    for record in payload.get("Records") or []:
        image = record.get("dynamodb", {}).get("NewImage", {})
        names.append(f"{image.get('tenant_id', {}).get('S')}/run:{image.get('run_id', {}).get('S')}")
    return tuple(names)


def _dead_letter(body: Any) -> DeadLetter:
    if not is_dead_letter(body):  # e.g. an event source's on-failure record: no record value to name
        condition = body.get("requestContext", {}).get("condition") if isinstance(body, dict) else None
        return DeadLetter(None, None, None, condition or "?", json.dumps(body)[:200])
    record, reason = body["record"], body["reason"]
    value = _json(base64.b64decode(record.get("value") or ""))
    problem = reason.get("problem")
    run_id = problem.get("run_id") if isinstance(problem, dict) else None
    return DeadLetter(
        tenant_of_dispatch_topic(str(record.get("topic"))),
        _text(value.get("dispatch_key")),
        _marker(value),
        reason.get("kind"),
        reason.get("detail"),
        run_id if isinstance(run_id, str) else None,
    )


def _headers(message: Message) -> tuple[tuple[str, bytes | None], ...]:
    raw = message.headers() or []
    return tuple((str(name), _bytes(value)) for name, value in (raw.items() if isinstance(raw, dict) else raw))


def _bytes(value: str | bytes | None) -> bytes | None:
    return value.encode() if isinstance(value, str) else value


def _json(value: str | bytes | None) -> dict[str, Any]:
    try:
        document = json.loads(value or b"null")
    except ValueError:
        return {}
    return document if isinstance(document, dict) else {}


def _marker(body: dict[str, Any]) -> str | None:
    run_input = body.get("input")
    return _text(run_input.get("marker")) if isinstance(run_input, dict) else None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None
