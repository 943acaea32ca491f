"""Real Kafka end to end: a KRaft broker, the local MSK event source, the relay, `poimen dev`, moto SQS."""

from __future__ import annotations

import base64
import functools
import json
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from confluent_kafka import ConsumerGroupTopicPartitions, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource  # type: ignore[attr-defined]

from poimen.contract import RunRequest
from poimen.dispatch import DispatchPublisher
from poimen.ids import keyed_run_id
from poimen.kafka import dispatch_topic
from poimen.relay import relay_service
from poimen_tools.local.event_source import LocalMskEventSource, failed_batch_key
from poimen_tools.local.kafka_broker import KafkaBroker
from poimen_tools.local.template import Template
from poimen_tools.topics import ensure_topics
from tests.conftest import count_runs
from tests.integration.conftest import (
    POIMEN,
    DevServer,
    dead_letters,
    free_port,
    signed_session,
    start_dev,
    wait_for,
)

pytestmark = pytest.mark.usefixtures("no_admission_in_process")

SPAWN = RunRequest(workflow_ref="wf/hello", input={"greeting": "hi"}, dispatch_key="order-42")


@pytest.fixture
def topic(broker: KafkaBroker, tenant: str) -> str:
    ensure_topics(broker.bootstrap_servers, tenant, partitions=3, replication_factor=1)
    return dispatch_topic(tenant)


EventSourceFactory = Callable[..., LocalMskEventSource]


