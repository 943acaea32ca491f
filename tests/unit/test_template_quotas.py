"""What AWS enforces at deploy, checked on template.yaml as CloudFormation gets it (SAM-transformed offline)
for 1, 50 and 200 tenants and the most one stack serves (poimen_tools.deploy_check), and one more, in every mode (single
Region, the multi-Region home and replica stacks) with 0, 1 and 2 peer cluster aliases, every option that adds
resources or policies on, tenant ids as long as the character maximum allows and the other values at their
longest: resources, outputs, mappings, parameters and their values, the template's size, each role's
policies and each function's environment. Each quota and its page: docs/operations.md#what-aws-enforces-at-deploy.
The template's quotas (resources, outputs, size) are counted on the template as declared, every Condition'd
resource kept: CloudFormation refuses "Number of resources, N, is greater than maximum allowed, 500" when it
validates the processed template, before any condition is evaluated. A role's policies and a function's
environment are measured on what the stack creates.
"""

from __future__ import annotations

import json
import re
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from poimen_tools.deploy_check import (
    DEFAULT_RELAY_MAXIMUM_POLLERS,
    MAX_EVENT_SOURCE_MAPPINGS,
    MAX_TENANT_CHARACTERS,
    OTHER_RESOURCES,
    GroupLoad,
    assign_poller_groups,
    dispatch_sources,
    limit_refusal,
    max_tenants,
    render_assignment,
)
from tests.conftest import REPO
from tests.unit.transforms import sam_transform

# CloudFormation quotas (User Guide, "Understand CloudFormation quotas").
RESOURCES = 500
OUTPUTS = 200
MAPPINGS = 200
MAPPING_ATTRIBUTES = 200
PARAMETERS = 200
PARAMETER_VALUE_BYTES = 4096
TEMPLATE_BODY_BYTES_IN_S3 = 1_000_000  # "1 MB"; Fn::ForEach's quotas apply to the resulting template
LOGICAL_ID_CHARACTERS = 255
DESCRIPTION_BYTES = 1024
# IAM quotas (IAM User Guide, "IAM and AWS STS quotas"): characters, whitespace not counted.
ROLE_INLINE_POLICIES_CHARACTERS = 10_240
MANAGED_POLICY_CHARACTERS = 6_144
MANAGED_POLICIES_PER_ROLE = 10
ROLE_TRUST_POLICY_CHARACTERS = 2_048
# Lambda quotas: every variable of a function, measured as Lambda measures it (the map as compact JSON).
ENVIRONMENT_BYTES = 4096

# The longest values a deploy can give where the template cannot know them.
PARTITION, REGION, ACCOUNT = "aws-us-gov", "ap-southeast-5", "123456789012"
PSEUDO = {
    "AWS::Partition": PARTITION,
    "AWS::Region": REGION,
    "AWS::AccountId": ACCOUNT,
    "AWS::URLSuffix": "amazonaws.com.cn",
    "AWS::StackName": "s" * 128,
}
CLUSTER_ARN = f"arn:aws:kafka:{REGION}:{ACCOUNT}:cluster/{'c' * 64}/5f0c3a1e-8d2b-4c6a-9e1f-2b7d4c8a6e30-25"
ALIASES = ("peer-one-" + "a" * 55, "peer-two-" + "b" * 55)  # 64 characters, the pattern's longest
KEY = f"arn:aws:kms:{REGION}:{ACCOUNT}:key/1234abcd-12ab-34cd-56ef-1234567890ab"
BROKERS = ",".join(f"b-{n}.{'p' * 40}.a1bcde.c12.kafka.{REGION}.amazonaws.com:9098" for n in range(1, 4))
# Every option that adds a resource or a statement on: a key, reserved concurrency, SnapStart, an alarm address.
HARDENED = {
    "MskClusterArn": CLUSTER_ARN,
    "KafkaBootstrapServers": BROKERS,
    "OutboxSubnetIds": ",".join(f"subnet-{n:017x}" for n in range(3)),
    "OutboxSecurityGroupIds": ",".join(f"sg-{n:017x}" for n in range(5)),
    "KmsKeyArn": KEY,
    "SnapStart": "PublishedVersions",
    "AdmissionReservedConcurrency": "1000",
    "RelayReservedConcurrency": "1000",
    "OutboxReservedConcurrency": "1000",
    "AlarmEmail": "oncall-" + "o" * 50 + "@example.com",
    "Stage": "s" * 16,
}
MODES = {
    "single": {"RunRetentionDays": "3650"},
    "home": {
        "TableMode": "global-home",
        "PeerRegion1": "us-east-2",
        "PeerRegion2": "us-west-2",
        "PeerRegion1KmsKeyArn": KEY,
        "PeerRegion2KmsKeyArn": KEY,
    },
    "replica": {
        "TableMode": "global-replica",
        "PeerRegion1": "us-east-1",
        "PeerRegion2": "us-west-2",
        "ReplicaStreamLabel": "2026-12-01T10:00:00.000",
    },
}


