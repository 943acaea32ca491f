"""template.yaml's multi-Region mode (docs/operations.md#multi-region), as CloudFormation gets it in each of
three Regions (poimen_tools.sam_transform, offline): the home stack creates the one MRSC global table, the
replica stacks use their Region's replica by name, the relay consumes the peer clusters' replicated dispatch
topics, the posture holds in every mode, and the deploy refuses what MRSC cannot do (the Rules, evaluated
here as CloudFormation evaluates them)."""

from __future__ import annotations

import fnmatch
import json
import re
from functools import cache
from typing import Any

import pytest

from poimen.kafka import CLUSTER_ALIAS_PATTERN, replicated_dispatch_topic, tenant_of_dispatch_topic
from poimen_tools.deploy_check import dispatch_sources
from poimen_tools.local.template import Template
from tests.conftest import REPO
from tests.unit.test_template_posture import _literal_placeholders
from tests.unit.transforms import sam_transform

TENANTS = ("acme", "beta-2")
STAGE = "dev"
TABLE_NAME = f"poimen-admission-{STAGE}"
LABEL = "2026-12-01T10:00:00.000"
HOME = {"TableMode": "global-home", "PeerRegion1": "us-east-2", "PeerRegion2": "us-west-2"}
# Each Region's stack: home us-east-1, replicas us-east-2 and us-west-2; and a home whose us-west-2 is the witness.
STACKS: dict[str, tuple[str, dict[str, str]]] = {
    "home": ("us-east-1", {**HOME, "PeerClusterAlias1": "east2", "PeerClusterAlias2": "west2"}),
    "replica-east-2": (
        "us-east-2",
        {
            "TableMode": "global-replica",
            "PeerRegion1": "us-east-1",
            "PeerRegion2": "us-west-2",
            "ReplicaStreamLabel": LABEL,
            "PeerClusterAlias1": "east1",
            "PeerClusterAlias2": "west2",
        },
    ),
    "replica-west-2": (
        "us-west-2",
        {
            "TableMode": "global-replica",
            "PeerRegion1": "us-east-1",
            "PeerRegion2": "us-east-2",
            "ReplicaStreamLabel": LABEL,
            "PeerClusterAlias1": "east1",
            "PeerClusterAlias2": "east2",
        },
    ),
    "home-with-witness": ("us-east-1", {**HOME, "WitnessRegion": "us-west-2", "PeerClusterAlias1": "east2"}),
}
for _region, _given in STACKS.values():  # the kinds make deploy derives from the aliases (deploy_check)
    _given["DispatchSources"] = dispatch_sources(
        (_given.get("PeerClusterAlias1", ""), _given.get("PeerClusterAlias2", ""))
    )
MODES = [("single", ("us-east-1", {})), *STACKS.items()]
ALIASES = {"home": ["east2", "west2"], "replica-east-2": ["east1", "west2"], "home-with-witness": ["east2"]}
# What differs between a tenant's mappings: the topic and its consumer group.
PER_TOPIC = ("Topics", "AmazonManagedKafkaEventSourceConfig")
KEY = "arn:aws:kms:{}:111122223333:key/1234abcd-12ab-34cd-56ef-1234567890ab"


@cache
def _transformed_in(region: str, **parameters: str) -> dict[str, Any]:
    """The template as CloudFormation gets it in `region`, offline (as tests/unit/test_template_posture.py)."""
    arguments = [f"{name}={value}" for name, value in {"Tenants": ",".join(TENANTS), **parameters}.items()]
    transformed: dict[str, Any] = json.loads(sam_transform(*arguments, region=region))
    return transformed


def _stack(name: str, **extra: str) -> dict[str, Any]:
    region, parameters = dict(MODES)[name]
    return _transformed_in(region, **parameters, **extra)


