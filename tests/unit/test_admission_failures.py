"""A 5xx answer means nothing was written: each step after validation is made to fail in turn.

Admission builds the item and the answer before its one conditional write, so whatever fails does so
before anything is stored; after the write only the answer built beforehand remains to be sent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import pytest
from botocore.client import BaseClient
from botocore.exceptions import ClientError, EndpointConnectionError

from poimen.ids import keyed_run_id
from tests.conftest import count_runs
from tests.unit.conftest import Invoke
from tests.unit.dynamodb_faults import (
    Fault,
    committed_then_500,
    committed_then_timed_out,
    connect_refused,
    connect_timed_out,
    internal_server_error,
    lost_before_dynamodb,
    replicated_write_conflict,
    runs_and_fences,
    script_attempts,
    throttled,
)

KEY = "k-1"
SPAWN = {"workflow_ref": "wf/hello", "input": {"n": 1, "ratio": 0.5}, "dispatch_key": KEY}


def _broken(*_: Any, **__: Any) -> Any:
    raise RuntimeError("injected")


@pytest.mark.parametrize(
    "step",
    [
        "poimen.admission.request_fingerprint",
        "poimen.admission.json_text",
        "poimen.admission.run_json",
        "poimen.store.NewRun.item",
        "poimen.store.item_size",
    ],
)
def test_a_failure_while_building_the_run_is_a_500_with_nothing_written(
    invoke: Invoke, monkeypatch: pytest.MonkeyPatch, dynamodb: Any, table_name: str, tenant: str, step: str
) -> None:
    monkeypatch.setattr(step, _broken)

    answer = invoke(body=SPAWN)

    assert answer.status == 500
    assert answer.body["type"] == "urn:poimen:problem:internal-error"
    assert count_runs(dynamodb, table_name, tenant) == []


def _client_error(code: str, operation: str) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": "injected"}}, operation)


def _failing(monkeypatch: pytest.MonkeyPatch, operation: str, error: Exception) -> None:
    """Every `operation` call any botocore client makes raises `error`, sent nowhere."""
    original: Callable[..., Any] = BaseClient._make_api_call  # type: ignore[attr-defined]

    def call(client: BaseClient, name: str, params: dict[str, Any]) -> Any:
        if name == operation:
            raise error
        return original(client, name, params)

    monkeypatch.setattr(BaseClient, "_make_api_call", call)


@pytest.mark.parametrize(
    ("operation", "error", "status"),
    [
        ("PutItem", _client_error("ThrottlingException", "PutItem"), 503),
        ("PutItem", _client_error("InternalServerError", "PutItem"), 503),
        ("PutItem", EndpointConnectionError(endpoint_url="https://dynamodb"), 503),
        ("PutItem", _client_error("AccessDeniedException", "PutItem"), 500),
        ("PutItem", _client_error("ValidationException", "PutItem"), 400),
        ("PutItem", KeyError("boom"), 500),
        ("GetItem", _client_error("ThrottlingException", "GetItem"), 503),
        ("GetItem", _client_error("AccessDeniedException", "GetItem"), 500),
    ],
    ids=["throttled", "dynamodb-error", "unreachable", "access-denied", "validation", "bug", "grants", "grants-denied"],
)
def test_a_failing_store_call_answers_without_a_run_written(
    invoke: Invoke,
    monkeypatch: pytest.MonkeyPatch,
    dynamodb: Any,
    table_name: str,
    tenant: str,
    operation: str,
    error: Exception,
    status: int,
) -> None:
    _failing(monkeypatch, operation, error)

    answer = invoke(body=SPAWN)

    assert answer.status == status
    assert count_runs(dynamodb, table_name, tenant) == []


def test_a_validation_exception_is_a_400_problem_naming_dynamodbs_reason(
    invoke: Invoke, monkeypatch: pytest.MonkeyPatch
) -> None:
    _failing(monkeypatch, "PutItem", _client_error("ValidationException", "PutItem"))

    answer = invoke(body=SPAWN)

    assert answer.status == 400
    assert answer.body["type"] == "urn:poimen:problem:run-not-storable"
    assert "injected" in answer.body["detail"]


def test_a_replay_from_a_store_that_omits_the_item_on_conflict_is_200(
    invoke: Invoke, monkeypatch: pytest.MonkeyPatch, dynamodb: Any, table_name: str, tenant: str
) -> None:
    # Given a store answering ConditionalCheckFailed without the item (dynalite, older emulators)
    original: Callable[..., Any] = BaseClient._make_api_call  # type: ignore[attr-defined]

    def without_item(client: BaseClient, name: str, params: dict[str, Any]) -> Any:
        try:
            return original(client, name, params)
        except ClientError as error:
            cast(dict[str, Any], error.response).pop("Item", None)
            raise

    monkeypatch.setattr(BaseClient, "_make_api_call", without_item)
    # When a keyed spawn is sent twice
    first = invoke(body=SPAWN)
    again = invoke(body=SPAWN)
    # Then the second is a replay of the first, and there is one run
    assert (first.status, again.status) == (201, 200)
    assert again.text == first.text
    assert len(count_runs(dynamodb, table_name, tenant)) == 1


# --- after the write was sent: an unknown outcome is resolved, never answered as "nothing written" ---

KEYLESS = {"workflow_ref": "wf/hello", "input": {"n": 1}}


@pytest.mark.parametrize(
    "faults",
    [
        [committed_then_timed_out, committed_then_timed_out],
        [committed_then_timed_out, internal_server_error],
        [committed_then_timed_out, connect_refused],
        [committed_then_timed_out, throttled],
        [committed_then_500],
    ],
    ids=["late-answers", "then-500", "then-unreachable", "then-throttled", "500-after-commit"],
)
def test_a_keyless_write_whose_answer_is_lost_is_found_and_answered_201(
    invoke: Invoke,
    monkeypatch: pytest.MonkeyPatch,
    dynamodb: Any,
    table_name: str,
    tenant: str,
    faults: list[Fault],
) -> None:
    # Given a write that DynamoDB committed, whose answers never arrive in time (or end in an error)
    script_attempts(monkeypatch, put_run=faults)
    # When a keyless spawn is sent
    answer = invoke(body=KEYLESS)
    # Then it is answered as the run it wrote, and that is the one item stored
    runs, fences = runs_and_fences(dynamodb, table_name, tenant)
    assert answer.status == 201, answer.body
    assert [run["run_id"]["S"] for run in runs] == [answer.body["run_id"]]
    assert fences == []
    assert answer.headers["Location"] == f"/v1/runs/{answer.body['run_id']}"


def test_a_keyed_write_whose_answers_are_late_is_201_and_its_repeat_a_replay(
    invoke: Invoke, monkeypatch: pytest.MonkeyPatch, dynamodb: Any, table_name: str, tenant: str
) -> None:
    # Given a keyed write committed with every answer late
    seen = script_attempts(monkeypatch, put_run=[committed_then_timed_out, committed_then_timed_out])
    # When it is sent, and then sent again
    first = invoke(body=SPAWN)
    again = invoke(body=SPAWN)
    # Then the first is 201 (read back by its run id), the second a replay; one run, no fence
    runs, fences = runs_and_fences(dynamodb, table_name, tenant)
    assert (first.status, again.status) == (201, 200), first.body
    assert again.text == first.text
    assert len(runs) == 1
    assert fences == []
    assert seen["get-run"] == 1


def test_a_keyless_write_that_never_landed_is_fenced_then_answered_unavailable(
    invoke: Invoke, monkeypatch: pytest.MonkeyPatch, dynamodb: Any, table_name: str, tenant: str
) -> None:
    # Given a keyless write whose every attempt timed out before DynamoDB saw it
    script_attempts(monkeypatch, put_run=[lost_before_dynamodb, lost_before_dynamodb])
    # When it is sent
    answer = invoke(body=KEYLESS)
    # Then its run id is fenced (a late write of it cannot land), no run stored, and the answer says retry
    runs, fences = runs_and_fences(dynamodb, table_name, tenant)
    assert answer.status == 503
    assert answer.body["type"] == "urn:poimen:problem:store-unavailable"
    assert "Retry-After" in answer.headers
    assert runs == []
    assert [fence["item_type"]["S"] for fence in fences] == ["fence"]
    fenced_id = fences[0]["pk"]["S"].rsplit("#", 1)[1]
    # And the fenced id is no run: a GET of it is 404
    assert invoke("GET", f"/v1/runs/{fenced_id}").status == 404
    # When the caller retries as told
    retried = invoke(body=KEYLESS)
    # Then there is one run
    runs, _ = runs_and_fences(dynamodb, table_name, tenant)
    assert retried.status == 201
    assert [run["run_id"]["S"] for run in runs] == [retried.body["run_id"]]


@pytest.mark.parametrize("resolution_fault", [connect_refused, lost_before_dynamodb, internal_server_error])
def test_a_keyless_write_that_cannot_be_resolved_is_outcome_unknown_naming_the_run(
    invoke: Invoke,
    monkeypatch: pytest.MonkeyPatch,
    dynamodb: Any,
    table_name: str,
    tenant: str,
    resolution_fault: Fault,
) -> None:
    # Given a committed keyless write whose answers are late, and a store unreachable when asked after
    script_attempts(
        monkeypatch, put_run=[committed_then_timed_out, committed_then_timed_out], put_fence=[resolution_fault]
    )
    # When it is sent
    answer = invoke(body=KEYLESS)
    # Then the answer is outcome-unknown, naming the run, and does not ask for a retry
    runs, _ = runs_and_fences(dynamodb, table_name, tenant)
    assert answer.status == 503
    assert answer.body["type"] == "urn:poimen:problem:outcome-unknown"
    run_id = answer.body["run_id"]
    assert answer.headers["Location"] == f"/v1/runs/{run_id}"
    assert "Retry-After" not in answer.headers
    # And the run it names is the one stored: a GET of its Location finds it
    assert [run["run_id"]["S"] for run in runs] == [run_id]
    assert invoke("GET", answer.headers["Location"]).body["run_id"] == run_id


def test_a_keyed_write_not_found_after_a_lost_answer_is_outcome_unknown_and_safe_to_retry(
    invoke: Invoke, monkeypatch: pytest.MonkeyPatch, dynamodb: Any, table_name: str, tenant: str
) -> None:
    # Given a keyed write whose attempts never reached DynamoDB
    script_attempts(monkeypatch, put_run=[lost_before_dynamodb, lost_before_dynamodb])
    # When it is sent
    answer = invoke(body=SPAWN)
    # Then it is outcome-unknown naming the key's run, nothing fenced (the key stays usable)
    runs, fences = runs_and_fences(dynamodb, table_name, tenant)
    assert answer.status == 503
    assert answer.body["type"] == "urn:poimen:problem:outcome-unknown"
    assert answer.body["run_id"] == keyed_run_id(tenant, KEY)
    assert answer.headers["Location"] == f"/v1/runs/{answer.body['run_id']}"
    assert answer.headers["Retry-After"] == "1"
    assert runs == []
    assert fences == []
    # When it is sent again
    retried = invoke(body=SPAWN)
    # Then that admits the one run
    runs, _ = runs_and_fences(dynamodb, table_name, tenant)
    assert retried.status == 201
    assert [run["run_id"]["S"] for run in runs] == [answer.body["run_id"]]


def test_a_keyed_write_whose_read_back_fails_is_outcome_unknown(
    invoke: Invoke, monkeypatch: pytest.MonkeyPatch, dynamodb: Any, table_name: str, tenant: str
) -> None:
    script_attempts(
        monkeypatch, put_run=[committed_then_timed_out, committed_then_timed_out], get_run=[connect_refused]
    )

    answer = invoke(body=SPAWN)

    assert answer.status == 503
    assert answer.body["type"] == "urn:poimen:problem:outcome-unknown"
    assert answer.body["run_id"] == keyed_run_id(tenant, KEY)
    assert len(runs_and_fences(dynamodb, table_name, tenant)[0]) == 1


@pytest.mark.parametrize("fault", [connect_refused, connect_timed_out])
def test_a_write_never_sent_is_store_unavailable_without_a_resolution(
    invoke: Invoke, monkeypatch: pytest.MonkeyPatch, dynamodb: Any, table_name: str, tenant: str, fault: Fault
) -> None:
    # Given a store that cannot be connected to for the write
    seen = script_attempts(monkeypatch, put_run=[fault, fault])
    # When a keyless spawn is sent
    answer = invoke(body=KEYLESS)
    # Then nothing was sent, so nothing is resolved or fenced: store-unavailable, retry
    assert answer.status == 503
    assert answer.body["type"] == "urn:poimen:problem:store-unavailable"
    assert seen == {"other": 1, "put-run": 2}
    assert runs_and_fences(dynamodb, table_name, tenant) == ([], [])


@pytest.mark.parametrize(
    ("fault", "slow_down"),
    [(throttled, True), (replicated_write_conflict, True), (connect_refused, False), (internal_server_error, False)],
    ids=["throttling", "replicated-write-conflict", "unreachable", "500"],
)
def test_a_store_unavailable_says_whether_dynamodb_throttled_it(
    invoke: Invoke,
    monkeypatch: pytest.MonkeyPatch,
    dynamodb: Any,
    table_name: str,
    tenant: str,
    fault: Fault,
    slow_down: bool,
) -> None:
    # Given a store whose every write attempt of a keyless spawn meets the fault (a 500 resolved as not written)
    script_attempts(monkeypatch, put_run=[fault] * 10)
    # When the spawn is sent
    answer = invoke(body=KEYLESS)
    # Then it is 503 store-unavailable, nothing written, and the problem's `throttled` is true only when DynamoDB
    # asked to slow down (poimen.wire.asks_to_slow_down), absent when the store failed
    assert (answer.status, answer.body["type"]) == (503, "urn:poimen:problem:store-unavailable")
    assert answer.body.get("throttled") is (True if slow_down else None)
    assert runs_and_fences(dynamodb, table_name, tenant)[0] == []
