"""One `poimen dev` serving 100 tenants (half of them with ids as long as a stack's Tenants list lets 100 be):
dispatches spread over their 100 dispatch topics, each one run in its tenant's table partition and one event on
its own tenant's events topic, none on another's."""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path

from poimen.contract import RunRequest
from poimen.dispatch import DispatchPublisher
from poimen.ids import keyed_run_id
from poimen.kafka import events_topic
from poimen_tools.deploy_check import MAX_TENANT_CHARACTERS, limit_refusal
from poimen_tools.local.kafka_broker import KafkaBroker
from tests.integration.conftest import start_dev, wait_for
from tests.integration.test_outbox import records_on

TENANTS = 100
# The local event source relays one tenant topic's batch after another: 3.5 to 4.5 records a second at 100
# tenants on this (loaded) machine, so one dispatch each, and every tenth tenant's sent twice.
PER_TENANT = 1
TWICE_EVERY = 10
# 100 ids of 29 characters and their commas are 2,999: the longest a stack's Tenants list holds of 100.
LONGEST = (MAX_TENANT_CHARACTERS + 1) // TENANTS - 1
# Names of this run only.
TAG = uuid.uuid4().hex[:8]
SERVED = tuple(f"{TAG}-{i:03d}" if i % 2 == 0 else f"{TAG}-{i:03d}-".ljust(LONGEST, "x") for i in range(TENANTS))


def test_poimen_dev_serves_100_tenants_each_run_once_and_each_event_on_its_tenants_topic(
    tmp_path: Path, broker: KafkaBroker
) -> None:
    """About 60 s: one `poimen dev` creating and relaying 100 tenants' topics (the number the claim is about),
    a dispatch on each and every tenth twice."""
    # Given poimen dev serving 100 tenants a stack accepts, half at the longest, on a broker of its own
    assert limit_refusal(list(SERVED), peer_aliases=0) is None
    assert max(map(len, SERVED)) == 29
    dev = start_dev(tmp_path, "--kafka-bootstrap", broker.bootstrap_servers, kafka=True, tenants=SERVED)
    try:
        assert dev.kafka_bootstrap is not None
        # When each tenant is sent a dispatch on its own dispatch topic, every tenth tenant's twice
        publisher = DispatchPublisher(dev.kafka_bootstrap)
        for n in range(PER_TENANT):
            for i, tenant in enumerate(SERVED):
                request = RunRequest(workflow_ref="wf/many", input={"n": n}, dispatch_key=f"k-{n}")
                publisher.publish(tenant, request)
                if i % TWICE_EVERY == 0:
                    publisher.publish(tenant, request)
        publisher.flush(60)
        expected = {(tenant, keyed_run_id(tenant, f"k-{n}")) for tenant in SERVED for n in range(PER_TENANT)}

        # Then the table holds each tenant's runs once, under its own tenant
        def stored() -> Counter[tuple[str, str]] | None:
            pages = dev.dynamodb().get_paginator("scan").paginate(TableName=dev.table_name, ConsistentRead=True)
            runs = Counter(
                (item["tenant_id"]["S"], item["run_id"]["S"])
                for page in pages
                for item in page["Items"]
                if item["pk"]["S"].startswith("RUN#")
            )
            return runs if sum(runs.values()) >= len(expected) else None

        runs = wait_for(stored, timeout=120, what=f"{len(expected)} runs")
        assert set(runs) == expected
        assert set(runs.values()) == {1}
        # And each run is one event, on its own tenant's events topic and no other's
        records = records_on(dev.kafka_bootstrap, [events_topic(tenant) for tenant in SERVED], len(expected))
        events = Counter((record["topic"], record["headers"]["ce_subject"].decode()) for record in records)
        assert set(events) == {(events_topic(tenant), run_id) for tenant, run_id in expected}
        assert set(events.values()) == {1}
    finally:
        assert dev.stop() == 0
