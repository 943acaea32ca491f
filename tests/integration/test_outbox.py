"""The outbox relay against the real broker: admitted runs (API keyed and keyless, the inbox relay with
redelivered dispatch messages) become exactly their events on poimen.<tenant>.events; broker outages and a
SIGKILLed `poimen dev` lose none; a producer that cannot reach the broker fails its batch."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import boto3
import pytest
from confluent_kafka import Consumer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from poimen.contract import RunRequest
from poimen.dispatch import DispatchPublisher
from poimen.ids import admission_id, keyed_run_id
from poimen.kafka import dispatch_topic, events_topic, partition_key
from poimen.outbox import OutboxBatchFailed, outbox_service
from poimen_tools.local.devserver import LocalLambdaContext
from poimen_tools.local.kafka_broker import KafkaBroker
from poimen_tools.local.moto import EmbeddedMoto
from poimen_tools.local.stream_source import LocalStreamEventSource, positions_file
from poimen_tools.local.template import Template
from poimen_tools.topics import ensure_topics
from tests.asyncapi_contract import record_errors
from tests.conftest import count_runs, load_event
from tests.integration.conftest import POIMEN, DevServer, free_port, signed_session, start_dev, wait_for


@pytest.fixture
def moto_server() -> Iterator[str]:
    """A moto server of this test's own, outliving any `poimen dev` the test kills."""
    with EmbeddedMoto() as moto:
        yield moto.endpoint


def table_with_stream(template: Template, endpoint: str) -> tuple[Any, str, dict[str, Any]]:
    """A new table as template.yaml declares it (with its stream) at `endpoint`: its client, its name, and
    the item of an admitted run (tests/events/dynamodb_stream_insert.json) to put into it."""
    dynamodb = boto3.client("dynamodb", endpoint_url=endpoint)
    table = f"t-{uuid.uuid4().hex[:8]}"
    dynamodb.create_table(**template.create_table_request("AdmissionTable", table))
    return dynamodb, table, load_event("dynamodb_stream_insert.json")["Records"][0]["dynamodb"]["NewImage"]


def events(
    bootstrap: str, tenant: str, expected: int, timeout: float = 60, last: str | None = None
) -> list[dict[str, Any]]:
    """Every record on the tenant's events topic, read from the beginning until `expected` are in (and the
    event of run `last`, if given), and a moment more, so that a duplicate after them is seen too."""
    return records_on(bootstrap, events_topic(tenant), expected, timeout, last)


def records_on(
    bootstrap: str, topic: str | Sequence[str], expected: int, timeout: float = 60, last: str | None = None
) -> list[dict[str, Any]]:
    """Every record on `topic` (or each of several), as `events` reads them, with the topic of each."""
    topics = [topic] if isinstance(topic, str) else list(topic)
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"check-{uuid.uuid4().hex[:8]}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    consumer.subscribe(topics)
    records: list[dict[str, Any]] = []
    idle_polls = 0
    try:

        def enough() -> bool:
            nonlocal idle_polls
            message = consumer.poll(0.5)
            if message is None or message.error() is not None:
                idle_polls += 1
            else:
                idle_polls = 0
                records.append(
                    {
                        "key": message.key(),
                        "value": message.value(),
                        "headers": dict(message.headers() or []),
                        "partition": message.partition(),
                        "topic": message.topic(),
                    }
                )
            seen_last = last is None or any(r["headers"].get("ce_subject") == last.encode() for r in records)
            return len(records) >= expected and seen_last and idle_polls >= 4

        wait_for(enough, timeout=timeout, what=f"{expected} records on {', '.join(topics)}")
    finally:
        consumer.close()
    return records


def _runs(dev: DevServer, tenant: str) -> dict[str, dict[str, Any]]:
    return {item["run_id"]["S"]: item for item in count_runs(dev.dynamodb(), dev.table_name, tenant)}


