"""The relay: topics, ordering, dead-letter format, signing, settings, no bypass; and whole batches
in-process (tests/unit/relay_harness.py) where no record may stall the batch."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import pytest
import urllib3
from aws_lambda_powertools.utilities.data_classes import KafkaEvent
from botocore.credentials import Credentials
from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

from poimen import relay as relay_module
from poimen.api import MAX_PROBLEM_ERRORS
from poimen.config import ConfigurationError, RelaySettings
from poimen.dead_letter import (
    MAX_DEAD_LETTER_BYTES,
    DeadLetterReason,
    age_text,
    dead_letter_attributes,
    dead_letter_body,
    dead_letter_message,
)
from poimen.kafka import dispatch_topic, tenant_of_dispatch_topic
from poimen.relay import (
    AdmissionApiRefused,
    AdmissionApiUnavailable,
    BatchOutcome,
    DeadLetterQueueUnavailable,
    Relay,
    _ordered_groups,
)
from poimen.retention import RunRetention
from poimen.store import Store
from poimen.wire import rfc3339
from poimen_tools.local.devserver import LocalLambdaContext
from poimen_tools.local.msk import KafkaRecord, msk_event
from poimen_tools.local.template import Template
from tests.conftest import count_runs, load_event
from tests.unit.relay_harness import RELAY_KEY, RelayHarness, sqs_message_size

SETTINGS = RelaySettings(admission_api_url="https://api.example", dlq_url="https://sqs/dlq", region="us-east-1")
SPAWN = {"workflow_ref": "wf/hello", "input": {"greeting": "hi"}, "goal_id": None}
TRACEPARENT = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def harness(template: Template, handler: Callable[[dict[str, Any], Any], dict[str, Any]], store: Store) -> RelayHarness:
    return RelayHarness.start(template, handler, store)


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

    letter = dead_letter_message(record, reason, RunRetention())

    assert letter["record"]["value"] == record.value
    assert letter["record"]["key"] == record.key
    assert letter["record"]["headers"] == record.headers
    assert letter["reason"] == {
        "kind": "rejected",
        "detail": reason.detail,
        "status": 400,
        "problem": {"type": "urn:x"},
    }
    assert json.loads(dead_letter_body(record, reason, RunRetention()))["record"] == letter["record"]


@pytest.mark.parametrize(
    ("sizes", "omitted"),
    [
        ({"value": 1024 * 1024}, ["value"]),
        ({"header": 300 * 1024}, ["headers"]),  # headers are lists of integers: ~4 bytes a byte
        ({"value": 1024 * 1024, "header": 300 * 1024, "key": 800 * 1024}, ["value", "headers", "key"]),
        ({"problem": 2 * 1024 * 1024}, ["problem"]),
        ({"value": 600 * 1024, "problem": 600 * 1024}, ["problem"]),
        ({"value": 600 * 1024, "key": 600 * 1024}, ["key"]),
        ({"key": 600 * 1024, "header": 200 * 1024}, ["headers"]),
        ({"value": 760 * 1024, "problem": 2 * 1024 * 1024, "header": 300 * 1024}, ["headers", "problem"]),
    ],
)
def test_a_dead_letter_leaves_out_what_makes_it_fit_keeping_value_then_key_then_headers_then_problem(
    sizes: dict[str, int], omitted: list[str]
) -> None:
    # Given a record (and an API answer) with parts of these sizes
    record = KafkaRecord(
        topic="poimen.acme.dispatch",
        partition=3,
        offset=42,
        timestamp_ms=1795780800000,
        value=b"v" * sizes.get("value", 10),
        key=b"k" * sizes.get("key", 10),
        headers=[("traceparent", TRACEPARENT), ("blob", b"\xff" * sizes.get("header", 10))],
    )
    delivered = next(KafkaEvent(msk_event([record])).records)
    reason = DeadLetterReason("rejected", "the admission API answered 413", 413, "x" * sizes.get("problem", 10))
    # When its dead letter is made
    body = dead_letter_body(delivered, reason, RunRetention())
    # Then it fits SQS beside its attributes, keeps the coordinates, and names each part left out by its
    # length and SHA-256
    assert sqs_message_size(body, dead_letter_attributes(delivered)) <= MAX_DEAD_LETTER_BYTES
    letter = json.loads(body)
    original = letter["record"]
    assert (original["topic"], original["partition"], original["offset"]) == ("poimen.acme.dispatch", 3, 42)
    assert (letter["reason"]["kind"], letter["reason"]["status"]) == ("rejected", 413)
    parts = {
        "value": (original, delivered.value),
        "headers": (original, json.dumps(delivered.headers, separators=(",", ":"))),
        "key": (original, delivered.key),
        "problem": (letter["reason"], reason.problem),
    }
    for name, (section, text) in parts.items():
        if name in omitted:
            assert section[name] is None
            assert section[f"{name}Omitted"] == {"reason": "too large for SQS", "length": len(text)}
            assert section[f"{name}Sha256"] == hashlib.sha256(text.encode()).hexdigest()
        else:
            assert f"{name}Omitted" not in section
            assert section[name] is not None


def test_a_value_that_fits_stays_when_the_apis_answer_is_what_is_too_large() -> None:
    # Given a 234 KB spawn with 18,000 unknown top-level fields, and an answer listing each (about 1.9 MB)
    spawn = {**SPAWN, **{f"x{i:05d}": 0 for i in range(18_000)}}
    record = KafkaRecord(
        topic="poimen.acme.dispatch", partition=0, offset=7, timestamp_ms=0, value=json.dumps(spawn).encode()
    )
    delivered = next(KafkaEvent(msk_event([record])).records)
    errors = [
        {"field": f"body.x{i:05d}", "type": "extra_forbidden", "message": "Extra inputs are not permitted"}
        for i in range(18_000)
    ]
    problem = {"type": "urn:poimen:problem:validation-error", "title": "Bad Request", "status": 400, "errors": errors}
    # When its dead letter is made
    letter = json.loads(
        dead_letter_body(delivered, DeadLetterReason("rejected", "answered 400", 400, problem), RunRetention())
    )
    # Then the value is kept whole and only the answer is left out
    assert base64.b64decode(letter["record"]["value"]) == record.value
    assert letter["reason"]["problem"] is None
    assert letter["reason"]["problemOmitted"]["length"] > MAX_DEAD_LETTER_BYTES
    assert "valueOmitted" not in letter["record"]


def test_a_record_with_18000_unknown_fields_is_one_dead_letter_holding_its_value(harness: RelayHarness) -> None:
    # Given a 234 KB spawn with 18,000 unknown top-level fields: each one a validation error of the API
    record = harness.record({**SPAWN, **{f"x{i:05d}": 0 for i in range(18_000)}}, 0)
    # When it is relayed
    outcome = harness.run([record])
    # Then its one dead letter holds the value whole and the API's bounded answer, which counts them all
    ((size, letter),) = harness.dead_letters()
    assert size <= MAX_DEAD_LETTER_BYTES
    assert base64.b64decode(letter["record"]["value"]) == record.value
    problem = letter["reason"]["problem"]
    assert (letter["reason"]["status"], problem["type"]) == (400, "urn:poimen:problem:validation-error")
    assert problem["errors_total"] == 18_000
    assert len(problem["errors"]) == MAX_PROBLEM_ERRORS
    assert outcome.dead_lettered == 1


def test_every_dead_letter_carries_its_coordinates_as_message_attributes(harness: RelayHarness) -> None:
    # Given two malformed records of one partition
    records = [harness.record(b"{not json", 5, key=b"a"), harness.record(None, 6, key=b"b")]
    # When they are relayed
    harness.run(records)
    # Then each letter's attributes name its topic, partition and offset, as its body does
    messages = harness.dead_letter_messages()
    assert len(messages) == 2
    for message in messages:
        body = json.loads(message["Body"])["record"]
        attributes = {name: value["StringValue"] for name, value in message["MessageAttributes"].items()}
        assert attributes == {
            "topic": body["topic"],
            "partition": str(body["partition"]),
            "offset": str(body["offset"]),
        }
        assert message["MessageAttributes"]["offset"]["DataType"] == "Number"
    assert sorted(int(m["MessageAttributes"]["offset"]["StringValue"]) for m in messages) == [5, 6]


class DownApi:
    """The relay's HTTP pool while the API is down: every request fails to connect."""

    def __init__(self) -> None:
        self.attempts = 0

    def request(self, *_: Any, **__: Any) -> Any:
        self.attempts += 1
        raise urllib3.exceptions.NewConnectionError(None, "connection refused")  # type: ignore[arg-type]


