"""The specification's cases through the Lambda handler: one run per (tenant, dispatch_key)."""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from poimen.admission import Admission
from poimen.contract import RunRequest
from poimen.ids import keyed_run_id
from poimen.store import NewRun, RunRecord, Store, run_pk
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
    admission = Admission(store, grants_cache_seconds=60, tenants={granted})
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
    def lost_answer_then_retry(self: Store, record: NewRun) -> RunRecord | None:
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


def exactly(text: str) -> Any:
    """JSON with each number that has a fraction or exponent kept as its text: equal means as sent."""
    return json.loads(text, parse_float=lambda number: ("number", number))


EXACT_INPUT = (
    '{"price": 12345678901234567.25, "above_2_53": 9007199254740993, "big": 123456789012345678901234567890,'
    ' "e": 1e15, "tiny": 1E-7, "tenth": 0.1, "negative_zero": -0.0, "nested": [2.50, {"avogadro": 6.02214076e23}]}'
)


def _keyed(run_input: str, key: str = "n-1") -> str:
    return f'{{"workflow_ref": "wf/n", "dispatch_key": "{key}", "input": {run_input}}}'


def test_numbers_in_input_come_back_exactly_as_sent(
    invoke: Invoke, dynamodb: Any, table_name: str, tenant: str
) -> None:
    sent = exactly(EXACT_INPUT)
    # Given a run whose input has numbers no IEEE-754 double holds exactly
    created = invoke(raw_body=_keyed(EXACT_INPUT))
    # When it is read back by id, by key, and replayed
    by_id = invoke("GET", f"/v1/runs/{created.body['run_id']}")
    by_key = invoke("GET", "/v1/runs", query="dispatch_key=n-1")
    replay = invoke(raw_body=_keyed(EXACT_INPUT))
    # Then every answer and the stored item hold each number as it was sent
    assert (created.status, by_id.status, by_key.status, replay.status) == (201, 200, 200, 200)
    for answer in (created, by_id, by_key, replay):
        assert exactly(answer.text)["input"] == sent
        assert answer.text == created.text
    [item] = count_runs(dynamodb, table_name, tenant)
    assert exactly(item["input"]["S"]) == sent


def test_a_numerically_different_input_under_the_same_key_is_422(invoke: Invoke) -> None:
    # 12345678901234567.25 and 12345678901234567.0 are one and the same IEEE-754 double
    first = invoke(raw_body=_keyed('{"amount": 12345678901234567.25}'))

    other = invoke(raw_body=_keyed('{"amount": 12345678901234567.0}'))

    assert (first.status, other.status) == (201, 422)
    assert other.body["run_id"] == first.body["run_id"]


@pytest.mark.parametrize("same", ["1.0", "1e0", "10e-1", "0.1E+1", "1.000"])
def test_numerically_equal_inputs_under_the_same_key_replay(invoke: Invoke, same: str) -> None:
    first = invoke(raw_body=_keyed('{"n": 1, "z": 0}'))

    again = invoke(raw_body=_keyed(f'{{"z": -0.0, "n": {same}}}'))

    assert (first.status, again.status) == (201, 200)
    assert again.text == first.text  # the first answer, numbers as the first request wrote them