def _assert_one_event_per_run(dev: DevServer, tenant: str, records: list[dict[str, Any]]) -> int:
    """Every run has its event, every event is a run's, duplicates are identical; the number of duplicates."""
    runs = _runs(dev, tenant)
    by_id: dict[str, dict[str, Any]] = {}
    duplicates = 0
    http = signed_session()
    for record in records:
        run_id = record["headers"]["ce_subject"].decode()
        if run_id in by_id:
            duplicates += 1
            assert record == by_id[run_id], "a duplicate is identical"
        by_id[run_id] = record
    assert set(by_id) == set(runs)
    for run_id, record in by_id.items():
        # The event's id names the run's one admission: its stored write's
        assert record["headers"]["ce_id"] == admission_id(run_id, runs[run_id]["attempt_id"]["S"]).encode()
        assert record["key"] == partition_key(tenant, run_id)
        answer = http.get(f"{dev.url}/v1/runs/{run_id}", headers={"X-Poimen-Tenant": tenant}, timeout=30)
        assert record["value"] == answer.content, "the value is GET /v1/runs/{id}, byte for byte"
        headers = record["headers"]
        assert headers["ce_specversion"] == b"1.0"
        assert headers["ce_type"] == b"poimen.run.admitted"
        assert headers["ce_subject"] == run_id.encode()
        assert headers["ce_source"] == f"urn:poimen:local:{tenant}".encode()
        assert headers["ce_time"] == runs[run_id]["created_at"]["S"].encode()
        assert headers["content-type"] == b"application/json"
    return duplicates


@pytest.fixture
def kafka_dev(tmp_path: Path, broker: KafkaBroker, tenant: str) -> Iterator[DevServer]:
    """`poimen dev` on the module's broker, serving the test's tenant: API, inbox relay and outbox relay."""
    dev = start_dev(tmp_path, "--kafka-bootstrap", broker.bootstrap_servers, kafka=True, tenants=[tenant])
    yield dev
    assert dev.stop() == 0


def test_every_admitted_run_is_exactly_one_event(kafka_dev: DevServer, broker: KafkaBroker, tenant: str) -> None:
    # Given the tenant's topics, of equal partition counts
    ensure_topics(broker.bootstrap_servers, tenant, partitions=3, replication_factor=1)
    # And runs admitted through the API, keyed (one of them twice) and keyless
    http = signed_session()
    headers = {"X-Poimen-Tenant": tenant}
    url = f"{kafka_dev.url}/v1/runs"
    keyed = {"workflow_ref": "wf/a", "input": {"n": 1.10}, "goal_id": "g-1", "dispatch_key": "api-1"}
    answers = [
        http.post(url, data=json.dumps(keyed), headers={**headers, "Content-Type": "application/json"}, timeout=30),
        http.post(url, data=json.dumps(keyed), headers={**headers, "Content-Type": "application/json"}, timeout=30),
        http.post(url, json={"workflow_ref": "wf/b", "input": {}}, headers=headers, timeout=30),
    ]
    assert [answer.status_code for answer in answers] == [201, 200, 201]
    # And runs admitted through the inbox relay, each dispatch message published twice (redelivered)
    publisher = DispatchPublisher(broker.bootstrap_servers)
    spawns = [RunRequest(workflow_ref="wf/c", input={"i": i}, dispatch_key=f"kafka-{i}") for i in range(3)]
    for spawn in [*spawns, *spawns]:
        publisher.publish(tenant, spawn)
    publisher.flush()
    wait_for(lambda: len(_runs(kafka_dev, tenant)) == 5, timeout=60, what="five runs")
    # When the outbox has published
    records = events(broker.bootstrap_servers, tenant, expected=5)
    # Then exactly five events, one per run, none duplicated (no failure happened)
    assert _assert_one_event_per_run(kafka_dev, tenant, records) == 0
    assert len(records) == 5
    # And each relayed run's event is on the partition number of its dispatch records (same key, murmur2)
    dispatch = records_on(broker.bootstrap_servers, f"poimen.{tenant}.dispatch", 6)
    dispatched = {r["key"]: r["partition"] for r in dispatch}
    assert {r["key"]: r["partition"] for r in records if r["key"] in dispatched} == dispatched
    # And every record of both topics is what infra/asyncapi.yaml describes
    for message, checked in (("runAdmitted", records), ("spawnRequest", dispatch)):
        for r in checked:
            assert record_errors(message, r["key"], r["headers"], r["value"]) == [], (message, r)