def test_a_batch_failing_for_an_outage_dead_letters_nothing_and_its_completing_retry_once(
    harness: RelayHarness, dynamodb: Any, table_name: str
) -> None:
    # Given a batch of a malformed record and a valid one, and the API down
    records = [
        harness.record(b"{not json", 0, key=b"bad"),
        harness.record({**SPAWN, "dispatch_key": "d-1"}, 1, key=b"ok"),
    ]
    up = harness.relay._http
    down = DownApi()
    harness.relay._http = down  # type: ignore[assignment]
    # When the event source tries the batch twice during the outage
    for _ in range(2):
        with pytest.raises(AdmissionApiUnavailable):
            harness.run(records, seconds=5)
    # Then nothing was dead-lettered, although the malformed record was seen each time
    assert down.attempts >= 2
    assert harness.dead_letters() == []
    # When the API is back and the batch is tried a third time
    harness.relay._http = up
    outcome = harness.run(records)
    # Then the malformed record is exactly one dead letter, and the valid one one run
    (letter,) = [letter for _, letter in harness.dead_letters()]
    assert (letter["record"]["offset"], letter["reason"]["kind"]) == (0, "invalid-json")
    assert (outcome.relayed, outcome.dead_lettered) == (1, 1)
    assert len(count_runs(dynamodb, table_name, harness.tenant)) == 1


