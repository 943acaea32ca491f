"""infra/asyncapi.yaml: an AsyncAPI 3.0 document of both topics, whose limits are the API's and whose
event is what the outbox builds (the records themselves are checked in tests/integration/test_outbox.py)."""

from __future__ import annotations

import json
from typing import Any

from poimen.contract import json_text
from poimen.kafka import (
    CLUSTER_ALIAS_PATTERN,
    dispatch_topic,
    events_topic,
    partition_key,
    replicated_dispatch_topic,
)
from poimen.outbox import events_of_batch
from tests.asyncapi_contract import document, record_errors
from tests.conftest import REPO, load_event


def _openapi_schema(name: str) -> dict[str, Any]:
    schema: dict[str, Any] = json.loads((REPO / "infra" / "openapi.json").read_text())["components"]["schemas"][name]
    return schema


def test_it_is_asyncapi_3_with_both_topics_at_their_addresses() -> None:
    doc = document()

    assert doc["asyncapi"].startswith("3.0.")
    assert doc["channels"]["dispatch"]["address"] == dispatch_topic("acme").replace("acme", "{tenant}")
    assert doc["channels"]["events"]["address"] == events_topic("acme").replace("acme", "{tenant}")
    assert {op["action"] for op in doc["operations"].values()} == {"send", "receive"}


def test_the_replicated_dispatch_channel_carries_the_same_spawn_requests() -> None:
    doc = document()
    channel = doc["channels"]["replicatedDispatch"]

    assert channel["address"] == replicated_dispatch_topic("west", "acme").replace("west", "{alias}").replace(
        "acme", "{tenant}"
    )
    assert channel["messages"] == doc["channels"]["dispatch"]["messages"]
    assert doc["components"]["parameters"]["alias"]["description"].endswith(CLUSTER_ALIAS_PATTERN)
    (operation,) = [op for op in doc["operations"].values() if op["channel"]["$ref"] == "#/channels/replicatedDispatch"]
    assert operation["action"] == "receive"


def test_the_dispatch_message_has_the_api_limits() -> None:
    assert document()["components"]["schemas"]["RunRequest"] == _openapi_schema("RunRequest")


def test_the_event_payload_names_every_member_of_the_api_run() -> None:
    run = document()["components"]["schemas"]["Run"]
    answered = _openapi_schema("Run")

    assert set(run["properties"]) == set(answered["properties"])
    assert run["required"] == answered["required"]


def test_the_outbox_event_of_the_canonical_insert_is_valid() -> None:
    (event,) = events_of_batch(load_event("dynamodb_stream_insert.json"), "prod")

    assert record_errors("runAdmitted", event.key, dict(event.headers), event.value) == []


def test_a_malformed_event_is_refused() -> None:
    (event,) = events_of_batch(load_event("dynamodb_stream_insert.json"), "prod")
    headers = {**dict(event.headers), "ce_type": b"something.else"}

    errors = record_errors("runAdmitted", b"acme/not-a-run-id", headers, b'{"run_id": "x"}')

    assert any(e.startswith("key:") for e in errors)
    assert any(e.startswith("headers:") for e in errors)
    assert any(e.startswith("value:") for e in errors)


def test_a_published_spawn_request_value_is_valid() -> None:
    body = {"workflow_ref": "wf/hello", "input": {"n": 1}, "goal_id": None, "dispatch_key": "k-1"}

    assert (
        record_errors(
            "spawnRequest", partition_key("acme", "28f956d5-cb15-83b0-bfc9-6c1d99e2e4ae"), {}, json_text(body).encode()
        )
        == []
    )
