"""The outbox relay in-process: stream images become events (key, value, CloudEvents headers), a batch
succeeds only when the broker acknowledged all of it, and the outbox cannot reach the write path."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import boto3
import pytest
from botocore.exceptions import ClientError
from confluent_kafka import KafkaError, KafkaException, Producer
from moto import mock_aws

from poimen.config import ConfigurationError, OutboxSettings
from poimen.contract import run_json
from poimen.ids import admission_id
from poimen.kafka import partition_key
from poimen.outbox import (
    NOT_A_RUN_MARKER,
    OPTIONAL_ATTRIBUTES,
    REQUIRED_ATTRIBUTES,
    UNDELIVERABLE,
    BatchOutcome,
    MalformedRun,
    OutboxBatchFailed,
    OutboxRelay,
    events_of_batch,
    parked_key,
    run_event,
)
from poimen.store import FENCE, ITEM_TYPE, RunRecord
from poimen_tools.local.devserver import LocalLambdaContext
from poimen_tools.local.stream_source import lambda_stream_record, passes
from poimen_tools.local.template import Template
from tests.conftest import REPO, load_event
from tests.unit.conftest import Invoke

SETTINGS = OutboxSettings(bootstrap_servers="127.0.0.1:9", region="us-east-1", stack_name="test")
PARKED_BUCKET = "outbox-failed-batches"
OUTBOX_ENV = {"KAFKA_BOOTSTRAP_SERVERS": "b:9098", "POIMEN_STACK_NAME": "s", "OUTBOX_FAILED_BATCHES_BUCKET": "b"}


@dataclass
class FakeProducer:
    """confluent_kafka.Producer's surface as the outbox uses it: records kept, acknowledged on flush unless
    the broker is 'down' (nothing acknowledged) or a record's delivery fails."""

    down: bool = False
    # value -> the error its delivery report carries (librdkafka's code), or that produce() raises for it
    fail_values: dict[bytes, int] = field(default_factory=dict)
    refuse_values: dict[bytes, int] = field(default_factory=dict)
    # Raised by produce() from its n-th call on (queue full, a fatal idempotent-producer state).
    refuse_from: int | None = None
    refusal: Exception = field(default_factory=lambda: BufferError("Local: Queue full"))
    queued: list[dict[str, Any]] = field(default_factory=list)
    acknowledged: list[dict[str, Any]] = field(default_factory=list)
    purged: int = 0

    def produce(self, topic: str, value: bytes, key: bytes, headers: list[tuple[str, bytes]], on_delivery: Any) -> None:
        if self.refuse_from is not None and len(self.queued) + 1 >= self.refuse_from:
            raise self.refusal
        if value in self.refuse_values:
            raise KafkaException(KafkaError(self.refuse_values[value]))
        self.queued.append({"topic": topic, "value": value, "key": key, "headers": headers, "cb": on_delivery})

    def poll(self, timeout: float) -> int:
        return 0

    def flush(self, timeout: float) -> int:
        if self.down:
            return len(self.queued)
        for record in self.queued:
            if record["value"] in self.fail_values:
                record["cb"](KafkaError(self.fail_values[record["value"]]), None)
            else:
                record["cb"](None, None)
                self.acknowledged.append(record)
        self.queued = []
        return 0

    def purge(self, in_queue: bool, in_flight: bool, blocking: bool) -> None:
        self.purged += len(self.queued)
        self.queued = []


def _relay(producer: FakeProducer) -> OutboxRelay:
    return OutboxRelay(SETTINGS, cast(Producer, producer))


def _publish(producer: FakeProducer, event: dict[str, Any]) -> BatchOutcome:
    outcome = BatchOutcome()
    _relay(producer).publish_batch(event, lambda: 10_000, outcome)
    return outcome


def _handler_with(
    template: Template, monkeypatch: pytest.MonkeyPatch, *producers: FakeProducer
) -> Callable[[dict[str, Any], Any], Any]:
    """The function's handler (template.yaml), whose producers are `producers`, one per producer it builds."""
    from poimen import outbox

    queue = list(producers)
    monkeypatch.setattr(outbox, "_kafka_producer", lambda settings: queue.pop(0))
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9")
    monkeypatch.setenv("POIMEN_STACK_NAME", "test")
    monkeypatch.setenv("OUTBOX_FAILED_BATCHES_BUCKET", PARKED_BUCKET)
    outbox.outbox_service.cache_clear()
    return template.load_handler("OutboxRelayFunction")


