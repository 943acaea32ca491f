"""Every answer body the API writes is one serializer's text, `poimen.contract.json_text` (compact, characters
written out): each problem, whether the screen, the resolver or a batch's spawn answers it, each run and each batch
answer, byte for byte. A batch's spawn's problem is the same bytes as the single route's answer for that spawn."""

from __future__ import annotations

import json
from typing import Any

import pytest

from poimen.contract import json_text, parse_json
from poimen.errors import OutcomeUnknown, StoreUnavailable
from poimen.store import Store
from poimen.wire import MAX_BODY_BYTES, SPAWNS_MEDIA_TYPE
from tests.unit.conftest import Answer, Invoke

GOOD = {"workflow_ref": "wf/hello", "input": {"n": 1}}
BATCH = {"content-type": SPAWNS_MEDIA_TYPE}
PROBLEM = "urn:poimen:problem:"


def _is_one_serializers_text(answer: Answer) -> None:
    """The body is json_text's text of its own value (parse_json: its numbers as written), byte for byte, and
    UTF-8 text a runtime can send (no lone surrogate written out)."""
    assert json_text(parse_json(answer.text)) == answer.text
    answer.text.encode("utf-8")


# Each request, and the problem type the API answers it (no dispatch key repeats across cases: one table a test).
_PROBLEMS: list[tuple[str, dict[str, Any], str]] = [
    ("screen-malformed-json", {"raw_body": '{"workflow_ref": '}, "malformed-json"),
    ("screen-too-deep", {"raw_body": '{"input": ' + "[" * 70 + "]" * 70 + "}"}, "malformed-json"),
    ("screen-not-base64", {"raw_body": json.dumps(GOOD), "flagged_base64": True}, "malformed-json"),
    ("screen-not-an-object", {"body": [GOOD]}, "validation-error"),
    ("screen-too-large", {"body": {**GOOD, "input": {"s": "x" * MAX_BODY_BYTES}}}, "payload-too-large"),
    ("screen-media-type", {"body": GOOD, "headers": {"content-type": "text/csv"}}, "unsupported-media-type"),
    ("resolver-validation", {"body": {"input": {}, "priority": 1}}, "validation-error"),
    # Non-ASCII in the problem: a field's name as sent, and one cut short with an ellipsis
    ("resolver-non-ascii-fields", {"body": {**GOOD, "schlüssel": 1, "中" * 300: 2}}, "validation-error"),
    ("resolver-tenant", {"body": GOOD, "tenant": "Not-A-Tenant"}, "validation-error"),
    ("resolver-query", {"method": "GET", "path": "/v1/runs"}, "validation-error"),
    # A lone surrogate in what the problem names: it is named by its place, never written out
    (
        "resolver-lone-surrogate",
        {"method": "GET", "path": "/v1/runs", "query": "dispatch_key=\ud800"},
        "validation-error",
    ),
    ("idempotency-key-invalid", {"body": GOOD, "headers": {"idempotency-key": '"k'}}, "idempotency-key-invalid"),
    (
        "idempotency-key-mismatch",
        {"body": {**GOOD, "dispatch_key": "p-1"}, "headers": {"idempotency-key": "p-2"}},
        "idempotency-key-mismatch",
    ),
    ("forbidden", {"body": GOOD, "principal": None}, "forbidden"),
    ("tenant-not-served", {"body": GOOD, "tenant": "nobody"}, "tenant-not-served"),
    ("run-not-found", {"method": "GET", "path": "/v1/runs/00000000-0000-8000-8000-000000000000"}, "run-not-found"),
    ("route-not-found", {"method": "GET", "path": "/v2/nothing"}, "not-found"),
    ("batch-envelope", {"body": {"spawns": []}, "headers": BATCH}, "validation-error"),
    (
        "batch-key-header",
        {"body": {"spawns": [GOOD]}, "headers": {**BATCH, "idempotency-key": "k-1"}},
        "idempotency-key-invalid",
    ),
]