def _tenants(count: int, prefix: str = "t") -> list[str]:
    """`count` distinct tenant ids, each as long as the character maximum allows for that many (at most 63)."""
    length = min(63, (MAX_TENANT_CHARACTERS + 1) // count - 1)
    return [f"{prefix}{n:0{length - 1}d}" for n in range(count)]


def _scenario(
    mode: str, aliases: int, count: int, prefix: str = "t", beside: dict[str, GroupLoad] | None = None
) -> dict[str, str]:
    """The parameters of a stack of `count` tenants, its poller groups assigned as make deploy would beside the
    other cells' mappings on the cluster (`beside`: the load of each group)."""
    tenants = _tenants(count, prefix)
    given = {**HARDENED, **MODES[mode], "Tenants": ",".join(tenants)}
    given.update({f"PeerClusterAlias{n + 1}": ALIASES[n] for n in range(aliases)})
    given["DispatchSources"] = dispatch_sources((ALIASES[0] if aliases > 0 else "", ALIASES[1] if aliases > 1 else ""))
    groups = assign_poller_groups(tenants, 1 + aliases, DEFAULT_RELAY_MAXIMUM_POLLERS, beside or {}, {})
    given["RelayPollerGroups"] = render_assignment(groups)
    return given


def loads_of(given: dict[str, str]) -> dict[str, GroupLoad]:
    """What the mappings of the stack of `given` put in each poller group."""
    loads: dict[str, GroupLoad] = {}
    mappings = len(given["DispatchSources"].split(","))
    for group in given["RelayPollerGroups"].split(","):
        token = group.rsplit("=", 1)[1]
        loads[token] = loads.get(token, GroupLoad()).plus(mappings, mappings * DEFAULT_RELAY_MAXIMUM_POLLERS)
    return loads


SCENARIOS = {
    f"{mode}-{aliases}-aliases-{count}-tenants": _scenario(mode, aliases, count)
    for mode in MODES
    for aliases in (0, 1, 2)
    # 100 and 101: a full poller group and one mapping into the next (single Region: the groups do not depend on
    # the table mode)
    for count in sorted({1, 50, 200, max_tenants(aliases)} | ({100, 101} if mode == "single" else set()))
    if count <= max_tenants(aliases)
}
# Two cells on one cluster, each at the maximum: the second's groups assigned beside the first's mappings.
TWO_CELLS = {
    f"single-{aliases}-aliases-second-cell": _scenario(
        "single",
        aliases,
        max_tenants(aliases),
        "u",
        loads_of(SCENARIOS[f"single-{aliases}-aliases-{max_tenants(aliases)}-tenants"]),
    )
    | {"Cell": "second"}
    for aliases in (0, 1, 2)
}
SCENARIOS.update(TWO_CELLS)


# One tenant more than the most a stack serves, with each number of aliases: the template must be over.
OVER = {
    f"single-{aliases}-aliases-over": _scenario("single", aliases, max_tenants(aliases) + 1) for aliases in (0, 1, 2)
}


def _batch(template: str, scenarios: list[dict[str, str]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """`scenarios` as CloudFormation gets them: one run of poimen_tools.sam_transform --batch --both
    (tests/unit/transforms.py), each scenario's template with every resource declared kept and with only those the
    stack creates, from one expansion."""
    output = sam_transform(batch=json.dumps(scenarios), kept="both", template=Path(template))
    return [(declared, created) for declared, created in json.loads(output)]


@cache
def _both_all() -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Every scenario (and OVER) as CloudFormation receives and validates it, and as the stack creates it."""
    every = {**SCENARIOS, **OVER}
    return dict(zip(every, _batch(str(REPO / "template.yaml"), list(every.values())), strict=True))


def _declared_all() -> dict[str, dict[str, Any]]:
    """Every scenario (and OVER) as CloudFormation receives and validates it: conditions not evaluated."""
    return {name: declared for name, (declared, _) in _both_all().items()}


def _transformed_all() -> dict[str, dict[str, Any]]:
    """Every scenario as the stack creates it: the resources whose Condition is false left out."""
    return {name: created for name, (_, created) in _both_all().items() if name in SCENARIOS}


# --- values as long as a deploy can make them -----------------------------------------------------------

_NAME = {  # a resource's Ref, at its longest
    "AWS::DynamoDB::Table": "t" * 255,
    "AWS::DynamoDB::GlobalTable": "t" * 255,
    "AWS::SQS::Queue": f"https://sqs.{REGION}.amazonaws.com/{ACCOUNT}/" + "q" * 80,
    "AWS::S3::Bucket": "b" * 63,
    "AWS::IAM::Role": "r" * 64,
    "AWS::ApiGatewayV2::Api": "a" * 10,
    "AWS::Lambda::Function": "f" * 64,
}
_TABLE_ARN = f"arn:{PARTITION}:dynamodb:{REGION}:{ACCOUNT}:table/" + "t" * 255
_ATTRIBUTE = {  # a resource's attribute (Fn::GetAtt), at its longest
    ("AWS::DynamoDB::Table", "Arn"): _TABLE_ARN,
    ("AWS::DynamoDB::Table", "StreamArn"): f"{_TABLE_ARN}/stream/2026-12-01T10:00:00.000",
    ("AWS::DynamoDB::GlobalTable", "Arn"): _TABLE_ARN,
    ("AWS::DynamoDB::GlobalTable", "StreamArn"): f"{_TABLE_ARN}/stream/2026-12-01T10:00:00.000",
    ("AWS::SQS::Queue", "Arn"): f"arn:{PARTITION}:sqs:{REGION}:{ACCOUNT}:" + "q" * 80,
    ("AWS::SQS::Queue", "QueueName"): "q" * 80,
    ("AWS::S3::Bucket", "Arn"): f"arn:{PARTITION}:s3:::" + "b" * 63,
    ("AWS::IAM::Role", "Arn"): f"arn:{PARTITION}:iam::{ACCOUNT}:role/" + "r" * 64,
    ("AWS::Lambda::Function", "Arn"): f"arn:{PARTITION}:lambda:{REGION}:{ACCOUNT}:function:" + "f" * 64,
}
_PLACEHOLDER = re.compile(r"\$\{([^}!][^}]*)\}")


def _longest(value: Any, template: dict[str, Any], given: dict[str, str]) -> Any:
    """`value` with every intrinsic function replaced by the longest string a deploy could make of it; fails on
    one it does not know, so that a new reference is sized before it is counted."""
    resources, parameters = template["Resources"], template.get("Parameters", {})

    def reference(name: str) -> str:
        if name in PSEUDO:
            return PSEUDO[name]
        if name in given:
            return given[name]
        if name in parameters:
            return str(parameters[name].get("Default", ""))
        return _NAME[resources[name]["Type"]]

    def attribute(name: str, key: str) -> str:
        return _ATTRIBUTE[(resources[name]["Type"], key)]

    def substitute(text: str, variables: dict[str, Any]) -> str:
        def one(match: re.Match[str]) -> str:
            name = match.group(1)
            if name in variables:
                return str(_longest(variables[name], template, given))
            if "." in name and name.split(".", 1)[0] in resources:
                return attribute(*name.split(".", 1))
            return reference(name)

        return _PLACEHOLDER.sub(one, text).replace("${!", "${")

    if isinstance(value, list):
        return [_longest(item, template, given) for item in value if item != {"Ref": "AWS::NoValue"}]
    if not isinstance(value, dict):
        return value
    if set(value) == {"Ref"}:
        return reference(value["Ref"])
    if set(value) == {"Fn::GetAtt"}:
        return attribute(*value["Fn::GetAtt"])
    if set(value) == {"Fn::Sub"}:
        text, variables = value["Fn::Sub"] if isinstance(value["Fn::Sub"], list) else (value["Fn::Sub"], {})
        return substitute(text, variables)
    if set(value) == {"Fn::Join"}:
        separator, items = value["Fn::Join"]
        return separator.join(str(item) for item in _longest(items, template, given))
    assert not any(key.startswith("Fn::") for key in value), f"an intrinsic this test cannot size: {value}"
    return {key: _longest(item, template, given) for key, item in value.items() if item != {"Ref": "AWS::NoValue"}}


def _policy_characters(document: Any, template: dict[str, Any], given: dict[str, str]) -> int:
    """A policy's size as IAM counts it: its JSON without whitespace."""
    return len(re.sub(r"\s", "", json.dumps(_longest(document, template, given))))


# --- the quotas -----------------------------------------------------------------------------------------


def _template_violations(template: dict[str, Any], given: dict[str, str]) -> list[str]:
    resources = template["Resources"]
    found = [f"{len(resources)} resources, over {RESOURCES}"] if len(resources) > RESOURCES else []
    for section, quota in (("Outputs", OUTPUTS), ("Mappings", MAPPINGS), ("Parameters", PARAMETERS)):
        if len(template.get(section, {})) > quota:
            found.append(f"{len(template[section])} {section.lower()}, over {quota}")
    found += [
        f"mapping {name} has {len(mapping)} attributes, over {MAPPING_ATTRIBUTES}"
        for name, mapping in template.get("Mappings", {}).items()
        if len(mapping) > MAPPING_ATTRIBUTES
    ]
    found += [f"logical id {name} is over {LOGICAL_ID_CHARACTERS}" for name in resources if len(name) > 255]
    size = len(json.dumps(template, separators=(",", ":")).encode())
    if size > TEMPLATE_BODY_BYTES_IN_S3:
        found.append(f"the template is {size:,} bytes, over {TEMPLATE_BODY_BYTES_IN_S3:,}")
    if len(template.get("Description", "").encode()) > DESCRIPTION_BYTES:
        found.append(f"the description is over {DESCRIPTION_BYTES} bytes")
    found += [
        f"parameter {name} is {len(value.encode()):,} bytes, over {PARAMETER_VALUE_BYTES:,}"
        for name, value in given.items()
        if len(value.encode()) > PARAMETER_VALUE_BYTES
    ]
    return found


def _role_violations(template: dict[str, Any], given: dict[str, str]) -> list[str]:
    resources, found = template["Resources"], []
    for name, resource in resources.items():
        if resource["Type"] == "AWS::IAM::ManagedPolicy":
            size = _policy_characters(resource["Properties"]["PolicyDocument"], template, given)
            if size > MANAGED_POLICY_CHARACTERS:
                found.append(f"managed policy {name} is {size:,} characters, over {MANAGED_POLICY_CHARACTERS:,}")
        if resource["Type"] != "AWS::IAM::Role":
            continue
        role = resource["Properties"]
        documents = [policy["PolicyDocument"] for policy in role.get("Policies", [])]
        documents += [
            other["Properties"]["PolicyDocument"]
            for other in resources.values()
            if other["Type"] == "AWS::IAM::Policy" and {"Ref": name} in other["Properties"]["Roles"]
        ]
        inline = sum(_policy_characters(document, template, given) for document in documents)
        if inline > ROLE_INLINE_POLICIES_CHARACTERS:
            found.append(
                f"role {name}'s inline policies are {inline:,} characters, over {ROLE_INLINE_POLICIES_CHARACTERS:,}"
            )
        managed = len(role.get("ManagedPolicyArns", [])) + sum(
            {"Ref": name} in other["Properties"].get("Roles", [])
            for other in resources.values()
            if other["Type"] == "AWS::IAM::ManagedPolicy"
        )
        if managed > MANAGED_POLICIES_PER_ROLE:
            found.append(f"role {name} has {managed} managed policies, over {MANAGED_POLICIES_PER_ROLE}")
        trust = _policy_characters(role["AssumeRolePolicyDocument"], template, given)
        if trust > ROLE_TRUST_POLICY_CHARACTERS:
            found.append(f"role {name}'s trust policy is {trust:,} characters, over {ROLE_TRUST_POLICY_CHARACTERS:,}")
    return found


def _environment_bytes(variables: dict[str, Any], template: dict[str, Any], given: dict[str, str]) -> int:
    rendered = {key: str(value) for key, value in _longest(variables, template, given).items()}
    return len(json.dumps(rendered, separators=(",", ":")).encode())


def _function_violations(template: dict[str, Any], given: dict[str, str]) -> list[str]:
    found = []
    for name, resource in template["Resources"].items():
        if resource["Type"] == "AWS::Lambda::Function":
            variables = resource["Properties"].get("Environment", {}).get("Variables", {})
            size = _environment_bytes(variables, template, given)
            if size > ENVIRONMENT_BYTES:
                found.append(f"function {name}'s environment is {size:,} bytes, over {ENVIRONMENT_BYTES:,}")
    return found


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_the_stack_deploys_within_every_quota(scenario: str) -> None:
    declared, created, given = _declared_all()[scenario], _transformed_all()[scenario], SCENARIOS[scenario]

    violations = (
        _template_violations(declared, given) + _role_violations(created, given) + _function_violations(created, given)
    )

    assert violations == [], scenario


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_resource_declared_is_one_the_stack_creates(scenario: str) -> None:
    declared, created = _declared_all()[scenario], _transformed_all()[scenario]
    msk = [
        resource
        for resource in declared["Resources"].values()
        if resource["Type"] == "AWS::Lambda::EventSourceMapping" and "Topics" in resource["Properties"]
    ]

    # What loops per tenant declares nothing conditional: only the fixed resources may be Condition'd, and
    # they are the OTHER_RESOURCES the maximum leaves room for (the outbox's stream mapping among them).
    assert not [resource for resource in msk if "Condition" in resource], scenario
    assert len(msk) == len([r for r in created["Resources"].values() if "Topics" in r.get("Properties", {})])
    assert len(declared["Resources"]) - len(msk) == OTHER_RESOURCES


@pytest.mark.parametrize("scenario", list(OVER))
def test_one_tenant_more_than_the_maximum_would_not_deploy(scenario: str) -> None:
    declared = _declared_all()[scenario]

    # The maximum is exact: one tenant more is over CloudFormation's resources a stack.
    assert _template_violations(declared, OVER[scenario])[0].endswith(f"resources, over {RESOURCES}")
    tenants, aliases = OVER[scenario]["Tenants"].split(","), scenario.split("-")[1]
    assert limit_refusal(tenants, int(aliases)) is not None


def test_the_resource_count_refuses_a_conditional_per_tenant_loop_at_the_maximum(tmp_path: Path) -> None:
    # Given the template with a per-tenant loop whose Condition is false, as the peer cluster loops once were
    text = (REPO / "template.yaml").read_text()
    loop = (
        "  Fn::ForEach::ConditionalSources:\n    - TenantId\n    - !Ref Tenants\n    - Conditional&{TenantId}:\n"
        "        Type: AWS::SQS::Queue\n        Condition: HasPeerClusterAlias1\n"
    )
    broken = tmp_path / "template.yaml"
    broken.write_text(text.replace("\nResources:\n", f"\nResources:\n{loop}", 1))
    given = _scenario("single", 0, max_tenants(0))

    # When it is counted as CloudFormation receives it, and as the stack would create it
    ((declared, created),) = _batch(str(broken), [given])

    # Then the declared count refuses it, though what would be created fits
    assert _template_violations(declared, given) == [f"{len(declared['Resources'])} resources, over {RESOURCES}"]
    assert _template_violations(created, given) == []


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_one_mapping_per_tenant_and_topic_as_the_maximum_counts_them(scenario: str) -> None:
    template, given = _declared_all()[scenario], SCENARIOS[scenario]
    tenants = given["Tenants"].split(",")
    aliases = sum(f"PeerClusterAlias{n}" in given for n in (1, 2))

    msk = [
        resource
        for resource in template["Resources"].values()
        if resource["Type"] == "AWS::Lambda::EventSourceMapping" and "Topics" in resource["Properties"]
    ]

    assert len(msk) == len(tenants) * (1 + aliases)
    assert len(msk) <= MAX_EVENT_SOURCE_MAPPINGS
    assert limit_refusal(tenants, aliases) is None


# --- the maximum, refused beyond ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("count", "aliases"),
    [(max_tenants(0) + 1, 0), (max_tenants(1) + 1, 1), (max_tenants(2) + 1, 2), (200, 2)],
)
def test_more_tenants_than_a_stack_serves_are_refused_in_one_line_that_says_how_to_split(
    count: int, aliases: int
) -> None:
    refusal = limit_refusal([f"t{n}" for n in range(count)], aliases)

    assert refusal is not None
    assert "\n" not in refusal
    assert f"{count} tenants" in refusal
    assert f"at most {max_tenants(aliases)}" in refusal
    assert "split them into cells" in refusal
    assert "docs/operations.md#cells" in refusal


def test_a_tenant_list_longer_than_a_stack_serves_is_refused() -> None:
    at_most = _tenants(50)
    longer = [*at_most[:-1], at_most[-1] + "x" * (MAX_TENANT_CHARACTERS + 1 - len(",".join(at_most)))]

    assert len(",".join(at_most)) <= MAX_TENANT_CHARACTERS
    assert limit_refusal(at_most, 0) is None
    refusal = limit_refusal(longer, 0)
    assert refusal is not None
    assert f"{MAX_TENANT_CHARACTERS + 1:,} characters" in refusal
    assert "split them into cells" in refusal


@pytest.mark.parametrize(
    ("command", "extra", "count"),
    [
        ("build", "", max_tenants(0) + 1),
        ("deploy", "PEER_CLUSTER_ALIAS_1=east1 PEER_CLUSTER_ALIAS_2=west2", max_tenants(2) + 1),
    ],
)
def test_make_refuses_more_tenants_before_sam_runs(command: str, extra: str, count: int) -> None:
    tenants = ",".join(f"t{n}" for n in range(count))

    result = subprocess.run(
        ["bash", "-c", f"make {command} TENANTS={tenants} {extra}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={"PATH": "/usr/bin:/bin", "SAM_CLI_TELEMETRY": "0"},
    )

    assert result.returncode != 0
    (refusal,) = [line for line in result.stderr.splitlines() if not line.startswith("make: ***")]
    assert refusal.startswith(f"make {command}: {count} tenants, and one stack serves at most")
    assert "sam build" not in result.stdout + result.stderr


def test_the_readme_and_the_operations_page_state_the_maximum() -> None:
    for page in (REPO / "README.md", REPO / "docs" / "operations.md"):
        text = " ".join(page.read_text().split())
        for aliases in (0, 1, 2):
            assert f"{max_tenants(aliases)} tenants" in text, (page.name, aliases)
        assert f"{MAX_TENANT_CHARACTERS:,} characters" in text, page.name