def _two_run_batch() -> dict[str, Any]:
    """The canonical insert, and a second run's copy of it."""
    event = load_event("dynamodb_stream_insert.json")
    second = json.loads(json.dumps(event["Records"][0]))
    second["dynamodb"]["NewImage"]["run_id"] = {"S": "0190a0c4-0000-7000-8000-000000000002"}
    event["Records"].append(second)
    return event


def _stream_event(dynamodb: Any, table_name: str) -> dict[str, Any]:
    """Every record of the table's stream so far, as Lambda's DynamoDB event source delivers them."""
    # The regional endpoint named: botocore resolves calls naming a stream ARN to an account endpoint
    # (<account>.ddb...), which in-process moto routes to DynamoDB itself.
    streams = boto3.client("dynamodbstreams", endpoint_url="https://streams.dynamodb.us-east-1.amazonaws.com")
    arn = dynamodb.describe_table(TableName=table_name)["Table"]["LatestStreamArn"]
    (shard,) = streams.describe_stream(StreamArn=arn)["StreamDescription"]["Shards"]
    iterator = streams.get_shard_iterator(StreamArn=arn, ShardId=shard["ShardId"], ShardIteratorType="TRIM_HORIZON")
    records = streams.get_records(ShardIterator=iterator["ShardIterator"])["Records"]
    return {"Records": [lambda_stream_record(record, arn) for record in records]}


def _shape(value: Any) -> Any:
    """A JSON value's structure: keys and types, not contents."""
    if isinstance(value, dict):
        return {key: _shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_shape(value[0])] if value else []
    return type(value).__name__


def test_the_canonical_insert_becomes_one_event_with_cloudevents_headers() -> None:
    event = load_event("dynamodb_stream_insert.json")

    (published,) = events_of_batch(event, "prod")

    image = event["Records"][0]["dynamodb"]["NewImage"]
    run_id = image["run_id"]["S"]
    assert published.topic == "poimen.acme.events"
    assert published.key == partition_key("acme", run_id) == f"acme/{run_id}".encode()
    assert published.value.decode() == run_json(
        run_id=run_id,
        tenant_id="acme",
        workflow_ref="wf/hello",
        input_json=image["input"]["S"],
        goal_id=None,
        dispatch_key="order-42",
        created_at="2026-11-27T12:00:00.000Z",
    )
    assert b'"amount":1.10,"big":12345678901234567890' in published.value  # numbers as admitted
    # ce_id names this admission of the run: derived from the run id and the stored write's attempt id
    assert published.event_id == admission_id(run_id, image["attempt_id"]["S"]) != run_id
    assert dict(published.headers) == {
        "ce_specversion": b"1.0",
        "ce_id": published.event_id.encode(),
        "ce_source": b"urn:poimen:prod:acme",
        "ce_type": b"poimen.run.admitted",
        "ce_subject": run_id.encode(),
        "ce_time": b"2026-11-27T12:00:00.000Z",
        "content-type": b"application/json",
    }


def test_a_stored_traceparent_rides_along() -> None:
    image = load_event("dynamodb_stream_insert.json")["Records"][0]["dynamodb"]["NewImage"]
    image["traceparent"] = {"S": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}

    headers = dict(run_event(image, "prod").headers)

    assert headers["traceparent"] == b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _fence(run: dict[str, Any]) -> dict[str, Any]:
    """The item admission writes at a keyless run's key when its write's outcome is unknown (store.fence_run)."""
    return {
        "pk": run["pk"],
        ITEM_TYPE: {"S": FENCE},
        "attempt_id": run["attempt_id"],
        "fenced_at": {"S": "2026-11-27T12:00:01.000Z"},
    }


def test_an_admitted_run_marked_as_no_run_is_not_published() -> None:
    event = load_event("dynamodb_stream_insert.json")
    event["Records"][0]["dynamodb"]["NewImage"][ITEM_TYPE] = {"S": FENCE}

    assert events_of_batch(event, "prod") == []
    assert ITEM_TYPE == NOT_A_RUN_MARKER


