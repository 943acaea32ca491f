"""template.yaml's outbox relay: its role reads the stream and writes the tenants' events topics only (never
the table), its stream event source keeps what it gives up on, and its alarms watch lag and failures."""

from __future__ import annotations

import fnmatch
import json
from typing import Any

import pytest

from poimen_tools.local.template import Template
from tests.unit.test_template_posture import _in_single_region, _transformed

TENANTS = ["acme", "beta-2"]
TABLE_WRITES = {
    "dynamodb:PutItem",
    "dynamodb:UpdateItem",
    "dynamodb:DeleteItem",
    "dynamodb:BatchWriteItem",
    "dynamodb:TransactWriteItems",
}


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def _role_statements(resources: dict[str, Any]) -> list[dict[str, Any]]:
    """Every statement the outbox's role holds: the function's own policies and each IAM policy naming the role."""
    statements = [s for p in resources["OutboxRelayFunction"]["Properties"]["Policies"] for s in p["Statement"]]
    for res in resources.values():
        if res["Type"] == "AWS::IAM::Policy" and {"Ref": "OutboxRelayFunctionRole"} in res["Properties"]["Roles"]:
            statements += res["Properties"]["PolicyDocument"]["Statement"]
    return statements


def test_the_outbox_role_cannot_write_the_table(template: Template) -> None:
    statements = _role_statements(template.expanded_resources({"Tenants": TENANTS}))
    actions = {action for s in statements for action in _as_list(s["Action"])}

    assert not actions & TABLE_WRITES
    assert not [a for a in actions if a.endswith("*")]
    assert {"dynamodb:GetRecords", "dynamodb:GetShardIterator", "dynamodb:DescribeStream"} <= actions
    (stream,) = [s for s in statements if s["Sid"] == "ReadTableStream"]
    assert _in_single_region(stream["Resource"]) == {"Fn::GetAtt": ["AdmissionTable", "StreamArn"]}


def test_transformed_the_outbox_role_has_no_table_write_either() -> None:
    resources = _transformed()["Resources"]
    role = resources["OutboxRelayFunctionRole"]["Properties"]
    text = json.dumps(role)

    assert not [action for action in TABLE_WRITES if action in text]
    # SAM's managed policies: logs, X-Ray (for any Tracing but Disabled: RelayTracing PassThrough too) and a VPC
    # function's network interfaces.
    assert {arn.rsplit("/", 1)[1] for arn in role["ManagedPolicyArns"]} == {
        "AWSLambdaBasicExecutionRole",
        "AWSXrayWriteOnlyAccess",
        "AWSLambdaVPCAccessExecutionRole",
    }


def test_the_outbox_writes_only_events_topics_of_its_one_cluster(template: Template) -> None:
    resources = template.expanded_resources({"Tenants": TENANTS})
    statements = _role_statements(resources)
    writes = [s for s in statements if "kafka-cluster:WriteData" in _as_list(s["Action"])]

    # One statement whatever the tenants (docs/posture.md#permissions-that-scale): every poimen.<tenant>.events
    # topic of the cluster MskClusterArn names, and nothing else: no other cluster, no dispatch topic.
    (events,) = writes
    pattern, names = events["Resource"]["Fn::Sub"]
    assert pattern == (
        "arn:${AWS::Partition}:kafka:${AWS::Region}:${AWS::AccountId}:topic/${Name}/${Uuid}/poimen.*.events"
    )
    assert names == {
        "Name": {"Fn::Select": [1, {"Fn::Split": ["/", {"Ref": "MskClusterArn"}]}]},
        "Uuid": {"Fn::Select": [2, {"Fn::Split": ["/", {"Ref": "MskClusterArn"}]}]},
    }
    assert set(events["Action"]) == {"kafka-cluster:DescribeTopic", "kafka-cluster:WriteData"}
    (cluster,) = [s for s in statements if s["Sid"] == "MskClusterProducer"]
    assert set(cluster["Action"]) == {"kafka-cluster:Connect", "kafka-cluster:WriteDataIdempotently"}
    assert cluster["Resource"] == {"Ref": "MskClusterArn"}
    assert not [s for s in statements if "kafka-cluster:ReadData" in _as_list(s["Action"])]


@pytest.mark.parametrize(
    ("topic", "written"),
    [
        ("poimen.acme.events", True),
        ("poimen.beta-2.events", True),
        ("poimen.acme.dispatch", False),
        ("east1.poimen.acme.events", False),  # a replicated topic is MirrorMaker's, never the outbox's
        ("other.acme.events", False),
    ],
)
def test_the_events_pattern_matches_only_events_topics(template: Template, topic: str, written: bool) -> None:
    (events,) = [
        s for s in _role_statements(template.expanded_resources({"Tenants": TENANTS})) if s["Sid"] == "MskEventsTopics"
    ]
    pattern = events["Resource"]["Fn::Sub"][0].rsplit("/", 1)[1]

    # IAM's ARN wildcard: '*' matches any run of characters, the rest literally (fnmatch, without '?' or '[').
    assert fnmatch.fnmatchcase(topic, pattern) is written


def test_the_stream_event_source_filters_retries_and_keeps_what_it_gives_up_on(template: Template) -> None:
    mapping = template.properties("OutboxRelaySource")
    (only,) = mapping["FilterCriteria"]["Filters"]

    assert mapping["FunctionName"] == {"Ref": "OutboxRelayFunction.Alias"}
    assert _in_single_region(mapping["EventSourceArn"]) == {"Fn::GetAtt": ["AdmissionTable", "StreamArn"]}
    assert mapping["StartingPosition"] == "TRIM_HORIZON"
    assert json.loads(only["Pattern"]) == {
        "eventName": ["INSERT", "MODIFY"],
        "dynamodb": {"NewImage": {"pk": {"S": [{"prefix": "RUN#"}]}, "status": {"S": ["admitted"]}}},
    }
    assert mapping["BisectBatchOnFunctionError"] is True
    assert mapping["MaximumRetryAttempts"] == {"Ref": "OutboxMaxRetryAttempts"}
    assert mapping["MaximumRecordAgeInSeconds"] == {"Ref": "OutboxMaxRecordAgeSeconds"}
    assert mapping["DestinationConfig"]["OnFailure"]["Destination"] == {
        "Fn::GetAtt": ["OutboxFailedBatchesBucket", "Arn"]
    }


