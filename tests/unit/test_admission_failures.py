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

from tests.conftest import count_runs
from tests.unit.conftest import Invoke

SPAWN = {"workflow_ref": "wf/hello", "input": {"n": 1, "ratio": 0.5}, "dispatch_key": "k-1"}


def _broken(*_: Any, **__: Any) -> Any:
    raise RuntimeError("injected")


@pytest.mark.parametrize(
    "step",
    [
        "poimen.admission.request_fingerprint",
        "poimen.admission.json_text",
        "poimen.admission.run_json",
        "poimen.store.RunRecord.serialize",
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
