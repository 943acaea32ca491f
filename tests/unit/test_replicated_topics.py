"""Replicated dispatch topics (multi-Region, MirrorMaker 2's prefixed active-active layout): the names, and
the relay on `<alias>.poimen.<tenant>.dispatch`, where a keyless spawn is a `keyless-replica` dead letter
(its original is relayed in its own Region) and a keyed one is relayed, one run with its original."""

from __future__ import annotations

import base64
import re
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from poimen.kafka import (
    CLUSTER_ALIAS_PATTERN,
    DISPATCH_TOPIC_PATTERN,
    InvalidClusterAlias,
    InvalidTenant,
    dispatch_topic,
    events_topic,
    replicated_dispatch_topic,
    source_alias_of_dispatch_topic,
    tenant_of_dispatch_topic,
)
from poimen.store import Store
from poimen.wire import TENANT_PATTERN
from poimen_tools.local.template import Template
from tests.conftest import count_runs
from tests.unit.relay_harness import RelayHarness

tenants = st.from_regex(TENANT_PATTERN, fullmatch=True)
aliases = st.from_regex(CLUSTER_ALIAS_PATTERN, fullmatch=True)
# librdkafka reads a ^-prefixed subscription as a regex; Python's re agrees with it on this one's syntax.
SUBSCRIPTION = re.compile(DISPATCH_TOPIC_PATTERN)


def subscribed(topic: str) -> bool:
    return SUBSCRIPTION.search(topic) is not None


# --- names ------------------------------------------------------------------------------------------------


@given(tenant=tenants)
def test_a_local_dispatch_topic_has_its_tenant_and_no_source_alias(tenant: str) -> None:
    topic = dispatch_topic(tenant)

    assert (tenant_of_dispatch_topic(topic), source_alias_of_dispatch_topic(topic)) == (tenant, None)
    assert subscribed(topic)


@given(alias=aliases, tenant=tenants)
def test_a_replicated_dispatch_topic_has_its_tenant_and_its_source_alias(alias: str, tenant: str) -> None:
    topic = replicated_dispatch_topic(alias, tenant)

    assert topic == f"{alias}.poimen.{tenant}.dispatch"
    assert (tenant_of_dispatch_topic(topic), source_alias_of_dispatch_topic(topic)) == (tenant, alias)
    assert subscribed(topic)


@given(first=aliases, second=aliases, tenant=tenants)
def test_a_topic_replicated_twice_is_no_dispatch_topic(first: str, second: str, tenant: str) -> None:
    # Two prefixes: replicated back and forth (a cycle), never a topic to relay.
    topic = f"{first}.{replicated_dispatch_topic(second, tenant)}"

    assert (tenant_of_dispatch_topic(topic), source_alias_of_dispatch_topic(topic)) == (None, None)
    assert not subscribed(topic)


@given(alias=st.text(min_size=1, max_size=70).filter(lambda a: re.fullmatch(CLUSTER_ALIAS_PATTERN[1:-1], a) is None))
def test_what_is_no_cluster_alias_names_no_topic(alias: str) -> None:
    topic = f"{alias}.poimen.acme.dispatch"

    with pytest.raises(InvalidClusterAlias):
        replicated_dispatch_topic(alias, "acme")
    # A dotted "alias" is itself a prefix of a prefix; anything else simply is no dispatch topic.
    assert tenant_of_dispatch_topic(topic) is None
    assert not subscribed(topic)


@pytest.mark.parametrize(
    "topic",
    [
        "west.poimen.Acme.dispatch",
        "west.poimen..dispatch",
        f"west.poimen.{'a' * 64}.dispatch",
        "west.poimen.acme.events",
        f"{'w' * 65}.poimen.acme.dispatch",
        ".poimen.acme.dispatch",
        "west poimen.acme.dispatch",
        "west.orders.acme.dispatch",
        "west.poimen.acme.dispatch.x",
    ],
)
def test_anything_else_with_a_prefix_is_no_dispatch_topic(topic: str) -> None:
    assert tenant_of_dispatch_topic(topic) is None
    assert source_alias_of_dispatch_topic(topic) is None
    assert not subscribed(topic)


def test_the_subscription_takes_no_events_topic() -> None:
    assert not subscribed(events_topic("acme"))
    assert not subscribed(f"west.{events_topic('acme')}")


def test_a_replicated_topic_is_named_only_for_a_tenant() -> None:
    with pytest.raises(InvalidTenant):
        replicated_dispatch_topic("west", "Acme")


# --- the relay on a replicated topic --------------------------------------------------------------------


@pytest.fixture
def harness(template: Template, handler: Callable[[dict[str, Any], Any], dict[str, Any]], store: Store) -> RelayHarness:
    return RelayHarness.start(template, handler, store)


KEYLESS = {"workflow_ref": "wf/hello", "input": {"n": 1}}
KEYED = {"workflow_ref": "wf/hello", "input": {"n": 1}, "dispatch_key": "order-7"}


def test_a_keyless_record_on_a_replicated_topic_is_a_keyless_replica_letter_and_no_run(
    harness: RelayHarness, dynamodb: Any, table_name: str
) -> None:
    # Given a keyless spawn replicated from the cluster `west`
    record = harness.record(KEYLESS, 3, topic=replicated_dispatch_topic("west", harness.tenant))
    # When the relay gets it
    outcome = harness.run([record])
    # Then it is one dead letter, reason keyless-replica, keeping the value; nothing was POSTed or stored
    ((_, letter),) = harness.dead_letters()
    assert letter["reason"]["kind"] == "keyless-replica"
    assert "west" in letter["reason"]["detail"]
    assert letter["record"]["topic"] == f"west.poimen.{harness.tenant}.dispatch"
    assert base64.b64decode(letter["record"]["value"]) == record.value
    assert (outcome.tenant, outcome.dead_lettered, outcome.relayed, outcome.replayed) == (harness.tenant, 1, 0, 0)
    assert harness.api.received == []
    assert count_runs(dynamodb, table_name, harness.tenant) == []


def test_a_keyless_record_on_the_local_topic_is_still_relayed(
    harness: RelayHarness, dynamodb: Any, table_name: str
) -> None:
    outcome = harness.run([harness.record(KEYLESS, 3)])

    assert (outcome.relayed, outcome.dead_lettered) == (1, 0)
    assert harness.dead_letters() == []
    assert len(count_runs(dynamodb, table_name, harness.tenant)) == 1


def test_a_keyed_record_and_its_replica_are_one_run(harness: RelayHarness, dynamodb: Any, table_name: str) -> None:
    # Given a keyed spawn on the tenant's own topic, and the same record replicated from `west`
    local = harness.record(KEYED, 3, key=b"order-7")
    replica = harness.record(KEYED, 41, key=b"order-7", topic=replicated_dispatch_topic("west", harness.tenant))
    # When the relay gets the original, then (in another invocation, as its own mapping's) the replica
    first = harness.run([local])
    second = harness.run([replica])
    # Then the original admitted the run, the replica replayed it: one run, no dead letter
    assert (first.relayed, first.replayed, second.relayed, second.replayed) == (1, 0, 0, 1)
    assert second.tenant == harness.tenant
    assert harness.dead_letters() == []
    (run,) = count_runs(dynamodb, table_name, harness.tenant)
    assert run["dispatch_key"]["S"] == "order-7"
    assert [received["x-poimen-tenant"] for received in harness.api.received] == [harness.tenant] * 2
