"""Poller groups (docs/operations.md#poller-groups): every MSK event source mapping the template declares is in the
poller group RelayPollerGroups gives its tenant, no group is over Lambda's 100 mappings or 2,000 MaximumPollers
across two cells on one cluster, `make deploy`'s group check (poimen_tools.deploy_check groups) refuses in one
line what Lambda would refuse, and a redeploy moves no mapping that need not move."""

from __future__ import annotations

import json
import re
import subprocess
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from poimen_tools import deploy_check
from poimen_tools.deploy_check import (
    DEFAULT_RELAY_MAXIMUM_POLLERS,
    MAPPINGS_A_POLLER_GROUP,
    MAX_TENANT_CHARACTERS,
    MAXIMUM_POLLERS_A_POLLER_GROUP,
    PARAMETER_VALUE_BYTES,
    POLLER_GROUPS,
    UNGROUPED,
    GroupLoad,
    assign_poller_groups,
    deployed_groups,
    group_loads,
    limit_refusal,
    main,
    max_tenants,
    parse_assignment,
    poller_group_name,
    poller_group_refusal,
    render_assignment,
)
from poimen_tools.local.template import Template
from tests.conftest import REPO
from tests.unit.test_template_quotas import SCENARIOS, TWO_CELLS, _declared_all
from tests.unit.transforms import sam_transform

CLUSTER = "arn:aws:kafka:us-east-1:111122223333:cluster/poimen/5f0c3a1e-8d2b-4c6a-9e1f-2b7d4c8a6e30-2"
FULL = GroupLoad(MAPPINGS_A_POLLER_GROUP, MAPPINGS_A_POLLER_GROUP * DEFAULT_RELAY_MAXIMUM_POLLERS)


def _msk_mappings(template: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        resource["Properties"]
        for resource in template["Resources"].values()
        if resource["Type"] == "AWS::Lambda::EventSourceMapping" and "Topics" in resource["Properties"]
    ]


def _group_of(mapping: dict[str, Any]) -> str:
    name = mapping["ProvisionedPollerConfig"]["PollerGroupName"]
    assert isinstance(name, str), f"unresolved: {name}"
    return name


# --- the template ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_declared_mapping_is_in_its_tenants_poller_group(scenario: str) -> None:
    declared, given = _declared_all()[scenario], SCENARIOS[scenario]
    groups = parse_assignment(given["RelayPollerGroups"])
    cluster = given["MskClusterArn"]

    for mapping in _msk_mappings(declared):
        tenant = mapping["AmazonManagedKafkaEventSourceConfig"]["ConsumerGroupId"].removeprefix("poimen-relay-")
        tenant = tenant.split(".", 1)[0]  # poimen-relay-<tenant>.<alias> for a peer alias's topic
        assert _group_of(mapping) == poller_group_name(cluster, groups[tenant])
        assert re.fullmatch(r"[a-zA-Z0-9_-]{1,128}", _group_of(mapping))


@pytest.mark.parametrize("aliases", [0, 1, 2])
def test_no_poller_group_is_over_lambdas_limits_across_two_cells_on_one_cluster(aliases: int) -> None:
    # Given two cells at their maximum on one cluster, the second's groups assigned beside the first's mappings
    first = f"single-{aliases}-aliases-{max_tenants(aliases)}-tenants"
    second = f"single-{aliases}-aliases-second-cell"
    assert SCENARIOS[first]["MskClusterArn"] == TWO_CELLS[second]["MskClusterArn"]

    # When every mapping both templates declare is counted in its group
    mappings: dict[str, int] = {}
    pollers: dict[str, int] = {}
    for scenario in (first, second):
        for mapping in _msk_mappings(_declared_all()[scenario]):
            group = _group_of(mapping)
            mappings[group] = mappings.get(group, 0) + 1
            pollers[group] = pollers.get(group, 0) + int(mapping["ProvisionedPollerConfig"]["MaximumPollers"])

    # Then none is over 100 mappings or 2,000 MaximumPollers, and the two cells share a group
    assert sum(mappings.values()) == 2 * max_tenants(aliases) * (1 + aliases)
    assert max(mappings.values()) <= MAPPINGS_A_POLLER_GROUP
    assert max(pollers.values()) <= MAXIMUM_POLLERS_A_POLLER_GROUP
    groups_of = [{_group_of(m) for m in _msk_mappings(_declared_all()[s])} for s in (first, second)]
    assert groups_of[0] & groups_of[1]


def test_a_tenant_missing_from_the_assignment_is_in_group_0_and_ungrouped_is_asked_for_by_name() -> None:
    cluster = "arn:aws:kafka:us-east-1:111122223333:cluster/poimen/abc-1"
    missing = sam_transform("Tenants=acme,globex", "RelayPollerGroups=acme=1", f"MskClusterArn={cluster}")
    unnamed = sam_transform("Tenants=acme,globex", f"MskClusterArn={cluster}")
    ungrouped = sam_transform("Tenants=acme,globex", "RelayPollerGroups=acme=-,globex=-", f"MskClusterArn={cluster}")

    # A tenant the assignment does not name (the template deployed or built by hand) is grouped, in group 0, never
    # silently ungrouped; the prefix of a longer id is never taken for it
    groups = [m["ProvisionedPollerConfig"]["PollerGroupName"] for m in _msk_mappings(json.loads(missing))]
    assert sorted(groups) == ["poimen-abc-1-0", "poimen-abc-1-1"]
    groups = [m["ProvisionedPollerConfig"]["PollerGroupName"] for m in _msk_mappings(json.loads(unnamed))]
    assert groups == ["poimen-abc-1-0", "poimen-abc-1-0"]
    # The opt-out: the mappings' PollerGroupName is empty, no group (an EPU each)
    configs = [m["ProvisionedPollerConfig"] for m in _msk_mappings(json.loads(ungrouped))]
    assert [config["PollerGroupName"] for config in configs] == ["", ""]


