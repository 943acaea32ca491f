"""template.yaml, read as data: least privilege, alarms, one MSK event source per tenant, the table."""

from __future__ import annotations

import re
from typing import Any

import pytest

from poimen.store import HASH_KEY, RunRecord
from poimen.wire import TENANT_PATTERN
from poimen_tools.local.template import Template
from tests.unit.test_template_posture import _in_single_region, _transformed

# Actions that take no resource ARN (IAM's "*" is the only possible resource for them).
RESOURCELESS_ACTIONS = {
    "ec2:CreateNetworkInterface",
    "ec2:DescribeNetworkInterfaces",
    "ec2:DescribeVpcs",
    "ec2:DeleteNetworkInterface",
    "ec2:DescribeSubnets",
    "ec2:DescribeSecurityGroups",
}
TENANTS = ["acme", "beta-2"]


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def _statements(template: Template, function: str) -> list[dict[str, Any]]:
    return [s for policy in template.properties(function).get("Policies", []) for s in policy["Statement"]]


def _policy_resources(template: Template) -> dict[str, list[dict[str, Any]]]:
    """The statements of each AWS::IAM::Policy declared beside the functions' own policies."""
    return {
        name: res["Properties"]["PolicyDocument"]["Statement"]
        for name, res in template.resources.items()
        if res["Type"] == "AWS::IAM::Policy"
    }


def _functions(template: Template) -> list[str]:
    return [name for name, res in template.resources.items() if res["Type"] == "AWS::Serverless::Function"]


def test_no_statement_uses_wildcards_where_a_resource_can_be_named(template: Template) -> None:
    statements = [(f, s) for f in _functions(template) for s in _statements(template, f)]
    statements += [(name, s) for name, policy in _policy_resources(template).items() for s in policy]

    assert len({owner for owner, _ in statements}) >= 5
    for owner, statement in statements:
        actions = _as_list(statement["Action"])
        assert not [a for a in actions if a == "*" or a.endswith(":*")], (owner, statement["Sid"])
        if statement["Resource"] == "*":
            assert set(actions) <= RESOURCELESS_ACTIONS, (owner, statement["Sid"])


def test_admission_may_only_put_and_get_items_of_its_table(template: Template) -> None:
    (statement,) = _statements(template, "AdmissionFunction")

    assert sorted(_as_list(statement["Action"])) == ["dynamodb:GetItem", "dynamodb:PutItem"]
    assert _in_single_region(statement["Resource"]) == {"Fn::GetAtt": ["AdmissionTable", "Arn"]}


def test_every_route_needs_iam_authorization(template: Template) -> None:
    api = template.properties("AdmissionApi")
    events = [
        event
        for function in _functions(template)
        for event in template.properties(function).get("Events", {}).values()
        if event["Type"] == "HttpApi"
    ]

    assert api["Auth"]["DefaultAuthorizer"] == "AWS_IAM"
    assert events
    assert all("Auth" not in event["Properties"] for event in events)  # none opts out of the default
    assert "AccessLogSettings" in api
    assert api["DefaultRouteSettings"]["ThrottlingRateLimit"] > 0