@pytest.mark.parametrize("batch_spawns", [1, 100])
@pytest.mark.parametrize("headers", [[{"traceparent": None}], [{"x-empty": None}, {"traceparent": list(TRACEPARENT)}]])
def test_a_header_with_a_null_value_is_absent_not_a_fault(
    harness: RelayHarness, headers: list[dict[str, Any]], batch_spawns: int
) -> None:
    # Given a valid record whose headers hold a null value, as Kafka allows (a header without a value)
    harness = harness.with_settings(batch_spawns=batch_spawns)
    event = msk_event([harness.record({**SPAWN, "dispatch_key": "null-header"}, 0)])
    (partition,) = event["records"].values()
    partition[0]["headers"] = headers
    # When it is relayed
    outcome = harness.run_event(event)
    # Then it is admitted, not dead-lettered; a null traceparent is none, a valid one beside a null header is forwarded
    assert (outcome.relayed, outcome.dead_lettered) == (1, 0)
    assert harness.dead_letters() == []
    forwarded = any("traceparent" in header and header["traceparent"] for header in headers)
    assert harness.api.forwarded == [TRACEPARENT.decode() if forwarded else None]


def test_requests_are_signed_for_execute_api() -> None:
    relay = Relay(SETTINGS, sqs=object(), credentials=Credentials("AKIDEXAMPLE", "secret", "token"))

    headers = relay._signed({"Content-Type": "application/json", "X-Poimen-Tenant": "acme"}, b"{}")

    assert headers["Authorization"].startswith("AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/")
    assert "/us-east-1/execute-api/aws4_request" in headers["Authorization"]
    assert "x-poimen-tenant" in headers["Authorization"]  # the tenant header is covered by the signature
    assert headers["X-Amz-Security-Token"] == "token"


def test_credentials_that_cannot_be_refreshed_fail_the_batch_not_the_record() -> None:
    class Expired:
        def get_frozen_credentials(self) -> Any:
            raise NoCredentialsError()

    relay = Relay(SETTINGS, sqs=object(), credentials=Expired())

    with pytest.raises(AdmissionApiRefused, match="no credentials"):
        relay._signed({"Content-Type": "application/json"}, b"{}")


def test_relay_settings_are_validated() -> None:
    env = {"ADMISSION_API_URL": "https://api.example/", "DLQ_URL": "q", "AWS_REGION": "eu-west-1"}
    timeouts = {"RELAY_HTTP_CONNECT_TIMEOUT_SECONDS": "0.5", "RELAY_DLQ_TIMEOUT_SECONDS": "0.25"}

    assert RelaySettings.from_env(env).admission_api_url == "https://api.example"
    tuned = RelaySettings.from_env({**env, **timeouts})
    assert (tuned.http_connect_timeout_seconds, tuned.dlq_timeout_seconds) == (0.5, 0.25)
    for broken in (
        {**env, "ADMISSION_API_URL": "api"},
        {**env, "DLQ_URL": ""},
        {**env, "RELAY_MAX_CONCURRENCY": "0"},
        {**env, "RELAY_HTTP_CONNECT_TIMEOUT_SECONDS": "0"},
        {**env, "RELAY_DLQ_TIMEOUT_SECONDS": "-1"},
    ):
        with pytest.raises(ConfigurationError):
            RelaySettings.from_env(broken)


def test_the_relay_never_imports_the_store_or_admission() -> None:
    code = "import sys, poimen.relay; print(sorted(m for m in sys.modules if m.startswith('poimen')))"
    loaded = json.loads(
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        .stdout.strip()
        .replace("'", '"')
    )

    # Only the HTTP contract's names, Kafka naming, its settings, the run retention rule, the record rule and
    # the dead letter it shares with poimen dlq, its bounded AWS session, and observability: never the store,
    # admission or the API
    allowed = {"poimen", "poimen.relay", "poimen.wire", "poimen.kafka", "poimen.config", "poimen.principals"}
    allowed |= {"poimen.retention", "poimen.inbox_rule", "poimen.dead_letter", "poimen.observability"}
    allowed.add("poimen.aws_session")
    assert "poimen.relay" in loaded
    assert set(loaded) <= allowed
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
    invoke_policy = template.resources["RelayInvokeAdmissionApi"]["Properties"]
    (invoke,) = invoke_policy["PolicyDocument"]["Statement"]
    assert invoke_policy["Roles"] == [{"Ref": "InboxRelayFunctionRole"}]
    assert invoke["Action"] == "execute-api:Invoke"
    assert invoke["Resource"]["Fn::Sub"].endswith("/*/POST/v1/runs")


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