def _of_type(resources: dict[str, Any], kind: str) -> dict[str, Any]:
    return {name: res for name, res in resources.items() if res["Type"] == kind}


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def _role_statements(resources: dict[str, Any], function: str) -> list[dict[str, Any]]:
    """Every statement of the function's role: its inline policies and each IAM policy naming the role."""
    role = resources[f"{function}Role"]["Properties"]
    statements = [s for policy in role.get("Policies", []) for s in policy["PolicyDocument"]["Statement"]]
    for res in _of_type(resources, "AWS::IAM::Policy").values():
        if {"Ref": f"{function}Role"} in res["Properties"]["Roles"]:
            statements += res["Properties"]["PolicyDocument"]["Statement"]
    return statements


def _actions(statements: list[dict[str, Any]]) -> set[str]:
    return {action for s in statements for action in _as_list(s["Action"])}


def _statement(statements: list[dict[str, Any]], sid: str) -> dict[str, Any]:
    (found,) = [s for s in statements if s["Sid"] == sid]
    return found


# --- the table in each Region ---------------------------------------------------------------------------


def test_the_home_stack_creates_one_strong_global_table_over_three_replicas() -> None:
    resources = _stack("home")["Resources"]

    (name,) = _of_type(resources, "AWS::DynamoDB::GlobalTable")
    table = resources[name]["Properties"]
    assert not _of_type(resources, "AWS::DynamoDB::Table")
    assert table["MultiRegionConsistency"] == "STRONG"
    assert table["TableName"] == TABLE_NAME  # fixed: the replica stacks find it by name
    assert [replica["Region"] for replica in table["Replicas"]] == [{"Ref": "AWS::Region"}, "us-east-2", "us-west-2"]
    assert "GlobalTableWitnesses" not in table
    # The single-Region table's key, stream and protection, on every replica; no TTL (MRSC has none).
    assert table["KeySchema"] == [{"AttributeName": "pk", "KeyType": "HASH"}]
    assert table["StreamSpecification"] == {"StreamViewType": "NEW_IMAGE"}
    assert "TimeToLiveSpecification" not in table
    assert all(r["PointInTimeRecoverySpecification"] == {"PointInTimeRecoveryEnabled": True} for r in table["Replicas"])
    assert all(r["DeletionProtectionEnabled"] == "true" for r in table["Replicas"])
    assert resources[name]["DeletionPolicy"] == "Retain"
    # Admission and the outbox use it: its name, its replica's ARN and stream in this Region.
    admission = resources["AdmissionFunction"]["Properties"]
    assert admission["Environment"]["Variables"]["TABLE_NAME"] == {"Ref": name}
    put_get = _statement(_role_statements(resources, "AdmissionFunction"), "AdmitAndReadRuns")
    assert put_get["Resource"] == {"Fn::GetAtt": [name, "Arn"]}
    stream = _statement(_role_statements(resources, "OutboxRelayFunction"), "ReadTableStream")
    assert stream["Resource"] == {"Fn::GetAtt": [name, "StreamArn"]}
    assert resources["OutboxRelaySource"]["Properties"]["EventSourceArn"] == {"Fn::GetAtt": [name, "StreamArn"]}


def test_a_home_stack_with_a_witness_has_two_replicas_and_the_witness() -> None:
    resources = _stack("home-with-witness")["Resources"]

    ((_, table),) = _of_type(resources, "AWS::DynamoDB::GlobalTable").items()
    assert table["Properties"]["MultiRegionConsistency"] == "STRONG"
    assert [r["Region"] for r in table["Properties"]["Replicas"]] == [{"Ref": "AWS::Region"}, "us-east-2"]
    assert table["Properties"]["GlobalTableWitnesses"] == [{"Region": "us-west-2"}]


