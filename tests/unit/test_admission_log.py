"""What an admission logs: one EMF line, its metric's, carrying the audit fields as metadata; and the runbook's
Logs Insights query (docs/operations.md#finding-an-admission) names only fields that line carries. The bytes of
the built function's line are counted under the RIE (tests/integration/test_rie.py)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tests.conftest import REPO
from tests.unit.conftest import Invoke

OPERATIONS = REPO / "docs" / "operations.md"
QUERY_MARKER = "<!-- logs-insights:"
# Logs Insights' own words in the query, and the fields every log event has (@timestamp, ...).
INSIGHTS_WORDS = {"fields", "filter", "sort", "limit", "and", "or", "not", "desc", "asc"}


def _emf_lines(printed: str) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in printed.splitlines() if line.startswith("{")]
    return [line for line in lines if "_aws" in line]


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
