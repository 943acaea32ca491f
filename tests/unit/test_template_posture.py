"""template.yaml's posture options, read as data and as CloudFormation gets them (SAM-transformed offline):
SnapStart on and off behind the alias `live`, the customer managed key, reserved concurrency, the scanner
suppressions, and the dashboard, whose metrics must be exactly the ones the code emits."""

from __future__ import annotations

import ast
import json
import re
from functools import cache
from typing import Any

import pytest

from poimen_tools.local.template import Template
from tests.conftest import REPO
from tests.unit.transforms import sam_transform

LAYER_PACKAGE = REPO / "layers" / "poimen" / "poimen"
FUNCTIONS = ("AdmissionFunction", "InboxRelayFunction", "OutboxRelayFunction")
KEY_ARN = "arn:aws:kms:us-east-1:111122223333:key/1234abcd-12ab-34cd-56ef-1234567890ab"
HARDENED = {
    "SnapStart": "PublishedVersions",
    "KmsKeyArn": KEY_ARN,
    "AdmissionReservedConcurrency": "50",
    "RelayReservedConcurrency": "10",
    "OutboxReservedConcurrency": "5",
}
ENCRYPTED = ["AdmissionTable", "RelayDeadLetterQueue", "FailedBatchesBucket", "AlarmTopic"]
LOG_GROUPS = ["AdmissionApiAccessLogs", "AdmissionFunctionLogs", "InboxRelayFunctionLogs", "OutboxRelayFunctionLogs"]
# Which function runs each layer module that emits metrics (its POWERTOOLS_SERVICE_NAME is the dimension).
EMITTING_MODULES = {
    "api": "AdmissionFunction",
    "admission": "AdmissionFunction",
    "relay": "InboxRelayFunction",
    "outbox": "OutboxRelayFunction",
}


@cache
def _transformed(**parameters: str) -> dict[str, Any]:
    """The template as CloudFormation gets it, offline (tests/unit/transforms.py)."""
    arguments = [f"{name}={value}" for name, value in {"Tenants": "acme,beta-2", **parameters}.items()]
    transformed: dict[str, Any] = json.loads(sam_transform(*arguments))
    return transformed


def _in_single_region(value: Any) -> Any:
    """What the stack uses in single-Region mode (the default) where the template chooses by TableMode:
    the IsSingleRegion branch (tests/unit/test_template_multiregion.py covers the other modes)."""
    condition, when_single, _ = value["Fn::If"]
    assert condition == "IsSingleRegion"
    return when_single


def _literal_placeholders(value: Any, *, inside_sub: bool = False) -> list[str]:
    """Every string outside an Fn::Sub that still holds a `${...}` placeholder: text CloudFormation would
    never substitute."""
    if isinstance(value, str):
        return [] if inside_sub or "${" not in value else [value]
    if isinstance(value, list):
        return [found for item in value for found in _literal_placeholders(item, inside_sub=inside_sub)]
    if isinstance(value, dict):
        return [
            found
            for key, item in value.items()
            for found in _literal_placeholders(item, inside_sub=inside_sub or key == "Fn::Sub")
        ]
    return []


def test_the_transform_keeps_every_sub_it_cannot_resolve() -> None:
    resources = _transformed()["Resources"]
    relay = resources["InboxRelayFunction"]["Properties"]["Environment"]["Variables"]

    assert _literal_placeholders(resources) == []
    assert relay["ADMISSION_API_URL"] == {
        "Fn::Sub": "https://${AdmissionApi}.execute-api.${AWS::Region}.${AWS::URLSuffix}"
    }
    # What a parameter resolves offline is substituted, and the rest of that Fn::Sub kept.
    layer = _only(resources, "AWS::Lambda::LayerVersion", "PoimenLayer")[1]
    assert layer["Properties"]["LayerName"] == "poimen-core-dev"


def _of_type(resources: dict[str, Any], kind: str) -> dict[str, Any]:
    return {name: res for name, res in resources.items() if res["Type"] == kind}