@pytest.mark.parametrize("stack", ["replica-east-2", "replica-west-2"])
def test_a_replica_stack_creates_no_table_and_uses_its_regions_replica_by_name(stack: str) -> None:
    resources = _stack(stack)["Resources"]
    table_arn = f"arn:${{AWS::Partition}}:dynamodb:${{AWS::Region}}:${{AWS::AccountId}}:table/{TABLE_NAME}"

    assert not [res for res in resources.values() if res["Type"].startswith("AWS::DynamoDB::")]
    admission = resources["AdmissionFunction"]["Properties"]
    assert admission["Environment"]["Variables"]["TABLE_NAME"] == TABLE_NAME
    put_get = _statement(_role_statements(resources, "AdmissionFunction"), "AdmitAndReadRuns")
    assert put_get["Resource"] == {"Fn::Sub": table_arn}
    # The replica's stream: by name and the label the deploy passes (ReplicaStreamLabel).
    outbox = _role_statements(resources, "OutboxRelayFunction")
    assert _statement(outbox, "ReadTableStream")["Resource"] == {"Fn::Sub": f"{table_arn}/stream/{LABEL}"}
    assert _statement(outbox, "ListTableStreams")["Resource"] == {"Fn::Sub": f"{table_arn}/stream/*"}
    assert resources["OutboxRelaySource"]["Properties"]["EventSourceArn"] == {"Fn::Sub": f"{table_arn}/stream/{LABEL}"}
    # The API, the relay and the outbox are all here.
    functions = _of_type(resources, "AWS::Lambda::Function")
    assert {"AdmissionFunction", "InboxRelayFunction", "OutboxRelayFunction"} <= set(functions)
    assert _of_type(resources, "AWS::ApiGatewayV2::Api")


@pytest.mark.parametrize(("mode", "stack"), MODES, ids=[mode for mode, _ in MODES])
def test_no_mode_creates_an_eventually_consistent_table(mode: str, stack: tuple[str, dict[str, str]]) -> None:
    resources = _transformed_in(stack[0], **stack[1])["Resources"]
    tables = _of_type(resources, "AWS::DynamoDB::Table")
    global_tables = _of_type(resources, "AWS::DynamoDB::GlobalTable")

    assert all(t["Properties"]["MultiRegionConsistency"] == "STRONG" for t in global_tables.values())
    assert len(global_tables) == (1 if mode.startswith("home") else 0)
    assert sorted(tables) == (["AdmissionTable"] if mode == "single" else [])


def test_strong_is_a_literal_no_parameter_can_change(template: Template) -> None:
    declared = [res for res in template.resources.values() if res["Type"] == "AWS::DynamoDB::GlobalTable"]

    assert [res["Properties"]["MultiRegionConsistency"] for res in declared] == ["STRONG"]
    assert "EVENTUAL" not in json.dumps(template.document["Parameters"])


# --- the relay: the peer clusters' replicated dispatch topics ------------------------------------------


def _relay_mappings(resources: dict[str, Any]) -> dict[str, dict[str, Any]]:
    mappings = _of_type(resources, "AWS::Lambda::EventSourceMapping")
    return {name: res for name, res in mappings.items() if name != "OutboxRelaySource"}


@pytest.mark.parametrize(("stack", "aliases"), ALIASES.items())
def test_one_more_event_source_per_tenant_and_peer_cluster_alias(stack: str, aliases: list[str]) -> None:
    resources = _stack(stack)["Resources"]
    mappings = _relay_mappings(resources)
    own = {tenant: mappings[f"RelaySource{tenant.replace('-', '')}"] for tenant in TENANTS}

    assert len(mappings) == len(TENANTS) * (1 + len(aliases))
    for number, alias in enumerate(aliases, start=1):
        for tenant in TENANTS:
            mapping = mappings[f"RelayPeer{number}Source{tenant.replace('-', '')}"]
            (topic,) = mapping["Properties"]["Topics"]
            assert topic == replicated_dispatch_topic(alias, tenant)
            assert tenant_of_dispatch_topic(topic) == tenant
            group = mapping["Properties"]["AmazonManagedKafkaEventSourceConfig"]["ConsumerGroupId"]
            assert group == f"poimen-relay-{tenant}.{alias}"
            # Everything else as the tenant's own mapping: alias, cluster, retries, parking, pollers, ordering.
            same = {k: v for k, v in mapping["Properties"].items() if k not in PER_TOPIC}
            assert same == {k: v for k, v in own[tenant]["Properties"].items() if k not in PER_TOPIC}
            assert mapping["DependsOn"] == own[tenant]["DependsOn"]
    groups = {m["Properties"]["AmazonManagedKafkaEventSourceConfig"]["ConsumerGroupId"] for m in mappings.values()}
    assert len(groups) == len(mappings)  # no two mappings share a consumer group


