"""Admission on a multi-Region strongly consistent (MRSC) global table: a write racing the same item's write
in another Region is refused with ReplicatedWriteConflictException (nothing written), retried within the
function's budget, else a 503 store-unavailable; and the table may live in another Region (TABLE_REGION)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import boto3
import pytest
from moto import mock_aws

from poimen.api import admission_service
from poimen.config import ConfigurationError, Settings
from poimen.errors import StoreUnavailable
from poimen.ids import keyed_run_id
from poimen.store import Store
from poimen_tools.local.moto import serialise_dynamodb_writes
from poimen_tools.local.template import Template
from tests.conftest import count_runs
from tests.unit.conftest import PRINCIPAL, Invoke
from tests.unit.dynamodb_faults import (
    committed_then_timed_out,
    lost_before_dynamodb,
    replicated_write_conflict,
    runs_and_fences,
    script_attempts,
)

KEY = "k-mr"
KEYED = {"workflow_ref": "wf/hello", "input": {"n": 1}, "dispatch_key": KEY}
KEYLESS = {"workflow_ref": "wf/hello", "input": {"n": 1}}
OTHER_REGION_CREATED_AT = "2026-01-02T03:04:05.678Z"


def other_region_wins(send: Callable[[], Any], request: Any) -> Any:
    """Another Region writes the same run (its own attempt, its own created_at) while this attempt is in
    flight: that write commits, this one is refused as a replicated write conflict."""
    ours = request.body
    params = json.loads(ours)
    params["Item"]["attempt_id"] = {"S": "other-region"}
    params["Item"]["created_at"] = {"S": OTHER_REGION_CREATED_AT}
    params.pop("ConditionExpression")
    params.pop("ExpressionAttributeNames")
    params.pop("ExpressionAttributeValues", None)
    params.pop("ReturnValuesOnConditionCheckFailure")
    request.body = json.dumps(params).encode()
    try:
        send()
    finally:
        request.body = ours
    return replicated_write_conflict(send, request)


@pytest.mark.parametrize("body", [KEYED, KEYLESS], ids=["keyed", "keyless"])
def test_a_write_conflicting_on_every_attempt_is_store_unavailable_with_nothing_written(
    invoke: Invoke, monkeypatch: pytest.MonkeyPatch, dynamodb: Any, table_name: str, tenant: str, body: Any
) -> None:
    # Given a table whose every write of the run conflicts with another Region's
    seen = script_attempts(monkeypatch, put_run=[replicated_write_conflict] * 2)
    # When a spawn is sent
    answer = invoke(body=body)
    # Then botocore retried it within the budget, and the answer is store-unavailable (known not written):
    # nothing resolved, fenced or stored
    assert answer.status == 503, answer.body
    assert answer.body["type"] == "urn:poimen:problem:store-unavailable"
    assert answer.headers["Retry-After"] == "1"
    assert seen["put-run"] == Settings.dynamodb_max_attempts
    assert "put-fence" not in seen
    assert "get-run" not in seen
    assert runs_and_fences(dynamodb, table_name, tenant) == ([], [])


def test_a_conflict_then_a_committed_attempt_is_one_run_answered_201(
    invoke: Invoke, monkeypatch: pytest.MonkeyPatch, dynamodb: Any, table_name: str, tenant: str
) -> None:
    # Given one conflicting attempt, then a write that goes through
    seen = script_attempts(monkeypatch, put_run=[replicated_write_conflict])
    # When a keyless spawn is sent
    answer = invoke(body=KEYLESS)
    # Then it is admitted once, with no resolution needed
    runs, fences = runs_and_fences(dynamodb, table_name, tenant)
    assert answer.status == 201, answer.body
    assert [run["run_id"]["S"] for run in runs] == [answer.body["run_id"]]
    assert fences == []
    assert seen["put-run"] == 2


def test_a_keyed_write_losing_to_another_regions_write_is_a_replay_of_that_run(
    invoke: Invoke, monkeypatch: pytest.MonkeyPatch, dynamodb: Any, table_name: str, tenant: str
) -> None:
    # Given another Region admitting the same key while this Region's write is in flight
    script_attempts(monkeypatch, put_run=[other_region_wins])
    # When the keyed spawn is sent here
    answer = invoke(body=KEYED)
    # Then the retry's condition sees the other Region's run: 200 with that run, and one run stored
    runs, fences = runs_and_fences(dynamodb, table_name, tenant)
    assert answer.status == 200, answer.body
    assert answer.body["run_id"] == keyed_run_id(tenant, KEY)
    assert answer.body["created_at"] == OTHER_REGION_CREATED_AT
    assert [(run["attempt_id"]["S"], run["created_at"]["S"]) for run in runs] == [
        ("other-region", OTHER_REGION_CREATED_AT)
    ]
    assert fences == []


def test_a_conflict_after_a_committed_but_unanswered_attempt_is_resolved_to_that_run(
    invoke: Invoke, monkeypatch: pytest.MonkeyPatch, dynamodb: Any, table_name: str, tenant: str
) -> None:
    # Given a first attempt that committed with its answer lost, then a conflicting one
    script_attempts(monkeypatch, put_run=[committed_then_timed_out, replicated_write_conflict])
    # When a keyless spawn is sent
    answer = invoke(body=KEYLESS)
    # Then the conflict does not hide the unknown outcome: the run is found (the fence fails on it), 201
    runs, fences = runs_and_fences(dynamodb, table_name, tenant)
    assert answer.status == 201, answer.body
    assert [run["run_id"]["S"] for run in runs] == [answer.body["run_id"]]
    assert fences == []


def test_a_conflict_on_the_fence_is_outcome_unknown_naming_the_run(
    invoke: Invoke, monkeypatch: pytest.MonkeyPatch, dynamodb: Any, table_name: str, tenant: str
) -> None:
    # Given a keyless write of unknown outcome, and a fence refused as a replicated write conflict
    script_attempts(
        monkeypatch, put_run=[lost_before_dynamodb, lost_before_dynamodb], put_fence=[replicated_write_conflict]
    )
    # When it is sent
    answer = invoke(body=KEYLESS)
    # Then the fence is not taken for written, nor the run for absent: outcome-unknown, naming the run
    assert answer.status == 503, answer.body
    assert answer.body["type"] == "urn:poimen:problem:outcome-unknown"
    assert answer.headers["Location"] == f"/v1/runs/{answer.body['run_id']}"
    assert "Retry-After" not in answer.headers
    assert runs_and_fences(dynamodb, table_name, tenant) == ([], [])


def test_a_grant_change_conflicting_on_every_attempt_is_store_unavailable(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    script_attempts(monkeypatch, other=[replicated_write_conflict] * Settings.dynamodb_max_attempts)

    with pytest.raises(StoreUnavailable, match="ReplicatedWriteConflictException"):
        store.grant(PRINCIPAL, "acme")


# --- TABLE_REGION: the table's Region, when it is not the function's -----------------------------------


def test_table_region_is_read_and_defaults_to_the_functions_region() -> None:
    base = {"TABLE_NAME": "t", "AWS_REGION": "us-east-1"}

    assert Settings.from_env(base).table_region is None
    assert Settings.from_env({**base, "TABLE_REGION": " "}).table_region is None
    assert Settings.from_env({**base, "TABLE_REGION": "us-west-2"}).table_region == "us-west-2"


@pytest.mark.parametrize("value", ["us east 1", "-us-east-1", "us-east-1-", "123", "us.east.1", "a" * 64])
def test_a_table_region_that_is_no_region_name_is_refused(value: str) -> None:
    with pytest.raises(ConfigurationError, match="TABLE_REGION"):
        Settings.from_env({"TABLE_NAME": "t", "AWS_REGION": "us-east-1", "TABLE_REGION": value})


TABLE_REGION = "us-west-2"


class TestTableInAnotherRegion:
    """The function in us-east-1, its table in us-west-2 (as `poimen dev --table-region` sets it)."""

    @pytest.fixture
    def dynamodb(self, template: Template, monkeypatch: pytest.MonkeyPatch, tenant: str) -> Iterator[Any]:
        """The table in TABLE_REGION, not in the function's Region; the handler points at it."""
        serialise_dynamodb_writes()
        with mock_aws():
            client = boto3.client("dynamodb", region_name=TABLE_REGION)
            table_name = f"admission-{uuid.uuid4().hex[:8]}"
            client.create_table(**template.create_table_request("AdmissionTable", table_name))
            monkeypatch.setenv("TABLE_NAME", table_name)
            monkeypatch.setenv("TABLE_REGION", TABLE_REGION)
            monkeypatch.setenv("TENANTS", tenant)
            monkeypatch.setenv("GRANTS_CACHE_SECONDS", "0")
            admission_service.cache_clear()
            yield client
            admission_service.cache_clear()

    def test_the_store_uses_the_table_region_for_every_client(self, store: Store) -> None:
        assert store.client.meta.region_name == TABLE_REGION
        assert store.resolution_client.meta.region_name == TABLE_REGION
        assert store.grants._get_connection().connection.client.meta.region_name == TABLE_REGION

    def test_admission_writes_to_the_table_in_the_table_region(
        self, invoke: Invoke, dynamodb: Any, table_name: str, tenant: str
    ) -> None:
        # Given the function in us-east-1 and its table in us-west-2 (the grant written there)
        # When a keyed spawn is sent twice
        first = invoke(body=KEYED)
        again = invoke(body=KEYED)
        # Then one run is stored in us-west-2's table, and us-east-1 has no such table
        assert (first.status, again.status) == (201, 200), first.body
        assert [run["run_id"]["S"] for run in count_runs(dynamodb, table_name, tenant)] == [first.body["run_id"]]
        assert table_name not in boto3.client("dynamodb", region_name="us-east-1").list_tables()["TableNames"]
