"""`DispatchPublisher.publish` refuses, before anything is queued, a record the relay could only
dead-letter: a tenant no relay consumes (the API's and the topics' one rule, `poimen.kafka.is_tenant_id`),
or a spawn request the API would refuse. Every record it publishes carries a dispatch_key (generated for a
spawn without one); a keyless one only when asked for by name, with a warning."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from poimen import dispatch
from poimen.contract import RunRequest
from poimen.dispatch import GENERATED_KEY_PREFIX, DispatchPublisher, InvalidDispatch, KeylessDispatchWarning
from poimen.ids import keyed_run_id
from poimen.kafka import InvalidTenant, is_tenant_id, tenant_of_dispatch_topic
from poimen.store import Store
from poimen.wire import MAX_BODY_BYTES, MAX_JSON_DEPTH
from poimen_tools.local.template import Template
from tests.conftest import count_runs
from tests.unit.relay_harness import RelayHarness

SPAWN = RunRequest(workflow_ref="wf/hello", input={}, dispatch_key="k-1")


class FakeProducer:
    """Records what would be sent to the broker."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.produced: list[tuple[str, bytes, bytes]] = []

    def produce(self, topic: str, *, key: bytes, value: bytes, on_delivery: Any) -> None:
        self.produced.append((topic, key, value))

    def poll(self, timeout: float) -> int:
        return 0

    def flush(self, timeout: float) -> int:
        return 0


@pytest.fixture
def publisher(monkeypatch: pytest.MonkeyPatch) -> DispatchPublisher:
    monkeypatch.setattr(dispatch, "Producer", FakeProducer)
    return DispatchPublisher("127.0.0.1:9092")


def nested(levels: int) -> dict[str, Any]:
    """An object `levels` deep: as an input, the body around it is one level deeper."""
    value: dict[str, Any] = {}
    for _ in range(levels - 1):
        value = {"a": value}
    return value


def produced(publisher: DispatchPublisher) -> list[tuple[str, bytes, bytes]]:
    producer = publisher._producer
    assert isinstance(producer, FakeProducer)
    return producer.produced


@pytest.mark.parametrize("tenant", ["Acme", "acme.eu", "", "-acme", "acme\n", "a" * 64, "acme/x", "\udcff"])
def test_a_tenant_no_relay_consumes_is_refused_and_nothing_is_queued(publisher: DispatchPublisher, tenant: str) -> None:
    with pytest.raises(InvalidTenant) as refused:
        publisher.publish(tenant, SPAWN)

    assert isinstance(refused.value, InvalidDispatch)
    assert refused.value.tenant_id == tenant
    assert produced(publisher) == []


def test_a_tenant_id_is_one_rule_for_the_api_the_topics_and_the_publisher(publisher: DispatchPublisher) -> None:
    # Given the same ids judged by the rule, the relay's topic parser and the publisher
    ids = ["acme", "a", "a-b", "0", "a" * 63, "Acme", "acme.eu", "a" * 64, "acme\n", "-a"]

    for tenant in ids:
        accepted = True
        try:
            publisher.publish(tenant, SPAWN)
        except InvalidTenant:
            accepted = False

        # Then each accepts exactly what the others do
        assert accepted == is_tenant_id(tenant) == (tenant_of_dispatch_topic(f"poimen.{tenant}.dispatch") == tenant)
    assert [topic for topic, _, _ in produced(publisher)] == [
        f"poimen.{tenant}.dispatch" for tenant in ids if is_tenant_id(tenant)
    ]


@pytest.mark.parametrize(
    ("request_", "reason"),
    [
        (RunRequest.model_construct(workflow_ref="", input={}), "workflow_ref"),
        (RunRequest.model_construct(workflow_ref="w" * 257, input={}), "workflow_ref"),
        (RunRequest.model_construct(workflow_ref="wf", input={}, dispatch_key="a\nb"), "dispatch_key"),
        (RunRequest.model_construct(workflow_ref="wf", input={}, dispatch_key="k" * 256), "dispatch_key"),
        (RunRequest.model_construct(workflow_ref="wf", input={}, goal_id=""), "goal_id"),
        (RunRequest(workflow_ref="wf", input={"text": "\udcff"}), "cannot be sent as JSON"),
        (RunRequest(workflow_ref="wf", input={"blob": "x" * MAX_BODY_BYTES}), f"exceeds {MAX_BODY_BYTES} bytes"),
        (RunRequest(workflow_ref="wf", input=nested(MAX_JSON_DEPTH)), f"deeper than {MAX_JSON_DEPTH} levels"),
    ],
)
def test_a_request_the_api_would_refuse_is_refused_and_nothing_is_queued(
    publisher: DispatchPublisher, request_: RunRequest, reason: str
) -> None:
    with pytest.raises(InvalidDispatch) as refused:
        publisher.publish("acme", request_)

    assert reason in str(refused.value)
    assert produced(publisher) == []