@pytest.mark.parametrize(("stack", "aliases"), ALIASES.items())
def test_the_relay_may_read_exactly_the_aliased_topics_and_their_groups(stack: str, aliases: list[str]) -> None:
    resources = _stack(stack)["Resources"]
    statements = _role_statements(resources, "InboxRelayFunction")
    topic_arns = [arn["Fn::Sub"] for arn in _as_list(_statement(statements, "MskDispatchTopics")["Resource"])]
    (group_arn,) = _as_list(_statement(statements, "MskRelayGroups")["Resource"])

    for mapping in _relay_mappings(resources).values():
        (topic,) = mapping["Properties"]["Topics"]
        group = mapping["Properties"]["AmazonManagedKafkaEventSourceConfig"]["ConsumerGroupId"]
        assert [arn for arn in topic_arns if fnmatch.fnmatchcase(topic, arn.rsplit("/", 1)[1])], topic
        assert fnmatch.fnmatchcase(group, group_arn["Fn::Sub"].rsplit("/", 1)[1]), group
    # The local topics' pattern and one per alias given: no other peer's topics.
    assert [arn.rsplit("/", 1)[1] for arn in topic_arns] == ["poimen.*.dispatch"] + [
        f"{alias}.poimen.*.dispatch" for alias in aliases
    ]
    # The pollers' network access is the same policy for every mapping (one cluster, one VPC).
    assert all("RelayMskNetworkAccess" in m["DependsOn"] for m in _relay_mappings(resources).values())


def test_no_alias_no_extra_event_source_and_no_extra_topic(template: Template) -> None:
    resources = _stack("single")["Resources"]
    statements = _role_statements(resources, "InboxRelayFunction")

    assert sorted(_relay_mappings(resources)) == ["RelaySourceacme", "RelaySourcebeta2"]
    (local,) = _as_list(_statement(statements, "MskDispatchTopics")["Resource"])
    assert local["Fn::Sub"].endswith("/poimen.*.dispatch")
    for name in ("PeerClusterAlias1", "PeerClusterAlias2"):
        parameter = template.document["Parameters"][name]
        assert parameter["Default"] == ""
        assert parameter["AllowedPattern"] == "^$|" + CLUSTER_ALIAS_PATTERN  # the code's one rule, or none


# --- posture in every mode ------------------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "stack"), MODES, ids=[mode for mode, _ in MODES])
def test_the_posture_holds_in_every_mode(mode: str, stack: tuple[str, dict[str, str]]) -> None:
    resources = _transformed_in(stack[0], **stack[1])["Resources"]
    relay = _actions(_role_statements(resources, "InboxRelayFunction"))
    outbox = _actions(_role_statements(resources, "OutboxRelayFunction"))
    admission = _actions(_role_statements(resources, "AdmissionFunction"))

    # The relay reaches runs only through POST /v1/runs; the outbox reads the stream and writes no item.
    assert not [action for action in relay if action.startswith("dynamodb:")], mode
    assert {a for a in outbox if a.startswith("dynamodb:")} == {
        "dynamodb:DescribeStream",
        "dynamodb:GetRecords",
        "dynamodb:GetShardIterator",
        "dynamodb:ListStreams",
    }
    assert {a for a in admission if a.startswith("dynamodb:")} == {"dynamodb:PutItem", "dynamodb:GetItem"}
    assert not [a for a in relay | outbox | admission if a == "*" or a.endswith(":*")]
    assert _literal_placeholders(resources) == []
    # Everything invokes the published alias.
    for mapping in _of_type(resources, "AWS::Lambda::EventSourceMapping").values():
        assert mapping["Properties"]["FunctionName"]["Ref"].endswith("Aliaslive")