def test_records_are_parked_before_the_stream_trims_them(template: Template) -> None:
    age = template.document["Parameters"]["OutboxMaxRecordAgeSeconds"]

    assert int(age["Default"]) < 24 * 3600
    assert int(age["MaxValue"]) < 24 * 3600  # DynamoDB streams keep records 24 hours


def test_the_outbox_waits_for_the_broker_within_its_timeout(template: Template) -> None:
    props = template.properties("OutboxRelayFunction")
    env = props["Environment"]["Variables"]

    assert env["KAFKA_AUTH"] == "iam"
    assert env["POIMEN_STACK_NAME"] == {"Ref": "AWS::StackName"}
    assert float(env["OUTBOX_DELIVERY_TIMEOUT_SECONDS"]) + float(env["OUTBOX_TIME_MARGIN_SECONDS"]) <= props["Timeout"]
    assert props["VpcConfig"] == {
        "SubnetIds": {"Ref": "OutboxSubnetIds"},
        "SecurityGroupIds": {"Ref": "OutboxSecurityGroupIds"},
    }


def test_the_parked_batches_bucket_is_private_encrypted_and_tls_only(template: Template) -> None:
    bucket = template.properties("OutboxFailedBatchesBucket")
    (statement,) = template.properties("OutboxFailedBatchesBucketPolicy")["PolicyDocument"]["Statement"]

    assert all(bucket["PublicAccessBlockConfiguration"].values())
    assert bucket["BucketEncryption"]["ServerSideEncryptionConfiguration"][0]["ServerSideEncryptionByDefault"]
    assert statement["Effect"] == "Deny"
    assert statement["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
    assert template.resources["OutboxFailedBatchesBucket"]["DeletionPolicy"] == "Retain"


@pytest.mark.parametrize(
    ("metric", "dimension"),
    [
        ("IteratorAge", {"Name": "FunctionName", "Value": {"Ref": "OutboxRelayFunction"}}),
        ("Errors", {"Name": "FunctionName", "Value": {"Ref": "OutboxRelayFunction"}}),
        ("Throttles", {"Name": "FunctionName", "Value": {"Ref": "OutboxRelayFunction"}}),
        ("DestinationDeliveryFailures", {"Name": "FunctionName", "Value": {"Ref": "OutboxRelayFunction"}}),
        (
            "OnFailureDestinationDeliveredEventCount",
            {"Name": "EventSourceMappingUUID", "Value": {"Ref": "OutboxRelaySource"}},
        ),
    ],
)
def test_the_outbox_alarms_notify(template: Template, metric: str, dimension: dict[str, Any]) -> None:
    alarms = [
        res["Properties"]
        for res in template.resources.values()
        if res["Type"] == "AWS::CloudWatch::Alarm" and res["Properties"].get("MetricName") == metric
    ]

    assert any(dimension in a["Dimensions"] and a["AlarmActions"] == [{"Ref": "AlarmTopic"}] for a in alarms)


def test_the_stream_event_counts_are_published(template: Template) -> None:
    assert template.properties("OutboxRelaySource")["MetricsConfig"] == {"Metrics": ["EventCount"]}


def test_the_function_sets_events_aside_in_its_bucket_with_write_only_access(template: Template) -> None:
    variables = template.properties("OutboxRelayFunction")["Environment"]["Variables"]
    statements = _role_statements(template.expanded_resources({"Tenants": TENANTS}))
    s3 = {action: s["Resource"] for s in statements for action in _as_list(s["Action"]) if action.startswith("s3:")}

    assert variables["OUTBOX_FAILED_BATCHES_BUCKET"] == {"Ref": "OutboxFailedBatchesBucket"}
    # PutObject for the mapping's parked batches and the function's undeliverable events; ListBucket, which
    # Lambda requires of an S3 destination's role; nothing that reads or deletes an object.
    assert s3 == {
        "s3:PutObject": {"Fn::Sub": "${OutboxFailedBatchesBucket.Arn}/*"},
        "s3:ListBucket": {"Fn::GetAtt": ["OutboxFailedBatchesBucket", "Arn"]},
    }


def test_one_alarm_watches_every_tenants_undeliverable_events(template: Template) -> None:
    # Given the namespace and service the outbox's metrics are published under
    namespace = template.document["Globals"]["Function"]["Environment"]["Variables"]["POWERTOOLS_METRICS_NAMESPACE"]
    service = template.function_environment("OutboxRelayFunction", {})["POWERTOOLS_SERVICE_NAME"]
    alarm = template.properties("OutboxUndeliverableEventsAlarm")
    # Then its one query sums EventsParked over every tenant (the code's own dimensions: service, tenant)
    (query,) = alarm["Metrics"]
    assert query["Expression"] == (
        f"SELECT SUM(EventsParked) FROM SCHEMA(\"{namespace}\", service, tenant) WHERE service = '{service}'"
    )
    assert query["ReturnData"] is True
    assert (alarm["Threshold"], alarm["ComparisonOperator"]) == (0, "GreaterThanThreshold")
    assert alarm["AlarmActions"] == [{"Ref": "AlarmTopic"}]
