"""What an admission logs: one EMF line, its metric's, carrying the audit fields as metadata; and the runbook's
Logs Insights query (docs/operations.md#finding-an-admission) names only fields that line carries. The bytes of
the built function's line are counted under the RIE (tests/integration/test_rie.py)."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
from botocore.client import BaseClient
from botocore.exceptions import ClientError

from benchmarks.cost_model import ID_SIZES, MEASURED, MEASURED_IDS, Ids, admission_log_bytes, batch_log_bytes
from poimen.api import admission_service
from poimen.ids import keyed_run_id
from poimen.observability import logger
from poimen.store import Store
from poimen.wire import MAX_BATCH_SPAWNS, SPAWNS_MEDIA_TYPE
from poimen_tools.local.rie import LOG_EVENT_OVERHEAD_BYTES
from poimen_tools.local.template import Template
from tests.conftest import REPO
from tests.unit.conftest import PRINCIPAL, Invoke
from tests.unit.dynamodb_faults import connect_refused, lost_before_dynamodb, script_attempts

OPERATIONS = REPO / "docs" / "operations.md"
TEMPLATE_VARIABLES = Template(REPO / "template.yaml").document["Globals"]["Function"]["Environment"]["Variables"]
QUERY_MARKER = "<!-- logs-insights:"
# Logs Insights' own words in the query, and the fields every log event has (@timestamp, ...).
INSIGHTS_WORDS = {"fields", "filter", "sort", "limit", "and", "or", "not", "desc", "asc"}


def _emf_lines(printed: str) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in printed.splitlines() if line.startswith("{")]
    return [line for line in lines if "_aws" in line]


def _json_lines(printed: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in printed.splitlines() if line.startswith("{")]


def _runbook_query() -> str:
    text = OPERATIONS.read_text()
    assert QUERY_MARKER in text, "docs/operations.md has no Logs Insights query"
    block = text.split(QUERY_MARKER, 1)[1]
    return block.split("```text\n", 1)[1].split("```", 1)[0]


def test_an_admission_and_its_replay_each_log_their_emf_line_with_the_audit_fields(
    invoke: Invoke, tenant: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a run admitted, then the same request again
    request = {"workflow_ref": "wf/audit", "input": {}, "dispatch_key": "k-audit"}
    first = invoke(body=request)
    replay = invoke(body=request)

    # Then each wrote its metric's EMF line, the audit fields in it as metadata, not as dimensions
    admitted, replayed = _emf_lines(capsys.readouterr().out)
    for line, metric, message, status in (
        (admitted, "RunsAdmitted", "run admitted", 201),
        (replayed, "RunsReplayed", "run replayed", 200),
    ):
        directive = line["_aws"]["CloudWatchMetrics"][0]
        assert directive["Metrics"] == [{"Name": metric, "Unit": "Count"}]
        assert directive["Dimensions"] == [["service"]]
        assert (line["message"], line["status"]) == (message, status)
        assert (line["tenant_id"], line["run_id"], line["dispatch_key"]) == (tenant, first.body["run_id"], "k-audit")
        assert line["correlation_id"]
        assert line["latency_ms"] >= 0
    assert (first.status, replay.status) == (201, 200)


def test_the_runbook_query_names_only_fields_an_admission_logs(
    invoke: Invoke, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given the line one admission logs, and the runbook's query
    invoke(body={"workflow_ref": "wf/audit", "input": {}, "dispatch_key": "k-query"})
    (line,) = _emf_lines(capsys.readouterr().out)
    query = _runbook_query()

    # Then every field the query names (outside its quoted values) is one of the line's
    unquoted = re.sub(r'"[^"]*"', "", query)
    named = set(re.findall(r"(?<![@\w])[a-z_]+(?![\w(])", unquoted)) - INSIGHTS_WORDS
    assert named == {"message", "tenant_id", "run_id", "dispatch_key", "status", "correlation_id", "latency_ms"}
    assert named <= set(line)
    # And it finds an admission by each of run id, tenant and dispatch key
    assert {"tenant_id", "run_id", "dispatch_key"} <= set(re.findall(r"(\w+) = ", query.split("| filter", 1)[1]))


def _refused_put(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's PutItem fails as no retry helps (DynamoDB's AccessDenied): the unhandled-error path, a 500."""
    original: Callable[..., Any] = BaseClient._make_api_call  # type: ignore[attr-defined]

    def call(client: BaseClient, name: str, params: dict[str, Any]) -> Any:
        if name == "PutItem":
            raise ClientError({"Error": {"Code": "AccessDeniedException", "Message": "injected"}}, name)
        return original(client, name, params)

    monkeypatch.setattr(BaseClient, "_make_api_call", call)


