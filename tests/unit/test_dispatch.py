"""`DispatchPublisher.publish` refuses, before anything is queued, a record the relay could only
dead-letter: a tenant no relay consumes (the API's and the topics' one rule, `poimen.kafka.is_tenant_id`),
or a spawn request the API would refuse."""

from __future__ import annotations

from typing import Any

import pytest

from poimen import dispatch
from poimen.contract import RunRequest
from poimen.dispatch import DispatchPublisher, InvalidDispatch
from poimen.kafka import InvalidTenant, is_tenant_id, tenant_of_dispatch_topic
from poimen.wire import MAX_BODY_BYTES, MAX_JSON_DEPTH

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
    run_id = publisher.publish("acme", SPAWN)

    assert produced(publisher) == [
        (
            "poimen.acme.dispatch",
            f"acme/{run_id}".encode(),
            b'{"workflow_ref":"wf/hello","input":{},"goal_id":null,"dispatch_key":"k-1"}',
        )
    ]
