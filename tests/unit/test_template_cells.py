"""Cells (docs/operations.md#cells): stacks of one Stage on one MSK cluster, each serving its own tenants. Two
cells, as CloudFormation gets them in every mode, name nothing alike: no layer, table, dashboard, consumer
group or any other name that must be unique in the account, the Region or the cluster; and a stack without
a cell keeps the names it had, so that no deployed resource is renamed (replaced)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from poimen_tools.deploy_check import CELL_PATTERN
from poimen_tools.local.template import Template
from tests.unit.test_template_multiregion import STACKS, _transformed_in

STAGE = "dev"
CELLS = {
    "c1": {"stack": "poimen-admission-dev-c1", "Tenants": "acme,beta-2"},
    "c2": {"stack": "poimen-admission-dev-c2", "Tenants": "gamma,delta"},
}
MODES = {"single": ("us-east-1", {}), **{name: STACKS[name] for name in ("home", "replica-east-2")}}
# The properties that name a resource in the account, the Region or the cluster: unset, CloudFormation makes
# the name from the stack's (unique already). Types not here name nothing outside their stack.
NAMES: dict[str, list[tuple[str, ...]]] = {
    "AWS::Lambda::LayerVersion": [("LayerName",)],
    "AWS::DynamoDB::Table": [("TableName",)],
    "AWS::DynamoDB::GlobalTable": [("TableName",)],
    "AWS::CloudWatch::Dashboard": [("DashboardName",)],
    "AWS::CloudWatch::Alarm": [("AlarmName",)],
    "AWS::Logs::LogGroup": [("LogGroupName",)],
    "AWS::SQS::Queue": [("QueueName",)],
    "AWS::S3::Bucket": [("BucketName",)],
    "AWS::SNS::Topic": [("TopicName",)],
    "AWS::Lambda::Function": [("FunctionName",)],
    "AWS::IAM::Role": [("RoleName",)],
    "AWS::IAM::ManagedPolicy": [("ManagedPolicyName",)],
    "AWS::SSM::Parameter": [("Name",)],
    "AWS::ApiGatewayV2::Api": [("Name",)],
    # A consumer group is the cluster's: two mappings in one group split the partitions between them.
    "AWS::Lambda::EventSourceMapping": [("AmazonManagedKafkaEventSourceConfig", "ConsumerGroupId")],
}
# Named only inside a resource of the same stack (a role's policy, a function's alias, an API's stage), or
# not named at all.
UNNAMED = {
    "AWS::ApiGatewayV2::Stage",
    "AWS::IAM::Policy",
    "AWS::Lambda::Alias",
    "AWS::Lambda::Permission",
    "AWS::Lambda::Version",
    "AWS::S3::BucketPolicy",
    "AWS::SNS::Subscription",
}


def _cell(mode: str, cell: str | None) -> dict[str, Any]:
    region, parameters = MODES[mode]
    tenants = CELLS[cell]["Tenants"] if cell else CELLS["c1"]["Tenants"]
    return _transformed_in(region, **parameters, Tenants=tenants, **({"Cell": cell} if cell else {}))


def _name(value: Any, stack: str) -> str:
    """A name as CloudFormation makes it: a string, or an Fn::Sub of the stack's pseudo parameters."""
    text = value["Fn::Sub"] if isinstance(value, dict) and set(value) == {"Fn::Sub"} else value
    assert isinstance(text, str), f"a name this test cannot resolve: {value}"
    return re.sub(r"\$\{AWS::StackName\}", stack, text)


def _physical_names(template: dict[str, Any], stack: str) -> set[str]:
    """Every name the stack gives that must be unique outside it, with what it names."""
    names = set()
    for logical_id, resource in template["Resources"].items():
        kind = resource["Type"]
        assert kind in NAMES or kind in UNNAMED, f"{logical_id}: {kind} is not classified here; does it name anything?"
        for path in NAMES.get(kind, []):
            value: Any = resource["Properties"]
            for key in path:
                value = value.get(key) if isinstance(value, dict) else None
            if value is not None:
                names.add(f"{kind} {_name(value, stack)}")
    for output in template.get("Outputs", {}).values():
        if "Export" in output:
            names.add(f"export {_name(output['Export']['Name'], stack)}")
    return names


def _table_by_name(template: dict[str, Any]) -> str | None:
    """The multi-Region table as the stack names it (the replica's TABLE_NAME, the home's TableName)."""
    resources = template["Resources"]
    variables = resources["AdmissionFunction"]["Properties"]["Environment"]["Variables"]
    if isinstance(variables["TABLE_NAME"], str):
        return variables["TABLE_NAME"]
    global_tables = [r for r in resources.values() if r["Type"] == "AWS::DynamoDB::GlobalTable"]
    return global_tables[0]["Properties"]["TableName"] if global_tables else None