def _unreachable(monkeypatch: pytest.MonkeyPatch) -> None:
    script_attempts(monkeypatch, put_run=[connect_refused, connect_refused])


def _answer_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    script_attempts(monkeypatch, put_run=[lost_before_dynamodb, lost_before_dynamodb])


@pytest.mark.parametrize(
    ("fault", "status", "message"),
    [
        (_unreachable, 503, "store unavailable"),
        (_answer_lost, 503, "write outcome unknown"),
        (_refused_put, 500, "unhandled error"),
    ],
    ids=["store-unavailable", "outcome-unknown", "unhandled-error"],
)
def test_a_spawn_that_fails_is_found_by_the_runbook_query_by_tenant_and_dispatch_key(
    invoke: Invoke,
    tenant: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    fault: Callable[[pytest.MonkeyPatch], None],
    status: int,
    message: str,
) -> None:
    # Given the Logger's lines printed where the EMF line is (the function's one log stream), and a store failing
    monkeypatch.setattr(logger.registered_handler, "stream", sys.stdout)
    fault(monkeypatch)

    # When a keyed spawn is sent
    answer = invoke(body={"workflow_ref": "wf/audit", "input": {}, "dispatch_key": "k-fails"})

    # Then the runbook's filter on tenant_id and dispatch_key finds the line saying what was answered
    assert answer.status == status
    found = [
        line
        for line in _json_lines(capsys.readouterr().out)
        if (line.get("tenant_id"), line.get("dispatch_key")) == (tenant, "k-fails")
    ]
    assert [(line["message"], line["status"]) for line in found] == [(message, status)], found
    if message == "write outcome unknown":
        assert found[0]["run_id"] == answer.body["run_id"] == keyed_run_id(tenant, "k-fails")