@pytest.mark.parametrize(
    "change",
    [
        lambda r: r.update(eventName="REMOVE"),
        lambda r: r["dynamodb"]["NewImage"].update(status={"S": "cancelled"}),
        lambda r: r["dynamodb"]["NewImage"].update(pk={"S": "GRANT#arn:aws:iam::1:role/x"}),
        lambda r: r["dynamodb"]["NewImage"].pop("status"),
        lambda r: r["dynamodb"].update(NewImage=_fence(r["dynamodb"]["NewImage"])),
    ],
    ids=["remove", "not-admitted", "grant", "no-status", "fence"],
)
def test_what_is_no_written_admitted_run_is_neither_let_through_nor_published(
    template: Template, change: Callable[[dict[str, Any]], None]
) -> None:
    event = load_event("dynamodb_stream_insert.json")
    change(event["Records"][0])
    filters = template.properties("OutboxRelaySource")["FilterCriteria"]["Filters"]

    assert not passes(filters, event["Records"][0])
    assert events_of_batch(event, "prod") == []


def test_the_template_filter_lets_the_canonical_run_through_and_not_the_grant(template: Template) -> None:
    run, grant = load_event("dynamodb_stream_insert.json")["Records"]
    filters = template.properties("OutboxRelaySource")["FilterCriteria"]["Filters"]

    assert passes(filters, run)
    assert not passes(filters, grant)


def test_a_run_item_lacking_what_an_event_needs_fails_the_batch() -> None:
    event = load_event("dynamodb_stream_insert.json")
    del event["Records"][0]["dynamodb"]["NewImage"]["input"]

    with pytest.raises(MalformedRun, match="input"):
        _publish(FakeProducer(), event)


@pytest.mark.parametrize("created_at", ["yesterday", "2026-11-27T12:00:00.000", "2026-11-27", "2026-W48-5"])
def test_a_run_item_whose_created_at_is_no_time_fails_the_batch_rather_than_its_set_aside(created_at: str) -> None:
    # created_at names the event's ce_time and the key an undeliverable event is set aside at: a time without
    # its offset (which Python reads in the process's own time zone), a date or an ISO week is no RFC 3339 time
    event = load_event("dynamodb_stream_insert.json")
    event["Records"][0]["dynamodb"]["NewImage"]["created_at"] = {"S": created_at}

    with pytest.raises(MalformedRun, match=f"created_at '{created_at}'"):
        _publish(FakeProducer(), event)


def test_the_event_value_is_the_get_answer_byte_for_byte(invoke: Invoke, dynamodb: Any, table_name: str) -> None:
    # Given runs admitted through the API: keyed with a goal and exact numbers, keyless, and one replayed
    keyed = invoke(
        raw_body='{"workflow_ref":"wf/a","input":{"n":1.10,"big":123456789012345678901234567890,"s":"é"},'
        '"goal_id":"g-1","dispatch_key":"k-1"}'
    )
    replayed = invoke(
        raw_body='{"workflow_ref":"wf/a","input":{"n":1.10,"big":123456789012345678901234567890,"s":"é"},'
        '"goal_id":"g-1","dispatch_key":"k-1"}'
    )
    keyless = invoke(body={"workflow_ref": "wf/b", "input": {}})
    assert (keyed.status, keyless.status) == (201, 201)
    # When the table's stream, as Lambda delivers it, goes through the outbox
    event = _stream_event(dynamodb, table_name)
    producer = FakeProducer()
    outcome = _publish(producer, event)
    # Then one event per admitted run (the replay wrote nothing, so it has none), each the GET answer
    values = {record["key"]: record["value"] for record in producer.acknowledged}
    assert replayed.status == 200
    assert len(producer.acknowledged) == 2
    for answer in (keyed, keyless):
        run_id, tenant = answer.body["run_id"], answer.body["tenant_id"]
        got = invoke("GET", f"/v1/runs/{run_id}")
        assert values[partition_key(tenant, run_id)] == got.text.encode()
    assert b'"n":1.10,"big":123456789012345678901234567890' in values[partition_key(tenant, keyed.body["run_id"])]
    assert sum(outcome.published.values()) == 2