def test_a_broker_outage_and_a_sigkill_lose_no_event(tmp_path: Path, moto_server: str, tenant: str) -> None:
    """Over 60 s: a broker and `poimen dev` of its own, since it stops the one and kills the other; each waits
    for the outbox to have resumed (Kafka's reconnect backoff and the stream's shard iterator) before going on."""
    # Given `poimen dev` on a broker and a moto server of this test's own (both outlive it)
    broker = KafkaBroker(tmp_path / "kafka")
    broker.start()
    table = f"t-{uuid.uuid4().hex[:8]}"
    endpoints = ("--dynamodb-endpoint", moto_server, "--sqs-endpoint", moto_server, "--s3-endpoint", moto_server)
    common = ("--kafka-bootstrap", broker.bootstrap_servers, *endpoints)
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    dev = start_dev(tmp_path / "first", *common, kafka=True, table_name=table, tenants=[tenant])
    http = signed_session()
    headers = {"X-Poimen-Tenant": tenant}
    try:

        def admit(i: int) -> None:
            body = {"workflow_ref": "wf/o", "input": {"i": i}, "dispatch_key": f"o-{i}"}
            assert http.post(f"{dev.url}/v1/runs", json=body, headers=headers, timeout=30).status_code == 201

        for i in range(5):
            admit(i)
        events(broker.bootstrap_servers, tenant, expected=5, timeout=90)
        # When the broker stops for a stretch while runs are admitted
        broker.stop()
        for i in range(5, 10):
            admit(i)
        broker.start()
        # And `poimen dev` is killed (SIGKILL) while it publishes more
        for i in range(10, 15):
            admit(i)
        dev.process.send_signal(signal.SIGKILL)
        dev.process.wait(timeout=30)
        # And started again on the same table and broker
        dev = start_dev(tmp_path / "second", *common, kafka=True, table_name=table, tenants=[tenant])
        for i in range(15, 18):
            admit(i)
        # Then every run has its event, and duplicates (after the failures only) are identical; the
        # stream is read in order, so once the last run's event is in, the restart has published the rest
        wait_for(lambda: len(_runs(dev, tenant)) == 18, what="18 runs")
        last = keyed_run_id(tenant, "o-17")
        records = events(broker.bootstrap_servers, tenant, expected=18, timeout=180, last=last)
        duplicates = _assert_one_event_per_run(dev, tenant, records)
        print(f"outbox outage and SIGKILL: {len(records)} records for 18 runs, {duplicates} identical duplicates")
    finally:
        if dev.process.poll() is None:
            dev.stop()
        broker.stop()
        positions_file(moto_server, table).unlink(missing_ok=True)


def outbox_handler(
    template: Template, monkeypatch: pytest.MonkeyPatch, bootstrap: str, moto: str, delivery_seconds: float
) -> tuple[Callable[[dict[str, Any], Any], Any], Any, str]:
    """The outbox's handler (template.yaml) producing to `bootstrap`, setting events aside in a new bucket of
    the moto server `moto`: the handler, an S3 client of that moto, the bucket."""
    s3 = boto3.client("s3", endpoint_url=moto)
    bucket = f"outbox-{uuid.uuid4().hex[:8]}"
    s3.create_bucket(Bucket=bucket)
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", bootstrap)
    monkeypatch.setenv("POIMEN_STACK_NAME", "local")
    monkeypatch.setenv("OUTBOX_DELIVERY_TIMEOUT_SECONDS", str(delivery_seconds))
    monkeypatch.setenv("OUTBOX_TIME_MARGIN_SECONDS", "0.5")
    monkeypatch.setenv("OUTBOX_FAILED_BATCHES_BUCKET", bucket)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto)
    outbox_service.cache_clear()
    return template.load_handler("OutboxRelayFunction"), s3, bucket


def parked_objects(s3: Any, bucket: str) -> list[tuple[str, dict[str, Any]]]:
    """(key, document) of every object in the bucket."""
    listed = s3.list_objects_v2(Bucket=bucket).get("Contents", [])
    return [(o["Key"], json.loads(s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read())) for o in listed]


def run_record(tenant: str, run_id: str) -> dict[str, Any]:
    """The canonical stream record of an admitted run, as the tenant's run `run_id`."""
    record: dict[str, Any] = load_event("dynamodb_stream_insert.json")["Records"][0]
    image = record["dynamodb"]["NewImage"]
    image.update({"pk": {"S": f"RUN#{tenant}#{run_id}"}, "run_id": {"S": run_id}, "tenant_id": {"S": tenant}})
    return record