@pytest.mark.parametrize(
    ("value", "forwarded"),
    [
        (TRACEPARENT, True),
        (TRACEPARENT + b"\r\nX-Injected: 1", False),
        (TRACEPARENT + b"\n", False),
        (TRACEPARENT.upper(), False),
        (b"00-" + b"0" * 32 + b"-b7ad6b7169203331-01", False),
        (b"00-0af7651916cd43dd8448eb211c80319c-" + b"0" * 16 + b"-01", False),
        (b"ff" + TRACEPARENT[2:], False),
        (TRACEPARENT[:-3], False),
        (TRACEPARENT[:-1] + "\u00b9".encode(), False),
        (b"", False),
    ],
)
@pytest.mark.parametrize("batch_spawns", [1, 100])
def test_only_a_well_formed_w3c_traceparent_is_forwarded(
    harness: RelayHarness, value: bytes, forwarded: bool, batch_spawns: int
) -> None:
    harness = harness.with_settings(batch_spawns=batch_spawns)
    harness.run([harness.record(SPAWN, 0, headers=[("traceparent", value)])])

    assert harness.api.forwarded == [value.decode() if forwarded else None]
    assert harness.dead_letters() == []


@pytest.mark.parametrize("batch_spawns", [1, 100])
def test_a_traceparent_with_cr_lf_stalls_no_record(harness: RelayHarness, store: Store, batch_spawns: int) -> None:
    # Given 21 records over 20 Kafka keys, the first of the shared key with a CR/LF in its traceparent
    harness = harness.with_settings(batch_spawns=batch_spawns)
    records = [harness.record({**SPAWN, "dispatch_key": f"d-{i}"}, i, key=f"k{min(i, 19)}".encode()) for i in range(21)]
    records[19] = harness.record(
        {**SPAWN, "dispatch_key": "d-19"}, 19, key=b"k19", headers=[("traceparent", TRACEPARENT + b"\r\nX: 1")]
    )
    # When the batch is relayed
    outcome = harness.run(records)
    # Then every record was posted and admitted, the bad header left behind, and nothing dead-lettered
    assert (outcome.relayed, outcome.dead_lettered) == (21, 0)
    # one call a record, or one for the partition's batch
    assert len(harness.api.received) == (21 if batch_spawns == 1 else 1)
    assert harness.api.forwarded == [None] * 21
    assert harness.dead_letters() == []


@pytest.mark.parametrize("header", [[256], "not a list of bytes", [None]])
def test_an_unforeseen_fault_of_a_record_is_its_dead_letter(harness: RelayHarness, header: Any) -> None:
    # Given a batch whose second record carries a header no Kafka client could have produced
    records = [harness.record({**SPAWN, "dispatch_key": f"d-{i}"}, i, key=f"k{i}".encode()) for i in range(3)]
    event = msk_event(records)
    (partition,) = event["records"].values()
    partition[1]["headers"] = [{"traceparent": header}]
    # When it is relayed
    outcome = harness.run_event(event)
    # Then that record is a relay-error dead letter naming the exception, and the others are admitted
    (letter,) = [letter for _, letter in harness.dead_letters()]
    assert letter["record"]["offset"] == 1
    assert letter["reason"]["kind"] == "relay-error"
    assert letter["reason"]["detail"].startswith(("ValueError: ", "TypeError: "))
    assert (outcome.relayed, outcome.dead_lettered) == (2, 1)


def test_a_300_kb_header_makes_a_dead_letter_that_fits(harness: RelayHarness) -> None:
    # Given a malformed record with a 300 KB header, and a valid record under the same key after it
    big = harness.record(b"{not json", 0, key=b"k", headers=[("blob", b"\xff" * 300 * 1024)])
    records = [big, harness.record({**SPAWN, "dispatch_key": "after"}, 1, key=b"k")]
    # When the batch is relayed to a queue of the template's maximum message size
    outcome = harness.run(records)
    # Then the dead letter fits, without the headers but with their digest, the value and the coordinates
    ((size, letter),) = harness.dead_letters()
    assert size <= MAX_DEAD_LETTER_BYTES
    assert (letter["record"]["offset"], letter["reason"]["kind"]) == (0, "invalid-json")
    assert base64.b64decode(letter["record"]["value"]) == b"{not json"
    assert letter["record"]["headers"] is None
    assert len(letter["record"]["headersSha256"]) == 64
    assert letter["record"]["key"] == base64.b64encode(b"k").decode()
    assert (outcome.relayed, outcome.dead_lettered) == (1, 1)


def test_max_dead_letter_size_is_the_queue_maximum(template: Template) -> None:
    assert template.properties("RelayDeadLetterQueue")["MaximumMessageSize"] == MAX_DEAD_LETTER_BYTES