def _only(resources: dict[str, Any], kind: str, prefix: str) -> tuple[str, dict[str, Any]]:
    (found,) = [(name, res) for name, res in _of_type(resources, kind).items() if name.startswith(prefix)]
    return found


# --- SnapStart and the alias ------------------------------------------------------------------------------


def test_snapstart_is_a_parameter_off_by_default_set_on_each_function(template: Template) -> None:
    parameter = template.document["Parameters"]["SnapStart"]
    function_globals = template.document["Globals"]["Function"]

    assert parameter["Default"] == "None"
    assert parameter["AllowedValues"] == ["None", "PublishedVersions"]
    # On each function, not in Globals: only there is the Ref resolved before SAM hashes the version.
    assert "SnapStart" not in function_globals
    for function in FUNCTIONS:
        assert template.properties(function)["SnapStart"] == {"ApplyOn": {"Ref": "SnapStart"}}
    assert function_globals["AutoPublishAlias"] == "live"
    assert function_globals["VersionDeletionPolicy"] == "Delete"


def test_msk_event_sources_invoke_the_relay_alias(template: Template) -> None:
    resources = template.expanded_resources({"Tenants": ["acme", "beta-2"]})

    for name, mapping in _of_type(resources, "AWS::Lambda::EventSourceMapping").items():
        relay = "OutboxRelayFunction" if name == "OutboxRelaySource" else "InboxRelayFunction"
        assert mapping["Properties"]["FunctionName"] == {"Ref": f"{relay}.Alias"}


@pytest.mark.parametrize("snapstart", ["None", "PublishedVersions"])
def test_transformed_both_ways_everything_invokes_the_published_alias(snapstart: str) -> None:
    resources = _transformed(SnapStart=snapstart)["Resources"]

    for function in FUNCTIONS:
        props = resources[function]["Properties"]
        version_id, version = _only(resources, "AWS::Lambda::Version", f"{function}Version")
        alias = resources[f"{function}Aliaslive"]
        assert props["SnapStart"] == {"ApplyOn": snapstart}
        assert version["Properties"]["FunctionName"] == {"Ref": function}
        assert version["DeletionPolicy"] == "Delete"
        assert alias["Properties"]["FunctionVersion"] == {"Fn::GetAtt": [version_id, "Version"]}
    mappings = _of_type(resources, "AWS::Lambda::EventSourceMapping")
    outbox = mappings.pop("OutboxRelaySource")
    assert outbox["Properties"]["FunctionName"] == {"Ref": "OutboxRelayFunctionAliaslive"}
    assert sorted(mappings) == ["RelaySourceacme", "RelaySourcebeta2"]
    assert {json.dumps(m["Properties"]["FunctionName"]) for m in mappings.values()} == {
        json.dumps({"Ref": "InboxRelayFunctionAliaslive"})
    }
    permissions = _of_type(resources, "AWS::Lambda::Permission").values()
    assert permissions
    assert all(p["Properties"]["FunctionName"] == {"Ref": "AdmissionFunctionAliaslive"} for p in permissions)
    body = json.dumps(resources["AdmissionApi"]["Properties"]["Body"])
    assert body.count("${AdmissionFunctionAliaslive}/invocations") == 4  # every route
    assert "${AdmissionFunction.Arn}" not in body


def test_switching_snapstart_publishes_new_versions() -> None:
    # Given the template transformed with SnapStart off, then on
    off = _transformed(SnapStart="None")["Resources"]
    on = _transformed(SnapStart="PublishedVersions")["Resources"]

    # Then each function gets a version of a new logical id: CloudFormation publishes it (with a snapshot)
    # and moves the alias, rather than keeping the alias on a version published without SnapStart.
    for function in FUNCTIONS:
        assert _only(off, "AWS::Lambda::Version", function)[0] != _only(on, "AWS::Lambda::Version", function)[0]


