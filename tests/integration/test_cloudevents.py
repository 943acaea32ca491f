"""The outbox's events read by the CloudEvents SDK (python `cloudevents`, pinned in pyproject.toml; its Kafka
binding in binary content mode), off a real broker, each as the outbox module says that run's event is."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from cloudevents.core.bindings.kafka import KafkaMessage, from_binary
from cloudevents.core.formats.json import JSONFormat

from poimen.outbox import run_event
from poimen_tools.local.kafka_broker import KafkaBroker
from poimen_tools.local.stream_source import LOCAL_STACK
from tests.conftest import count_runs
from tests.integration.conftest import DevServer, signed_session, start_dev
from tests.integration.test_outbox import events

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture
def kafka_dev(tmp_path: Path, broker: KafkaBroker, tenant: str) -> Iterator[DevServer]:
    dev = start_dev(tmp_path, "--kafka-bootstrap", broker.bootstrap_servers, kafka=True, tenants=[tenant])
    yield dev
    assert dev.stop() == 0


def test_the_sdk_reads_each_event_as_the_outbox_builds_it(
    kafka_dev: DevServer, broker: KafkaBroker, tenant: str
) -> None:
    # Given runs admitted through the API (poimen dev created the tenant's topics): keyed (sent twice), keyless,
    # and one carrying a traceparent
    headers = {"X-Poimen-Tenant": tenant}
    spawns: list[tuple[dict[str, Any], dict[str, str]]] = [
        ({"workflow_ref": "wf/ce", "input": {"n": 1.10, "s": "é"}, "goal_id": "g-1", "dispatch_key": "ce-1"}, {}),
        ({"workflow_ref": "wf/ce", "input": {"n": 1.10, "s": "é"}, "goal_id": "g-1", "dispatch_key": "ce-1"}, {}),
        ({"workflow_ref": "wf/ce", "input": {}}, {"traceparent": TRACEPARENT}),
    ]
    with signed_session() as http:
        statuses = [
            http.post(f"{kafka_dev.url}/v1/runs", json=body, headers={**headers, **extra}, timeout=30).status_code
            for body, extra in spawns
        ]
    assert statuses == [201, 200, 201]
    stored = count_runs(kafka_dev.dynamodb(), kafka_dev.table_name, tenant)
    assert len(stored) == 2
    # And the event the outbox module computes for each stored run (its stream image is the stored item)
    expected = {built.key: built for built in (run_event(item, LOCAL_STACK) for item in stored)}

    # When the SDK reads what the outbox published
    records = events(broker.bootstrap_servers, tenant, expected=2)
    read = [
        (
            record,
            from_binary(
                KafkaMessage(headers=record["headers"], key=record["key"], value=record["value"]), JSONFormat()
            ),
        )
        for record in records
    ]

    # Then there is one event per run, and each is, attribute by attribute, the one the outbox builds
    assert sorted(record["key"] for record, _ in read) == sorted(expected)
    for record, event in read:
        built = expected[record["key"]]
        attributes = {name: value.decode() for name, value in built.headers if name.startswith("ce_")}
        assert event.get_specversion() == attributes["ce_specversion"] == "1.0"
        assert event.get_id() == attributes["ce_id"]
        assert event.get_source() == attributes["ce_source"]
        assert event.get_type() == attributes["ce_type"]
        assert event.get_subject() == attributes["ce_subject"]
        assert event.get_time() == datetime.fromisoformat(attributes["ce_time"])
        assert event.get_datacontenttype() == dict(built.headers)["content-type"].decode() == "application/json"
        assert event.get_data() == json.loads(built.value)
        # The binding reads the record key as the partitionkey extension, and nothing else as an extension: the
        # W3C traceparent travels as a plain Kafka header, as the outbox builds it
        assert event.get_extension("partitionkey") == built.key.decode()
        assert set(event.get_attributes()) == {name.removeprefix("ce_") for name in attributes} | {
            "datacontenttype",
            "partitionkey",
        }
        assert record["headers"].get("traceparent") == dict(built.headers).get("traceparent")
    assert [record["headers"].get("traceparent") for record, _ in read].count(TRACEPARENT.encode()) == 1