@pytest.fixture
def event_source(
    template: Template, dev: DevServer, dlq: str, topic: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[EventSourceFactory]:
    """The local MSK event source on this test's topic, feeding the relay handler pointed at `poimen dev`."""
    monkeypatch.setenv("ADMISSION_API_URL", dev.url)
    monkeypatch.setenv("DLQ_URL", dlq)
    monkeypatch.setenv("AWS_ENDPOINT_URL_SQS", dev.aws_endpoint)
    relay_service.cache_clear()
    handler = template.load_handler("InboxRelayFunction")
    sqs = dev.sqs()
    started: list[LocalMskEventSource] = []

    def create(bootstrap: str, group_id: str | None = None) -> LocalMskEventSource:
        source = LocalMskEventSource(
            bootstrap,
            handler,
            on_failure=lambda record: sqs.send_message(QueueUrl=dlq, MessageBody=json.dumps(record)),
            group_id=group_id or f"relay-{uuid.uuid4().hex[:8]}",
            batching_window_seconds=0.2,
            max_attempts=2,
            retry_base_seconds=0.1,
            function_timeout_seconds=20,
            topics=[topic],
        )
        source.start()
        started.append(source)
        return source

    yield create
    for source in started:
        source.stop()
    relay_service.cache_clear()


def _partitions(admin: AdminClient, topic: str, offset: int = -1001) -> list[TopicPartition]:
    metadata = admin.list_topics(topic, timeout=10)
    return [TopicPartition(topic, partition, offset) for partition in metadata.topics[topic].partitions]


@functools.cache
def _admin(bootstrap: str) -> AdminClient:
    return AdminClient({"bootstrap.servers": bootstrap})


def _committed(bootstrap: str, group_id: str, topic: str) -> int:
    """Records the group has committed on the topic (sum of its partitions' committed offsets)."""
    admin = _admin(bootstrap)
    request = ConsumerGroupTopicPartitions(group_id, _partitions(admin, topic))
    (future,) = admin.list_consumer_group_offsets([request]).values()
    try:
        partitions = future.result().topic_partitions
    except KafkaException as error:
        # The group coordinator still loading (a fresh broker): none counted yet. librdkafka does not always flag it
        # retriable.
        if error.args[0].retriable() or error.args[0].code() == KafkaError.COORDINATOR_LOAD_IN_PROGRESS:
            return -1
        raise
    return sum(max(tp.offset, 0) for tp in partitions)


def _runs(dev: DevServer, tenant: str) -> list[dict[str, Any]]:
    return count_runs(dev.dynamodb(), dev.table_name, tenant)


def test_one_published_message_is_one_run_through_one_post(
    broker: KafkaBroker, dev: DevServer, tenant: str, event_source: EventSourceFactory, dlq: str
) -> None:
    source = event_source(broker.bootstrap_servers)
    publisher = DispatchPublisher(broker.bootstrap_servers)

    run_id = publisher.publish(tenant, SPAWN).run_id
    publisher.flush()

    wait_for(lambda: _committed(broker.bootstrap_servers, source.group_id, dispatch_topic(tenant)) == 1)
    assert [run["run_id"]["S"] for run in _runs(dev, tenant)] == [run_id] == [keyed_run_id(tenant, "order-42")]
    assert [entry["message"] for entry in dev.admissions(tenant)] == ["run admitted"]
    assert dead_letters(dev, dlq) == []


def test_relayed_records_reach_admission_through_post_v1_runs_a_call_a_partition_batch(
    broker: KafkaBroker, dev: DevServer, tenant: str, event_source: EventSourceFactory, dlq: str
) -> None:
    # Given 30 records on the tenant's three partitions, published before the relay starts
    publisher = DispatchPublisher(broker.bootstrap_servers)
    spawns = [RunRequest(workflow_ref="wf/hello", input={"n": n}, dispatch_key=f"p-{n}") for n in range(30)]
    run_ids = [publisher.publish(tenant, spawn).run_id for spawn in spawns]
    publisher.flush()
    # When the relay consumes them
    source = event_source(broker.bootstrap_servers)
    wait_for(lambda: _committed(broker.bootstrap_servers, source.group_id, dispatch_topic(tenant)) == 30)
    # Then the API, instrumented by its own structured logs, admitted each record once in the handler of
    # POST /v1/runs (the one route that admits), and in fewer requests than records: a call a partition batch
    admissions = dev.admissions(tenant)
    assert sorted(entry["run_id"] for entry in admissions) == sorted(run_ids)
    assert [entry["message"] for entry in admissions] == ["run admitted"] * 30
    requests = {entry["correlation_id"] for entry in admissions}
    assert len(requests) <= 10  # at most 3 partitions in each of a few batches, never one a record
    assert sorted(run["run_id"]["S"] for run in _runs(dev, tenant)) == sorted(run_ids)
    assert dead_letters(dev, dlq) == []


def test_forced_redelivery_is_still_one_run(
    broker: KafkaBroker, dev: DevServer, tenant: str, event_source: EventSourceFactory
) -> None:
    # Given a message relayed and committed by a consumer group
    group = f"relay-{uuid.uuid4().hex[:8]}"
    source = event_source(broker.bootstrap_servers, group)
    publisher = DispatchPublisher(broker.bootstrap_servers)
    publisher.publish(tenant, SPAWN)
    publisher.flush()
    wait_for(lambda: _committed(broker.bootstrap_servers, group, dispatch_topic(tenant)) == 1)
    source.stop()
    # When the group's offsets are reset to the start and the same message is published again
    admin = AdminClient({"bootstrap.servers": broker.bootstrap_servers})
    from confluent_kafka import ConsumerGroupTopicPartitions

    metadata = admin.list_topics(dispatch_topic(tenant), timeout=10)
    beginning = [
        TopicPartition(dispatch_topic(tenant), p, 0) for p in metadata.topics[dispatch_topic(tenant)].partitions
    ]
    (future,) = admin.alter_consumer_group_offsets([ConsumerGroupTopicPartitions(group, beginning)]).values()
    future.result()
    publisher.publish(tenant, SPAWN)
    publisher.flush()
    event_source(broker.bootstrap_servers, group)
    # Then both deliveries of both copies were admitted as one run
    wait_for(lambda: _committed(broker.bootstrap_servers, group, dispatch_topic(tenant)) == 2)
    assert len(_runs(dev, tenant)) == 1
    assert sorted(entry["message"] for entry in dev.admissions(tenant)) == [
        "run admitted",
        "run replayed",
        "run replayed",
    ]


def test_a_broker_outage_loses_nothing_and_the_api_keeps_admitting(
    dev: DevServer, tenant: str, tmp_path: Path, event_source: EventSourceFactory, dlq: str
) -> None:
    # Given a broker of this test's own, with one message in the log before it stops
    broker = KafkaBroker(tmp_path / "kafka")
    broker.start()
    try:
        ensure_topics(broker.bootstrap_servers, tenant, partitions=3, replication_factor=1)
        publisher = DispatchPublisher(broker.bootstrap_servers)
        before = publisher.publish(tenant, RunRequest(workflow_ref="wf/a", input={}, dispatch_key="before-stop")).run_id
        publisher.flush()
        broker.stop()
        # When a message is published while it is down (the producer buffers it)
        during = publisher.publish(
            tenant, RunRequest(workflow_ref="wf/b", input={}, dispatch_key="during-outage")
        ).run_id
        source = event_source(broker.bootstrap_servers)
        # Then direct admissions keep working meanwhile
        direct = signed_session().post(
            f"{dev.url}/v1/runs",
            json={"workflow_ref": "wf/direct", "input": {}, "dispatch_key": "direct"},
            headers={"X-Poimen-Tenant": tenant},
            timeout=30,
        )
        assert direct.status_code == 201
        # And once the broker is back, both messages become runs, and nothing was dead-lettered
        broker.start()
        publisher.flush(60)
        wait_for(lambda: len(_runs(dev, tenant)) == 3, timeout=60)
        source.stop()
    finally:
        broker.stop()
    assert {run["run_id"]["S"] for run in _runs(dev, tenant)} == {before, during, direct.json()["run_id"]}
    assert dead_letters(dev, dlq) == []


def test_a_malformed_message_is_dead_lettered_and_later_ones_admitted(
    broker: KafkaBroker, dev: DevServer, tenant: str, topic: str, event_source: EventSourceFactory, dlq: str
) -> None:
    raw = Producer({"bootstrap.servers": broker.bootstrap_servers})
    raw.produce(topic, key=b"same", value=b"{not json")
    raw.produce(topic, key=b"same", value=json.dumps(SPAWN.model_dump()).encode())
    assert raw.flush(30) == 0

    event_source(broker.bootstrap_servers)

    wait_for(lambda: len(_runs(dev, tenant)) == 1)
    letters = wait_for(lambda: dead_letters(dev, dlq))
    assert [letter["reason"]["kind"] for letter in letters] == ["invalid-json"]


def test_a_batch_failing_every_attempt_goes_to_the_on_failure_destination(
    broker: KafkaBroker,
    dev: DevServer,
    tenant: str,
    event_source: EventSourceFactory,
    dlq: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a relay that the API refuses (a URL that is no admission API answers 404)
    monkeypatch.setenv("ADMISSION_API_URL", f"{dev.url}/not-the-api")
    relay_service.cache_clear()
    publisher = DispatchPublisher(broker.bootstrap_servers)
    publisher.publish(tenant, SPAWN)
    publisher.flush()
    # When the event source has tried the batch max_attempts times
    source = event_source(broker.bootstrap_servers)
    (record,) = wait_for(lambda: dead_letters(dev, dlq))
    # Then Lambda's OnFailure record names the batch, and the group moved past it
    assert record["requestContext"]["condition"] == "RetryAttemptsExhausted"
    assert record["requestContext"]["approximateInvokeCount"] == 2
    assert next(iter(record["KafkaBatchInfo"]["recordsInfo"])).startswith(f"{dispatch_topic(tenant)}-")
    # and, as an S3 destination gets it, the whole event: the records themselves are kept
    (records,) = json.loads(record["payload"])["records"].values()
    assert [json.loads(base64.b64decode(r["value"]))["dispatch_key"] for r in records] == [SPAWN.dispatch_key]
    wait_for(lambda: _committed(broker.bootstrap_servers, source.group_id, dispatch_topic(tenant)) == 1)
    assert _runs(dev, tenant) == []


def test_inbox_lag_is_emitted(
    broker: KafkaBroker, tenant: str, event_source: EventSourceFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    source = event_source(broker.bootstrap_servers)
    publisher = DispatchPublisher(broker.bootstrap_servers)
    publisher.publish(tenant, SPAWN)
    publisher.flush()

    wait_for(lambda: _committed(broker.bootstrap_servers, source.group_id, dispatch_topic(tenant)) == 1)

    documents = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith('{"_aws"')]
    lags = [doc["InboxLag"] for doc in documents if "InboxLag" in doc]
    assert lags
    assert all(0 <= (lag[0] if isinstance(lag, list) else lag) < 60_000 for lag in lags)


def test_poimen_dev_runs_the_whole_path(tmp_path: Path, tenant: str) -> None:
    # Given `poimen dev` with its own broker and event source, knowing no principal but its dev key
    dev = start_dev(tmp_path, kafka=True, test_principal=False, tenants=[tenant])
    try:
        assert dev.kafka_bootstrap is not None
        # When a dispatch message is published with the CLI
        published = subprocess.run(
            [
                str(POIMEN),
                "dispatch",
                "publish",
                "--bootstrap-servers",
                dev.kafka_bootstrap,
                "--tenant",
                tenant,
                "--workflow-ref",
                "wf/hello",
                "--input",
                '{"n": 1}',
                "--dispatch-key",
                "cli-1",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        # Then one run appears, admitted through the API
        run_id = keyed_run_id(tenant, "cli-1")
        assert run_id in published.stdout
        wait_for(lambda: len(count_runs(dev.dynamodb(), dev.table_name, tenant)) == 1, timeout=60)
        # (the handler logs the admission just after its write)
        entries = wait_for(lambda: dev.admissions(tenant), timeout=10, what="the admission's log line")
        assert [entry["message"] for entry in entries] == ["run admitted"]
    finally:
        assert dev.stop() == 0


def test_topics_ensure_is_idempotent(broker: KafkaBroker, tenant: str) -> None:
    command = [str(POIMEN), "topics", "ensure", "--tenant", tenant, "--bootstrap-servers", broker.bootstrap_servers]
    command += ["--partitions", "2", "--replication-factor", "1", "--retention-ms", "3600000"]

    first = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True).stdout
    again = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True).stdout

    assert first.splitlines() == [f"poimen.{tenant}.dispatch: created", f"poimen.{tenant}.events: created"]
    assert again.splitlines() == [f"poimen.{tenant}.dispatch: exists", f"poimen.{tenant}.events: exists"]
    metadata = AdminClient({"bootstrap.servers": broker.bootstrap_servers}).list_topics(timeout=10)
    assert len(metadata.topics[f"poimen.{tenant}.dispatch"].partitions) == 2
    # The dispatch topic's timestamps are the broker's (LogAppendTime), not the publishers' clocks
    assert topic_config(broker, f"poimen.{tenant}.dispatch")["message.timestamp.type"] == "LogAppendTime"
    assert topic_config(broker, f"poimen.{tenant}.events")["message.timestamp.type"] == "CreateTime"
    assert topic_config(broker, f"poimen.{tenant}.dispatch")["retention.ms"] == "3600000"


def topic_config(broker: KafkaBroker, topic: str) -> dict[str, str]:
    """The topic's configuration as the broker describes it."""
    admin = AdminClient({"bootstrap.servers": broker.bootstrap_servers})
    (future,) = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, topic)]).values()
    return {name: entry.value for name, entry in future.result(timeout=10).items()}


