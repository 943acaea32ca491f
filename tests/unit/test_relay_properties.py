"""Property: with the API and the dead-letter queue up, no batch of Kafka records, however malformed (any
header bytes and sizes, keys, values, tombstones), makes the relay raise; each record is admitted or
dead-lettered exactly as its kind says, and every dead letter fits SQS."""

from __future__ import annotations

import hashlib
import json
import re
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poimen.api import admission_service
from poimen.dead_letter import MAX_DEAD_LETTER_BYTES
from poimen.store import Store
from poimen.wire import MAX_BODY_BYTES, TRACEPARENT_PATTERN
from poimen_tools.local.msk import KafkaRecord, msk_event
from poimen_tools.local.template import Template
from tests.conftest import count_runs
from tests.unit.relay_harness import RelayHarness

VALID_TRACEPARENT = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@dataclass(frozen=True)
class Spec:
    """One record to generate, and what must become of it: "admitted" or its dead letter's kind."""

    kind: str
    value: Any  # JSON-encoded unless bytes or None
    keyed: bool  # an admitted spawn gets a dispatch_key of its own
    topic: str | None  # None: the example's tenant dispatch topic
    key: bytes | None
    headers: list[tuple[str, bytes]]
    timestamp_ms: int


def _repeated(byte: bytes, low: int, high: int) -> st.SearchStrategy[bytes]:
    """Large values cheaply: a size drawn from [low, high] of one byte."""
    return st.integers(min_value=low, max_value=high).map(lambda size: byte * size)


ascii_text = st.text(alphabet=string.ascii_letters + string.digits + "/-_ ", max_size=12)
spawn = st.fixed_dictionaries(
    {
        "workflow_ref": ascii_text.filter(bool),
        "input": st.dictionaries(ascii_text, st.integers(-1000, 1000) | ascii_text | st.none(), max_size=3),
    },
    optional={"goal_id": ascii_text.filter(bool)},
)
values: dict[str, st.SearchStrategy[Any]] = {
    "admitted": spawn,
    "rejected": st.one_of(
        st.just({"input": {}}),
        st.just({"workflow_ref": 7, "input": {}}),
        st.just({"workflow_ref": "wf", "input": "not an object"}),
        st.just({"workflow_ref": "wf", "input": {}, "unknown": True}),
        st.just({"workflow_ref": "wf", "input": {"blob": "x" * MAX_BODY_BYTES}}),  # 413
    ),
    "invalid-json": st.one_of(
        st.sampled_from([b"", b"[]", b"42", b'"wf"', b"null", b"true", b"{not json"]),
        st.text(max_size=40).map(lambda text: ("x" + text).encode()),
    ),
    "undecodable": st.one_of(
        st.binary(max_size=40).map(lambda data: b"\xff" + data),
        _repeated(b"\xff", 1024 * 1024, 1100 * 1024),  # too large for SQS even as base64
    ),
    "empty-value": st.none(),
}
header_values = st.one_of(
    st.binary(max_size=64),
    st.just(VALID_TRACEPARENT),
    st.sampled_from([b"\r\n", b"\n", b"\x00", b" "]).map(lambda bad: VALID_TRACEPARENT + bad),
    st.just(VALID_TRACEPARENT.upper()),
    _repeated(b"\xff", 250 * 1024, 320 * 1024),  # ~1.2 MB as MSK's integer lists
)
headers = st.lists(
    st.tuples(st.sampled_from(["traceparent", "TraceParent", "tracestate"]) | st.text(max_size=8), header_values),
    max_size=3,
)
keys = st.one_of(st.none(), st.sampled_from([b"a", b"b"]), st.binary(max_size=16), _repeated(b"k", 800_000, 900_000))


@st.composite
def specs(draw: st.DrawFn) -> Spec:
    kind = draw(st.sampled_from([*values, "invalid-topic"]))
    invalid_topic = kind == "invalid-topic"
    return Spec(
        kind=kind,
        value=draw(spawn if invalid_topic else values[kind]),
        keyed=draw(st.booleans()),
        topic=draw(st.sampled_from(["poimen.Acme.dispatch", "poimen..dispatch", "other"])) if invalid_topic else None,
        key=draw(keys),
        headers=draw(headers),
        timestamp_ms=draw(st.integers(min_value=-1, max_value=2**42)),
    )


@pytest.fixture
def harness(template: Template, handler: Callable[[dict[str, Any], Any], dict[str, Any]], store: Store) -> RelayHarness:
    return RelayHarness.start(template, handler, store)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(batch=st.lists(specs(), min_size=1, max_size=8))
def test_no_record_fails_the_batch_and_each_ends_as_its_kind_says(
    harness: RelayHarness, dynamodb: Any, table_name: str, batch: list[Spec], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a batch of this example's tenant (one the stack serves), each record at its own offset
    tenant = f"p-{uuid.uuid4().hex[:12]}"
    monkeypatch.setenv("TENANTS", tenant)
    admission_service.cache_clear()
    records = [
        KafkaRecord(
            topic=spec.topic or f"poimen.{tenant}.dispatch",
            partition=0,
            offset=offset,
            timestamp_ms=spec.timestamp_ms,
            value=_encoded(spec, offset),
            key=spec.key,
            headers=spec.headers,
        )
        for offset, spec in enumerate(batch)
    ]
    event = msk_event(records)
    delivered = {(entry["topic"], entry["offset"]): entry for entries in event["records"].values() for entry in entries}
    posted_before = len(harness.api.received)
    # When the relay handles it: it does not raise
    outcome = harness.run_event(event)
    # Then every record not admitted is one dead letter of its kind, whole or with digests of what it left out
    letters = harness.dead_letters()
    expected = {(record.topic, record.offset): spec.kind for spec, record in zip(batch, records, strict=True)}
    dead = {key: kind for key, kind in expected.items() if kind != "admitted"}
    got = {(letter["record"]["topic"], letter["record"]["offset"]): letter["reason"]["kind"] for _, letter in letters}
    assert got == dead
    assert len(letters) == len(dead) == outcome.dead_lettered
    for size, letter in letters:
        assert size <= MAX_DEAD_LETTER_BYTES
        _assert_digests_match(letter["record"], delivered[(letter["record"]["topic"], letter["record"]["offset"])])
    # And every other record was admitted: one run each, the trace context forwarded only when well-formed
    admitted = len(expected) - len(dead)
    assert outcome.relayed + outcome.replayed == admitted
    assert len(count_runs(dynamodb, table_name, tenant, only="pk")) == admitted
    forwarded = [headers["traceparent"] for headers in harness.api.received[posted_before:] if "traceparent" in headers]
    assert all(re.fullmatch(TRACEPARENT_PATTERN, value) for value in forwarded)


def _encoded(spec: Spec, offset: int) -> bytes | None:
    if spec.value is None or isinstance(spec.value, bytes):
        return spec.value
    value = {**spec.value, "dispatch_key": f"d-{offset}"} if spec.keyed and spec.kind == "admitted" else spec.value
    return json.dumps(value).encode()


def _assert_digests_match(kept: dict[str, Any], delivered: dict[str, Any]) -> None:
    for part in ("key", "value", "headers"):
        if f"{part}Omitted" in kept:
            original = delivered.get(part)
            text = original if isinstance(original, str) else json.dumps(original, separators=(",", ":"))
            assert kept[f"{part}Sha256"] == hashlib.sha256(text.encode()).hexdigest()
        else:
            assert kept[part] == delivered.get(part)