def test_the_parameters_default_is_group_0_for_all_and_its_pattern_is_the_checks() -> None:
    parameter = Template(REPO / "template.yaml").document["Parameters"]["RelayPollerGroups"]
    pattern = re.compile(parameter["AllowedPattern"])
    worst = _tenants_of_characters(max_tenants(0), MAX_TENANT_CHARACTERS)

    # Empty by default: every tenant in group 0 (sam build, sam validate and a deploy by hand expand the loop)
    assert parameter["Default"] == ""
    assert pattern.fullmatch("")
    assert pattern.fullmatch(render_assignment(dict.fromkeys(worst, POLLER_GROUPS[-1])))
    assert pattern.fullmatch("acme=-,globex=-")  # RELAY_POLLER_GROUPS=ungrouped
    for refused in (UNGROUPED, "acme=", "acme=10", "acme=A", "acme", "acme=0,", "acme=-,globex=0"):
        assert not pattern.fullmatch(refused), refused
    relay_maximum = Template(REPO / "template.yaml").document["Parameters"]["RelayMaximumPollers"]
    assert relay_maximum["Default"] == DEFAULT_RELAY_MAXIMUM_POLLERS
    assert (relay_maximum["MinValue"], relay_maximum["MaxValue"]) == (1, deploy_check.MOST_MAXIMUM_POLLERS)


def _tenants_of_characters(count: int, characters: int) -> list[str]:
    """`count` distinct ids whose list is exactly `characters` long."""
    ids = [f"t{n}" for n in range(count)]
    short = characters - len(",".join(ids))
    return [f"{tenant}{'x' * (short // count + (n < short % count))}" for n, tenant in enumerate(ids)]


def test_the_assignment_of_the_most_tenants_fits_a_parameter_value_and_limits_checks_it() -> None:
    worst = _tenants_of_characters(max_tenants(0), MAX_TENANT_CHARACTERS)
    assignment = render_assignment(dict.fromkeys(worst, POLLER_GROUPS[-1]))

    assert len(",".join(worst)) == MAX_TENANT_CHARACTERS
    assert len(assignment.encode()) == MAX_TENANT_CHARACTERS + 2 * max_tenants(0) <= PARAMETER_VALUE_BYTES
    assert limit_refusal(worst, 0) is None