def test_stopping_while_a_batch_fails_commits_nothing(
    broker: KafkaBroker, dev: DevServer, tenant: str, topic: str, template: Template, event_source: EventSourceFactory
) -> None:
    # Given a function that fails, and an event source backing off between attempts
    failed = threading.Event()

    def failing(event: dict[str, Any], context: Any) -> dict[str, Any]:
        failed.set()
        raise RuntimeError("the function failed")

    group = f"relay-{uuid.uuid4().hex[:8]}"
    stalled = LocalMskEventSource(
        broker.bootstrap_servers,
        failing,
        on_failure=lambda _: None,
        group_id=group,
        batching_window_seconds=0.2,
        max_attempts=3,
        retry_base_seconds=30,
        topics=[topic],
    )
    publisher = DispatchPublisher(broker.bootstrap_servers)
    publisher.publish(tenant, SPAWN)
    publisher.flush()
    stalled.start()
    assert failed.wait(30)
    # When it is stopped during the backoff
    stalled.stop()
    # Then nothing was committed, and the next consumer of the group relays the record
    assert _committed(broker.bootstrap_servers, group, topic) == 0
    event_source(broker.bootstrap_servers, group)
    wait_for(lambda: _committed(broker.bootstrap_servers, group, topic) == 1)
    assert len(_runs(dev, tenant)) == 1