def test_a_reused_dispatch_key_is_found_by_the_runbook_query_with_the_run_it_names(
    invoke: Invoke, tenant: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a run admitted under a key
    monkeypatch.setattr(logger.registered_handler, "stream", sys.stdout)
    first = invoke(body={"workflow_ref": "wf/audit", "input": {}, "dispatch_key": "k-reused"})
    capsys.readouterr()

    # When the key comes again with another request
    answer = invoke(body={"workflow_ref": "wf/other", "input": {}, "dispatch_key": "k-reused"})

    # Then the runbook's filter finds the 422 by tenant, dispatch key and the run it names, in its metric's line
    assert answer.status == 422
    (line,) = [
        line
        for line in _json_lines(capsys.readouterr().out)
        if (line.get("tenant_id"), line.get("dispatch_key")) == (tenant, "k-reused")
    ]
    assert (line["message"], line["status"], line["run_id"]) == ("dispatch key reused", 422, first.body["run_id"])
    assert line["_aws"]["CloudWatchMetrics"][0]["Metrics"] == [{"Name": "DispatchKeyConflicts", "Unit": "Count"}]
    assert line["correlation_id"]


def test_each_spawn_of_a_batch_is_found_by_the_runbook_query_and_its_metrics_are_one_line(
    invoke: Invoke, tenant: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a run admitted under k-b1, and the Logger's lines printed where the EMF line is
    monkeypatch.setattr(logger.registered_handler, "stream", sys.stdout)
    first = invoke(body={"workflow_ref": "wf/audit", "input": {}, "dispatch_key": "k-b1"})
    capsys.readouterr()
    spawns = [
        {"workflow_ref": "wf/audit", "input": {}, "dispatch_key": "k-b1"},  # replayed
        {"workflow_ref": "wf/audit", "input": {}, "dispatch_key": "k-b2"},  # admitted
        {"workflow_ref": "wf/other", "input": {}, "dispatch_key": "k-b1"},  # 422
        {"workflow_ref": "wf/audit", "input": {}},  # keyless, admitted
    ]

    # When they are sent as one batch
    answer = invoke(body={"spawns": spawns}, headers={"content-type": SPAWNS_MEDIA_TYPE})

    # Then each spawn has its own line with the runbook's fields, naming its run, and the batch one EMF line of
    # its summed metrics
    assert answer.status == 200
    run_ids = [result.get("run", result.get("problem", {})).get("run_id") for result in answer.body["results"]]
    lines = [line for line in _json_lines(capsys.readouterr().out) if line.get("tenant_id") == tenant]
    audits = [line for line in lines if "run_id" in line and "_aws" not in line]
    assert [(line["message"], line["status"], line["dispatch_key"]) for line in audits] == [
        ("run replayed", 200, "k-b1"),
        ("run admitted", 201, "k-b2"),
        ("dispatch key reused", 422, "k-b1"),
        ("run admitted", 201, None),
    ]
    assert [line["run_id"] for line in audits] == [first.body["run_id"], run_ids[1], first.body["run_id"], run_ids[3]]
    assert all(line["correlation_id"] and line["latency_ms"] >= 0 for line in audits)
    (emf,) = [line for line in lines if "_aws" in line]
    names = {metric["Name"] for metric in emf["_aws"]["CloudWatchMetrics"][0]["Metrics"]}
    assert names == {"RunsAdmitted", "RunsReplayed", "DispatchKeyConflicts"}
    assert (emf["RunsAdmitted"], emf["RunsReplayed"], emf["DispatchKeyConflicts"], emf["spawns"]) == ([2], [1], [1], 4)


def test_a_tenant_not_granted_is_found_by_the_runbook_query_by_tenant_and_dispatch_key(
    handler: Callable[..., Any],
    dynamodb: Any,
    tenant: str,
    monkeypatch: pytest.MonkeyPatch,
    invoke: Invoke,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Given a served tenant the caller is not granted
    monkeypatch.setattr(logger.registered_handler, "stream", sys.stdout)
    other = f"{tenant}-b"

    # When it spawns for that tenant
    answer = invoke(body={"workflow_ref": "wf/audit", "input": {}, "dispatch_key": "k-403"}, tenant=other)

    # Then the refusal's line carries the tenant, the key and the status
    assert answer.status == 403
    found = [
        line
        for line in _json_lines(capsys.readouterr().out)
        if (line.get("tenant_id"), line.get("dispatch_key")) == (other, "k-403")
    ]
    assert [(line["message"], line["status"]) for line in found] == [("tenant not granted", 403)], found


def test_a_requests_spawn_keys_end_with_it(
    invoke: Invoke, tenant: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a spawn refused for a tenant the caller is not granted, its line naming the key
    monkeypatch.setattr(logger.registered_handler, "stream", sys.stdout)
    other = f"{tenant}-b"
    invoke(body={"workflow_ref": "wf/audit", "input": {}, "dispatch_key": "k-earlier"}, tenant=other)
    capsys.readouterr()

    # When the next request, a look-up, is refused too
    answer = invoke("GET", f"/v1/runs/{keyed_run_id(other, 'k-earlier')}", tenant=other)

    # Then its line names no key of the request before (the Logger's keys are cleared each invocation)
    assert answer.status == 403
    (line,) = [line for line in _json_lines(capsys.readouterr().out) if line.get("message") == "tenant not granted"]
    assert "dispatch_key" not in line
    assert "status" in line


def _line_bytes(
    invoke: Invoke, store: Store, monkeypatch: pytest.MonkeyPatch, printed: Callable[[], str], ids: Ids
) -> int:
    """The bytes CloudWatch Logs would ingest of the admission's line spawned with `ids`, its latency_ms written
    as 0.0 (its digits vary with the machine, not with the ids)."""
    monkeypatch.setenv("TENANTS", ids.tenant_id)
    admission_service.cache_clear()
    store.grant(PRINCIPAL, ids.tenant_id)
    answer = invoke(
        body={"workflow_ref": "wf/audit", "input": {}, "dispatch_key": ids.dispatch_key}, tenant=ids.tenant_id
    )
    assert answer.status == 201
    (line,) = _emf_lines(text := printed())
    assert (line["tenant_id"], line["dispatch_key"]) == (ids.tenant_id, ids.dispatch_key)
    (event,) = [event for event in text.splitlines() if event.startswith("{")]
    return len(re.sub(r'"latency_ms":[0-9.]+', '"latency_ms":0.0', event).encode()) + LOG_EVENT_OVERHEAD_BYTES


def test_the_cost_models_log_bytes_follow_the_ids_as_the_handler_writes_them(
    invoke: Invoke, store: Store, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given the line the model's measured bytes are of (its ids), written here
    def printed() -> str:
        return capsys.readouterr().out

    measured = _line_bytes(invoke, store, monkeypatch, printed, MEASURED_IDS)

    # Then every other size of ids the model prices (the longest the API accepts among them) differs from it by
    # what the model says, escapes included
    for ids in [ids for ids in ID_SIZES if ids != MEASURED_IDS]:
        written = _line_bytes(invoke, store, monkeypatch, printed, ids)
        assert written - measured == admission_log_bytes(MEASURED, ids) - MEASURED.admission_log_bytes, ids.label


def test_the_cost_models_batch_log_bytes_are_each_spawns_audit_line_and_the_batchs_emf_line(
    invoke: Invoke, store: Store, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given the model's ids, served and granted, and a full batch of keys as long as its key
    monkeypatch.setenv("TENANTS", MEASURED_IDS.tenant_id)
    admission_service.cache_clear()
    store.grant(PRINCIPAL, MEASURED_IDS.tenant_id)
    keys = [f"{MEASURED_IDS.dispatch_key[:-3]}{n:03d}" for n in range(MAX_BATCH_SPAWNS)]
    capsys.readouterr()

    # When they are admitted in one batch
    spawns = [{"workflow_ref": "wf/audit", "input": {}, "dispatch_key": key} for key in keys]
    answer = invoke(body={"spawns": spawns}, headers={"content-type": SPAWNS_MEDIA_TYPE}, tenant=MEASURED_IDS.tenant_id)
    assert answer.status == 200

    # Then what CloudWatch Logs would ingest of the invocation (each line's bytes and 26, latency_ms written as
    # 0.0, the EMF line in the template's namespace) is what the model prices for a batch of that many spawns: a
    # line a spawn and the batch's EMF line
    events = [event for event in capsys.readouterr().out.splitlines() if event.startswith("{")]
    assert len(events) == MAX_BATCH_SPAWNS + 1
    namespace = TEMPLATE_VARIABLES["POWERTOOLS_METRICS_NAMESPACE"]
    written = [
        re.sub(r'"latency_ms":[0-9.]+', '"latency_ms":0.0', event).replace(
            f'"Namespace":"{os.environ["POWERTOOLS_METRICS_NAMESPACE"]}"', f'"Namespace":"{namespace}"'
        )
        for event in events
    ]
    ingested = sum(len(event.encode()) + LOG_EVENT_OVERHEAD_BYTES for event in written)
    assert ingested == batch_log_bytes(MEASURED, MEASURED_IDS, MAX_BATCH_SPAWNS)


def test_the_layer_leaves_a_processs_logging_alone_and_the_admission_function_keeps_libraries_at_warning() -> None:
    # Given a process that logs at DEBUG (`poimen --debug`, whose `poimen dev` runs the relay in-process)
    script = "\n".join(
        [
            "import logging",
            "logging.basicConfig(level=logging.DEBUG)",
            "import poimen.observability, poimen.relay",
            "print(logging.getLogger().level)",
            "from poimen_tools.local.template import Template",
            "Template(__import__('pathlib').Path('template.yaml')).load_handler('AdmissionFunction')",
            "print(logging.getLogger().level)",
        ]
    )

    # When it loads the layer's logging, then the admission function's entry point
    levels = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()

    # Then the layer left it at DEBUG; the admission function (JSON log format, whose runtime sets the root
    # logger to INFO) keeps libraries' records at WARNING
    assert levels == [str(logging.DEBUG), str(logging.WARNING)]


def test_a_batch_that_publishes_no_metric_leaves_no_metadata_to_the_next_requests_line(
    invoke: Invoke, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a batch whose every spawn is refused 400: no metric, so Powertools prints no line for it, and keeps
    # what was added to its metric set (metadata) for the next line it prints
    spawns = [{"workflow_ref": 5, "input": {}}]
    answer = invoke(body={"spawns": spawns}, headers={"content-type": SPAWNS_MEDIA_TYPE})
    assert (answer.status, answer.body["results"][0]["status"]) == (200, 400)
    capsys.readouterr()

    # When the next request finds the store unavailable (a metric, so an EMF line)
    script_attempts(monkeypatch, put_run=[connect_refused, connect_refused])
    refused = invoke(body={"workflow_ref": "wf/audit", "input": {}, "dispatch_key": "k-503"})

    # Then its line carries its own metric and nothing of the batch before it (its tenant, its count of spawns)
    assert refused.status == 503
    (line,) = _emf_lines(capsys.readouterr().out)
    assert line["StoreUnavailable"] == [1.0]
    assert "tenant_id" not in line
    assert "spawns" not in line