# --- the customer managed key ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "valid"),
    [
        ("", True),
        (KEY_ARN, True),
        ("arn:aws-us-gov:kms:us-gov-west-1:111122223333:key/mrk-1a2b", True),
        ("alias/poimen", False),
        ("arn:aws:kms:us-east-1:111122223333:alias/poimen", False),
        ("key", False),
    ],
)
def test_kms_key_parameter_takes_a_key_arn_or_nothing(template: Template, value: str, valid: bool) -> None:
    # A key ARN, not an alias: IAM policies name the key itself.
    pattern = template.document["Parameters"]["KmsKeyArn"]["AllowedPattern"]

    assert bool(re.fullmatch(pattern, value)) is valid


def test_without_a_key_everything_stays_on_aws_managed_encryption() -> None:
    resources = _transformed()["Resources"]

    assert resources["AdmissionTable"]["Properties"]["SSESpecification"] == {"SSEEnabled": True}
    assert resources["RelayDeadLetterQueue"]["Properties"]["SqsManagedSseEnabled"] is True
    assert "KmsMasterKeyId" not in resources["RelayDeadLetterQueue"]["Properties"]
    (rule,) = resources["FailedBatchesBucket"]["Properties"]["BucketEncryption"]["ServerSideEncryptionConfiguration"]
    assert rule == {"ServerSideEncryptionByDefault": {"SSEAlgorithm": "AES256"}}
    # The AWS managed SNS key would stop CloudWatch from delivering alarms: no key at all instead.
    assert "KmsMasterKeyId" not in resources["AlarmTopic"]["Properties"]
    assert all("KmsKeyId" not in resources[group]["Properties"] for group in LOG_GROUPS)


def test_with_a_key_every_store_of_data_uses_it() -> None:
    resources = _transformed(KmsKeyArn=KEY_ARN)["Resources"]
    function_keys = {json.dumps(resources[f]["Properties"]["KmsKeyArn"]) for f in FUNCTIONS}

    assert resources["AdmissionTable"]["Properties"]["SSESpecification"] == {
        "SSEEnabled": True,
        "SSEType": "KMS",
        "KMSMasterKeyId": KEY_ARN,
    }
    queue = resources["RelayDeadLetterQueue"]["Properties"]
    assert queue["KmsMasterKeyId"] == KEY_ARN
    assert "SqsManagedSseEnabled" not in queue  # one of SSE-SQS and SSE-KMS
    (rule,) = resources["FailedBatchesBucket"]["Properties"]["BucketEncryption"]["ServerSideEncryptionConfiguration"]
    assert rule == {
        "ServerSideEncryptionByDefault": {"SSEAlgorithm": "aws:kms", "KMSMasterKeyID": KEY_ARN},
        "BucketKeyEnabled": True,
    }
    assert resources["AlarmTopic"]["Properties"]["KmsMasterKeyId"] == KEY_ARN
    assert all(resources[group]["Properties"]["KmsKeyId"] == KEY_ARN for group in LOG_GROUPS)
    # From Globals, resolved by CloudFormation at deploy: environment variables and SnapStart snapshots.
    assert function_keys == {json.dumps({"Fn::If": ["HasKmsKey", {"Ref": "KmsKeyArn"}, {"Ref": "AWS::NoValue"}]})}


@pytest.mark.parametrize(
    ("policy", "role", "services"),
    [
        ("AdmissionKeyAccess", "AdmissionFunctionRole", ["dynamodb"]),
        ("RelayKeyAccess", "InboxRelayFunctionRole", ["sqs", "s3"]),
    ],
)
def test_roles_use_the_key_only_through_their_services(
    template: Template, policy: str, role: str, services: list[str]
) -> None:
    resource = template.resources[policy]
    (statement,) = resource["Properties"]["PolicyDocument"]["Statement"]
    via = statement["Condition"]["StringEquals"]["kms:ViaService"]

    assert resource["Condition"] == "HasKmsKey"
    assert resource["Properties"]["Roles"] == [{"Ref": role}]
    assert statement["Resource"] == {"Ref": "KmsKeyArn"}
    assert all(action.startswith("kms:") and "*" not in action for action in statement["Action"])
    assert [v["Fn::Sub"] for v in (via if isinstance(via, list) else [via])] == [
        f"{service}.${{AWS::Region}}.amazonaws.com" for service in services
    ]
    assert statement["Condition"]["StringEquals"]["kms:CallerAccount"] == {"Ref": "AWS::AccountId"}