def test_a_batch_neither_handled_nor_parked_is_read_again_while_its_topic_is_paused(
    broker: KafkaBroker, topic: str
) -> None:
    # Given a function that always fails, and an on-failure destination that is down for the first batch parked
    seen: list[tuple[int, int]] = []
    parked: list[tuple[int, int]] = []

    def failing(event: dict[str, Any], context: Any) -> dict[str, Any]:
        seen.extend((record["partition"], record["offset"]) for group in event["records"].values() for record in group)
        raise RuntimeError("the function failed")

    refusals = [ConnectionError("the bucket is unreachable")]

    def destination(record: dict[str, Any]) -> None:
        if refusals:
            raise refusals.pop()
        for group in json.loads(record["payload"])["records"].values():
            parked.extend((item["partition"], item["offset"]) for item in group)

    group = f"relay-{uuid.uuid4().hex[:8]}"
    source = LocalMskEventSource(
        broker.bootstrap_servers,
        failing,
        on_failure=destination,
        group_id=group,
        batching_window_seconds=0.2,
        max_attempts=1,
        retry_base_seconds=0.1,
        topics=[topic],
    )
    producer = Producer({"bootstrap.servers": broker.bootstrap_servers})

    # When three records of one partition are relayed by a real consumer, its topic paused while each batch runs
    for number in range(3):
        producer.produce(topic, value=f"record-{number}".encode(), partition=0)
    producer.flush(10)
    source.start()
    try:
        wait_for(lambda: _committed(broker.bootstrap_servers, group, topic) == 3, timeout=60)
    finally:
        source.stop()

    # Then the batch the destination refused was read again from its first record: every record parked once,
    # none skipped, and the first one seen at least twice
    assert sorted(parked) == [(0, 0), (0, 1), (0, 2)]
    assert seen.count((0, 0)) >= 2