class UnreachableQueue:
    """An SQS client whose every SendMessage fails as given."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.attempts = 0

    def send_message(self, **_: Any) -> None:
        self.attempts += 1
        raise self.error


def test_an_unreachable_dlq_fails_the_batch_before_the_deadline(
    template: Template, handler: Callable[[dict[str, Any], Any], dict[str, Any]], store: Store
) -> None:
    # Given a dead-letter queue that cannot be reached, and 5 s left (2 s of margin, 1 s + 1 s per attempt)
    queue = UnreachableQueue(EndpointConnectionError(endpoint_url="https://sqs.invalid"))
    harness = RelayHarness.start(template, handler, store, sqs=queue)
    started = time.monotonic()
    # When a record must be dead-lettered
    with pytest.raises(DeadLetterQueueUnavailable, match="EndpointConnectionError"):
        harness.run([harness.record(b"{not json", 0)], seconds=5)
    # Then it was retried while an attempt still fitted before the deadline, and the batch failed
    assert queue.attempts > 1
    assert time.monotonic() - started < 3


def test_a_dlq_backoff_never_waits_past_the_last_attempt_that_fits(
    template: Template,
    handler: Callable[[dict[str, Any], Any], dict[str, Any]],
    store: Store,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given an unreachable dead-letter queue, 5 s left (3 s to the batch's deadline, an attempt 2 s), and
    # every backoff drawing the cap, RELAY_RETRY_CAP_SECONDS (5 s: longer than the time left)
    monkeypatch.setattr(Relay, "_jitter", lambda self, _attempt: self._settings.retry_cap_seconds)
    queue = UnreachableQueue(EndpointConnectionError(endpoint_url="https://sqs.invalid"))
    harness = RelayHarness.start(template, handler, store, sqs=queue)
    started = time.monotonic()
    # When a record must be dead-lettered
    with pytest.raises(DeadLetterQueueUnavailable, match="EndpointConnectionError"):
        harness.run([harness.record(b"{not json", 0)], seconds=5)
    # Then the batch failed at once, before its deadline: a wait that leaves no time for another attempt is
    # not waited
    assert queue.attempts == 1
    assert time.monotonic() - started < 3


def test_a_dlq_refusing_the_relay_fails_the_batch_at_once(
    template: Template, handler: Callable[[dict[str, Any], Any], dict[str, Any]], store: Store
) -> None:
    answer: Any = {"Error": {"Code": "AccessDenied", "Message": "no"}, "ResponseMetadata": {"HTTPStatusCode": 403}}
    refusal = ClientError(answer, "SendMessage")
    queue = UnreachableQueue(refusal)
    harness = RelayHarness.start(template, handler, store, sqs=queue)

    with pytest.raises(DeadLetterQueueUnavailable, match="AccessDenied"):
        harness.run([harness.record(None, 0)])

    assert queue.attempts == 1


DAY_MS = 86_400_000


@pytest.fixture
def retaining_harness(
    template: Template, handler: Callable[[dict[str, Any], Any], dict[str, Any]], store: Store
) -> RelayHarness:
    """A relay whose runs are kept 3 days (RUN_RETENTION_DAYS=3)."""
    return RelayHarness.start(template, handler, store, run_retention_days=3)


def test_a_record_older_than_the_run_retention_is_dead_lettered_as_expired_not_admitted(
    retaining_harness: RelayHarness, dynamodb: Any, table_name: str
) -> None:
    harness = retaining_harness
    now_ms = int(time.time() * 1000)
    # Given a record published 4 days 2 hours ago, past a run retention of 3 days, and a fresh one
    old = harness.record({**SPAWN, "dispatch_key": "old"}, 0, key=b"old", timestamp_ms=now_ms - 4 * DAY_MS - 7_200_000)
    fresh = harness.record({**SPAWN, "dispatch_key": "fresh"}, 1, key=b"fresh", timestamp_ms=now_ms - 2 * DAY_MS)
    # When they are relayed
    outcome = harness.run([old, fresh])
    # Then only the fresh one is a run, and the old one is one dead letter naming its age and the retention
    runs = count_runs(dynamodb, table_name, harness.tenant)
    assert [run["dispatch_key"]["S"] for run in runs] == ["fresh"]
    ((_, letter),) = harness.dead_letters()
    assert letter["record"]["offset"] == 0
    assert letter["reason"] == {
        "kind": "expired",
        "detail": "the record is 4 days 2 h old, older than the run retention of 3 days: its run may have "
        "expired, and admitting it again would be a second run",
        "status": None,
        "problem": None,
    }
    assert (outcome.relayed, outcome.dead_lettered) == (1, 1)


def test_a_record_without_a_timestamp_is_admitted_whatever_the_run_retention(
    retaining_harness: RelayHarness, dynamodb: Any, table_name: str
) -> None:
    # Given a record without a timestamp (-1), with a run retention of 3 days
    record = retaining_harness.record({**SPAWN, "dispatch_key": "k"}, 0, timestamp_ms=-1)
    # When it is relayed
    outcome = retaining_harness.run([record])
    # Then it is a run, as without retention
    assert len(count_runs(dynamodb, table_name, retaining_harness.tenant)) == 1
    assert retaining_harness.dead_letters() == []
    assert outcome.relayed == 1


def test_a_record_of_timestamp_0_is_from_1970_not_one_without_a_timestamp(
    retaining_harness: RelayHarness, dynamodb: Any, table_name: str
) -> None:
    # Given, with runs kept 3 days, a record whose producer set its CreateTime to 0 (a clock never set; Kafka's
    # "no timestamp" is -1 alone), and one without a timestamp
    zero = retaining_harness.record({**SPAWN, "dispatch_key": "zero"}, 0, key=b"a", timestamp_ms=0)
    none = retaining_harness.record({**SPAWN, "dispatch_key": "none"}, 1, key=b"b", timestamp_ms=-1)
    # When they are relayed
    retaining_harness.run([zero, none])
    # Then the record of 1970 is older than the retention, a dead letter `expired`, not a run admitted whatever
    # its age; the one without a timestamp is admitted, as always
    runs = count_runs(dynamodb, table_name, retaining_harness.tenant)
    assert [run["dispatch_key"]["S"] for run in runs] == ["none"]
    ((_, letter),) = retaining_harness.dead_letters()
    assert (letter["record"]["timestamp"], letter["reason"]["kind"]) == (0, "expired")


def test_a_record_from_the_future_is_dead_lettered_not_trusted_under_a_run_retention(
    retaining_harness: RelayHarness, harness: RelayHarness, dynamodb: Any, table_name: str
) -> None:
    # Given a publisher whose clock is 50 minutes fast, and one a minute fast, runs kept 3 days
    now_ms = int(time.time() * 1000)
    ahead_ms = 50 * 60_000 + 30_000  # 50 minutes and a half: still 50 minutes ahead when it is relayed
    fast = retaining_harness.record({**SPAWN, "dispatch_key": "fast"}, 0, key=b"a", timestamp_ms=now_ms + ahead_ms)
    skewed = retaining_harness.record({**SPAWN, "dispatch_key": "skew"}, 1, key=b"b", timestamp_ms=now_ms + 60_000)
    # When their records are relayed
    retaining_harness.run([fast, skewed])
    # Then the record 50 minutes ahead is a dead letter of its own reason, not a run (its age cannot be told:
    # trusted, it could admit a spawn again past its run's expiry); a minute ahead is within the skew allowed
    runs = count_runs(dynamodb, table_name, retaining_harness.tenant)
    assert [run["dispatch_key"]["S"] for run in runs] == ["skew"]
    ((_, letter),) = retaining_harness.dead_letters()
    assert (letter["record"]["offset"], letter["reason"]["kind"]) == (0, "future-timestamp")
    assert "50 min ahead of the relay's clock" in letter["reason"]["detail"]
    # And without a run retention no age is told, so the future record is admitted
    harness.run([harness.record({**SPAWN, "dispatch_key": "fast"}, 0, timestamp_ms=now_ms + 50 * 60_000)])
    runs = count_runs(dynamodb, table_name, harness.tenant)  # the two harnesses serve the one tenant
    assert sorted(run["dispatch_key"]["S"] for run in runs) == ["fast", "skew"]


def test_without_a_run_retention_an_old_record_is_admitted(
    harness: RelayHarness, dynamodb: Any, table_name: str
) -> None:
    # Given a record a year old, and runs kept forever
    old = harness.record({**SPAWN, "dispatch_key": "k"}, 0, timestamp_ms=int(time.time() * 1000) - 365 * DAY_MS)
    # When it is relayed
    harness.run([old])
    # Then it is a run
    assert len(count_runs(dynamodb, table_name, harness.tenant)) == 1
    assert harness.dead_letters() == []


@pytest.mark.parametrize(("changed_days_ago", "admitted"), [(1 / 24, False), (3, True)])
def test_after_a_raise_of_the_run_retention_a_record_from_before_it_is_held_to_the_shorter(
    harness: RelayHarness, template: Template, dynamodb: Any, table_name: str, changed_days_ago: float, admitted: bool
) -> None:
    # Given the relay as the template configures it once RunRetentionDays was raised from 1 to 7 days (make
    # deploy passes the deployed value and the time of the change), the raise an hour or 3 days ago
    changed_at = datetime.now(UTC) - timedelta(days=changed_days_ago)
    parameters = {
        "RunRetentionDays": "7",
        "PreviousRunRetentionDays": "1",
        "RunRetentionChangedAt": rfc3339(changed_at),
    }
    relay = harness.with_environment(template.function_environment("InboxRelayFunction", parameters))
    # When a record published 2 days ago is delivered again
    two_days_ago = int(time.time() * 1000) - 2 * DAY_MS
    relay.run([harness.record({**SPAWN, "dispatch_key": "k"}, 0, timestamp_ms=two_days_ago)])
    # Then from before the raise it is held to 1 day (its run, written under 1 day, is gone): dead-lettered
    # as expired, no run; from after it, a run
    runs = count_runs(dynamodb, table_name, harness.tenant)
    letters = [letter for _, letter in harness.dead_letters()]
    assert len(runs) == (1 if admitted else 0)
    assert [letter["reason"]["kind"] for letter in letters] == ([] if admitted else ["expired"])


def test_the_relay_reads_its_run_retention_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"ADMISSION_API_URL": "https://api.example", "DLQ_URL": "https://sqs/dlq", "AWS_REGION": "us-east-1"}
    for name, value in {**env, "AWS_ACCESS_KEY_ID": "AKIDEXAMPLE", "AWS_SECRET_ACCESS_KEY": "secret"}.items():
        monkeypatch.setenv(name, value)
    relay_module.relay_service.cache_clear()
    try:
        monkeypatch.setenv("RUN_RETENTION_DAYS", "3")
        assert relay_module.relay_service()._settings.run_retention.days == 3
        relay_module.relay_service.cache_clear()
        monkeypatch.setenv("RUN_RETENTION_DAYS", "")
        assert relay_module.relay_service()._settings.run_retention.days is None
        relay_module.relay_service.cache_clear()
        monkeypatch.setenv("RUN_RETENTION_DAYS", "three")
        with pytest.raises(ConfigurationError, match="RUN_RETENTION_DAYS must be empty"):
            relay_module.relay_service()
    finally:
        relay_module.relay_service.cache_clear()


@pytest.mark.parametrize(
    ("ms", "text"),
    [
        (0, "0 s"),
        (42_000, "42 s"),
        (300_000, "5 min"),
        (11_100_000, "3 h 5 min"),
        (DAY_MS, "1 day"),
        (4 * DAY_MS, "4 days"),
    ],
)
def test_ages_are_told_in_their_largest_units(ms: int, text: str) -> None:
    assert age_text(ms) == text


class RetryAfterFirst(urllib3.PoolManager):
    """The admission API behind a first answer of 429 with this Retry-After; the POSTs' times are noted."""

    def __init__(self, api: urllib3.PoolManager, retry_after: str) -> None:
        super().__init__()
        self._api = api
        self._retry_after = retry_after
        self.sent_at: list[float] = []

    def urlopen(self, method: str, url: str, redirect: bool = True, **kw: Any) -> urllib3.BaseHTTPResponse:  # type: ignore[override]
        self.sent_at.append(time.time())
        if len(self.sent_at) == 1:
            return urllib3.HTTPResponse(body=b"{}", status=429, headers={"Retry-After": self._retry_after})
        return self._api.urlopen(method, url, redirect, **kw)