def test_the_admission_requests_valid_traceparent_reaches_the_event(
    invoke: Invoke, dynamodb: Any, table_name: str
) -> None:
    # Given admissions with a valid traceparent, a malformed one, and none
    valid = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    bodies = [{"workflow_ref": "wf/t", "input": {}, "dispatch_key": f"t-{i}"} for i in range(3)]
    answers = [
        invoke(body=bodies[0], headers={"traceparent": valid}),
        invoke(
            body=bodies[1], headers={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\nX: y"}
        ),
        invoke(body=bodies[2]),
    ]
    # When the stream goes through the outbox
    published = {e.run_id: dict(e.headers) for e in events_of_batch(_stream_event(dynamodb, table_name), "test")}
    # Then only the valid one is stored with its run and carried as the event's traceparent header
    assert [published[a.body["run_id"]].get("traceparent") for a in answers] == [valid.encode(), None, None]


def test_locally_built_stream_events_have_the_shape_of_the_canonical_event(
    invoke: Invoke, dynamodb: Any, table_name: str
) -> None:
    assert (
        invoke(body={"workflow_ref": "wf/hello", "input": {"greeting": "hi"}, "dispatch_key": "order-42"}).status == 201
    )

    (built,) = [
        r for r in _stream_event(dynamodb, table_name)["Records"] if r["dynamodb"]["Keys"]["pk"]["S"].startswith("RUN#")
    ]

    (canonical, _) = load_event("dynamodb_stream_insert.json")["Records"]
    assert _shape(built) == _shape(canonical)


def test_a_batch_succeeds_only_when_every_event_is_acknowledged() -> None:
    event = load_event("dynamodb_stream_insert.json")

    with pytest.raises(OutboxBatchFailed, match="1 event"):
        _publish(FakeProducer(down=True), event)


@pytest.mark.parametrize(
    "code", [KafkaError._MSG_TIMED_OUT, KafkaError.NOT_ENOUGH_REPLICAS, KafkaError.CLUSTER_AUTHORIZATION_FAILED]
)
def test_a_delivery_error_that_a_retry_can_heal_fails_the_batch(code: int) -> None:
    event = load_event("dynamodb_stream_insert.json")
    (published,) = events_of_batch(event, SETTINGS.stack_name)
    producer = FakeProducer(fail_values={published.value: code})

    with pytest.raises(OutboxBatchFailed, match=re.escape(KafkaError(code).str())):
        _publish(producer, event)


@pytest.mark.parametrize("code", sorted(UNDELIVERABLE))
@pytest.mark.parametrize("where", ["delivery report", "produce"])
def test_an_event_no_retry_can_deliver_is_undeliverable_and_the_batch_goes_on(code: int, where: str) -> None:
    # Given a batch of two runs, the second of which the broker (or the client) can never take
    event = _two_run_batch()
    good, bad = events_of_batch(event, SETTINGS.stack_name)
    failing = {bad.value: code}
    producer = FakeProducer(fail_values=failing) if where == "delivery report" else FakeProducer(refuse_values=failing)
    # When it is published
    outcome = _publish(producer, event)
    # Then the batch went through: the first event acknowledged, the second undeliverable, with its reason
    assert [record["value"] for record in producer.acknowledged] == [good.value]
    (undeliverable,) = outcome.undeliverable
    assert (undeliverable.event, undeliverable.error.code()) == (bad, code)
    assert undeliverable.event.stream_record == event["Records"][-1]
    assert outcome.failures == []


def test_an_undeliverable_event_in_a_failing_batch_waits_for_the_retry() -> None:
    # Given a batch of two runs: one the broker can never take, the other not acknowledged (the broker away)
    event = _two_run_batch()
    first, second = events_of_batch(event, SETTINGS.stack_name)
    codes = {first.value: KafkaError._MSG_TIMED_OUT, second.value: KafkaError.UNKNOWN_TOPIC_OR_PART}
    # When it is handled, it fails (the event source retries it), and nothing is set aside by this attempt
    outcome = BatchOutcome()
    with pytest.raises(OutboxBatchFailed):
        _relay(FakeProducer(fail_values=codes)).publish_batch(event, lambda: 10_000, outcome)
    assert len(outcome.undeliverable) == 1
    assert outcome.parked == {}


def test_unacknowledged_events_are_purged_so_only_the_retry_sends_them() -> None:
    producer = FakeProducer(down=True)

    with pytest.raises(OutboxBatchFailed):
        _publish(producer, load_event("dynamodb_stream_insert.json"))

    assert producer.purged == 1
    assert producer.queued == []


def test_the_handler_publishes_metrics_per_tenant(
    template: Template, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given the function's handler (template.yaml) with a producer that acknowledges
    from poimen import outbox

    handler = _handler_with(template, monkeypatch, FakeProducer())
    event = load_event("dynamodb_stream_insert.json")
    second = json.loads(json.dumps(event["Records"][0]))
    second["dynamodb"]["NewImage"]["tenant_id"] = {"S": "beta"}
    event["Records"].append(second)
    # When a batch of two tenants' runs is handled
    handler(event, LocalLambdaContext("OutboxRelayFunction"))
    # Then each tenant has its EventsPublished and OutboxLag, under its own tenant dimension
    documents = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith('{"_aws"')]
    per_tenant = {doc["tenant"]: doc for doc in documents if "EventsPublished" in doc}
    assert set(per_tenant) == {"acme", "beta"}
    for doc in per_tenant.values():
        assert doc["EventsPublished"] == [1.0]
        assert doc["OutboxLag"][0] >= 0
        (directive,) = doc["_aws"]["CloudWatchMetrics"]
        assert sorted(directive["Dimensions"][0]) == ["service", "tenant"]
    outbox.outbox_service.cache_clear()


def test_the_handler_sets_aside_what_cannot_be_delivered_per_tenant_and_counts_it(
    template: Template, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given the handler, with the bucket where it sets events aside, and a batch of three runs of two
    # tenants, of which the broker can take only the first (the other tenant has no topic)
    with mock_aws():
        s3 = boto3.client("s3")
        s3.create_bucket(Bucket=PARKED_BUCKET)
        event = _two_run_batch()
        third = json.loads(json.dumps(event["Records"][-1]))
        third["dynamodb"]["NewImage"].update({"tenant_id": {"S": "beta"}, "run_id": {"S": "r-3"}})
        event["Records"].append(third)
        _, second, beta = events_of_batch(event, "test")
        unknown = {second.value: KafkaError.UNKNOWN_TOPIC_OR_PART, beta.value: KafkaError.TOPIC_AUTHORIZATION_FAILED}
        handler = _handler_with(template, monkeypatch, FakeProducer(fail_values=unknown))
        # When it is handled
        try:
            handler(event, LocalLambdaContext("OutboxRelayFunction", 60))
        finally:
            from poimen import outbox

            outbox.outbox_service.cache_clear()
        # Then it succeeded, and each tenant's undeliverable events are one on-failure record under its prefix
        keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=PARKED_BUCKET)["Contents"])
        parked = {
            key.split("/")[1]: json.loads(s3.get_object(Bucket=PARKED_BUCKET, Key=key)["Body"].read()) for key in keys
        }
    assert all(key.startswith("undeliverable/") for key in keys)
    assert set(parked) == {"acme", "beta"}
    assert json.loads(parked["acme"]["payload"]) == {"Records": [event["Records"][2]]}
    assert json.loads(parked["beta"]["payload"]) == {"Records": [event["Records"][3]]}
    assert [why["error"] for why in parked["beta"]["undeliverable"]] == ["TOPIC_AUTHORIZATION_FAILED"]
    assert parked["acme"]["requestContext"]["functionArn"].endswith(":function:OutboxRelayFunction")
    assert parked["acme"]["DDBStreamBatchInfo"]["shardId"] is None  # the function is not told its shard
    # And each tenant's metrics count what was published and what was set aside
    documents = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith('{"_aws"')]
    counted = {doc["tenant"]: (doc.get("EventsPublished"), doc.get("EventsParked")) for doc in documents}
    assert counted == {"acme": ([1.0], [1.0]), "beta": (None, [1.0])}