def test_with_a_key_every_replica_is_encrypted_with_its_regions_key() -> None:
    keys = {"KmsKeyArn": KEY.format("us-east-1"), "PeerRegion1KmsKeyArn": KEY.format("us-east-2")}
    keys["PeerRegion2KmsKeyArn"] = KEY.format("us-west-2")
    resources = _stack("home", **keys)["Resources"]

    ((_, table),) = _of_type(resources, "AWS::DynamoDB::GlobalTable").items()
    assert table["Properties"]["SSESpecification"] == {"SSEEnabled": True, "SSEType": "KMS"}
    assert [r["SSESpecification"] for r in table["Properties"]["Replicas"]] == [
        {"KMSMasterKeyId": KEY.format(region)} for region in ("us-east-1", "us-east-2", "us-west-2")
    ]


def test_make_lint_scans_the_multi_region_stacks_as_transformed() -> None:
    makefile = (REPO / "Makefile").read_text()

    assert "$(CHECKOV_SCAN) --file .cache/checkov/template.home.transformed.json" in makefile
    assert "$(CHECKOV_SCAN) --file .cache/checkov/template.replica.transformed.json" in makefile
    assert "TableMode=global-home" in makefile
    assert "TableMode=global-replica" in makefile


# --- the refusals at deploy (CloudFormation Rules) -------------------------------------------------------


def _value(expression: Any, parameters: dict[str, Any], region: str) -> Any:
    """A Rules expression as CloudFormation evaluates it: Ref (parameters with their defaults, AWS::Region),
    Fn::Equals, Fn::Not, Fn::And, Fn::Or and Fn::Contains (the functions the template's Rules use)."""
    if not isinstance(expression, dict):
        return [_value(item, parameters, region) for item in expression] if isinstance(expression, list) else expression
    ((function, arguments),) = expression.items()
    if function == "Ref":
        return region if arguments == "AWS::Region" else parameters[arguments]
    values = [_value(argument, parameters, region) for argument in arguments]
    if function == "Fn::Equals":
        return str(values[0]) == str(values[1])
    if function == "Fn::Not":
        return not values[0]
    if function == "Fn::And":
        return all(values)
    if function == "Fn::Or":
        return any(values)
    if function == "Fn::Contains":
        return values[1] in values[0]
    raise AssertionError(f"a Rules function this evaluator does not know: {function}")


def _refusals(template: Template, region: str, **given: str) -> dict[str, list[str]]:
    """Rule name -> the AssertDescriptions of its failing assertions, for a deploy with `given` in `region`."""
    parameters: dict[str, Any] = {
        name: str(p.get("Default", "")) for name, p in template.document["Parameters"].items()
    }
    parameters.update(given)
    for name, declared in template.document["Parameters"].items():  # a list parameter's Ref is its list
        if declared["Type"] == "CommaDelimitedList":
            parameters[name] = parameters[name].split(",")
    refused: dict[str, list[str]] = {}
    for name, rule in template.document["Rules"].items():
        if "RuleCondition" in rule and not _value(rule["RuleCondition"], parameters, region):
            continue
        failing = [a["AssertDescription"] for a in rule["Assertions"] if not _value(a["Assert"], parameters, region)]
        if failing:
            refused[name] = failing
    return refused


@pytest.mark.parametrize(("mode", "stack"), MODES, ids=[mode for mode, _ in MODES])
def test_each_regions_stack_is_accepted(template: Template, mode: str, stack: tuple[str, dict[str, str]]) -> None:
    assert _refusals(template, stack[0], **stack[1]) == {}, mode


@pytest.mark.parametrize("mode", ["global-home", "global-replica"])
def test_run_retention_is_refused_in_multi_region_mode_because_mrsc_has_no_ttl(template: Template, mode: str) -> None:
    peers = {"PeerRegion1": "us-east-2", "PeerRegion2": "us-west-2", "ReplicaStreamLabel": LABEL}
    if mode == "global-home":
        peers.pop("ReplicaStreamLabel")

    refused = _refusals(template, "us-east-1", TableMode=mode, RunRetentionDays="30", **peers)

    assert list(refused) == ["MultiRegionHasNoRunRetention"]
    (reason,) = refused["MultiRegionHasNoRunRetention"]
    assert "RunRetentionDays" in reason
    assert "no TTL" in reason
    # In the transformed template too: CloudFormation gets the Rule.
    assert "MultiRegionHasNoRunRetention" in _stack("home")["Rules"]
    assert _refusals(template, "us-east-1", RunRetentionDays="30") == {}  # single-Region: TTL as before