def test_a_producer_that_cannot_reach_the_broker_fails_the_batch_and_sets_nothing_aside(
    template: Template, monkeypatch: pytest.MonkeyPatch, moto_server: str
) -> None:
    # Given the outbox's handler pointed at a port where no broker listens
    handler, s3, bucket = outbox_handler(template, monkeypatch, f"127.0.0.1:{free_port()}", moto_server, 2)
    try:
        # When a batch with one admitted run is handled
        with pytest.raises(OutboxBatchFailed, match=r"1 failed of 1.*Message timed out"):
            handler(load_event("dynamodb_stream_insert.json"), LocalLambdaContext("OutboxRelayFunction", 4))
    finally:
        outbox_service.cache_clear()
    # Then the batch failed (the event source retries it): an outage is no reason to set its event aside
    assert parked_objects(s3, bucket) == []


def test_an_event_no_retry_can_deliver_is_set_aside_and_the_batch_goes_on(
    template: Template, monkeypatch: pytest.MonkeyPatch, moto_server: str, broker: KafkaBroker
) -> None:
    # Given a broker that refuses unknown topics as MSK does, where only the first tenant has its topics
    served, unknown = (f"t-{uuid.uuid4().hex[:12]}" for _ in range(2))
    ensure_topics(broker.bootstrap_servers, served, partitions=1, replication_factor=1)
    handler, s3, bucket = outbox_handler(template, monkeypatch, broker.bootstrap_servers, moto_server, 6)
    good, bad = str(uuid.uuid4()), str(uuid.uuid4())
    event = {"Records": [run_record(served, good), run_record(unknown, bad)]}
    failed = 0
    try:
        # When a batch of one run of each is handled, and retried while it fails, as the event source does
        for _ in range(3):
            try:
                handler(event, LocalLambdaContext("OutboxRelayFunction", 20))
                break
            except OutboxBatchFailed:
                failed += 1
    finally:
        outbox_service.cache_clear()
    # Then the first invocation went through: the served tenant's event is on its topic, once
    assert failed == 0
    (published,) = events(broker.bootstrap_servers, served, expected=1)
    assert published["headers"]["ce_subject"] == good.encode()
    # And the other's event was set aside, once, in Lambda's S3 on-failure record under its tenant's prefix,
    # holding its stream record and why it cannot be delivered
    ((key, parked),) = parked_objects(s3, bucket)
    assert key.startswith(f"undeliverable/{unknown}/")
    assert parked["requestContext"]["condition"] == "EventsUndeliverable"
    assert parked["DDBStreamBatchInfo"]["batchSize"] == 1
    assert json.loads(parked["payload"]) == {"Records": [run_record(unknown, bad)]}
    ((why),) = parked["undeliverable"]
    assert (why["run_id"], why["topic"], why["error"]) == (bad, events_topic(unknown), "UNKNOWN_TOPIC_OR_PART")
    # And no topic was created for the tenant that has none
    assert (
        events_topic(unknown) not in AdminClient({"bootstrap.servers": broker.bootstrap_servers}).list_topics().topics
    )


def test_events_each_within_the_topics_record_limit_are_published_though_a_batch_of_them_is_not(
    template: Template, monkeypatch: pytest.MonkeyPatch, moto_server: str, broker: KafkaBroker
) -> None:
    # Given a tenant whose events topic takes records of at most 2,000 bytes (max.message.bytes, which bounds
    # a whole record batch), and a stream batch of ten of its runs whose events take about 600 bytes each, and
    # one whose event alone is over the limit
    tenant = f"t-{uuid.uuid4().hex[:12]}"
    topic = events_topic(tenant)
    admin = AdminClient({"bootstrap.servers": broker.bootstrap_servers})
    admin.create_topics([NewTopic(topic, 1, 1, config={"max.message.bytes": "2000"})])[topic].result()
    small = [str(uuid.uuid4()) for _ in range(10)]
    large = str(uuid.uuid4())
    records = [run_record(tenant, run_id) for run_id in small]
    oversized = run_record(tenant, large)
    oversized["dynamodb"]["NewImage"]["input"] = {"S": json.dumps({"blob": "x" * 3000})}
    handler, s3, bucket = outbox_handler(template, monkeypatch, broker.bootstrap_servers, moto_server, 6)
    try:
        # When the batch is handled
        handler({"Records": [*records[:5], oversized, *records[5:]]}, LocalLambdaContext("OutboxRelayFunction", 20))
    finally:
        outbox_service.cache_clear()
    # Then each event the topic takes is on it, once: librdkafka batched them into requests over the limit,
    # which the broker refused whole, and that refusal is no reason to set aside an event it takes alone
    published = events(broker.bootstrap_servers, tenant, expected=10)
    assert sorted(record["headers"]["ce_subject"].decode() for record in published) == sorted(small)
    # And only the event over the limit by itself was set aside
    ((key, parked),) = parked_objects(s3, bucket)
    assert key.startswith(f"undeliverable/{tenant}/")
    assert [(why["run_id"], why["error"]) for why in parked["undeliverable"]] == [(large, "MSG_SIZE_TOO_LARGE")]