def test_a_batch_retried_after_a_failed_set_aside_sets_each_event_aside_once_and_counts_it_once(
    template: Template, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given the handler, whose bucket refuses the first write of a second tenant's set-aside event, and a
    # batch of one run of each of two tenants that have no events topic
    from poimen import outbox

    with mock_aws():
        s3 = boto3.client("s3")
        s3.create_bucket(Bucket=PARKED_BUCKET)
        event = load_event("dynamodb_stream_insert.json")
        beta = json.loads(json.dumps(event["Records"][0]))
        beta["dynamodb"]["NewImage"].update({"tenant_id": {"S": "beta"}, "pk": {"S": "RUN#beta#r-2"}})
        beta["dynamodb"]["SequenceNumber"] = "111300000000012345678903"
        event["Records"].append(beta)
        events = events_of_batch(event, "test")
        unknown = {published.value: KafkaError.UNKNOWN_TOPIC_OR_PART for published in events}
        handler = _handler_with(
            template, monkeypatch, FakeProducer(fail_values=unknown), FakeProducer(fail_values=unknown)
        )
        refused: list[str] = []

        def refuse_betas_first_write(params: dict[str, Any], **_: Any) -> None:
            if params["Key"].startswith("undeliverable/beta/") and not refused:
                refused.append(params["Key"])
                raise ClientError({"Error": {"Code": "InternalError", "Message": "injected"}}, "PutObject")

        try:
            outbox.outbox_service()._s3_client().meta.events.register(
                "before-parameter-build.s3.PutObject", refuse_betas_first_write
            )
            # When it is handled: the set-aside fails on the second tenant, and the event source retries the batch
            with pytest.raises(OutboxBatchFailed, match="could not set aside 1 event"):
                handler(event, LocalLambdaContext("OutboxRelayFunction", 60))
            handler(event, LocalLambdaContext("OutboxRelayFunction", 60))
        finally:
            outbox.outbox_service.cache_clear()
        # Then each event is one object in the bucket, under its tenant's prefix
        keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=PARKED_BUCKET)["Contents"])
        parked = [json.loads(s3.get_object(Bucket=PARKED_BUCKET, Key=key)["Body"].read()) for key in keys]
    assert refused
    assert [key.split("/")[1] for key in keys] == ["acme", "beta"]
    assert sorted(why["run_id"] for document in parked for why in document["undeliverable"]) == sorted(
        published.run_id for published in events
    )
    # And EventsParked, over both invocations, counts each event once
    documents = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith('{"_aws"')]
    counted: dict[str, float] = {}
    for doc in documents:
        if "EventsParked" in doc:
            counted[doc["tenant"]] = counted.get(doc["tenant"], 0.0) + sum(doc["EventsParked"])
    assert counted == {"acme": 1.0, "beta": 1.0}


