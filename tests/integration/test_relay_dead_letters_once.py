"""One bad record is one dead letter, however often its batch fails for an outage, is retried or parked:
a real KRaft broker, the local MSK event source, the relay handler, `poimen dev` and its moto SQS and S3. In both
poller modes (RelayEventPollers): the local mapping retries and parks as the template's mappings declare, and the
relay is told the mode (RELAY_EVENT_POLLERS)."""

from __future__ import annotations

import json
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import boto3
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource  # type: ignore[attr-defined]

from poimen.config import EVENT_POLLER_MODES, ON_DEMAND_POLLERS
from poimen.ids import keyed_run_id
from poimen.kafka import dispatch_topic
from poimen.relay import relay_service
from poimen_tools.local.event_source import LocalMskEventSource, failed_batch_key, relay_mapping_attempts
from poimen_tools.local.kafka_broker import KafkaBroker
from poimen_tools.local.template import Template
from poimen_tools.topics import ensure_topics
from tests.conftest import count_runs
from tests.integration.conftest import POIMEN, DevServer, dead_letters, free_port, wait_for

pytestmark = pytest.mark.usefixtures("no_admission_in_process")

SPAWN = {"workflow_ref": "wf/hello", "input": {}, "dispatch_key": "once-1"}
Handler = Callable[[dict[str, Any], Any], Any]


@pytest.fixture
def topic(broker: KafkaBroker, tenant: str) -> str:
    ensure_topics(broker.bootstrap_servers, tenant, partitions=1, replication_factor=1)
    return dispatch_topic(tenant)