def test_a_run_fingerprinted_under_the_earlier_rule_still_replays(invoke: Invoke, store: Store, granted: str) -> None:
    # Given a run stored before numbers were exact: input re-serialised, fingerprint of json.dumps
    run_input = {"count": 10, "ratio": 1.5, "name": "ünï"}
    request = {"workflow_ref": "wf/legacy", "input": run_input, "goal_id": None}
    canonical = json.dumps(request, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    run_id = keyed_run_id(granted, "legacy")
    store.runs(
        run_pk(granted, run_id),
        run_id=run_id,
        tenant_id=granted,
        workflow_ref="wf/legacy",
        input_json=json.dumps(run_input, separators=(",", ":"), ensure_ascii=False),
        dispatch_key="legacy",
        fingerprint=hashlib.sha256(canonical.encode()).hexdigest(),
        attempt_id="earlier",
        status="admitted",
        created_at="2026-01-01T00:00:00.000Z",
    ).save()
    # When the same request comes again, and then a different one
    again = invoke(body={**request, "dispatch_key": "legacy"})
    other = invoke(body={**request, "input": {**run_input, "count": 11}, "dispatch_key": "legacy"})
    # Then the first is a replay of the stored run and the second a conflict
    assert (again.status, other.status) == (200, 422)
    assert again.body["created_at"] == "2026-01-01T00:00:00.000Z"


def test_a_reused_key_whose_stored_input_breaks_todays_limits_is_422(
    invoke: Invoke, store: Store, granted: str
) -> None:
    # Given a run stored before nesting was limited (255 levels), under another fingerprint rule
    run_id = keyed_run_id(granted, "deep")
    store.runs(
        run_pk(granted, run_id),
        run_id=run_id,
        tenant_id=granted,
        workflow_ref="wf",
        input_json='{"a":' * 254 + "{}" + "}" * 254,
        dispatch_key="deep",
        fingerprint="an earlier rule's",
        attempt_id="earlier",
        status="admitted",
        created_at="2026-01-01T00:00:00.000Z",
    ).save()

    answer = invoke(body={"workflow_ref": "wf", "input": {}, "dispatch_key": "deep"})

    assert answer.status == 422
    assert answer.body["run_id"] == run_id


# --- Idempotency-Key: the dispatch_key sent as a header ------------------------------------------------

UNKEYED = {key: value for key, value in SPAWN.items() if key != "dispatch_key"}


@pytest.mark.parametrize("header", ['"k-1"', "k-1"], ids=["quoted", "unquoted"])
def test_a_header_keyed_spawn_is_the_run_of_its_key(
    invoke: Invoke, dynamodb: Any, table_name: str, tenant: str, header: str
) -> None:
    # Given a spawn keyed only by its Idempotency-Key header
    first = invoke(body=UNKEYED, headers={"idempotency-key": header})
    # When the same request comes again
    again = invoke(body=UNKEYED, headers={"idempotency-key": header})
    # Then it is the run of key k-1, admitted once and replayed
    assert (first.status, again.status) == (201, 200)
    assert first.body["run_id"] == keyed_run_id(tenant, "k-1")
    assert first.body["dispatch_key"] == "k-1"
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.body == first.body
    runs = count_runs(dynamodb, table_name, tenant)
    assert [(item["run_id"]["S"], item["dispatch_key"]["S"]) for item in runs] == [(first.body["run_id"], "k-1")]


def test_a_header_key_and_a_body_key_are_one_key(invoke: Invoke, dynamodb: Any, table_name: str, tenant: str) -> None:
    # Given a run admitted with k-1 in the body
    body_keyed = invoke(body=SPAWN)
    # When the same request comes with k-1 in the header only, then in both
    header_keyed = invoke(body=UNKEYED, headers={"idempotency-key": '"k-1"'})
    both = invoke(body=SPAWN, headers={"idempotency-key": "k-1"})
    # Then both answer the first run, and there is one run
    assert (body_keyed.status, header_keyed.status, both.status) == (201, 200, 200)
    assert header_keyed.body == both.body == body_keyed.body
    assert len(count_runs(dynamodb, table_name, tenant)) == 1


def test_the_same_key_in_header_and_body_admits_one_run(
    invoke: Invoke, dynamodb: Any, table_name: str, tenant: str
) -> None:
    answer = invoke(body=SPAWN, headers={"idempotency-key": '"k-1"'})

    assert answer.status == 201
    assert answer.body["run_id"] == keyed_run_id(tenant, "k-1")
    assert [item["run_id"]["S"] for item in count_runs(dynamodb, table_name, tenant)] == [answer.body["run_id"]]


def test_a_header_key_with_another_request_is_422(invoke: Invoke, dynamodb: Any, table_name: str, tenant: str) -> None:
    # Given a run admitted with k-1 in the body
    first = invoke(body=SPAWN)
    # When k-1 comes in the header with another workflow
    conflict = invoke(body={**UNKEYED, "workflow_ref": "wf/other"}, headers={"idempotency-key": '"k-1"'})
    # Then it is the reused-key refusal, naming the first run, and nothing more is stored
    assert conflict.status == 422
    assert conflict.body["type"] == "urn:poimen:problem:dispatch-key-reused"
    assert conflict.body["run_id"] == first.body["run_id"]
    assert len(count_runs(dynamodb, table_name, tenant)) == 1


def test_a_header_key_escapes_as_rfc_8941_says(invoke: Invoke, tenant: str) -> None:
    answer = invoke(body=UNKEYED, headers={"idempotency-key": r'"say \"hi\" \\ bye"'})

    assert answer.status == 201
    assert answer.body["dispatch_key"] == 'say "hi" \\ bye'
    assert answer.body["run_id"] == keyed_run_id(tenant, 'say "hi" \\ bye')
