"""The specification's cases through the Lambda handler: one run per (tenant, dispatch_key)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from poimen.admission import Admission
from poimen.contract import RunRequest
from poimen.ids import keyed_run_id
from poimen.store import RunRecord, Store
from tests.conftest import count_runs
from tests.unit.conftest import PRINCIPAL, Invoke

SPAWN = {"workflow_ref": "wf/hello", "input": {"greeting": "hi", "n": 1}, "goal_id": "g-1", "dispatch_key": "k-1"}


def test_keyed_spawn_admits_one_run(invoke: Invoke, dynamodb: Any, table_name: str, tenant: str) -> None:
    answer = invoke(body=SPAWN)

    assert answer.status == 201
    run_id = answer.body["run_id"]
    assert run_id == keyed_run_id(tenant, "k-1")
    assert answer.headers["Location"] == f"/v1/runs/{run_id}"
    assert answer.body == {
        "run_id": run_id,
        "tenant_id": tenant,
        "workflow_ref": "wf/hello",
        "input": {"greeting": "hi", "n": 1},
        "goal_id": "g-1",
        "dispatch_key": "k-1",
        "status": "admitted",
        "created_at": answer.body["created_at"],
    }
    assert [item["run_id"]["S"] for item in count_runs(dynamodb, table_name, tenant)] == [run_id]


def test_replay_answers_the_first_run_unchanged(invoke: Invoke, dynamodb: Any, table_name: str, tenant: str) -> None:
    # Given a run admitted with key k-1
    first = invoke(body=SPAWN)
    # When the same request comes again
    again = invoke(body=SPAWN)
    # Then it is a 200 replay with the identical body, and there is still one run
    assert (first.status, again.status) == (201, 200)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert "Location" not in again.headers
    assert again.body == first.body
    assert len(count_runs(dynamodb, table_name, tenant)) == 1


def test_twenty_concurrent_duplicates_make_one_run(store: Store, dynamodb: Any, table_name: str, granted: str) -> None:
    # Threads call the admission logic the handler calls: a Lambda execution environment runs one
    # invocation at a time, so the handler itself is exercised concurrently through `poimen dev`'s
    # worker processes (tests/integration); here twenty threads race on the conditional write.
    admission = Admission(store, grants_cache_seconds=60)
    request = RunRequest.model_validate(SPAWN)

    with ThreadPoolExecutor(max_workers=20) as pool:
        answers = list(pool.map(lambda _: admission.admit_run(PRINCIPAL, granted, request), range(20)))

    assert sorted(answer.replayed for answer in answers) == [False] + [True] * 19
    assert {answer.run.run_id for answer in answers} == {keyed_run_id(granted, "k-1")}
    assert len({answer.run.created_at for answer in answers}) == 1
    assert len(count_runs(dynamodb, table_name, granted)) == 1


@pytest.mark.parametrize("body", [SPAWN, {**SPAWN, "dispatch_key": None}], ids=["keyed", "unkeyed"])
def test_a_retried_put_that_finds_its_own_write_is_still_a_new_run(
    invoke: Invoke, monkeypatch: pytest.MonkeyPatch, dynamodb: Any, table_name: str, tenant: str, body: Any
) -> None:
    # Given a PutItem whose answer is lost after DynamoDB stored the item, and that botocore resends
    def lost_answer_then_retry(self: Store, record: RunRecord) -> RunRecord | None:
        original_put(self, record)
        return original_put(self, record)

    original_put = Store.put_run_if_absent
    monkeypatch.setattr(Store, "put_run_if_absent", lost_answer_then_retry)
    # When a spawn is admitted
    answer = invoke(body=body)
    # Then the caller is told it created the run, and there is one run
    assert answer.status == 201
    assert "Idempotent-Replayed" not in answer.headers
    assert len(count_runs(dynamodb, table_name, tenant)) == 1


def test_spawns_without_a_key_are_always_new_runs(invoke: Invoke, dynamodb: Any, table_name: str, tenant: str) -> None:
    unkeyed = {"workflow_ref": "wf/hello", "input": {"same": True}}

    answers = [invoke(body=unkeyed), invoke(body=unkeyed)]

    assert [answer.status for answer in answers] == [201, 201]
    assert answers[0].body["run_id"] != answers[1].body["run_id"]
    assert all(answer.body["dispatch_key"] is None for answer in answers)
    assert len(count_runs(dynamodb, table_name, tenant)) == 2


@pytest.mark.parametrize(
    "change",
    [{"workflow_ref": "wf/other"}, {"input": {"greeting": "bye", "n": 1}}, {"goal_id": "g-2"}, {"goal_id": None}],
    ids=["workflow_ref", "input", "goal_id", "goal_id-dropped"],
)
def test_reused_key_with_another_request_is_422_with_the_existing_run(
    invoke: Invoke, dynamodb: Any, table_name: str, tenant: str, change: dict[str, Any]
) -> None:
    first = invoke(body=SPAWN)

    conflict = invoke(body={**SPAWN, **change})

    assert conflict.status == 422
    assert conflict.headers["Content-Type"] == "application/problem+json"
    assert conflict.body["type"] == "urn:poimen:problem:dispatch-key-reused"
    assert conflict.body["run_id"] == first.body["run_id"]
    runs = count_runs(dynamodb, table_name, tenant)
    assert len(runs) == 1
    assert runs[0]["workflow_ref"]["S"] == "wf/hello"


def test_key_order_inside_input_does_not_matter(invoke: Invoke) -> None:
    first = invoke(body={**SPAWN, "input": {"a": 1, "b": {"x": 1, "y": 2}}})

    again = invoke(body={**SPAWN, "input": {"b": {"y": 2, "x": 1}, "a": 1}})

    assert again.status == 200
    assert again.body == first.body


def test_same_key_in_two_tenants_is_two_runs(
    invoke: Invoke, store: Store, dynamodb: Any, table_name: str, tenant: str
) -> None:
    other = f"{tenant}-b"
    store.grant(PRINCIPAL, other)

    mine = invoke(body=SPAWN)
    theirs = invoke(body=SPAWN, tenant=other)

    assert (mine.status, theirs.status) == (201, 201)
    assert mine.body["run_id"] != theirs.body["run_id"]
    assert len(count_runs(dynamodb, table_name, tenant)) == 1
    assert len(count_runs(dynamodb, table_name, other)) == 1


def test_get_run_by_id_and_by_dispatch_key(invoke: Invoke) -> None:
    created = invoke(body=SPAWN).body

    by_id = invoke("GET", f"/v1/runs/{created['run_id']}")
    by_key = invoke("GET", "/v1/runs", query="dispatch_key=k-1")

    assert (by_id.status, by_key.status) == (200, 200)
    assert by_id.body == created
    assert by_key.body == created


def test_unknown_run_is_404(invoke: Invoke) -> None:
    by_id = invoke("GET", f"/v1/runs/{keyed_run_id('nobody', 'x')}")
    by_key = invoke("GET", "/v1/runs", query="dispatch_key=never-used")

    for answer in (by_id, by_key):
        assert answer.status == 404
        assert answer.body["type"] == "urn:poimen:problem:run-not-found"


def test_a_run_of_another_tenant_is_404_not_403(invoke: Invoke, store: Store, tenant: str) -> None:
    # Given a caller granted both tenants, and a run in the first
    other = f"{tenant}-b"
    store.grant(PRINCIPAL, other)
    run_id = invoke(body=SPAWN).body["run_id"]
    # When it asks for that run as the other tenant
    by_id = invoke("GET", f"/v1/runs/{run_id}", tenant=other)
    by_key = invoke("GET", "/v1/runs", query="dispatch_key=k-1", tenant=other)
    # Then the run does not exist there
    assert (by_id.status, by_key.status) == (404, 404)
    assert by_id.body == invoke("GET", f"/v1/runs/{keyed_run_id(other, 'absent')}", tenant=other).body