@pytest.fixture
def api_down(dev: DevServer, dlq: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], None]]:
    """The relay's environment with the admission API unreachable (nothing listens on its port); calling
    the result brings the API back (the relay's next environment points at `poimen dev`)."""
    monkeypatch.setenv("ADMISSION_API_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("DLQ_URL", dlq)
    monkeypatch.setenv("AWS_ENDPOINT_URL_SQS", dev.aws_endpoint)
    monkeypatch.setenv("RELAY_TIME_MARGIN_SECONDS", "0.5")
    monkeypatch.setenv("RELAY_DLQ_TIMEOUT_SECONDS", "0.25")
    relay_service.cache_clear()

    def back() -> None:
        monkeypatch.setenv("ADMISSION_API_URL", dev.url)
        relay_service.cache_clear()

    yield back
    relay_service.cache_clear()


def _publish_bad_then_good(broker: KafkaBroker, topic: str, timestamp_ms: int = 0) -> None:
    """A malformed record, then a valid one of the same key; created at `timestamp_ms` if given (else now)."""
    producer = Producer({"bootstrap.servers": broker.bootstrap_servers})
    producer.produce(topic, key=b"same", value=b"{not json", partition=0, timestamp=timestamp_ms)
    producer.produce(topic, key=b"same", value=json.dumps(SPAWN).encode(), partition=0, timestamp=timestamp_ms)
    assert producer.flush(30) == 0


def _in_mode(template: Template, tenant: str, mode: str, monkeypatch: pytest.MonkeyPatch) -> int | None:
    """The relay told the poller mode, as the template tells it; the local mapping's attempts in that mode."""
    monkeypatch.setenv("RELAY_EVENT_POLLERS", mode)
    relay_service.cache_clear()
    return relay_mapping_attempts(template, {"Tenants": tenant, "RelayEventPollers": mode})


def _event_source(
    broker: KafkaBroker, topic: str, handler: Handler, on_failure: Any, max_attempts: int | None
) -> LocalMskEventSource:
    return LocalMskEventSource(
        broker.bootstrap_servers,
        handler,
        on_failure=on_failure,
        group_id=f"relay-{uuid.uuid4().hex[:8]}",
        batching_window_seconds=0.5,
        max_attempts=max_attempts,
        retry_base_seconds=0.1,
        function_timeout_seconds=3,
        topics=[topic],
    )


@pytest.mark.parametrize("mode", EVENT_POLLER_MODES)
def test_a_bad_record_in_a_batch_failing_twice_for_an_outage_is_one_dead_letter(
    broker: KafkaBroker,
    template: Template,
    dev: DevServer,
    tenant: str,
    topic: str,
    dlq: str,
    api_down: Callable[[], None],
    mode: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a malformed record and a valid one after it, and the API down for the batch's first two attempts, in
    # either poller mode (provisioned: 3 attempts before parking; on-demand: retried until handled)
    max_attempts = _in_mode(template, tenant, mode, monkeypatch)
    relay = template.load_handler("InboxRelayFunction")
    attempts: list[int] = []
    lock = threading.Lock()

    def invoke(event: dict[str, Any], context: Any) -> Any:
        with lock:
            attempts.append(sum(len(records) for records in event["records"].values()))
            if len(attempts) == 3:
                api_down()  # the API is back for the third attempt
        return relay(event, context)

    _publish_bad_then_good(broker, topic)
    parked: list[dict[str, Any]] = []
    source = _event_source(broker, topic, invoke, on_failure=parked.append, max_attempts=max_attempts)
    # When the event source tries the batch until it completes
    source.start()
    try:
        wait_for(lambda: count_runs(dev.dynamodb(), dev.table_name, tenant), timeout=60, what="the valid record's run")
        wait_for(lambda: len(attempts) == 3, what="three attempts")
    finally:
        source.stop()
    # Then the batch was tried three times, whole, never parked, and its bad record is exactly one dead letter
    assert attempts == [2, 2, 2]
    assert parked == []
    letters = dead_letters(dev, dlq)
    assert [(letter["record"]["offset"], letter["reason"]["kind"]) for letter in letters] == [(0, "invalid-json")]
    runs = count_runs(dev.dynamodb(), dev.table_name, tenant)
    assert [run["run_id"]["S"] for run in runs] == [keyed_run_id(tenant, "once-1")]


def test_a_parked_batch_dead_letters_nothing_and_its_redrive_one_letter_per_bad_record(
    broker: KafkaBroker,
    template: Template,
    dev: DevServer,
    tenant: str,
    topic: str,
    dlq: str,
    api_down: Callable[[], None],
) -> None:
    # Given a malformed record and a valid one after it, the API down past the retry budget, S3 on failure
    bucket = f"failed-{uuid.uuid4().hex[:12]}"
    s3 = boto3.client("s3", endpoint_url=dev.aws_endpoint)
    s3.create_bucket(Bucket=bucket)

    def park(record: dict[str, Any]) -> None:
        s3.put_object(Bucket=bucket, Key=failed_batch_key(record, "once"), Body=json.dumps(record).encode())

    _publish_bad_then_good(broker, topic)
    source = _event_source(broker, topic, template.load_handler("InboxRelayFunction"), on_failure=park, max_attempts=2)
    # When the event source gives up on the batch and parks it
    source.start()
    try:
        wait_for(lambda: s3.list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 1, timeout=60, what="the batch parked")
    finally:
        source.stop()
    # Then nothing was dead-lettered: the parked batch holds both records
    assert dead_letters(dev, dlq) == []
    (item,) = s3.list_objects_v2(Bucket=bucket)["Contents"]
    parked = json.loads(json.loads(s3.get_object(Bucket=bucket, Key=item["Key"])["Body"].read())["payload"])
    assert [record["offset"] for records in parked["records"].values() for record in records] == [0, 1]
    # When the API is back and the parked batch is redriven
    api_down()
    redrive = [
        str(POIMEN), "dlq", "redrive", "--yes", "--kind", "failed-batch", "--api-url", dev.url,
        "--queue-url", dlq, "--bucket", bucket, "--aws-endpoint", dev.aws_endpoint,
    ]  # fmt: skip
    done = subprocess.run(redrive, capture_output=True, text=True, timeout=120, check=False)
    # Then the bad record is exactly one dead letter, the valid one one run, and nothing is parked
    assert done.returncode in (0, 1), done.stdout + done.stderr
    letters = dead_letters(dev, dlq)
    assert [(letter["record"]["offset"], letter["reason"]["kind"]) for letter in letters] == [(0, "invalid-json")]
    runs = count_runs(dev.dynamodb(), dev.table_name, tenant)
    assert [run["run_id"]["S"] for run in runs] == [keyed_run_id(tenant, "once-1")]
    assert s3.list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0


def test_on_demand_an_outage_past_the_age_limit_dead_letters_each_record_once_and_frees_the_partition(
    broker: KafkaBroker,
    template: Template,
    dev: DevServer,
    tenant: str,
    topic: str,
    dlq: str,
    api_down: Callable[[], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given on-demand pollers (the local mapping retries until handled, parks nothing) with an age limit of an hour,
    # a malformed record and a valid one created two hours ago, and the API down for good
    max_attempts = _in_mode(template, tenant, ON_DEMAND_POLLERS, monkeypatch)
    monkeypatch.setenv("RELAY_MAX_RECORD_AGE_SECONDS", "3600")
    relay = template.load_handler("InboxRelayFunction")
    attempts: list[int] = []

    def invoke(event: dict[str, Any], context: Any) -> Any:
        attempts.append(sum(len(records) for records in event["records"].values()))
        return relay(event, context)

    # (The topic keeps its publishers' CreateTime here, which `topics ensure` replaces by the broker's
    # LogAppendTime: the only way to have records two hours old without waiting two hours.)
    created = ConfigEntry("message.timestamp.type", "CreateTime", incremental_operation=AlterConfigOpType.SET)
    admin = AdminClient({"bootstrap.servers": broker.bootstrap_servers})
    resource = ConfigResource("topic", topic, incremental_configs=[created])
    for altered in admin.incremental_alter_configs([resource]).values():
        altered.result(30)
    _publish_bad_then_good(broker, topic, timestamp_ms=int(time.time() * 1000) - 2 * 3600 * 1000)
    parked: list[dict[str, Any]] = []
    source = _event_source(broker, topic, invoke, on_failure=parked.append, max_attempts=max_attempts)
    # When the event source delivers the batch
    source.start()
    try:
        wait_for(lambda: _queued(dev, dlq) == 2, timeout=60, what="both records dead-lettered")
    finally:
        source.stop()
    # Then its one invocation handled it (the partition moves on: nothing left to block it, nothing to lose when the
    # topic's retention ends), each record is one dead letter, and nothing was parked
    assert (max_attempts, attempts, parked) == (None, [2], [])
    letters = sorted(dead_letters(dev, dlq), key=lambda letter: int(letter["record"]["offset"]))
    assert [(letter["record"]["offset"], letter["reason"]["kind"]) for letter in letters] == [
        (0, "invalid-json"),
        (1, "retries-exhausted"),
    ]
    assert count_runs(dev.dynamodb(), dev.table_name, tenant) == []
    # When the API is back and the letters are redriven, as the runbook says
    for letter in letters:  # (read above: sent back for the redrive to find)
        dev.sqs().send_message(QueueUrl=dlq, MessageBody=json.dumps(letter))
    api_down()
    redrive = [
        str(POIMEN), "dlq", "redrive", "--yes", "--api-url", dev.url, "--queue-url", dlq,
        "--aws-endpoint", dev.aws_endpoint,
    ]  # fmt: skip
    done = subprocess.run(redrive, capture_output=True, text=True, timeout=120, check=False)
    # Then the given-up record is one run, and only the malformed one stays dead-lettered
    assert done.returncode in (0, 1), done.stdout + done.stderr
    runs = count_runs(dev.dynamodb(), dev.table_name, tenant)
    assert [run["run_id"]["S"] for run in runs] == [keyed_run_id(tenant, "once-1")]
    assert [letter["reason"]["kind"] for letter in dead_letters(dev, dlq)] == ["invalid-json"]


def _queued(dev: DevServer, queue_url: str) -> int:
    """The messages in a queue of the dev server's moto, none consumed."""
    attributes = dev.sqs().get_queue_attributes(QueueUrl=queue_url, AttributeNames=["ApproximateNumberOfMessages"])
    return int(attributes["Attributes"]["ApproximateNumberOfMessages"])