def _first_answer_retry_after(harness: RelayHarness, value: str) -> tuple[RelayHarness, RetryAfterFirst]:
    api = RetryAfterFirst(harness.api, value)
    credentials = Credentials(RELAY_KEY.access_key, RELAY_KEY.secret_key)
    relay = Relay(harness.relay._settings, sqs=harness.sqs, http=api, credentials=credentials)
    return dataclasses.replace(harness, relay=relay), api


@pytest.mark.parametrize("value", ["1e9", "inf", "+3", "\u0663", "3.0", "0x10", "-5"])
def test_a_retry_after_that_is_not_delay_seconds_is_ignored(
    harness: RelayHarness, value: str, dynamodb: Any, table_name: str
) -> None:
    # Given an API whose first answer is 429 with a Retry-After that is neither delay-seconds (ASCII digits)
    # nor an HTTP-date (RFC 9110 10.2.3): an exponent, infinity, a sign, an Arabic-Indic 3, a fraction, hex
    retried, api = _first_answer_retry_after(harness, value)
    # When a record is relayed with 4 s left (2 s to the batch's deadline)
    retried.run([harness.record({**SPAWN, "dispatch_key": "k"}, 0)], seconds=4)
    # Then the Retry-After was ignored, as a client does with a field it cannot read: the record was sent
    # again after its backoff and is one run (read as a number, 1e9 s, inf or 3 s would fail the batch)
    assert len(api.sent_at) == 2
    assert len(count_runs(dynamodb, table_name, harness.tenant)) == 1