# --- grants that scale (docs/posture.md#permissions-that-scale) -----------------------------------------


def _grants(resources: dict[str, Any]) -> dict[str, str]:
    kinds = {"AWS::IAM::Role", "AWS::IAM::Policy", "AWS::IAM::ManagedPolicy"}
    return {
        name: json.dumps(res["Properties"], sort_keys=True) for name, res in resources.items() if res["Type"] in kinds
    }


@pytest.mark.parametrize("parameters", [{}, HARDENED], ids=["defaults", "hardened"])
def test_no_role_grows_with_the_tenants(parameters: dict[str, str]) -> None:
    # Given the stack for one tenant and for fifty
    one = _transformed(**parameters, Tenants="t0")["Resources"]
    fifty = _transformed(**parameters, Tenants=",".join(f"t{n}" for n in range(50)))["Resources"]

    # Then every role, policy and statement is the same: a grant per tenant would multiply against IAM's
    # quotas (10,240 characters of inline policies a role), the one-topic-per-mapping event sources apart.
    assert _grants(fifty) == _grants(one)


# --- reserved concurrency -------------------------------------------------------------------------------


@pytest.mark.parametrize("parameter", ["AdmissionReservedConcurrency", "RelayReservedConcurrency"])
@pytest.mark.parametrize(("value", "valid"), [("", True), ("1", True), ("250", True), ("0", False), ("-1", False)])
def test_reserved_concurrency_is_empty_or_positive(template: Template, parameter: str, value: str, valid: bool) -> None:
    # 0 would stop the function altogether: not a value to reach by accident.
    pattern = template.document["Parameters"][parameter]["AllowedPattern"]

    assert bool(re.fullmatch(pattern, value)) is valid


def test_reserved_concurrency_is_unreserved_when_empty_and_reserved_when_set() -> None:
    unset = _transformed()["Resources"]
    reserved = _transformed(AdmissionReservedConcurrency="50", RelayReservedConcurrency="10")["Resources"]

    assert all("ReservedConcurrentExecutions" not in unset[f]["Properties"] for f in FUNCTIONS)
    assert int(reserved["AdmissionFunction"]["Properties"]["ReservedConcurrentExecutions"]) == 50
    assert int(reserved["InboxRelayFunction"]["Properties"]["ReservedConcurrentExecutions"]) == 10


# --- scanner suppressions -------------------------------------------------------------------------------


def _suppressions(template: Template) -> list[tuple[str, str, str]]:
    return [
        (name, skip["id"], skip.get("comment", ""))
        for name, res in template.resources.items()
        for skip in res.get("Metadata", {}).get("checkov", {}).get("skip", [])
    ]


def test_every_scanner_suppression_has_a_reason_and_is_documented(template: Template) -> None:
    posture = (REPO / "docs" / "posture.md").read_text()
    suppressions = _suppressions(template)

    assert suppressions
    for name, check, comment in suppressions:
        assert re.fullmatch(r"CKV_AWS_\d+", check), name
        assert len(comment.split()) >= 8, (name, check)  # a reason, not a label
        assert f"`{check}`" in posture, (name, check)
        assert f"`{name}`" in posture, (name, check)


def test_the_hardened_transformed_template_is_the_one_make_lint_scans() -> None:
    makefile = (REPO / "Makefile").read_text()

    assert "$(CHECKOV_SCAN) --file template.yaml" in makefile
    assert "$(CHECKOV_SCAN) --file .cache/checkov/template.transformed.json" in makefile
    for name in HARDENED:
        assert f"{name}=" in makefile


