"""RelayEventPollers, transformed as CloudFormation gets it (tests/unit/transforms.py): provisioned (the default)
mappings keep their pollers, bounded retries and S3 on-failure destination; on-demand mappings declare none of
the three, which AWS sets only in provisioned mode (docs/operations.md#event-poller-modes), and the relay is told
the mode. Only properties are conditional: both modes declare the same resources (the quota counts them)."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import pytest

from poimen.config import EVENT_POLLER_MODES, MAX_RECORD_AGE_SECONDS, ON_DEMAND_POLLERS, PROVISIONED_POLLERS
from poimen_tools.local.template import Template
from poimen_tools.topics import dispatch_retention_ms
from tests.unit.transforms import sam_transform

PROVISIONED_ONLY = ("ProvisionedPollerConfig", "MaximumRetryAttempts", "DestinationConfig")
PARAMETERS = {"Tenants": "acme,beta-2", "PeerClusterAlias1": "east", "DispatchSources": "Source,Peer1Source"}


@cache
def _both_modes() -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Each mode's template, every resource declared and only those created, from one transform of both."""
    scenarios = json.dumps([{**PARAMETERS, "RelayEventPollers": mode} for mode in EVENT_POLLER_MODES])
    pairs = json.loads(sam_transform(batch=scenarios, kept="both"))
    return {mode: (declared, created) for mode, (declared, created) in zip(EVENT_POLLER_MODES, pairs, strict=True)}


def _transformed(mode: str, *, declared: bool = False) -> dict[str, Any]:
    """The stack's template in this mode: the resources it creates, or with `declared` every one declared."""
    declared_template, created = _both_modes()[mode]
    return declared_template if declared else created


def _mappings(resources: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: body["Properties"]
        for name, body in resources.items()
        if body["Type"] == "AWS::Lambda::EventSourceMapping" and name.startswith("Relay")
    }


def test_the_poller_mode_is_a_parameter_provisioned_by_default(template: Template) -> None:
    parameter = template.document["Parameters"]["RelayEventPollers"]
    age = template.document["Parameters"]["RelayOnDemandMaxRecordAgeSeconds"]

    assert parameter["Default"] == PROVISIONED_POLLERS
    assert tuple(parameter["AllowedValues"]) == EVENT_POLLER_MODES
    # Short of the shortest .dispatch retention (a day), so a record is dead-lettered before the topic drops it.
    assert age["MaxValue"] == MAX_RECORD_AGE_SECONDS


# Kafka deletes a log segment at its first retention check (log.retention.check.interval.ms, 5 min by default) once
# the segment's newest record is retention.ms old: https://kafka.apache.org/documentation/#brokerconfigs.
KAFKA_RETENTION_CHECK_SECONDS = 300


def test_the_age_limit_gives_a_batch_up_before_the_shortest_dispatch_retention_can_drop_it(template: Template) -> None:
    # Given the longest age limit, the shortest .dispatch retention (RunRetentionDays 1) and the relay's timeout
    limit = template.document["Parameters"]["RelayOnDemandMaxRecordAgeSeconds"]["MaxValue"]
    shortest_seconds = dispatch_retention_ms(1) / 1000
    timeout = template.document["Resources"]["InboxRelayFunction"]["Properties"]["Timeout"]
    # Then a batch is given up before Kafka may delete its records: the give-up is the first failing invocation that
    # starts past the limit, so up to two invocations late (one that started just before it, then its retry), and
    # Kafka may delete a record from the moment it is retention.ms old, at its next check
    assert limit + 2 * timeout + KAFKA_RETENTION_CHECK_SECONDS <= shortest_seconds


def test_provisioned_mappings_bound_retries_and_park_failed_batches_in_s3() -> None:
    mappings = _mappings(_transformed(PROVISIONED_POLLERS)["Resources"])

    assert len(mappings) == 4  # two tenants, each its own topic and one peer's replica
    for name, properties in mappings.items():
        pollers = properties["ProvisionedPollerConfig"]
        assert (pollers["MinimumPollers"], pollers["MaximumPollers"]) == (1, 3), name
        assert "PollerGroupName" in pollers, name  # its value: tests/unit/test_poller_groups.py
        assert properties["MaximumRetryAttempts"] == 100, name
        assert properties["DestinationConfig"] == {
            "OnFailure": {"Destination": {"Fn::GetAtt": ["FailedBatchesBucket", "Arn"]}}
        }, name


def test_on_demand_mappings_declare_nothing_aws_sets_only_in_provisioned_mode() -> None:
    resources = _transformed(ON_DEMAND_POLLERS)["Resources"]
    mappings = _mappings(resources)

    assert len(mappings) == 4
    for name, properties in mappings.items():
        assert not set(PROVISIONED_ONLY) & set(properties), name
        # What the relay relies on stays: the topic from its start, the batching, the stable consumer group.
        assert properties["StartingPosition"] == "TRIM_HORIZON", name
        assert "ConsumerGroupId" in properties["AmazonManagedKafkaEventSourceConfig"], name
    variables = resources["InboxRelayFunction"]["Properties"]["Environment"]["Variables"]
    assert variables["RELAY_EVENT_POLLERS"] == ON_DEMAND_POLLERS
    assert str(variables["RELAY_MAX_RECORD_AGE_SECONDS"]) == "10800"


@pytest.mark.parametrize("declared", [False, True])
def test_both_modes_declare_and_create_the_same_resources(declared: bool) -> None:
    provisioned = _transformed(PROVISIONED_POLLERS, declared=declared)["Resources"]
    on_demand = _transformed(ON_DEMAND_POLLERS, declared=declared)["Resources"]

    # But for the relay's published version, named for a hash of its configuration (RELAY_EVENT_POLLERS changed).
    assert len(provisioned) == len(on_demand)
    assert sorted(_unversioned(provisioned)) == sorted(_unversioned(on_demand))


def _unversioned(resources: dict[str, Any]) -> list[str]:
    return [name for name in resources if not name.startswith("InboxRelayFunctionVersion")]