@pytest.mark.parametrize(
    ("bucket", "timeout", "refusal"),
    [(False, 60, "could not set aside 1 event"), (True, 5, "too little to set aside 1 event")],
    ids=["no-bucket", "no-time-left"],
)
def test_an_event_that_cannot_surely_be_set_aside_fails_the_batch(
    template: Template, monkeypatch: pytest.MonkeyPatch, bucket: bool, timeout: float, refusal: str
) -> None:
    # Given the handler, whose bucket is missing or whose invocation has a few seconds left, and a batch whose
    # one run the broker can never take
    with mock_aws():
        if bucket:
            boto3.client("s3").create_bucket(Bucket=PARKED_BUCKET)
        event = load_event("dynamodb_stream_insert.json")
        (published,) = events_of_batch(event, "test")
        producer = FakeProducer(fail_values={published.value: KafkaError._UNKNOWN_TOPIC})
        handler = _handler_with(template, monkeypatch, producer)
        # When it is handled, the batch fails: the event source retries it rather than lose the event
        try:
            with pytest.raises(OutboxBatchFailed, match=refusal):
                handler(event, LocalLambdaContext("OutboxRelayFunction", timeout))
        finally:
            from poimen import outbox

            outbox.outbox_service.cache_clear()


def test_the_outbox_reads_the_attributes_run_records_have() -> None:
    attributes = {attribute.attr_name: attribute for attribute in RunRecord.get_attributes().values()}

    assert {name for name, a in attributes.items() if not a.null} == REQUIRED_ATTRIBUTES
    assert {name for name, a in attributes.items() if a.null} == OPTIONAL_ATTRIBUTES