def test_limits_refuses_an_assignment_over_a_parameter_value(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a character maximum raised past what the assignment leaves room for
    monkeypatch.setattr(deploy_check, "MAX_TENANT_CHARACTERS", PARAMETER_VALUE_BYTES)
    tenants = _tenants_of_characters(max_tenants(0), 3800)

    refusal = limit_refusal(tenants, 0)

    assert refusal is not None
    assert f"are {3800 + 2 * len(tenants):,} bytes, over CloudFormation's 4,096" in refusal


# --- the assignment ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("count", "aliases"), [(1, 0), (100, 0), (101, 0), (446, 0), (223, 1), (148, 2)])
def test_the_assignment_fills_groups_in_order_within_lambdas_limits(count: int, aliases: int) -> None:
    tenants = [f"t{n}" for n in range(count)]

    groups = assign_poller_groups(tenants, 1 + aliases, DEFAULT_RELAY_MAXIMUM_POLLERS, {}, {})

    assert list(groups) == tenants
    sizes = {group: list(groups.values()).count(group) * (1 + aliases) for group in set(groups.values())}
    assert max(sizes.values()) <= MAPPINGS_A_POLLER_GROUP
    # First fit: as few groups as 100 mappings a group allows (a tenant's mappings are never split)
    assert len(sizes) == -(-count // (MAPPINGS_A_POLLER_GROUP // (1 + aliases)))
    assert poller_group_refusal(groups, tenants, 1 + aliases, DEFAULT_RELAY_MAXIMUM_POLLERS, {}, CLUSTER) is None


ONE_MAPPING = GroupLoad(1, DEFAULT_RELAY_MAXIMUM_POLLERS)  # what a deployed tenant without peer aliases holds


def test_a_redeploy_keeps_every_mapping_in_its_group() -> None:
    # Given a deployed cell of 150 tenants beside another cell's 30 mappings in group 2
    tenants = [f"t{n}" for n in range(150)]
    others = {"2": GroupLoad(30, 90)}
    deployed = assign_poller_groups(tenants, 1, DEFAULT_RELAY_MAXIMUM_POLLERS, others, {})

    # When it is redeployed as it is, and with one tenant fewer and one more
    same = assign_poller_groups(tenants, 1, DEFAULT_RELAY_MAXIMUM_POLLERS, others, deployed, ONE_MAPPING)
    again = assign_poller_groups([*tenants[1:], "new"], 1, DEFAULT_RELAY_MAXIMUM_POLLERS, others, deployed, ONE_MAPPING)

    # Then no mapping moves, and the new tenant does not take the room t0 leaves in group 0: CloudFormation deletes
    # t0's mapping in the update's cleanup, after it has created the new one, so for a while group 0 holds both
    assert same == deployed
    assert {tenant: again[tenant] for tenant in tenants[1:]} == {tenant: deployed[tenant] for tenant in tenants[1:]}
    assert (deployed["t0"], again["new"]) == ("0", "1")


def test_a_tenant_moves_only_when_its_group_has_no_room_left_for_its_growth() -> None:
    # Given two deployed tenants in group 0 beside another cell's 97 mappings (1,999 MaximumPollers in all)
    previous, others = {"a": "0", "b": "0"}, {"0": GroupLoad(97, 1993)}

    # When RelayMaximumPollers goes from 3 to 4: room for one more poller in group 0
    moved = assign_poller_groups(["a", "b"], 1, 4, others, previous, ONE_MAPPING)

    # Then the first stays and grows there, the second moves (its 3 pollers still counted in group 0 meanwhile)
    assert moved == {"a": "0", "b": "1"}
    assert poller_group_refusal(moved, ["a", "b"], 1, 4, others, CLUSTER, previous, ONE_MAPPING) is None
    assert poller_group_refusal({"a": "0", "b": "0"}, ["a", "b"], 1, 4, others, CLUSTER, previous, ONE_MAPPING)


def test_a_given_assignment_is_refused_when_a_group_would_be_over_while_the_update_runs() -> None:
    # Given tenant a deployed in group 0 beside another cell's 99 mappings: group 0 is full
    previous, others = {"a": "0"}, {"0": GroupLoad(99, 297)}

    # When a is moved to group 1 and b given group 0, the room a leaves
    refusal = poller_group_refusal({"a": "1", "b": "0"}, ["a", "b"], 1, 3, others, CLUSTER, previous, ONE_MAPPING)

    # Then it is refused: a leaves group 0 in parallel with b's creation, not before it
    assert refusal is not None
    assert "would hold 101 mappings" in refusal
    assert "count where they are until its update completes" in refusal
    assert poller_group_refusal({"a": "1", "b": "0"}, ["a", "b"], 1, 3, others, CLUSTER) is None


def test_the_load_of_a_group_counts_every_other_stacks_mapping_and_not_the_stacks_own() -> None:
    def mapping(uuid: str, group: str, pollers: int | None = None) -> dict[str, Any]:
        config: dict[str, Any] = {"MinimumPollers": 1, "PollerGroupName": poller_group_name(CLUSTER, group)}
        if pollers is not None:
            config["MaximumPollers"] = pollers
        return {"UUID": uuid, "ProvisionedPollerConfig": config}

    listed = [
        mapping("own", "0", 3),
        mapping("theirs", "0", 3),
        mapping("default", "1"),  # no MaximumPollers: Lambda's default, 200
        {"UUID": "ungrouped", "ProvisionedPollerConfig": {"MinimumPollers": 1}},
        {"UUID": "someone-elses", "ProvisionedPollerConfig": {"PollerGroupName": "other-0"}},
        {"UUID": "on-demand"},
    ]

    assert group_loads(listed, CLUSTER, frozenset({"own"})) == {"0": GroupLoad(1, 3), "1": GroupLoad(1, 200)}


# --- refusals ------------------------------------------------------------------------------------------------


def _refusal(assignment: dict[str, str], tenants: list[str], **more: Any) -> str | None:
    given: dict[str, Any] = {"mappings_a_tenant": 1, "maximum_pollers": DEFAULT_RELAY_MAXIMUM_POLLERS, "taken": {}}
    given.update(more)
    return poller_group_refusal(
        assignment, tenants, given["mappings_a_tenant"], given["maximum_pollers"], given["taken"], CLUSTER
    )


@pytest.mark.parametrize(
    ("assignment", "tenants", "more", "said"),
    [
        # RelayMaximumPollers too high for a tenant's three mappings: 3 x 700 is over 2,000 in any group
        ({"a": "0"}, ["a"], {"mappings_a_tenant": 3, "maximum_pollers": 700}, "lower RelayMaximumPollers to 666"),
        # Every group of the cluster full: nowhere to go
        ({}, ["a"], {"taken": dict.fromkeys(POLLER_GROUPS, FULL)}, "no poller group for a: each of the cluster's 36"),
        # Given explicitly, over a group's 100 mappings beside another cell's 99
        ({"a": "0", "b": "0"}, ["a", "b"], {"taken": {"0": GroupLoad(99, 297)}}, "would hold 101 mappings"),
        # Given explicitly, over a group's 2,000 MaximumPollers
        ({"a": "0"}, ["a"], {"maximum_pollers": 201, "taken": {"0": GroupLoad(10, 1800)}}, "2,001 MaximumPollers"),
        ({"a": "0"}, ["a", "b"], {}, "no poller group for b"),
        ({"a": "0", "z": "0"}, ["a"], {}, "names z, not in TENANTS"),
        ({"a": "A"}, ["a"], {}, "the group 'A'"),
        ({"a": "10"}, ["a"], {}, "the group '10'"),
    ],
)
def test_an_assignment_lambda_would_refuse_is_refused_in_one_line(
    assignment: dict[str, str], tenants: list[str], more: dict[str, Any], said: str
) -> None:
    refusal = _refusal(assignment, tenants, **more)

    assert refusal is not None
    assert said in refusal
    assert "\n" not in refusal
    assert "docs/operations.md#poller-groups" in refusal


def test_the_computed_assignment_is_refused_when_every_group_is_full() -> None:
    full = dict.fromkeys(POLLER_GROUPS, FULL)

    groups = assign_poller_groups(["a"], 1, DEFAULT_RELAY_MAXIMUM_POLLERS, full, {})

    assert groups == {}
    assert _refusal(groups, ["a"], taken=full) is not None


def test_a_cluster_whose_group_names_lambda_would_refuse_is_refused() -> None:
    odd = "arn:aws:kafka:us-east-1:111122223333:cluster/poimen/not.a.uuid"

    refusal = poller_group_refusal({"a": "0"}, ["a"], 1, 3, {}, odd)

    assert refusal is not None
    assert "PollerGroupName is 1-128" in refusal


def test_ungrouped_is_never_refused_but_only_for_every_tenant() -> None:
    assert _refusal({"a": "-", "b": "-"}, ["a", "b"], maximum_pollers=2000, mappings_a_tenant=3) is None
    assert "the group '-'" in str(_refusal({"a": "-", "b": "0"}, ["a", "b"]))
    # A tenant deployed ungrouped is grouped by the next deploy that computes the groups
    assert assign_poller_groups(["a"], 1, DEFAULT_RELAY_MAXIMUM_POLLERS, {}, {"a": "-"}) == {"a": "0"}


# --- what make deploy runs -----------------------------------------------------------------------------------


def _clients(
    stack: dict[str, Any] | None,
    resources: list[str],
    listed: list[dict[str, Any]],
    cells: list[dict[str, Any]] | None = None,
    change_sets: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] | None = None,
) -> tuple[Any, Any]:
    """CloudFormation and Lambda clients answering as AWS would (botocore's Stubber: requests and answers checked
    against the services' models; moto cannot create an MSK event source mapping): the stack, its resources, the
    cluster's mappings, then every stack of the Region (the stack and `cells`) and each cell's change sets (by stack
    name: (summary, described))."""
    cloudformation = boto3.client("cloudformation", region_name="us-east-1")
    lambda_ = boto3.client("lambda", region_name="us-east-1")
    cf_stub, lambda_stub = Stubber(cloudformation), Stubber(lambda_)
    if stack is None:
        cf_stub.add_client_error(
            "describe_stacks", "ValidationError", "Stack with id S does not exist", expected_params={"StackName": "S"}
        )
    else:
        cf_stub.add_response("describe_stacks", {"Stacks": [stack]}, {"StackName": "S"})
        summaries = [
            {
                "LogicalResourceId": f"RelaySource{uuid}",
                "PhysicalResourceId": _uuid(uuid),
                "ResourceType": "AWS::Lambda::EventSourceMapping",
                "LastUpdatedTimestamp": "2026-12-01T00:00:00Z",
                "ResourceStatus": "CREATE_COMPLETE",
            }
            for uuid in resources
        ]
        cf_stub.add_response("list_stack_resources", {"StackResourceSummaries": summaries}, {"StackName": "S"})
    lambda_stub.add_response("list_event_source_mappings", {"EventSourceMappings": listed}, {"EventSourceArn": CLUSTER})
    every = [*([stack] if stack is not None else []), *(cells or [])]
    cf_stub.add_response("describe_stacks", {"Stacks": every}, {})
    for each in every:
        keys = {parameter["ParameterKey"] for parameter in each.get("Parameters", [])}
        if {"Tenants", "MskClusterArn"} <= keys or each["StackStatus"] == "REVIEW_IN_PROGRESS":
            pending = (change_sets or {}).get(each["StackName"], [])
            summaries = [summary for summary, _ in pending]
            cf_stub.add_response("list_change_sets", {"Summaries": summaries}, {"StackName": each["StackId"]})
            for summary, described in pending:
                cf_stub.add_response("describe_change_set", described, {"ChangeSetName": summary["ChangeSetId"]})
    cf_stub.activate()
    lambda_stub.activate()
    return cloudformation, lambda_


def _uuid(name: str) -> str:
    """A mapping's UUID (36 characters, as Lambda's model requires) standing for `name`."""
    return f"{name:0>12}".replace("-", "0")[-12:].join(["00000000-0000-0000-0000-", ""])


def _esm(uuid: str, group: str, topic: str = "poimen.other.dispatch", pollers: int = 3) -> dict[str, Any]:
    config = {"MinimumPollers": 1, "MaximumPollers": pollers, "PollerGroupName": poller_group_name(CLUSTER, group)}
    return {"UUID": _uuid(uuid), "EventSourceArn": CLUSTER, "Topics": [topic], "ProvisionedPollerConfig": config}


def test_the_deployed_groups_leave_out_the_stacks_own_mappings_and_keep_its_parameters() -> None:
    stack = _own_stack(
        "UPDATE_COMPLETE", RelayPollerGroups="acme=1", RelayMaximumPollers="5", DispatchSources="Source,Peer1Source"
    )
    cloudformation, lambda_ = _clients(
        stack, ["own-1"], [_esm("own-1", "1", "poimen.acme.dispatch"), _esm("other-1", "1")]
    )

    deployed = deployed_groups(cloudformation, lambda_, "S", CLUSTER)

    assert deployed.taken == {"1": GroupLoad(1, 3)}
    assert (deployed.previous, deployed.maximum_pollers, deployed.held) == ("acme=1", "5", {"acme": GroupLoad(1, 3)})


@pytest.mark.parametrize(
    ("status", "parameter", "listed_own", "expected"),
    [
        # A failed creation rolled back: its mappings are deleted, whatever its parameters still say
        ("ROLLBACK_COMPLETE", "acme=0,globex=0", [], "RelayPollerGroups=acme=0,globex=1\n"),
        # An update that moved acme to group 1 rolled back: acme's mapping is in group 0 again, and stays there
        (
            "UPDATE_ROLLBACK_COMPLETE",
            "acme=1,globex=1",
            [("own-a", "0", "poimen.acme.dispatch")],
            "RelayPollerGroups=acme=0,globex=1\n",
        ),
        # A tenant whose peer alias's mapping is where its own is: one tenant, not two
        (
            "UPDATE_COMPLETE",
            "acme=0",
            [("own-a", "0", "poimen.acme.dispatch"), ("own-b", "0", "west.poimen.acme.dispatch")],
            "RelayPollerGroups=acme=0,globex=1\n",
        ),
    ],
)
def test_the_group_check_counts_the_stacks_own_mappings_where_lambda_has_them(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    status: str,
    parameter: str,
    listed_own: list[tuple[str, str, str]],
    expected: str,
) -> None:
    # Given a stack whose parameters say where its tenants were meant to be, its mappings where Lambda has them,
    # and another cell's mappings in group 0 leaving room for one tenant more than the stack's own there
    stack = {
        "StackName": "S",
        "CreationTime": "2026-12-01T00:00:00Z",
        "StackStatus": status,
        "Parameters": [
            {"ParameterKey": "RelayPollerGroups", "ParameterValue": parameter},
            {"ParameterKey": "DispatchSources", "ParameterValue": "Source" + ",Peer1Source" * (len(listed_own) > 1)},
        ],
    }
    others = 100 - max(1, len(listed_own))
    listed = [_esm(f"other-{n}", "0") for n in range(others)] + [_esm(*own) for own in listed_own]
    cloudformation, lambda_ = _clients(stack, ["own-a", "own-b", "own-g"], listed)

    # When make deploy's group check runs
    code = _group_check(
        monkeypatch,
        cloudformation,
        lambda_,
        "acme,globex",
        "DispatchSources=Source" + ",Peer1Source" * (len(listed_own) > 1),
    )

    # Then it computes from the mappings Lambda has (none held for a rolled-back creation: no room given away for
    # them, no refusal of a group they would overfill), not from the parameters
    assert (code, *capsys.readouterr()) == (0, expected, "")


def test_a_removed_tenants_mapping_holds_its_maximum_pollers_as_lambda_lists_them_until_the_cleanup(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given acme's mapping in group 0 at 1,000 MaximumPollers (raised by hand in an incident; the stack still says
    # RelayMaximumPollers 3), beside another cell's mapping of 1,000: group 0 is full
    stack = _own_stack("UPDATE_COMPLETE", RelayPollerGroups="acme=0", RelayMaximumPollers="3")
    listed = [_esm("other", "0", pollers=1000), _esm("own-a", "0", "poimen.acme.dispatch", pollers=1000)]
    cloudformation, lambda_ = _clients(stack, ["own-a"], listed)

    # When acme is replaced by globex
    code = _group_check(monkeypatch, cloudformation, lambda_, "globex", "DispatchSources=Source")

    # Then globex goes to group 1: acme's 1,000 pollers stay in group 0 until the update's cleanup deletes them
    assert (code, *capsys.readouterr()) == (0, "RelayPollerGroups=globex=1\n", "")


def _cell_stack(name: str, status: str, tenants: list[str], groups: str) -> dict[str, Any]:
    """Another cell's stack (or, `groups` given, its parameters as a change set describes them) on the cluster."""
    return {
        "StackName": name,
        "StackId": f"arn:aws:cloudformation:us-east-1:111122223333:stack/{name}/1",
        "CreationTime": "2026-12-01T00:00:00Z",
        "StackStatus": status,
        "Parameters": [
            {"ParameterKey": "Tenants", "ParameterValue": ",".join(tenants)},
            {"ParameterKey": "MskClusterArn", "ParameterValue": CLUSTER},
            {"ParameterKey": "Cell", "ParameterValue": name.lower()},
            {"ParameterKey": "RelayPollerGroups", "ParameterValue": groups},
        ]
        if groups
        else [],
    }


def _change_set(stack: dict[str, Any], tenants: list[str], groups: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A change set of `stack` not yet executed (sam deploy waiting for its confirmation): summary, described."""
    cell = _cell_stack(stack["StackName"], "REVIEW_IN_PROGRESS", tenants, groups)
    arn = f"arn:aws:cloudformation:us-east-1:111122223333:changeSet/samcli-deploy1/{stack['StackName']}"
    summary = {
        "StackId": stack["StackId"],
        "ChangeSetId": arn,
        "ChangeSetName": "samcli-deploy1",
        "Status": "CREATE_COMPLETE",
        "ExecutionStatus": "AVAILABLE",
    }
    described = {**summary, "StackName": stack["StackName"], "Parameters": cell["Parameters"], "Changes": []}
    return summary, described


@pytest.mark.parametrize("new_cell", [True, False])
def test_another_cells_change_set_not_yet_executed_holds_its_room_in_the_groups(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], new_cell: bool
) -> None:
    # Given cell t, on the cluster, waiting for the confirmation of a change set that puts 99 tenants in group 0:
    # a new stack (none of its mappings created yet), or a deployed one with 50 of them and 49 more to come
    theirs = [f"t{n}" for n in range(99)]
    deployed = [] if new_cell else theirs[:50]
    stack = _cell_stack(
        "T",
        "REVIEW_IN_PROGRESS" if new_cell else "UPDATE_COMPLETE",
        deployed,
        render_assignment(dict.fromkeys(deployed, "0")),
    )
    pending = _change_set(stack, theirs, render_assignment(dict.fromkeys(theirs, "0")))
    listed = [_esm(f"t{n}", "0", f"poimen.{tenant}.dispatch") for n, tenant in enumerate(deployed)]
    cloudformation, lambda_ = _clients(None, [], listed, [stack], {"T": [pending]})

    # When make deploy's group check runs for this cell before t's change set is executed
    code = _group_check(monkeypatch, cloudformation, lambda_, "acme,globex", "DispatchSources=Source")

    # Then group 0 has room for one tenant only: t's 99 mappings count there though Lambda lists at most 50
    assert (code, *capsys.readouterr()) == (0, "RelayPollerGroups=acme=0,globex=1\n", "")


def test_a_group_another_cell_overfills_refuses_only_that_cell_not_this_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given another function's mapping in group 0, and cell t's change set (made by hand, without make deploy)
    # putting 100 tenants there: Lambda will refuse one of t's mappings
    theirs = [f"t{n}" for n in range(100)]
    stack = _cell_stack("T", "REVIEW_IN_PROGRESS", [], "")
    pending = _change_set(stack, theirs, render_assignment(dict.fromkeys(theirs, "0")))
    cloudformation, lambda_ = _clients(None, [], [_esm("someone", "0")], [stack], {"T": [pending]})

    # When this cell's group check runs
    code = _group_check(monkeypatch, cloudformation, lambda_, "acme", "DispatchSources=Source")

    # Then its tenant goes to group 1 and nothing is refused: this deploy adds nothing to group 0
    assert (code, *capsys.readouterr()) == (0, "RelayPollerGroups=acme=1\n", "")


def test_each_deployed_tenant_grows_from_what_its_own_mappings_hold(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given group 0 at 1,999 MaximumPollers: another cell's 996, acme's mapping raised by hand to 1,000, globex's 3
    stack = _own_stack("UPDATE_COMPLETE", RelayPollerGroups="acme=0,globex=0")
    listed = [
        _esm("other", "0", pollers=996),
        _esm("own-a", "0", "poimen.acme.dispatch", pollers=1000),
        _esm("own-g", "0", "poimen.globex.dispatch", pollers=3),
    ]
    cloudformation, lambda_ = _clients(stack, ["own-a", "own-g"], listed)

    # When RelayMaximumPollers goes from 3 to 5
    code = _group_check(
        monkeypatch, cloudformation, lambda_, "acme,globex", "DispatchSources=Source", "--maximum-pollers", "5"
    )

    # Then globex's 2 pollers more do not fit group 0 and it moves (acme, lowered to 5, stays): its growth is from
    # its own 3, not from the 1,000 of the tenant holding most
    assert (code, *capsys.readouterr()) == (0, "RelayPollerGroups=acme=0,globex=1\n", "")


def _own_stack(status: str, **parameters: str) -> dict[str, Any]:
    """Stack S as CloudFormation describes it: `status`, with these parameters."""
    return {
        "StackName": "S",
        "CreationTime": "2026-12-01T00:00:00Z",
        "StackStatus": status,
        "Parameters": [{"ParameterKey": key, "ParameterValue": value} for key, value in parameters.items()],
    }


def _group_check(
    monkeypatch: pytest.MonkeyPatch, cloudformation: Any, lambda_: Any, tenants: str, sources: str, *extra: str
) -> int:
    """make deploy's group check for `tenants` (of the kinds `sources`) on CLUSTER, AWS answering as the given
    clients do."""
    monkeypatch.setattr(boto3, "client", {"cloudformation": cloudformation, "lambda": lambda_}.get)
    arguments = ["--tenants", tenants, "--msk-cluster-arn", CLUSTER, "--dispatch-sources", sources, *extra]
    return main(["--prog", "make deploy", "groups", "--stack-name", "S", *arguments])


def _run_groups(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], listed: list[dict[str, Any]], *extra: str
) -> tuple[int, str, str]:
    cloudformation, lambda_ = _clients(None, [], listed)
    code = _group_check(monkeypatch, cloudformation, lambda_, "acme,globex", "DispatchSources=Source", *extra)
    out, err = capsys.readouterr()
    return code, out, err


def test_make_deploys_group_check_prints_the_assignment_beside_the_other_cells(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given another cell's 99 mappings in group 0
    listed = [_esm(f"other-{n}", "0") for n in range(99)]

    code, out, err = _run_groups(monkeypatch, capsys, listed)

    # Then one tenant fills group 0 and the other goes to group 1
    assert (code, out, err) == (0, "RelayPollerGroups=acme=0,globex=1\n", "")


def test_make_deploys_group_check_refuses_what_lambda_would_refuse_in_one_line_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    listed = [_esm(f"other-{n}", "0") for n in range(99)]

    code, out, err = _run_groups(monkeypatch, capsys, listed, "--poller-groups", "acme=0,globex=0")

    assert (code, out) == (2, "")
    (line,) = err.splitlines()
    assert line.startswith("make deploy: poller group poimen-5f0c3a1e-8d2b-4c6a-9e1f-2b7d4c8a6e30-2-0 would hold 101")


def test_make_deploys_group_check_names_a_tenant_given_no_group_as_such(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # When the operator's RELAY_POLLER_GROUPS leaves out globex, on a cluster whose groups are empty
    code, out, err = _run_groups(monkeypatch, capsys, [], "--poller-groups", "acme=0")

    # Then the one line says so, not that every one of the cluster's groups is full
    assert (code, out) == (2, "")
    (line,) = err.splitlines()
    assert line.startswith("make deploy: RELAY_POLLER_GROUPS gives globex no group: give each tenant of TENANTS one")
    assert "would be over" not in line


def test_make_deploys_group_check_refuses_a_tenant_given_two_groups(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # When a tired operator gives acme twice, the second time to the group with room
    listed = [_esm(f"other-{n}", "0") for n in range(98)]
    code, out, err = _run_groups(monkeypatch, capsys, listed, "--poller-groups", "acme=0,globex=0,acme=1")

    # Then it is refused in one line, not silently deployed with one of the two (which, the operator cannot tell)
    assert (code, out) == (2, "")
    (line,) = err.splitlines()
    assert line.startswith("make deploy: RELAY_POLLER_GROUPS gives acme more than one group")


@pytest.mark.parametrize("maximum_pollers", ["5O", "0", "2001", "-1", "3.5"])
def test_make_deploys_group_check_refuses_a_relay_maximum_pollers_the_template_refuses(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], maximum_pollers: str
) -> None:
    # When samconfig.toml's overrides give RelayMaximumPollers a typo or a value out of the template's range
    code, out, err = _run_groups(monkeypatch, capsys, [], "--maximum-pollers", maximum_pollers)

    # Then it is refused in one line, exit 2 (not a traceback, nor an assignment computed for it)
    assert (code, out) == (2, "")
    (line,) = err.splitlines()
    assert line.startswith(f"make deploy: RelayMaximumPollers {maximum_pollers!r} is not a whole number of 1 to 2000")


@pytest.mark.parametrize("given", [UNGROUPED, "acme=-,globex=-"])  # by name, or every tenant '-' by hand
def test_make_deploys_group_check_says_what_ungrouped_costs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], given: str
) -> None:
    code, out, err = _run_groups(monkeypatch, capsys, [], "--poller-groups", given)

    assert (code, out) == (0, "RelayPollerGroups=acme=-,globex=-\n")
    assert "an EPU of its own, about $135 a month a mapping" in err


def test_make_deploy_passes_the_groups_it_checked_to_every_sam_deploy() -> None:
    given = ["TENANTS=acme", "MSK_CLUSTER_ARN=x", "KAFKA_BOOTSTRAP_SERVERS=b", "OUTBOX_SUBNET_IDS=s"]
    result = subprocess.run(
        ["make", "-n", "deploy", *given, "OUTBOX_SECURITY_GROUP_IDS=g", "RELAY_POLLER_GROUPS=acme=3"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={"PATH": "/usr/bin:/bin"},
    )
    commands = result.stdout.replace("\\\n", " ").splitlines()

    (check,) = [line for line in commands if "deploy_check.py" in line and " groups " in line]
    assert '--poller-groups "acme=3"' in check
    assert '--dispatch-sources "$(cat .aws-sam/dispatch-sources.parameter)"' in check
    assert check.rstrip().endswith("> .aws-sam/poller-groups.parameter")
    deploys = result.stdout.split("sam deploy ")[1:]
    assert len(deploys) == 3  # the hold, the change, the settling (RunRetentionDays)
    assert all('"$(cat .aws-sam/poller-groups.parameter)"' in deploy.split("\n")[0] for deploy in deploys)


def test_make_deploys_group_check_deploys_nothing_when_lambda_cannot_be_read(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a role without lambda:ListEventSourceMappings
    cloudformation = boto3.client("cloudformation", region_name="us-east-1")
    lambda_ = boto3.client("lambda", region_name="us-east-1")
    cf_stub, lambda_stub = Stubber(cloudformation), Stubber(lambda_)
    cf_stub.add_client_error("describe_stacks", "ValidationError", "Stack with id S does not exist")
    lambda_stub.add_client_error("list_event_source_mappings", "AccessDeniedException", "not authorized")
    cf_stub.activate()
    lambda_stub.activate()

    code = _group_check(monkeypatch, cloudformation, lambda_, "acme", "DispatchSources=Source")

    # Then it exits 3 with one line, and prints no parameter to deploy with
    out, err = capsys.readouterr()
    assert (code, out) == (3, "")
    (line,) = err.splitlines()
    assert line.startswith("make deploy: could not read the cluster's poller groups from Lambda and CloudFormation")
    assert line.endswith("nothing deployed")


def _full_cluster() -> list[dict[str, Any]]:
    """Every poller group of the cluster holding 100 mappings of other stacks."""
    return [_esm(f"{group}-{n}", group) for group in POLLER_GROUPS for n in range(MAPPINGS_A_POLLER_GROUP)]


def test_make_deploys_group_check_puts_no_on_demand_mapping_in_a_group(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a cluster whose every poller group is full, and a deploy with RelayEventPollers=on-demand
    code, out, err = _run_groups(monkeypatch, capsys, _full_cluster(), "--event-pollers", "on-demand")

    # Then its mappings, which join no group on-demand, are not refused: every tenant ungrouped, nothing counted
    assert (code, out, err) == (0, "RelayPollerGroups=acme=-,globex=-\n", "")


def test_a_redeploy_of_an_on_demand_stack_counts_it_in_no_group(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given the stack deployed on-demand (sam deploy keeps RelayEventPollers when it is not given), with the groups
    # an earlier provisioned deploy gave it, and every group of the cluster full of other stacks' mappings
    stack = _own_stack("UPDATE_COMPLETE", RelayPollerGroups="acme=0,globex=0", RelayEventPollers="on-demand")
    cloudformation, lambda_ = _clients(stack, [], _full_cluster())

    # When make deploy redeploys it without naming the mode
    code = _group_check(monkeypatch, cloudformation, lambda_, "acme,globex", "DispatchSources=Source")

    # Then it stays on-demand, ungrouped, and is not refused for groups it does not use
    out, err = capsys.readouterr()
    assert (code, out, err) == (0, "RelayPollerGroups=acme=-,globex=-\n", "")


def test_make_deploy_passes_the_poller_mode_it_deploys_with_to_the_group_check() -> None:
    given = ["TENANTS=acme", "MSK_CLUSTER_ARN=x", "KAFKA_BOOTSTRAP_SERVERS=b", "OUTBOX_SUBNET_IDS=s"]
    result = subprocess.run(
        ["make", "-n", "deploy", *given, "OUTBOX_SECURITY_GROUP_IDS=g"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={"PATH": "/usr/bin:/bin"},
    )
    (check,) = [line for line in result.stdout.replace("\\\n", " ").splitlines() if " groups " in line]
    assert '--event-pollers ""' in check  # samconfig.toml's dev overrides name none: the deployed stack's


def test_a_switch_to_on_demand_is_refused_while_the_stacks_mappings_are_provisioned(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given the stack deployed provisioned, its mapping in group 0
    stack = _own_stack("UPDATE_COMPLETE", RelayPollerGroups="acme=0")
    cloudformation, lambda_ = _clients(stack, ["own-1"], [_esm("own-1", "0")])

    # When make deploy is asked for on-demand pollers
    code = _group_check(
        monkeypatch, cloudformation, lambda_, "acme", "DispatchSources=Source", "--event-pollers", "on-demand"
    )

    # Then it deploys nothing and says, in one line, which mapping to clear first and how: a template that drops
    # ProvisionedPollerConfig leaves provisioned mode on (and billed) on a mapping that has it
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    (line,) = err.splitlines()
    assert line.startswith("make deploy: RelayEventPollers=on-demand, but 1 of the stack's mappings is provisioned")
    assert f"--uuid {_uuid('own-1')} --provisioned-poller-config '{{}}'" in line


def test_make_deploys_group_check_prices_no_epu_for_on_demand_mappings(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run_groups(monkeypatch, capsys, [], "--poller-groups", UNGROUPED, "--event-pollers", "on-demand")

    # On-demand mappings take no EPU: nothing about the $135 an ungrouped provisioned mapping costs
    assert (code, out, err) == (0, "RelayPollerGroups=acme=-,globex=-\n", "")


def _by_hand_change_set(groups: str, event_pollers: str = "provisioned") -> tuple[dict[str, Any], Any]:
    """Cell t's stack, not yet created, and its change set made by sam deploy by hand (no make deploy): 100 tenants,
    RelayPollerGroups and RelayEventPollers as given (CloudFormation lists a parameter left to its default too)."""
    stack = _cell_stack("T", "REVIEW_IN_PROGRESS", [], "")
    summary, described = _change_set(stack, [f"t{n}" for n in range(100)], "x=0")
    parameters = [p for p in described["Parameters"] if p["ParameterKey"] != "RelayPollerGroups"]
    parameters += [
        {"ParameterKey": "RelayPollerGroups", "ParameterValue": groups},
        {"ParameterKey": "RelayEventPollers", "ParameterValue": event_pollers},
    ]
    return stack, (summary, {**described, "Parameters": parameters})


@pytest.mark.parametrize("groups", ["", "t0=-", "t0=0,t1=0"])
def test_another_cells_tenants_its_assignment_does_not_name_hold_room_in_group_0(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], groups: str
) -> None:
    # Given cell t's change set deployed by hand: RelayPollerGroups empty (the template's default) or naming a few
    # of its 100 tenants, so that the template puts the others in group 0 (",<RelayPollerGroups>,<tenant>=0")
    stack, pending = _by_hand_change_set(groups)
    cloudformation, lambda_ = _clients(None, [], [], [stack], {"T": [pending]})

    # When make deploy's group check runs for this cell
    code = _group_check(monkeypatch, cloudformation, lambda_, "acme,globex", "DispatchSources=Source")

    # Then t's 99 or 100 mappings count in group 0 (as the template places them; "t0=-" ungroups t0 only), and
    # this cell's tenants go where there is room: group 0 never past Lambda's 100 mappings
    expected = "acme=0,globex=1" if groups == "t0=-" else "acme=1,globex=1"
    assert (code, *capsys.readouterr()) == (0, f"RelayPollerGroups={expected}\n", "")


def test_another_cells_on_demand_tenants_hold_no_room_in_a_group(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given cell t's change set deployed on-demand by hand, its RelayPollerGroups (kept by sam deploy from an
    # earlier provisioned deploy) naming group 0 for each of its 100 tenants: on-demand, no mapping is in a group
    stack, pending = _by_hand_change_set(render_assignment({f"t{n}": "0" for n in range(100)}), "on-demand")
    cloudformation, lambda_ = _clients(None, [], [], [stack], {"T": [pending]})

    code = _group_check(monkeypatch, cloudformation, lambda_, "acme,globex", "DispatchSources=Source")

    # Then group 0 is empty for this cell's tenants
    assert (code, *capsys.readouterr()) == (0, "RelayPollerGroups=acme=0,globex=0\n", "")


def test_make_deploys_refusal_of_a_tenant_given_no_group_names_the_docs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _run_groups(monkeypatch, capsys, [], "--poller-groups", "acme=0")

    assert code == 2
    assert err.rstrip("\n").endswith(f"({deploy_check.POLLER_GROUPS_DOC})"), err