def test_a_retry_after_http_date_is_honoured(harness: RelayHarness, dynamodb: Any, table_name: str) -> None:
    # Given an API whose first answer is 429 with Retry-After as an HTTP-date 30 s from now
    retried, api = _first_answer_retry_after(harness, format_datetime(datetime.now(UTC) + timedelta(seconds=30), True))
    # When a record is relayed with 10 s left
    # Then the batch fails at once (the date is past its deadline), as it does for `Retry-After: 30`, not
    # sending the record again before the time the API asked for
    with pytest.raises(AdmissionApiUnavailable, match="after 1 attempts: HTTP 429"):
        retried.run([harness.record({**SPAWN, "dispatch_key": "k"}, 0)], seconds=10)
    assert len(api.sent_at) == 1
    assert count_runs(dynamodb, table_name, harness.tenant) == []


def test_a_retry_after_http_date_in_the_past_is_no_wait(harness: RelayHarness, dynamodb: Any, table_name: str) -> None:
    # Given an API whose first answer is 429 with Retry-After as an HTTP-date a minute ago
    retried, api = _first_answer_retry_after(harness, format_datetime(datetime.now(UTC) - timedelta(minutes=1), True))
    # When a record is relayed, then it is sent again after its backoff only, and is one run
    retried.run([harness.record({**SPAWN, "dispatch_key": "k"}, 0)], seconds=4)
    assert len(api.sent_at) == 2
    assert api.sent_at[1] - api.sent_at[0] < 1
    assert len(count_runs(dynamodb, table_name, harness.tenant)) == 1