def _parked_records(dev: DevServer, bucket: str) -> list[dict[str, Any]]:
    """Every record of every batch parked in the bucket (the payload Lambda writes to S3)."""
    s3 = boto3.client("s3", endpoint_url=dev.aws_endpoint)
    records: list[dict[str, Any]] = []
    for item in s3.list_objects_v2(Bucket=bucket).get("Contents", []):
        parked = json.loads(s3.get_object(Bucket=bucket, Key=item["Key"])["Body"].read())
        for batch in json.loads(parked["payload"])["records"].values():
            records.extend(batch)
    return records


def test_an_outage_past_the_retry_budget_parks_batches_and_one_redrive_admits_each_once(
    broker: KafkaBroker,
    template: Template,
    dev: DevServer,
    tenant: str,
    topic: str,
    dlq: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given the admission API down (nothing listens), a small retry budget, and S3 as on-failure destination
    bucket = f"failed-{uuid.uuid4().hex[:12]}"
    s3 = boto3.client("s3", endpoint_url=dev.aws_endpoint)
    s3.create_bucket(Bucket=bucket)
    monkeypatch.setenv("ADMISSION_API_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("DLQ_URL", dlq)
    monkeypatch.setenv("AWS_ENDPOINT_URL_SQS", dev.aws_endpoint)
    monkeypatch.setenv("RELAY_TIME_MARGIN_SECONDS", "0.5")
    relay_service.cache_clear()
    source = LocalMskEventSource(
        broker.bootstrap_servers,
        template.load_handler("InboxRelayFunction"),
        on_failure=lambda record: s3.put_object(
            Bucket=bucket, Key=failed_batch_key(record, "outage-test"), Body=json.dumps(record).encode()
        ),
        group_id=f"relay-{uuid.uuid4().hex[:8]}",
        batching_window_seconds=0.2,
        max_attempts=2,
        retry_base_seconds=0.1,
        function_timeout_seconds=2,
        topics=[topic],
    )
    # When messages arrive during the outage (one of them twice) and the event source gives up on them
    spawns = [RunRequest(workflow_ref="wf/outage", input={"i": i}, dispatch_key=f"o-{i}") for i in range(4)]
    publisher = DispatchPublisher(broker.bootstrap_servers)
    for spawn in [*spawns, spawns[0]]:
        publisher.publish(tenant, spawn)
    publisher.flush()
    source.start()
    try:
        wait_for(lambda: len(_parked_records(dev, bucket)) == 5, timeout=90, what="every batch parked in S3")
        wait_for(lambda: _committed(broker.bootstrap_servers, source.group_id, topic) == 5, what="offsets past them")
    finally:
        source.stop()
        relay_service.cache_clear()
    assert _runs(dev, tenant) == []

    # And the API is back and `poimen dlq redrive` runs, twice
    redrive = [
        str(POIMEN), "dlq", "redrive", "--yes", "--api-url", dev.url, "--queue-url", dlq,
        "--bucket", bucket, "--aws-endpoint", dev.aws_endpoint,
    ]  # fmt: skip
    first = subprocess.run(redrive, capture_output=True, text=True, timeout=120, check=False)
    runs_after_first = _runs(dev, tenant)
    second = subprocess.run(redrive, capture_output=True, text=True, timeout=120, check=False)

    # Then exactly one run per dispatch_key, nothing left parked, and the second redrive changed nothing
    assert first.returncode == 0, first.stdout + first.stderr
    assert second.returncode == 0, second.stdout + second.stderr
    assert sorted(run["dispatch_key"]["S"] for run in runs_after_first) == [s.dispatch_key for s in spawns]
    assert s3.list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0
    assert dead_letters(dev, dlq) == []
    assert _runs(dev, tenant) == runs_after_first


def test_a_record_older_than_the_run_retention_is_dead_lettered_as_expired(
    broker: KafkaBroker,
    dev: DevServer,
    tenant: str,
    topic: str,
    event_source: EventSourceFactory,
    dlq: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a relay whose runs are kept 3 days, a dispatch topic whose timestamps are its publishers' (one
    # created by others: CreateTime), and two dispatches: one produced with a timestamp 4 days old, one now
    monkeypatch.setenv("RUN_RETENTION_DAYS", "3")
    create_time(broker, topic)
    raw = Producer({"bootstrap.servers": broker.bootstrap_servers})
    old_ms = int(time.time() * 1000) - 4 * 86_400_000
    old = {**SPAWN.model_dump(), "dispatch_key": "old"}
    raw.produce(topic, key=b"old", value=json.dumps(old).encode(), timestamp=old_ms)
    raw.produce(topic, key=b"new", value=json.dumps(SPAWN.model_dump()).encode())
    assert raw.flush(30) == 0
    # When the relay reads them
    event_source(broker.bootstrap_servers)
    # Then only the fresh one is a run, and the old one is a dead letter of kind expired, its timestamp kept
    wait_for(lambda: len(_runs(dev, tenant)) == 1)
    (letter,) = wait_for(lambda: dead_letters(dev, dlq))
    assert letter["reason"]["kind"] == "expired"
    assert letter["reason"]["detail"].startswith("the record is 4 days old, older than the run retention of 3 days")
    assert letter["record"]["timestamp"] == old_ms
    assert [run["dispatch_key"]["S"] for run in _runs(dev, tenant)] == [SPAWN.dispatch_key]


def create_time(broker: KafkaBroker, topic: str) -> None:
    """Make the topic keep its publishers' timestamps (message.timestamp.type=CreateTime)."""
    admin = AdminClient({"bootstrap.servers": broker.bootstrap_servers})
    entry = ConfigEntry("message.timestamp.type", "CreateTime", incremental_operation=AlterConfigOpType.SET)
    resource = ConfigResource(ConfigResource.Type.TOPIC, topic, incremental_configs=[entry])
    for future in admin.incremental_alter_configs([resource]).values():
        future.result(timeout=10)
    wait_for(lambda: topic_config(broker, topic)["message.timestamp.type"] == "CreateTime")


def test_the_relay_ages_a_dispatch_by_the_brokers_clock_not_its_publishers(
    broker: KafkaBroker,
    dev: DevServer,
    tenant: str,
    topic: str,
    event_source: EventSourceFactory,
    dlq: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given runs kept 3 days, the dispatch topic as poimen topics ensure declares it, and a publisher whose
    # clock is 4 days slow and one 50 minutes fast
    monkeypatch.setenv("RUN_RETENTION_DAYS", "3")
    raw = Producer({"bootstrap.servers": broker.bootstrap_servers})
    now_ms = int(time.time() * 1000)
    slow, fast = ({**SPAWN.model_dump(), "dispatch_key": key} for key in ("slow", "fast"))
    raw.produce(topic, key=b"slow", value=json.dumps(slow).encode(), timestamp=now_ms - 4 * 86_400_000)
    raw.produce(topic, key=b"fast", value=json.dumps(fast).encode(), timestamp=now_ms + 50 * 60_000)
    assert raw.flush(30) == 0
    # When the relay reads them
    event_source(broker.bootstrap_servers)
    # Then both are runs: their timestamps are the broker's, when it appended them, so neither is expired nor
    # from the future, and no dead letter is made
    wait_for(lambda: len(_runs(dev, tenant)) == 2)
    assert sorted(run["dispatch_key"]["S"] for run in _runs(dev, tenant)) == ["fast", "slow"]
    assert dead_letters(dev, dlq) == []


def test_topics_ensure_refuses_a_dispatch_retention_longer_than_the_run_retention(
    broker: KafkaBroker, tenant: str
) -> None:
    command = [str(POIMEN), "topics", "ensure", "--tenant", tenant, "--bootstrap-servers", broker.bootstrap_servers]
    command += ["--replication-factor", "1", "--retention-ms", "-1", "--run-retention-days", "3"]

    refused = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)

    assert refused.returncode == 2
    assert refused.stderr.splitlines() == [
        "poimen topics ensure: --retention-ms -1 (forever) keeps dispatch records longer than --run-retention-days 3: "
        "a record older than its run could be admitted again; nothing was created"
    ]
    topics = AdminClient({"bootstrap.servers": broker.bootstrap_servers}).list_topics(timeout=10).topics
    assert not {f"poimen.{tenant}.dispatch", f"poimen.{tenant}.events"} & set(topics)