def test_one_msk_event_source_per_tenant_topic(template: Template) -> None:
    resources = template.expanded_resources({"Tenants": TENANTS})
    transformed = _transformed(Tenants=",".join(TENANTS))["Resources"]
    mappings = {
        name: res["Properties"]
        for name, res in resources.items()
        if res["Type"] == "AWS::Lambda::EventSourceMapping" and name.startswith("RelaySource")
    }

    assert sorted(mappings) == ["RelaySourceacme", "RelaySourcebeta2"]
    for tenant in TENANTS:
        mapping = mappings[f"RelaySource{tenant.replace('-', '')}"]
        assert mapping["FunctionName"] == {"Ref": "InboxRelayFunction.Alias"}  # the published version
        # The topic and the group as CloudFormation resolves them (the loop's Fn::Select over the aliases).
        deployed = transformed[f"RelaySource{tenant.replace('-', '')}"]["Properties"]
        assert deployed["Topics"] == [f"poimen.{tenant}.dispatch"]
        assert deployed["AmazonManagedKafkaEventSourceConfig"]["ConsumerGroupId"] == f"poimen-relay-{tenant}"
        assert mapping["StartingPosition"] == "TRIM_HORIZON"
        # Provisioned pollers (RelayEventPollers' default): tests/unit/test_template_pollers.py has both modes.
        assert deployed["DestinationConfig"]["OnFailure"]["Destination"] == {
            "Fn::GetAtt": ["FailedBatchesBucket", "Arn"]
        }
        assert resources[f"RelaySource{tenant.replace('-', '')}"]["DependsOn"] == [
            "RelayInvokeAdmissionApi",
            "RelayMskNetworkAccess",
            "AdmissionFunctionAliaslive",  # the version that trusts the relay for this tenant
        ]
        # The parameter itself, not a number equal to its default (a hard-coded 100 deploys the same with it).
        assert mapping["MaximumRetryAttempts"] == {
            "Fn::If": ["HasProvisionedPollers", {"Ref": "RelayMaxRetryAttempts"}, {"Ref": "AWS::NoValue"}]
        }
        assert deployed["MaximumRetryAttempts"] == template.document["Parameters"]["RelayMaxRetryAttempts"]["Default"]
        # In a poller group (tests/unit/test_poller_groups.py resolves its name), when provisioned.
        condition, provisioned, _ = mapping["ProvisionedPollerConfig"]["Fn::If"]
        assert condition == "HasProvisionedPollers"
        assert set(provisioned) == {"MinimumPollers", "MaximumPollers", "PollerGroupName"}
        assert mapping["BatchSize"] == {"Ref": "RelayBatchSize"}


def test_default_tenants_are_valid_tenant_ids(template: Template) -> None:
    tenants = template.document["Parameters"]["Tenants"]["Default"].split(",")

    assert all(re.fullmatch(TENANT_PATTERN, tenant) for tenant in tenants)
    # The deploy refuses what the code refuses: the parameter's pattern is the code's one rule.
    assert template.document["Parameters"]["Tenants"]["AllowedPattern"] == TENANT_PATTERN


def test_every_queue_has_an_alarm_that_notifies(template: Template) -> None:
    resources = template.resources
    queues = [name for name, res in resources.items() if res["Type"] == "AWS::SQS::Queue"]
    alarmed = {
        dimension["Value"]["Fn::GetAtt"][0]
        for res in resources.values()
        if res["Type"] == "AWS::CloudWatch::Alarm" and res["Properties"].get("AlarmActions")
        for dimension in res["Properties"].get("Dimensions", [])
        if dimension["Name"] == "QueueName"
    }

    assert queues
    assert set(queues) <= alarmed


@pytest.mark.parametrize("function", ["AdmissionFunction", "InboxRelayFunction"])
@pytest.mark.parametrize("metric", ["Errors", "Throttles"])
def test_each_function_alarms_on_errors_and_throttles(template: Template, function: str, metric: str) -> None:
    alarms = [
        res["Properties"]
        for res in template.resources.values()
        if res["Type"] == "AWS::CloudWatch::Alarm" and res["Properties"].get("MetricName") == metric
    ]

    assert any({"Name": "FunctionName", "Value": {"Ref": function}} in alarm["Dimensions"] for alarm in alarms)


def test_table_matches_the_model_and_is_protected(template: Template) -> None:
    table = template.properties("AdmissionTable")

    assert table["KeySchema"] == [{"AttributeName": HASH_KEY, "KeyType": "HASH"}]
    assert table["StreamSpecification"] == {"StreamViewType": RunRecord.Meta.stream_view_type}
    assert table["BillingMode"] == "PAY_PER_REQUEST"
    assert table["PointInTimeRecoverySpecification"] == {"PointInTimeRecoveryEnabled": True}
    assert table["SSESpecification"] == {
        "SSEEnabled": True,  # the AWS managed key, or KmsKeyArn's (tests/unit/test_template_posture.py)
        "SSEType": {"Fn::If": ["HasKmsKey", "KMS", {"Ref": "AWS::NoValue"}]},
        "KMSMasterKeyId": {"Fn::If": ["HasKmsKey", {"Ref": "KmsKeyArn"}, {"Ref": "AWS::NoValue"}]},
    }
    assert table["DeletionProtectionEnabled"] == {"Ref": "TableDeletionProtection"}
    assert template.resources["AdmissionTable"]["DeletionPolicy"] == "Retain"