# --- the dashboard --------------------------------------------------------------------------------------


def _dashboard_body(template: Template) -> dict[str, Any]:
    """The DashboardBody Fn::Sub, each ${...} replaced by its own name (the JSON must parse either way)."""
    text, _ = template.properties("AdmissionDashboard")["DashboardBody"]["Fn::Sub"]
    body: dict[str, Any] = json.loads(re.sub(r"\$\{([^}]+)\}", r"<\1>", text))
    return body


def _metric_rows(template: Template) -> list[list[Any]]:
    return [row for widget in _dashboard_body(template)["widgets"] for row in widget["properties"].get("metrics", [])]


_SEARCH = re.compile(r"SEARCH\('\{(?P<schema>[^}]+)\}(?P<terms>[^']*)'")
_TERM = re.compile(r'(?P<name>[A-Za-z]+)="(?P<value>[^"]*)"')


def _metrics_on_dashboard(template: Template, namespace: str) -> dict[str, set[tuple[str, str]]]:
    """Metric name -> its (dimension, value) pairs, for every metric row of `namespace`: plain rows, and
    SEARCH expressions, whose schema dimensions without a value in the search terms read as value "*"."""
    found: dict[str, set[tuple[str, str]]] = {}
    for row in _metric_rows(template):
        plain = [item for item in row if not isinstance(item, dict)]
        if plain and plain[0] == namespace:
            dimensions = plain[2:]
            found.setdefault(plain[1], set()).update(zip(dimensions[::2], dimensions[1::2], strict=True))
        for item in row:
            search = _SEARCH.search(item.get("expression", "")) if isinstance(item, dict) else None
            if search is None:
                continue
            schema_namespace, *schema_dimensions = search["schema"].split(",")
            terms = {term["name"]: term["value"] for term in _TERM.finditer(search["terms"])}
            if schema_namespace == namespace and "MetricName" in terms:
                pairs = {(name, terms.get(name, "*")) for name in schema_dimensions}
                found.setdefault(terms["MetricName"], set()).update(pairs)
    return found