@pytest.mark.parametrize(("request_", "kind"), [case[1:] for case in _PROBLEMS], ids=[case[0] for case in _PROBLEMS])
def test_every_problem_is_the_one_serializers_text(invoke: Invoke, request_: dict[str, Any], kind: str) -> None:
    arguments = dict(request_)
    method, path = arguments.pop("method", "POST"), arguments.pop("path", "/v1/runs")

    answer = invoke(method, path, **arguments)

    assert (answer.headers["Content-Type"], answer.body["type"]) == ("application/problem+json", PROBLEM + kind)
    _is_one_serializers_text(answer)


def test_a_problem_with_non_ascii_is_written_out_in_utf8(invoke: Invoke) -> None:
    # When a problem names fields of non-ASCII names, one cut short with "…"
    answer = invoke(body={**GOOD, "schlüssel": 1, "中" * 300: 2})
    # Then its text holds those characters themselves, as a run's does, not \u escapes
    assert "schlüssel" in answer.text
    assert "…" in answer.text
    assert "\\u" not in answer.text


def test_the_errors_of_the_store_are_the_one_serializers_text(
    invoke: Invoke, monkeypatch: pytest.MonkeyPatch, tenant: str
) -> None:
    answers: list[Answer] = []
    for error in (
        StoreUnavailable("throttled", retry_after_seconds=2),
        OutcomeUnknown("00000000-0000-8000-8000-000000000001", "lost", keyed=True),
        KeyError("boom"),
    ):

        def failing(self: Store, record: object, error: Exception = error) -> None:
            raise error

        monkeypatch.setattr(Store, "put_run_if_absent", failing)
        answers.append(invoke(body={**GOOD, "dispatch_key": f"e-{len(answers)}"}))
    assert [answer.body["type"] for answer in answers] == [
        PROBLEM + "store-unavailable",
        PROBLEM + "outcome-unknown",
        PROBLEM + "internal-error",
    ]
    for answer in answers:
        _is_one_serializers_text(answer)


def test_a_batch_answer_and_each_spawns_problem_in_it_are_the_one_serializers_text(invoke: Invoke) -> None:
    # Given a run a key admitted, then a batch of a new run, its replay, its 422, an invalid spawn with non-ASCII
    # in its problem, a spawn over the body limit and a keyless run
    assert invoke(body={**GOOD, "dispatch_key": "s-1"}).status == 201
    spawns: list[dict[str, Any]] = [
        {**GOOD, "dispatch_key": "s-2"},
        {**GOOD, "dispatch_key": "s-1"},
        {**GOOD, "dispatch_key": "s-1", "workflow_ref": "wf/other"},
        {**GOOD, "dispatch_key": "s-3", "schlüssel": "é"},
        {**GOOD, "dispatch_key": "s-4", "input": {"s": "x" * MAX_BODY_BYTES}},
        {**GOOD, "input": {"x": 1.10, "中": "文"}},
    ]
    # When it is sent
    answer = invoke(body={"spawns": spawns}, headers=BATCH)
    # Then the whole answer is the one serializer's text
    assert [result["status"] for result in answer.body["results"]] == [201, 200, 422, 400, 413, 201]
    _is_one_serializers_text(answer)
    # And each refused spawn's problem is the very bytes the single route answers for that spawn alone (but the
    # 413's, whose detail counts the spawn as compact JSON, the single route's the body as sent)
    for index in (2, 3):
        single = invoke(body=spawns[index])
        assert single.status == answer.body["results"][index]["status"]
        assert json_text(parse_json(answer.text)["results"][index]["problem"]) == single.text


def test_runs_and_the_document_are_the_one_serializers_text(invoke: Invoke) -> None:
    created = invoke(body={**GOOD, "dispatch_key": "r-1", "input": {"x": 1.10, "中": ["文", None, True]}})
    replayed = invoke(body={**GOOD, "dispatch_key": "r-1", "input": {"x": 1.10, "中": ["文", None, True]}})
    found = invoke("GET", f"/v1/runs/{created.body['run_id']}")
    document = invoke("GET", "/openapi.json")
    assert [answer.status for answer in (created, replayed, found, document)] == [201, 200, 200, 200]
    for answer in (created, replayed, found, document):
        _is_one_serializers_text(answer)