def test_dead_letter_queue_is_encrypted_and_keeps_messages_14_days_without_run_retention(template: Template) -> None:
    queue = template.properties("RelayDeadLetterQueue")

    assert queue["SqsManagedSseEnabled"] == {"Fn::If": ["HasKmsKey", {"Ref": "AWS::NoValue"}, True]}
    assert queue["KmsMasterKeyId"] == {"Fn::If": ["HasKmsKey", {"Ref": "KmsKeyArn"}, {"Ref": "AWS::NoValue"}]}
    assert template.evaluate(queue["MessageRetentionPeriod"]) == 14 * 24 * 3600  # test_run_retention.py: with it


def test_failed_batches_bucket_keeps_records_private_encrypted_and_expiring(template: Template) -> None:
    bucket = template.properties("FailedBatchesBucket")
    (tls_only,) = template.properties("FailedBatchesBucketPolicy")["PolicyDocument"]["Statement"]

    (encryption,) = bucket["BucketEncryption"]["ServerSideEncryptionConfiguration"]
    assert encryption["ServerSideEncryptionByDefault"]["SSEAlgorithm"] == {"Fn::If": ["HasKmsKey", "aws:kms", "AES256"]}
    assert set(bucket["PublicAccessBlockConfiguration"].values()) == {True}
    assert len(bucket["PublicAccessBlockConfiguration"]) == 4
    assert bucket["OwnershipControls"] == {"Rules": [{"ObjectOwnership": "BucketOwnerEnforced"}]}
    (rule,) = bucket["LifecycleConfiguration"]["Rules"]
    assert template.evaluate(rule["ExpirationInDays"], {"FailedBatchRetentionDays": "30"}) == "30"
    assert template.resources["FailedBatchesBucket"]["DeletionPolicy"] == "Retain"
    assert tls_only["Effect"] == "Deny"
    assert tls_only["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}


def test_relay_may_only_put_objects_into_and_list_the_failed_batches_bucket(template: Template) -> None:
    s3 = [
        s
        for s in _statements(template, "InboxRelayFunction")
        if any(a.startswith("s3:") for a in _as_list(s["Action"]))
    ]
    admission_s3 = [s for s in _statements(template, "AdmissionFunction") if "s3:" in str(s["Action"])]

    assert sorted((_as_list(s["Action"]), s["Resource"]) for s in s3) == [
        (["s3:ListBucket"], {"Fn::GetAtt": ["FailedBatchesBucket", "Arn"]}),
        (["s3:PutObject"], {"Fn::Sub": "${FailedBatchesBucket.Arn}/*"}),
    ]
    assert admission_s3 == []


def test_the_relay_is_authorized_by_the_deploy_for_the_stacks_tenants(template: Template) -> None:
    admission_env = template.properties("AdmissionFunction")["Environment"]["Variables"]
    invoke = template.properties("RelayInvokeAdmissionApi")

    assert admission_env["RELAY_PRINCIPAL"] == {"Fn::GetAtt": ["InboxRelayFunctionRole", "Arn"]}
    assert admission_env["TENANTS"] == {"Fn::Join": [",", {"Ref": "Tenants"}]}
    assert invoke["Roles"] == [{"Ref": "InboxRelayFunctionRole"}]
    (statement,) = invoke["PolicyDocument"]["Statement"]
    assert statement["Action"] == "execute-api:Invoke"
    assert statement["Resource"]["Fn::Sub"].endswith("${AdmissionApi}/*/POST/v1/runs")


def test_retry_budget_blocks_a_partition_for_hours_before_it_parks_the_batch(template: Template) -> None:
    retries = template.document["Parameters"]["RelayMaxRetryAttempts"]
    relay_timeout = template.resources["InboxRelayFunction"]["Properties"]["Timeout"]

    assert 1 <= retries["Default"] * relay_timeout / 3600 <= 6  # an outage of up to ~3 h heals by itself
    assert "FailedBatchesBucket" in retries["Description"]


def test_parking_failures_alarm(template: Template) -> None:
    alarms = [res["Properties"] for res in template.resources.values() if res["Type"] == "AWS::CloudWatch::Alarm"]

    assert any(
        alarm.get("MetricName") == "DestinationDeliveryFailures"
        and {"Name": "FunctionName", "Value": {"Ref": "InboxRelayFunction"}} in alarm["Dimensions"]
        and alarm["AlarmActions"]
        for alarm in alarms
    )