def _dimensions_added(module: str) -> set[str]:
    """The dimensions a layer module adds to its metrics beyond `service`: its `add_dimension(name=...)`s."""
    tree = ast.parse((LAYER_PACKAGE / f"{module}.py").read_text())
    return {
        str(keyword.value.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_dimension"
        for keyword in node.keywords
        if keyword.arg == "name" and isinstance(keyword.value, ast.Constant)
    }


def _emitted_metrics() -> dict[str, set[str]]:
    """Metric name -> the modules of the layer that emit it: every `add_metric(name=...)` in the code, and every
    `print_count(name, ...)` and `add_count(name, ...)` (poimen.observability: the line printed directly, a Count
    added unless metrics are disabled), whose own forwarding of its `name` to `add_metric` is counted at their
    callers."""
    emitted: dict[str, set[str]] = {}
    for path in sorted(LAYER_PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            function = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
            if function in {"print_count", "add_count"}:
                name = node.args[0]
            elif function == "add_metric":
                (name,) = [keyword.value for keyword in node.keywords if keyword.arg == "name"]
                if path.stem == "observability" and isinstance(name, ast.Name) and name.id == "name":
                    continue  # print_count's and add_count's forwarding
            else:
                continue
            options = [name.body, name.orelse] if isinstance(name, ast.IfExp) else [name]
            for option in options:
                assert isinstance(option, ast.Constant), f"{path.name}: metric names must be literals"
                assert isinstance(option.value, str), f"{path.name}: metric names are strings"
                emitted.setdefault(option.value, set()).add(path.stem)
    return emitted


def test_the_code_emits_metrics_from_known_functions() -> None:
    emitted = _emitted_metrics()

    assert {"RunsAdmitted", "RunsReplayed", "DispatchRelayed", "InboxLag"} <= set(emitted)
    assert set().union(*emitted.values()) <= set(EMITTING_MODULES), "map the new module to its function"


def test_dashboard_shows_exactly_the_metrics_the_code_emits_with_their_service(template: Template) -> None:
    namespace = template.document["Globals"]["Function"]["Environment"]["Variables"]["POWERTOOLS_METRICS_NAMESPACE"]
    on_dashboard = _metrics_on_dashboard(template, namespace)
    emitted = _emitted_metrics()

    assert set(on_dashboard) == set(emitted)
    for metric, modules in emitted.items():
        services = {template.function_environment(EMITTING_MODULES[m], {})["POWERTOOLS_SERVICE_NAME"] for m in modules}
        added = set().union(*(_dimensions_added(m) for m in modules))
        # Powertools' own dimension is `service`, plus what the module adds (the relay: `tenant`, drawn by a
        # SEARCH per tenant): a series exists only under exactly its dimension set.
        expected = {("service", service) for service in services} | {(name, "*") for name in added}
        assert on_dashboard[metric] == expected, metric


def test_the_relays_metrics_are_per_tenant_on_the_dashboard(template: Template) -> None:
    on_dashboard = _metrics_on_dashboard(template, "Poimen")

    assert _dimensions_added("relay") == {"tenant"}
    relay_metrics = ("DispatchRelayed", "DispatchReplayed", "DispatchDeadLettered", "RelayRetries", "InboxLag")
    for metric in (*relay_metrics, "DispatchKeyless"):
        assert ("tenant", "*") in on_dashboard[metric], metric


def test_dashboard_covers_the_api_the_relay_lag_the_dlq_and_the_table(template: Template) -> None:
    namespaces = ("AWS/ApiGateway", "AWS/Lambda", "AWS/SQS", "AWS/DynamoDB")
    aws = {namespace: _metrics_on_dashboard(template, namespace) for namespace in namespaces}
    rows = [json.dumps(row) for row in _metric_rows(template)]

    assert {"4xx", "5xx", "Count", "Latency"} <= set(aws["AWS/ApiGateway"])
    assert all(dims == {("ApiId", "<AdmissionApi>")} for dims in aws["AWS/ApiGateway"].values())
    assert any('"Latency"' in row and '"p50"' in row for row in rows)
    assert any('"Latency"' in row and '"p99"' in row for row in rows)
    # OffsetLag of the whole relay (what the alarm watches), and per tenant's mapping (a SEARCH).
    assert aws["AWS/Lambda"]["OffsetLag"] == {("FunctionName", "<InboxRelayFunction>"), ("EventSourceMappingUUID", "*")}
    dlq = {("QueueName", "<RelayDeadLetterQueue.QueueName>")}
    assert aws["AWS/SQS"] == {"ApproximateNumberOfMessagesVisible": dlq, "ApproximateAgeOfOldestMessage": dlq}
    assert set(aws["AWS/DynamoDB"]) == {"ReadThrottleEvents", "WriteThrottleEvents"}


def test_dashboard_names_only_this_stacks_resources(template: Template) -> None:
    text, variables = template.properties("AdmissionDashboard")["DashboardBody"]["Fn::Sub"]
    names = {ref.split(".")[0] for ref in re.findall(r"\$\{([^}]+)\}", text)}

    assert names - {"AWS::Region"} - set(variables) <= set(template.resources)
    # The table by name: this stack's own in single-Region mode (the global table's replica otherwise).
    assert variables == {"AdmissionTableName": variables["AdmissionTableName"]}
    assert _in_single_region(variables["AdmissionTableName"]) == {"Ref": "AdmissionTable"}
    assert all(widget["properties"]["region"] == "<AWS::Region>" for widget in _dashboard_body(template)["widgets"])


def test_dashboard_url_is_an_output(template: Template) -> None:
    url = template.document["Outputs"]["AdmissionDashboardUrl"]["Value"]["Fn::Sub"]

    assert url.endswith("#dashboards/dashboard/${AdmissionDashboard}")