def test_a_failing_batch_is_never_skipped_and_is_parked_after_its_attempts(
    template: Template, moto_server: str, tmp_path: Path
) -> None:
    # Given a table with a stream, and a stream event source whose function always fails
    dynamodb, table, run = table_with_stream(template, moto_server)
    dynamodb.put_item(TableName=table, Item=run)
    calls: list[int] = []
    parked: list[dict[str, Any]] = []
    done = threading.Event()

    def park(record: dict[str, Any]) -> None:
        parked.append(record)
        done.set()

    def failing(event: dict[str, Any], context: Any) -> None:
        calls.append(len(event["Records"]))
        raise OutboxBatchFailed("broker unreachable")

    source = LocalStreamEventSource(
        moto_server,
        table,
        failing,
        on_failure=park,
        filters=template.properties("OutboxRelaySource")["FilterCriteria"]["Filters"],
        max_attempts=3,
        retry_base_seconds=0.05,
    )
    # When it runs until it gives up
    source.start()
    try:
        assert done.wait(30)
    finally:
        source.stop()
    # Then the batch was tried every time, and parked whole with its records, as Lambda parks it in S3
    assert calls == [1, 1, 1]
    (record,) = parked
    assert record["requestContext"]["condition"] == "RetryAttemptsExhausted"
    assert record["DDBStreamBatchInfo"]["batchSize"] == 1
    (kept,) = json.loads(record["payload"])["Records"]
    assert kept["dynamodb"]["NewImage"] == run