def test_the_relay_counts_keyless_records_per_tenant_beside_the_inbox_lag(
    template: Template,
    harness: RelayHarness,
    dynamodb: Any,
    table_name: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Given the relay function's handler (template.yaml), relaying through the in-process API
    lambda_handler = template.load_handler("InboxRelayFunction")
    monkeypatch.setattr(relay_module, "relay_service", lambda: harness.relay)
    other = f"{harness.tenant}-b"  # the stack's second tenant (tests/unit/conftest.py)
    batches = [
        [harness.record(SPAWN, 0), harness.record({**SPAWN, "dispatch_key": "k-1"}, 1), harness.record(SPAWN, 2)],
        [harness.record(SPAWN, 0, topic=dispatch_topic(other))],
        [harness.record({**SPAWN, "dispatch_key": "k-2"}, 3)],
    ]
    # When each batch is one invocation, as each tenant's mapping invokes the function
    for records in batches:
        lambda_handler(msk_event(records), LocalLambdaContext("InboxRelayFunction", 60))
    # Then each invocation's metrics (EMF, the JSON CloudWatch stores) count its keyless records under its tenant
    emitted = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith('{"_aws"')]
    documents = [doc for doc in emitted if "DispatchRelayed" in doc]  # not the in-process admissions' own
    assert [(doc["tenant"], doc.get("DispatchKeyless"), doc["DispatchRelayed"]) for doc in documents] == [
        (harness.tenant, [2.0], [3.0]),
        (other, [1.0], [1.0]),
        (harness.tenant, None, [1.0]),  # no keyless record: no value (a tenant's series is paid for while sent)
    ]
    for doc in documents[:2]:
        (directive,) = doc["_aws"]["CloudWatchMetrics"]
        assert {metric["Name"]: metric["Unit"] for metric in directive["Metrics"]}["DispatchKeyless"] == "Count"
        assert sorted(directive["Dimensions"][0]) == ["service", "tenant"]
    # And every record was admitted
    assert len(count_runs(dynamodb, table_name, harness.tenant)) == 4
    assert len(count_runs(dynamodb, table_name, other)) == 1


def test_a_keyless_record_is_counted_once_for_each_invocation_that_relayed_it_not_for_each_that_tried(
    harness: RelayHarness, dynamodb: Any, table_name: str
) -> None:
    records = [harness.record(SPAWN, 0)]
    outcomes = [BatchOutcome() for _ in range(3)]

    def invoke(outcome: BatchOutcome, seconds: float) -> None:
        """One invocation of the batch, published as `outcome` (handle_batch publishes it, failed or not)."""
        deadline = time.monotonic() + seconds
        harness.relay.relay_batch(
            KafkaEvent(msk_event(records)), lambda: int((deadline - time.monotonic()) * 1000), outcome
        )

    # Given a batch of one keyless record, tried twice by the event source while the API is down
    up = harness.relay._http
    harness.relay._http = DownApi()  # type: ignore[assignment]
    for outcome in outcomes[:2]:
        with pytest.raises(AdmissionApiUnavailable):
            invoke(outcome, 5)
    # When the API is back and the batch is tried a third time
    harness.relay._http = up
    invoke(outcomes[2], 60)
    # Then the one run it admitted is counted once as keyless, as it is once as relayed (DispatchKeyless counts what
    # the producer sent, not the event source's tries of it)
    assert len(count_runs(dynamodb, table_name, harness.tenant)) == 1
    assert [(outcome.relayed, outcome.keyless) for outcome in outcomes] == [(0, 0), (0, 0), (1, 1)]