def test_the_outbox_imports_neither_admission_nor_the_store() -> None:
    # Given the outbox's handler module, imported in a fresh interpreter as Lambda imports it
    probe = (
        "import sys; sys.path[:0] = ['functions/outbox_relay', 'layers/poimen']; import app; "
        "print(sorted(m for m in ('poimen.admission', 'poimen.store', 'poimen.api', 'pynamodb') if m in sys.modules))"
    )
    # When it is loaded
    loaded = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    # Then nothing that writes the table is, and the module names none of it either
    assert loaded.stdout.strip() == "[]"
    tree = ast.parse((REPO / "layers/poimen/poimen/outbox.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert not imported & {"poimen.admission", "poimen.store", "poimen.api", "pynamodb", "boto3"}


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"POIMEN_STACK_NAME": "s"}, "KAFKA_BOOTSTRAP_SERVERS"),
        ({"KAFKA_BOOTSTRAP_SERVERS": "b:9098"}, "POIMEN_STACK_NAME"),
        ({"KAFKA_BOOTSTRAP_SERVERS": "b:9098", "POIMEN_STACK_NAME": "s"}, "OUTBOX_FAILED_BATCHES_BUCKET"),
        ({**OUTBOX_ENV, "KAFKA_AUTH": "scram"}, "KAFKA_AUTH"),
        ({**OUTBOX_ENV, "OUTBOX_DELIVERY_TIMEOUT_SECONDS": "0"}, "positive"),
    ],
)
def test_outbox_settings_refuse_what_cannot_work(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        OutboxSettings.from_env({"AWS_REGION": "us-east-1", **environ})


def test_outbox_settings_from_the_template_environment(template: Template) -> None:
    environment = template.function_environment(
        "OutboxRelayFunction", {"KafkaBootstrapServers": "b-1:9098", "OutboxFailedBatchesBucket": "parked"}
    )

    settings = OutboxSettings.from_env({**environment, "AWS_REGION": "eu-west-1", "POIMEN_STACK_NAME": "prod"})

    assert settings.iam_auth
    assert settings.failed_batches_bucket == "parked"
    assert (
        settings.delivery_timeout_seconds + settings.time_margin_seconds
        <= template.properties("OutboxRelayFunction")["Timeout"]
    )


@pytest.mark.parametrize(
    ("failing", "purged"),
    [
        (FakeProducer(down=True), 2),  # the broker away: nothing acknowledged
        (FakeProducer(refuse_from=2, refusal=BufferError("Local: Queue full")), 1),  # produce() raises
        (FakeProducer(refuse_from=2, refusal=KafkaException(KafkaError(KafkaError._FATAL, "fatal"))), 1),
    ],
    ids=["unacknowledged", "queue-full", "fatal-producer"],
)
def test_after_a_failed_batch_the_next_one_gets_a_new_producer(
    template: Template, monkeypatch: pytest.MonkeyPatch, failing: FakeProducer, purged: int
) -> None:
    # Given the handler, whose first producer fails the batch (the broker away, or produce() refusing its
    # second event: a full queue, a fatal idempotent-producer state), and whose next one works
    from poimen import outbox

    working = FakeProducer()
    handler = _handler_with(template, monkeypatch, failing, working)
    event = _two_run_batch()
    try:
        # When a batch fails, and the event source retries it
        with pytest.raises(OutboxBatchFailed):
            handler(event, LocalLambdaContext("OutboxRelayFunction"))
        handler(event, LocalLambdaContext("OutboxRelayFunction"))
    finally:
        outbox.outbox_service.cache_clear()
    # Then what the failed attempt had queued was purged (only the retry sends it), and the retry went
    # through a producer of its own
    assert (failing.purged, failing.queued, failing.acknowledged) == (purged, [], [])
    assert len(working.acknowledged) == 2


@pytest.mark.parametrize("iam", [True, False])
def test_the_producer_is_idempotent_acks_all_murmur2_and_msk_iam_when_deployed(
    monkeypatch: pytest.MonkeyPatch, iam: bool
) -> None:
    from poimen import outbox

    configs: list[dict[str, Any]] = []

    def producer(config: dict[str, Any]) -> FakeProducer:
        configs.append(config)
        return FakeProducer()

    monkeypatch.setattr(outbox, "Producer", producer)
    settings = OutboxSettings(
        bootstrap_servers="b-1:9098", region="eu-west-1", stack_name="prod", iam_auth=iam, delivery_timeout_seconds=55
    )

    outbox.OutboxRelay(settings)

    (config,) = configs
    assert (config["enable.idempotence"], config["acks"], config["partitioner"]) == (True, "all", "murmur2_random")
    assert config["message.timeout.ms"] == 55_000
    # an unknown topic is said (UNDELIVERABLE) before the record times out
    assert config["topic.metadata.propagation.max.ms"] == 10_000
    assert config["bootstrap.servers"] == "b-1:9098"
    if iam:
        assert (config["security.protocol"], config["sasl.mechanism"]) == ("SASL_SSL", "OAUTHBEARER")
        assert callable(config["oauth_cb"])
    else:
        assert "security.protocol" not in config


@pytest.mark.parametrize(
    ("environ", "service"),
    [
        ({"POWERTOOLS_SERVICE_NAME": "poimen-outbox-relay"}, "poimen-outbox-relay"),  # Lambda: its own variable
        (
            {"POWERTOOLS_SERVICE_NAME": "poimen-admission", "OUTBOX_SERVICE_NAME": "poimen-outbox-relay"},
            "poimen-outbox-relay",
        ),
    ],
    ids=["lambda", "poimen-dev"],
)
def test_the_outbox_publishes_its_metrics_under_its_own_service(environ: dict[str, str], service: str) -> None:
    settings = OutboxSettings.from_env({"AWS_REGION": "us-east-1", **OUTBOX_ENV, **environ})

    assert settings.service_name == service
    assert OutboxRelay(settings, cast(Producer, FakeProducer())).metrics.provider.service == service


def test_a_batch_of_undeliverable_events_is_set_aside_concurrently_not_one_write_after_another() -> None:
    # Given a bucket that answers a write only once another is in flight (S3's latency: one write after another,
    # a batch of a tenant without its topic would hold its shard, every tenant's events behind it, for one S3
    # round trip per event), and a batch of four runs of a tenant whose topic does not exist
    lock = threading.Lock()
    written: list[str] = []

    class SlowBucket:
        together = threading.Barrier(2, timeout=3)

        def put_object(self, **params: Any) -> None:
            self.together.wait()
            with lock:
                written.append(params["Key"])

    event = load_event("dynamodb_stream_insert.json")
    for n in range(2, 5):
        copy = json.loads(json.dumps(event["Records"][0]))
        copy["dynamodb"]["NewImage"]["run_id"] = {"S": f"0190a0c4-0000-7000-8000-00000000000{n}"}
        event["Records"].append(copy)
    events = events_of_batch(event, "test")
    outcome = BatchOutcome()
    for published in events:
        outcome.failed(published, KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART))
    settings = OutboxSettings("localhost:9", "us-east-1", "test", failed_batches_bucket=PARKED_BUCKET)
    relay = OutboxRelay(settings, producer=cast("Producer", FakeProducer()), s3=SlowBucket())
    context: Any = LocalLambdaContext("OutboxRelayFunction", 60)
    # When it sets them aside
    relay.set_aside(outcome, context)
    # Then each is one object at its own key, and counted once
    assert sorted(written) == sorted(parked_key(published) for published in events)
    assert len(set(written)) == 4
    assert outcome.parked == {events[0].tenant_id: 4}


@pytest.mark.usefixtures("metrics_off")
def test_a_batch_of_100_tenants_prints_no_emf_line_when_metrics_are_disabled(
    template: Template, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Powertools' flush_metrics, metrics disabled, prints nothing and clears nothing, and its add_metric prints the
    # set at a metric's 100th value whether or not they are: a tenant's document a flush, EventsPublished would
    # reach it at a batch's 100th tenant. 100 is the mapping's BatchSize (template.yaml), one record a tenant.
    # Given the function's handler, metrics disabled, and a batch of one run each of 100 tenants
    handler = _handler_with(template, monkeypatch, FakeProducer())
    record = load_event("dynamodb_stream_insert.json")["Records"][0]
    records = []
    for index in range(100):
        copy = json.loads(json.dumps(record))
        copy["dynamodb"]["NewImage"]["tenant_id"] = {"S": f"tenant-{index}"}
        records.append(copy)
    capsys.readouterr()

    # When it is handled
    handler({"Records": records}, LocalLambdaContext("OutboxRelayFunction"))

    # Then no EMF line was printed
    assert [line[:80] for line in capsys.readouterr().out.splitlines() if '"_aws"' in line] == []