def test_poimen_dev_serves_its_tenants_and_refuses_the_others_as_aws_does(
    kafka_dev: DevServer, broker: KafkaBroker, tenant: str
) -> None:
    # Given `poimen dev` serving the test's tenant on a broker that creates no topic on demand (as MSK)
    other = f"t-{uuid.uuid4().hex[:12]}"
    topics = AdminClient({"bootstrap.servers": broker.bootstrap_servers}).list_topics(timeout=10).topics
    # Then its tenant's topics were created at start, before any run, and no other tenant's
    assert {dispatch_topic(tenant), events_topic(tenant)} <= set(topics)
    assert not {dispatch_topic(other), events_topic(other)} & set(topics)
    # And a run of another tenant is refused, though the dev key is granted every tenant, and nothing is stored
    answer = signed_session().post(
        f"{kafka_dev.url}/v1/runs",
        json={"workflow_ref": "wf/x", "input": {}, "dispatch_key": "x-1"},
        headers={"X-Poimen-Tenant": other},
        timeout=30,
    )
    assert (answer.status_code, answer.json()["type"]) == (403, "urn:poimen:problem:tenant-not-served")
    assert count_runs(kafka_dev.dynamodb(), kafka_dev.table_name, other) == []
    # And publishing a spawn for it fails as on MSK: it has no topic, and none is created
    published = subprocess.run(
        [str(POIMEN), "dispatch", "publish", "--tenant", other, "--workflow-ref", "wf/x", "--input", "{}",
         "--bootstrap-servers", broker.bootstrap_servers, "--timeout", "5"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert published.returncode == 1, published.stderr
    assert f"has no topic {dispatch_topic(other)}" in published.stderr
    topics = AdminClient({"bootstrap.servers": broker.bootstrap_servers}).list_topics(timeout=10).topics
    assert dispatch_topic(other) not in topics


def test_poimen_dev_announces_its_outbox_and_it_publishes_metrics_under_its_own_service(
    kafka_dev: DevServer, broker: KafkaBroker, tenant: str, template: Template
) -> None:
    banner = kafka_dev.log.read_text()
    assert "Outbox relay: table stream -> poimen.<tenant>.events" in banner
    # When a run is admitted and its event published
    body = {"workflow_ref": "wf/m", "input": {}, "dispatch_key": "metrics-1"}
    signed_session().post(f"{kafka_dev.url}/v1/runs", json=body, headers={"X-Poimen-Tenant": tenant}, timeout=30)
    events(broker.bootstrap_servers, tenant, expected=1)

    # Then its EMF metrics name the outbox's service, as template.yaml gives it (the dashboard reads that one)
    def published() -> list[dict[str, Any]]:
        documents = [json.loads(line) for line in kafka_dev.log.read_text().splitlines() if line.startswith('{"_aws"')]
        return [doc for doc in documents if "EventsPublished" in doc and doc.get("tenant") == tenant]

    (document,) = wait_for(published, timeout=30, what="the outbox's EMF document")
    assert document["service"] == template.function_environment("OutboxRelayFunction", {})["POWERTOOLS_SERVICE_NAME"]


def test_events_tail_prints_each_event(kafka_dev: DevServer, broker: KafkaBroker, tenant: str) -> None:
    # Given a run admitted through the API and its event published
    body = {"workflow_ref": "wf/tail", "input": {}, "dispatch_key": "tail-1"}
    answer = signed_session().post(
        f"{kafka_dev.url}/v1/runs", json=body, headers={"X-Poimen-Tenant": tenant}, timeout=30
    )
    run_id = answer.json()["run_id"]
    events(broker.bootstrap_servers, tenant, expected=1)
    # When `poimen events tail` reads the topic from the beginning, for one event
    tail = subprocess.run(
        [
            str(POIMEN),
            "events",
            "tail",
            "--tenant",
            tenant,
            "--bootstrap-servers",
            broker.bootstrap_servers,
            "--from-beginning",
            "--limit",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    # Then it printed one line: time, run id, dispatch key, workflow_ref
    assert tail.returncode == 0, tail.stderr
    (line,) = tail.stdout.splitlines()
    assert line.split() == [answer.json()["created_at"], run_id, "tail-1", "wf/tail"]


def test_events_backfill_republishes_exactly_the_window_idempotently(
    kafka_dev: DevServer, broker: KafkaBroker, tenant: str
) -> None:
    # Given three runs and their events
    http = signed_session()
    created = []
    for i in range(3):
        body = {"workflow_ref": "wf/bf", "input": {"i": i}, "dispatch_key": f"bf-{i}"}
        answer = http.post(f"{kafka_dev.url}/v1/runs", json=body, headers={"X-Poimen-Tenant": tenant}, timeout=30)
        created.append(answer.json())
    before = events(broker.bootstrap_servers, tenant, expected=3)
    # When the window holding the last two is backfilled, after a dry run
    backfill = [
        str(POIMEN), "events", "backfill", "--tenant", tenant, "--since", created[1]["created_at"],
        "--bootstrap-servers", broker.bootstrap_servers,
        "--table-name", kafka_dev.table_name, "--dynamodb-endpoint", kafka_dev.aws_endpoint, "--stack-name", "local",
    ]  # fmt: skip
    dry = subprocess.run([*backfill, "--dry-run"], capture_output=True, text=True, timeout=60, check=False)
    assert dry.returncode == 0, dry.stderr
    assert len(events(broker.bootstrap_servers, tenant, expected=3)) == 3  # a dry run publishes nothing
    first = subprocess.run(backfill, capture_output=True, text=True, timeout=60, check=False)
    second = subprocess.run(backfill, capture_output=True, text=True, timeout=60, check=False)
    # Then each run of the window was republished once per backfill, identical to its first event
    assert first.returncode == second.returncode == 0, first.stderr + second.stderr
    assert "2 run(s)" in dry.stdout
    assert "2 event(s) published" in first.stdout
    after = events(broker.bootstrap_servers, tenant, expected=7)
    assert len(after) == 7
    # (partitions interleave when read: counted, not in order)
    counts = Counter(record["headers"]["ce_subject"].decode() for record in after)
    assert counts == {created[0]["run_id"]: 1, created[1]["run_id"]: 3, created[2]["run_id"]: 3}
    originals = {record["headers"]["ce_id"]: record for record in before}
    assert all(record == originals[record["headers"]["ce_id"]] for record in after)
    assert _assert_one_event_per_run(kafka_dev, tenant, after) == 4


def backfill_of_one_run(
    template: Template, moto_server: str, tenant: str, bootstrap: str, timeout: str
) -> subprocess.CompletedProcess[str]:
    """`poimen events backfill` to `bootstrap` of a window holding one admitted run of the tenant, in a new table."""
    dynamodb, table, run = table_with_stream(template, moto_server)
    dynamodb.put_item(TableName=table, Item={**run, "pk": {"S": f"RUN#{tenant}#r"}, "tenant_id": {"S": tenant}})
    return subprocess.run(
        [str(POIMEN), "events", "backfill", "--tenant", tenant, "--since", "2026-01-01T00:00:00Z",
         "--table-name", table, "--dynamodb-endpoint", moto_server,
         "--bootstrap-servers", bootstrap, "--timeout", timeout],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_a_backfill_the_broker_does_not_acknowledge_fails_with_one_line(
    template: Template, moto_server: str, tenant: str
) -> None:
    # Given one admitted run of the tenant, and no broker where the backfill is pointed: when it is backfilled
    backfill = backfill_of_one_run(template, moto_server, tenant, f"127.0.0.1:{free_port()}", "2")
    # Then it says so in one line, with exit code 3 (unavailable), having published nothing
    assert backfill.returncode == 3, backfill.stdout + backfill.stderr
    (line,) = backfill.stderr.splitlines()
    assert line.startswith("poimen events backfill: 0 of 1 event(s) published, then the broker")
    assert backfill.stdout == ""


def test_a_backfill_of_a_tenant_without_topics_says_so_and_publishes_nothing(
    template: Template, moto_server: str, broker: KafkaBroker, tenant: str
) -> None:
    # Given one admitted run of a tenant whose topics were never created (MSK makes none): when it is backfilled
    backfill = backfill_of_one_run(template, moto_server, tenant, broker.bootstrap_servers, "6")
    # Then it says that its event cannot be published and how to fix it, exit 1, counting none as published
    assert backfill.returncode == 1, backfill.stdout + backfill.stderr
    assert f"{events_topic(tenant)}: 0 event(s) published" in backfill.stdout
    assert "1 event(s) not published" in backfill.stderr
    assert "UNKNOWN_TOPIC_OR_PART" in backfill.stderr
    assert f"poimen topics ensure --tenant {tenant}" in backfill.stderr
    assert events_topic(tenant) not in AdminClient({"bootstrap.servers": broker.bootstrap_servers}).list_topics().topics


def test_a_restarted_stream_source_resumes_after_its_last_handled_batch(
    template: Template, moto_server: str, tmp_path: Path
) -> None:
    # Given a table with a stream and two runs, read by a source keeping its positions in a file
    dynamodb, table, run = table_with_stream(template, moto_server)

    def put(run_id: str) -> None:
        dynamodb.put_item(TableName=table, Item={**run, "pk": {"S": f"RUN#acme#{run_id}"}, "run_id": {"S": run_id}})

    seen: list[str] = []

    def handler(event: dict[str, Any], context: Any) -> None:
        seen.extend(record["dynamodb"]["NewImage"]["run_id"]["S"] for record in event["Records"])

    def source() -> LocalStreamEventSource:
        return LocalStreamEventSource(
            moto_server, table, handler, on_failure=lambda _: None, positions=tmp_path / "positions.json"
        )

    put("r-1")
    put("r-2")
    first = source()
    first.start()
    try:
        wait_for(lambda: seen == ["r-1", "r-2"], what="both runs handled")
    finally:
        first.stop()
    # When a run is admitted while it is down, and a new source starts on the same positions
    put("r-3")
    second = source()
    second.start()
    try:
        wait_for(lambda: len(seen) == 3, what="the new run handled")
    finally:
        second.stop()
    # Then it went on after the last handled batch: the new run only, nothing again
    assert seen == ["r-1", "r-2", "r-3"]