def test_a_valid_request_is_queued_as_the_body_post_v1_runs_takes(publisher: DispatchPublisher) -> None:
    published = publisher.publish("acme", SPAWN)

    assert produced(publisher) == [
        (
            "poimen.acme.dispatch",
            f"acme/{published.run_id}".encode(),
            b'{"workflow_ref":"wf/hello","input":{},"goal_id":null,"dispatch_key":"k-1"}',
        )
    ]


def test_a_spawn_without_a_key_is_published_with_a_generated_one_which_is_returned(
    publisher: DispatchPublisher,
) -> None:
    # When two spawns without a dispatch_key are published
    first = publisher.publish("acme", RunRequest(workflow_ref="wf/hello", input={}))
    second = publisher.publish("acme", RunRequest(workflow_ref="wf/hello", input={}))

    # Then each record carries a key generated for it (a UUIDv7 under the publisher's prefix), the one returned,
    # and the run id returned is the one admission derives from it, which is the record's partition key
    records = produced(publisher)
    assert [json.loads(value)["dispatch_key"] for _, _, value in records] == [first.dispatch_key, second.dispatch_key]
    assert first.dispatch_key != second.dispatch_key
    for published, (_, key, _) in zip((first, second), records, strict=True):
        assert published.generated
        assert published.dispatch_key.startswith(GENERATED_KEY_PREFIX)
        assert uuid.UUID(published.dispatch_key.removeprefix(GENERATED_KEY_PREFIX)).version == 7
        assert published.run_id == keyed_run_id("acme", published.dispatch_key)
        assert key == f"acme/{published.run_id}".encode()


def test_a_spawn_with_a_key_is_published_with_that_key(publisher: DispatchPublisher) -> None:
    published = publisher.publish("acme", SPAWN)

    assert (published.dispatch_key, published.generated) == ("k-1", False)
    assert published.run_id == keyed_run_id("acme", "k-1")


def test_the_run_a_generated_key_names_is_the_one_admitted_however_often_it_is_delivered(
    publisher: DispatchPublisher,
    template: Template,
    handler: Callable[[dict[str, Any], Any], dict[str, Any]],
    store: Store,
    dynamodb: Any,
    table_name: str,
) -> None:
    # Given a spawn without a key published to the test's tenant
    harness = RelayHarness.start(template, handler, store)
    published = publisher.publish(harness.tenant, RunRequest(workflow_ref="wf/hello", input={"n": 1}))
    ((_, key, value),) = produced(publisher)
    # When the relay is given its record twice (redelivered after a kill, before its offset was committed)
    record = harness.record(value, 0, key=key)
    harness.run([record])
    harness.run([record])
    # Then the table holds one run, the one the publisher named, under the generated key
    (run,) = count_runs(dynamodb, table_name, harness.tenant)
    assert (run["run_id"]["S"], run["dispatch_key"]["S"]) == (published.run_id, published.dispatch_key)
    assert harness.dead_letters() == []


def test_a_keyless_record_is_published_only_when_asked_for_by_name_and_warns(publisher: DispatchPublisher) -> None:
    spawn = RunRequest(workflow_ref="wf/hello", input={})
    # When a keyless record is asked for by name
    with pytest.warns(KeylessDispatchWarning, match="at least once"):
        publisher.publish_without_dispatch_key("acme", spawn)

    # Then it is queued without a key, under a partition key of a fresh UUIDv7
    ((topic, key, value),) = produced(publisher)
    assert topic == "poimen.acme.dispatch"
    assert json.loads(value)["dispatch_key"] is None
    assert uuid.UUID(key.decode().removeprefix("acme/")).version == 7


def test_a_keyless_publish_of_a_keyed_request_is_refused_and_nothing_is_queued(publisher: DispatchPublisher) -> None:
    with pytest.raises(ValueError, match="carries a dispatch_key"):
        publisher.publish_without_dispatch_key("acme", SPAWN)

    assert produced(publisher) == []


def test_a_spawn_that_a_generated_key_takes_over_the_body_limit_is_refused_naming_the_key(
    publisher: DispatchPublisher,
) -> None:
    # Given a spawn without a key whose body, as the caller sends it, is 10 bytes inside the API's limit
    empty = len(b'{"workflow_ref":"wf/hello","input":{"x":""},"goal_id":null,"dispatch_key":null}')
    spawn = RunRequest(workflow_ref="wf/hello", input={"x": "a" * (MAX_BODY_BYTES - empty - 10)})
    # When it is published, given a generated key (50 bytes more than none)
    with pytest.raises(InvalidDispatch) as refused:
        publisher.publish("acme", spawn)
    # Then it is refused, nothing queued, saying that the generated key is what takes it over and what to do
    assert produced(publisher) == []
    assert str(refused.value) == (
        f"the spawn request's body exceeds {MAX_BODY_BYTES} bytes ({MAX_BODY_BYTES + 40}) with the dispatch_key "
        f"generated for it ({MAX_BODY_BYTES - 10} without a key): give it a shorter dispatch_key of your own"
    )
