"""`poimen dev --run-retention-days`: the table's TTL, the DLQ's retention and expired runs, over HTTP."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from confluent_kafka.admin import AdminClient, ConfigResource  # type: ignore[attr-defined]

from poimen.ids import keyed_run_id
from poimen.outbox import RunEvent, events_of_batch
from poimen.store import EXPIRES_AT, run_pk
from poimen_tools.local.stream_source import LocalStreamEventSource
from poimen_tools.local.template import Template
from poimen_tools.topics import check_dispatch_retention
from tests.conftest import count_runs
from tests.integration.conftest import DevServer, signed_session, start_dev, wait_for

DAY = 86_400


@pytest.fixture(scope="module")
def retained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevServer]:
    server = start_dev(tmp_path_factory.mktemp("retention"), "--run-retention-days", "3")
    yield server
    assert server.stop() == 0


def _post(session: requests.Session, dev: DevServer, tenant: str, body: object) -> requests.Response:
    return session.post(f"{dev.url}/v1/runs", json=body, headers={"X-Poimen-Tenant": tenant}, timeout=30)


def test_the_table_expires_runs_and_the_dead_letters_keep_no_longer(retained: DevServer) -> None:
    ttl = retained.dynamodb().describe_time_to_live(TableName=retained.table_name)["TimeToLiveDescription"]
    queue = retained.sqs().get_queue_attributes(QueueUrl=retained.dlq_url, AttributeNames=["MessageRetentionPeriod"])

    assert (ttl["TimeToLiveStatus"], ttl["AttributeName"]) == ("ENABLED", EXPIRES_AT)
    assert queue["Attributes"]["MessageRetentionPeriod"] == str(3 * DAY)


def _expire(dev: DevServer, tenant: str, dispatch_key: str) -> None:
    """Put the run past its TTL, as DynamoDB leaves it until it deletes it (lazily, maybe days later)."""
    dev.dynamodb().update_item(
        TableName=dev.table_name,
        Key={"pk": {"S": run_pk(tenant, keyed_run_id(tenant, dispatch_key))}},
        UpdateExpression="SET #e = :past",
        ExpressionAttributeNames={"#e": EXPIRES_AT},
        ExpressionAttributeValues={":past": {"N": str(int(time.time()) - 60)}},
    )


def test_an_expired_run_not_yet_deleted_is_404_and_its_key_admits_anew(retained: DevServer, tenant: str) -> None:
    http = signed_session()
    dynamodb = retained.dynamodb()
    # Given a keyed run admitted under retention: it carries its expiry
    first = _post(http, retained, tenant, {"workflow_ref": "wf", "input": {"n": 1}, "dispatch_key": "k-1"})
    (stored,) = count_runs(dynamodb, retained.table_name, tenant)
    assert first.status_code == 201
    assert int(stored[EXPIRES_AT]["N"]) > time.time() + 3 * DAY - 60
    # When it is past its expiry, and not deleted yet
    _expire(retained, tenant, "k-1")
    read = http.get(f"{retained.url}/v1/runs/{first.json()['run_id']}", headers={"X-Poimen-Tenant": tenant}, timeout=30)
    again = _post(http, retained, tenant, {"workflow_ref": "wf", "input": {"n": 2}, "dispatch_key": "k-1"})
    # Then it is not found, and its key admits a new run: the one run of the key
    assert read.status_code == 404
    assert again.status_code == 201
    assert again.json()["run_id"] == first.json()["run_id"]
    (stored,) = count_runs(dynamodb, retained.table_name, tenant)
    assert stored["created_at"] == {"S": again.json()["created_at"]}
    assert stored["input"] == {"S": '{"n":2}'}


def test_the_run_admitted_over_an_expired_one_reaches_the_outbox_from_the_stream(
    retained: DevServer, tenant: str, template: Template
) -> None:
    # Given a run admitted, expired (not deleted), and its key admitted again, over HTTP
    http = signed_session()
    first = _post(http, retained, tenant, {"workflow_ref": "wf", "input": {"n": 1}, "dispatch_key": "k-2"})
    _expire(retained, tenant, "k-2")
    again = _post(http, retained, tenant, {"workflow_ref": "wf", "input": {"n": 2}, "dispatch_key": "k-2"})
    assert (first.status_code, again.status_code) == (201, 201)
    # When the table's stream feeds the outbox's filter and decoding, as the event source mapping does
    published: list[RunEvent] = []
    names: list[str] = []
    lock = threading.Lock()

    def outbox(event: dict[str, Any], context: Any) -> None:
        ours = [r for r in event["Records"] if r["dynamodb"]["NewImage"].get("tenant_id") == {"S": tenant}]
        with lock:
            names.extend(r["eventName"] for r in ours)
            published.extend(events_of_batch({"Records": ours}, "local"))

    source = LocalStreamEventSource(
        retained.aws_endpoint,
        retained.table_name,
        outbox,
        on_failure=lambda record: None,
        filters=template.properties("OutboxRelaySource")["FilterCriteria"]["Filters"],
    )
    source.start()
    try:
        wait_for(lambda: len(published) >= 3, what="the stream's three writes of the run")
    finally:
        source.stop()
    # Then the first run was an INSERT, the new admission a MODIFY (the test's expiry another), and the new
    # admission's event is the new run, not the expired one
    assert names == ["INSERT", "MODIFY", "MODIFY"]
    assert published[0].created_at == first.json()["created_at"]
    assert published[-1].created_at == again.json()["created_at"]
    assert b'"n":2' in published[-1].value
    # And the two admissions are two CloudEvents (ids), the test's expiry an identical copy of the first
    assert published[1] == published[0]
    assert published[-1].event_id != published[0].event_id


def test_poimen_dev_creates_dispatch_topics_that_topics_ensure_accepts_for_its_retention(
    tmp_path: Path, tenant: str
) -> None:
    # Given `poimen dev --run-retention-days 1` with its own broker, serving a tenant
    dev = start_dev(tmp_path, "--run-retention-days", "1", kafka=True, tenants=[tenant])
    try:
        assert dev.kafka_bootstrap is not None
        admin = AdminClient({"bootstrap.servers": dev.kafka_bootstrap})
        # When it has started, which creates the tenant's topics
        topic = f"poimen.{tenant}.dispatch"
        assert topic in admin.list_topics(timeout=5).topics
        # Then its dispatch topic keeps records no longer than the runs (what poimen topics ensure
        # --run-retention-days 1 accepts), stamped by the broker
        (future,) = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, topic)]).values()
        config = {name: entry.value for name, entry in future.result(timeout=10).items()}
        check_dispatch_retention(int(config["retention.ms"]), 1)
        assert config["retention.ms"] == str(DAY * 1000)
        assert config["message.timestamp.type"] == "LogAppendTime"
    finally:
        assert dev.stop() == 0