@pytest.mark.parametrize(
    ("region", "given", "rule"),
    [
        ("us-east-1", {**HOME, "PeerRegion2": ""}, "MultiRegionHasTwoPeers"),
        ("us-east-1", {"TableMode": "global-home"}, "MultiRegionHasTwoPeers"),
        ("us-east-1", {**HOME, "PeerRegion2": "us-east-1"}, "MultiRegionHasTwoPeers"),
        ("us-east-1", {**HOME, "PeerRegion2": "us-east-2"}, "MultiRegionHasTwoPeers"),
        ("us-east-1", {**HOME, "PeerRegion2": "eu-west-1"}, "MultiRegionInOneRegionSet"),
        ("eu-west-1", {**HOME}, "MultiRegionInOneRegionSet"),
        ("us-east-1", {**HOME, "WitnessRegion": "us-east-1"}, "WitnessIsAPeer"),
        ("us-east-1", {"WitnessRegion": "us-west-2"}, "WitnessIsAPeer"),
        ("us-east-1", {"PeerRegion1": "us-east-2"}, "SingleRegionHasNoPeers"),
        ("us-east-1", {"ReplicaStreamLabel": LABEL}, "SingleRegionHasNoPeers"),
        ("us-east-2", {**HOME, "TableMode": "global-replica", "PeerRegion1": "us-east-1"}, "ReplicaUsesItsStream"),
        ("us-east-1", {**HOME, "ReplicaStreamLabel": LABEL}, "HomeStreamIsItsOwn"),
        ("us-east-1", {**HOME, "KmsKeyArn": KEY.format("us-east-1")}, "HomeKeysEveryReplica"),
        ("us-east-1", {"PeerClusterAlias1": "west", "PeerClusterAlias2": "west"}, "PeerClusterAliasesDiffer"),
        # DispatchSources (the loop of the relay's mappings) and the aliases disagree: a mapping on a topic
        # without an alias, or an alias without its mappings.
        ("us-east-1", {"PeerClusterAlias1": "east1"}, "DispatchSourcesMatchPeerClusterAlias1"),
        ("us-east-1", {"DispatchSources": "Source,Peer1Source"}, "DispatchSourcesMatchPeerClusterAlias1"),
        ("us-east-1", {"DispatchSources": "Source,Peer2Source"}, "DispatchSourcesMatchPeerClusterAlias2"),
        ("us-east-1", {"PeerClusterAlias2": "west2"}, "DispatchSourcesMatchPeerClusterAlias2"),
        (
            "us-east-1",
            {"DispatchSources": "Peer1Source", "PeerClusterAlias1": "east1"},
            "DispatchSourcesHaveTheTenantsOwn",
        ),
    ],
)
def test_inconsistent_regions_are_refused_with_a_reason(
    template: Template, region: str, given: dict[str, str], rule: str
) -> None:
    refused = _refusals(template, region, **given)

    assert rule in refused, refused
    assert all(len(reason.split()) >= 8 for reason in refused[rule])  # a reason, not a label


def test_a_witness_needs_no_key_of_its_own(template: Template) -> None:
    keys = {"KmsKeyArn": KEY.format("us-east-1"), "PeerRegion1KmsKeyArn": KEY.format("us-east-2")}

    assert _refusals(template, "us-east-1", **HOME, WitnessRegion="us-west-2", **keys) == {}


def test_every_rule_explains_itself_and_names_only_parameters(template: Template) -> None:
    rules = template.document["Rules"]
    refs = set(re.findall(r"'Ref': '([^']+)'", str(rules)))

    assert refs - {"AWS::Region"} <= set(template.document["Parameters"])
    assert all(assertion["AssertDescription"] for rule in rules.values() for assertion in rule["Assertions"])
