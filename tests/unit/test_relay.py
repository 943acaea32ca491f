"""The relay's pure parts: topics, ordering, dead-letter format, signing, settings, and no bypass."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from typing import Any

import pytest
from aws_lambda_powertools.utilities.data_classes import KafkaEvent
from botocore.credentials import Credentials

from poimen.config import ConfigurationError, RelaySettings
from poimen.kafka import dispatch_topic, tenant_of_dispatch_topic
from poimen.relay import DeadLetterReason, Relay, _ordered_groups, dead_letter_message
from poimen_tools.local.msk import KafkaRecord, msk_event
from poimen_tools.local.template import Template
from tests.conftest import load_event

SETTINGS = RelaySettings(admission_api_url="https://api.example", dlq_url="https://sqs/dlq", region="us-east-1")


def test_built_events_have_the_shape_of_the_canonical_msk_event() -> None:
    canonical = load_event("msk_dispatch.json")
    (original,) = canonical["records"]["poimen.acme.dispatch-0"]
    record = KafkaRecord(
        topic=original["topic"],
        partition=original["partition"],
        offset=original["offset"],
        timestamp_ms=original["timestamp"],
        key=base64.b64decode(original["key"]),
        value=base64.b64decode(original["value"]),
        headers=[("traceparent", bytes(original["headers"][0]["traceparent"]))],
    )

    built = msk_event([record], canonical["bootstrapServers"], canonical["eventSourceArn"])

    assert built == canonical


def test_null_keys_are_left_out_and_tombstones_are_null() -> None:
    event = msk_event([KafkaRecord(topic="poimen.t.dispatch", partition=1, offset=7, timestamp_ms=0, value=None)])

    (record,) = event["records"]["poimen.t.dispatch-1"]
    assert "key" not in record
    assert record["value"] is None


@pytest.mark.parametrize(
    ("topic", "tenant"),
    [
        ("poimen.acme.dispatch", "acme"),
        ("poimen.a-1.dispatch", "a-1"),
        ("poimen.Acme.dispatch", None),
        ("poimen.acme.events", None),
        ("poimen..dispatch", None),
        ("poimen.a.b.dispatch", None),
        ("other.acme.dispatch", None),
        (f"poimen.{'a' * 64}.dispatch", None),
    ],
)
def test_tenant_comes_from_the_dispatch_topic_name(topic: str, tenant: str | None) -> None:
    assert tenant_of_dispatch_topic(topic) == tenant
    if tenant is not None:
        assert dispatch_topic(tenant) == topic


def test_records_sharing_a_key_form_one_group_in_offset_order() -> None:
    def record(offset: int, key: bytes | None, topic: str = "poimen.t.dispatch") -> KafkaRecord:
        return KafkaRecord(topic=topic, partition=0, offset=offset, timestamp_ms=0, value=b"{}", key=key)

    event = KafkaEvent(msk_event([record(3, b"a"), record(1, b"a"), record(2, b"b"), record(4, None), record(5, None)]))

    groups = [[(r.key, r.offset) for r in group] for group in _ordered_groups(event.records)]

    a, b = base64.b64encode(b"a").decode(), base64.b64encode(b"b").decode()
    assert sorted(groups, key=str) == sorted([[(a, 1), (a, 3)], [(b, 2)], [(None, 4)], [(None, 5)]], key=str)


def test_dead_letter_keeps_the_record_as_delivered_and_the_reason() -> None:
    event = KafkaEvent(load_event("msk_dispatch.json"))
    record = next(event.records)
    reason = DeadLetterReason("rejected", "the admission API answered 400", 400, {"type": "urn:x"})

    letter = dead_letter_message(record, reason)
    without_value = dead_letter_message(record, reason, keep_value=False)

    assert letter["record"]["value"] == record.value
    assert letter["record"]["key"] == record.key
    assert letter["record"]["headers"] == record.headers
    assert letter["reason"] == {
        "kind": "rejected",
        "detail": reason.detail,
        "status": 400,
        "problem": {"type": "urn:x"},
    }
    assert without_value["record"]["value"] is None
    assert without_value["record"]["valueOmitted"]["base64Length"] == len(record.value)
    assert len(without_value["record"]["valueSha256"]) == 64
    json.dumps(letter)


def test_requests_are_signed_for_execute_api() -> None:
    relay = Relay(SETTINGS, sqs=object(), credentials=Credentials("AKIDEXAMPLE", "secret", "token"))

    headers = relay._signed({"Content-Type": "application/json", "X-Poimen-Tenant": "acme"}, b"{}")

    assert headers["Authorization"].startswith("AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/")
    assert "/us-east-1/execute-api/aws4_request" in headers["Authorization"]
    assert "x-poimen-tenant" in headers["Authorization"]  # the tenant header is covered by the signature
    assert headers["X-Amz-Security-Token"] == "token"


def test_relay_settings_are_validated() -> None:
    env = {"ADMISSION_API_URL": "https://api.example/", "DLQ_URL": "q", "AWS_REGION": "eu-west-1"}

    assert RelaySettings.from_env(env).admission_api_url == "https://api.example"
    for broken in ({**env, "ADMISSION_API_URL": "api"}, {**env, "DLQ_URL": ""}, {**env, "RELAY_MAX_CONCURRENCY": "0"}):
        with pytest.raises(ConfigurationError):
            RelaySettings.from_env(broken)


def test_the_relay_never_imports_the_store_or_admission() -> None:
    code = "import sys, poimen.relay; print(sorted(m for m in sys.modules if m.startswith('poimen')))"
    loaded = json.loads(
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        .stdout.strip()
        .replace("'", '"')
    )

    assert "poimen.relay" in loaded
    assert not {"poimen.store", "poimen.admission", "poimen.api"} & set(loaded)


@pytest.mark.parametrize("module", ["poimen.relay", "poimen.api"])
def test_the_functions_do_not_load_the_kafka_client(module: str) -> None:
    # confluent-kafka is for publishers and tools; the Lambda functions would only pay its cold start.
    code = f"import sys, {module}; print('confluent_kafka' in sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout

    assert loaded.strip() == "False"


def test_the_relay_role_cannot_touch_dynamodb(template: Template) -> None:
    statements = [
        statement
        for policy in template.properties("InboxRelayFunction")["Policies"]
        for statement in policy["Statement"]
    ]
    actions = [action for statement in statements for action in _as_list(statement["Action"])]

    assert actions
    assert not [action for action in actions if action.lower().startswith("dynamodb:") or action == "*"]
    invoke = next(s for s in statements if "execute-api:Invoke" in _as_list(s["Action"]))
    assert invoke["Resource"]["Fn::Sub"].endswith("/*/POST/v1/runs")


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]