@pytest.mark.parametrize("mode", list(MODES))
def test_two_cells_name_nothing_alike(mode: str) -> None:
    # Given two cells of one Stage, in the same mode, serving disjoint tenants
    first = _physical_names(_cell(mode, "c1"), CELLS["c1"]["stack"])
    second = _physical_names(_cell(mode, "c2"), CELLS["c2"]["stack"])

    # Then no name of one is a name of the other: layers, the table, the dashboard, consumer groups, ...
    assert first & second == set(), mode
    assert any(name.startswith("AWS::Lambda::LayerVersion") for name in first)
    assert any(name.startswith("AWS::Lambda::EventSourceMapping") for name in first)


@pytest.mark.parametrize("mode", ["home", "replica-east-2"])
def test_each_cell_of_a_multi_region_deployment_finds_its_own_table(mode: str) -> None:
    tables = {cell: _table_by_name(_cell(mode, cell)) for cell in CELLS}

    assert tables == {cell: f"poimen-admission-{STAGE}_{cell}" for cell in CELLS}


@pytest.mark.parametrize("mode", list(MODES))
def test_a_stack_without_a_cell_keeps_its_names(mode: str) -> None:
    template = _cell(mode, None)
    layers = {
        resource["Properties"]["LayerName"]
        for resource in template["Resources"].values()
        if resource["Type"] == "AWS::Lambda::LayerVersion"
    }

    # The names the stack had before cells (the layers' but poimen-core-, harmless: a layer's version is replaced
    # on every change of its content anyway); a changed table name would replace the table (a new, empty one).
    assert layers == {f"poimen-core-{STAGE}", f"poimen-kafka-{STAGE}"}
    assert _table_by_name(template) in (None, f"poimen-admission-{STAGE}")


@pytest.mark.parametrize(
    ("first", "second"),
    [
        # Stage dev-c2 without a cell and Stage dev in cell c2 would both be poimen-admission-dev-c2 with a '-'.
        (("dev-c2", ""), ("dev", "c2")),
        # A Stage that starts like the Kafka layer's prefix: poimen-<Stage> must not be poimen-kafka-<Stage>.
        (("kafka-dev", ""), ("dev", "")),
        (("kafka-dev", "c1"), ("dev", "c1")),
    ],
)
def test_no_stage_and_cell_name_what_another_pair_names(first: tuple[str, str], second: tuple[str, str]) -> None:
    region, parameters = MODES["home"]
    one, other = (
        _transformed_in(region, **parameters, Stage=stage, Tenants=tenants, **({"Cell": cell} if cell else {}))
        for (stage, cell), tenants in ((first, CELLS["c1"]["Tenants"]), (second, CELLS["c2"]["Tenants"]))
    )

    assert _table_by_name(one) != _table_by_name(other)
    assert _physical_names(one, "a") & _physical_names(other, "b") == set()


def test_make_deploy_checks_the_cell_by_the_templates_pattern(template: Template) -> None:
    assert template.document["Parameters"]["Cell"]["AllowedPattern"] == f"^$|^{CELL_PATTERN.pattern}$"
    assert template.document["Parameters"]["Cell"]["Default"] == ""


@pytest.mark.parametrize("mode", list(MODES))
def test_each_cells_relay_can_call_only_its_own_cells_api(mode: str) -> None:
    # Given each cell's template as CloudFormation gets it
    for cell in CELLS:
        resources = _cell(mode, cell)["Resources"]
        relay = resources["InboxRelayFunction"]["Properties"]
        (invoke,) = resources["RelayInvokeAdmissionApi"]["Properties"]["PolicyDocument"]["Statement"]
        admission = resources["AdmissionFunction"]["Properties"]["Environment"]["Variables"]

        # Then its relay posts to the API of its own stack, in its own Region (no variable, map or parameter can
        # point it at another cell's), IAM lets it invoke that API's POST /v1/runs only, and that API's
        # admission trusts this relay's role alone: another cell's API is out of its reach twice over.
        assert relay["Environment"]["Variables"]["ADMISSION_API_URL"] == {
            "Fn::Sub": "https://${AdmissionApi}.execute-api.${AWS::Region}.${AWS::URLSuffix}"
        }
        assert resources["AdmissionApi"]["Type"] == "AWS::ApiGatewayV2::Api"
        own_api = "arn:${AWS::Partition}:execute-api:${AWS::Region}:${AWS::AccountId}:${AdmissionApi}"
        assert invoke["Resource"] == {"Fn::Sub": f"{own_api}/*/POST/v1/runs"}
        assert admission["RELAY_PRINCIPAL"] == {"Fn::GetAtt": ["InboxRelayFunctionRole", "Arn"]}
