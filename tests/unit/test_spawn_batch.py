"""The batch form of POST /v1/runs (application/vnd.poimen.spawns+json) through the Lambda handler: each spawn
admitted by the single route's rule and answered as the single route answers it, one result a spawn, in order."""

from __future__ import annotations

import json
import uuid
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poimen.ids import keyed_run_id
from poimen.store import Store
from poimen.wire import MAX_BATCH_BODY_BYTES, MAX_BATCH_SPAWNS, MAX_BODY_BYTES, SPAWNS_MEDIA_TYPE
from tests.conftest import count_runs
from tests.unit.conftest import PRINCIPAL, Answer, Invoke
from tests.unit.dynamodb_faults import (
    lost_before_dynamodb,
    only_for,
    runs_and_fences,
    script_attempts,
    throttled,
)

BATCH = {"content-type": SPAWNS_MEDIA_TYPE}
RESULTS = "application/vnd.poimen.spawn-results+json"


def _spawn(key: str | None, workflow: str = "wf/hello", **fields: Any) -> dict[str, Any]:
    spawn: dict[str, Any] = {"workflow_ref": workflow, "input": {"n": 1}, **fields}
    if key is not None:
        spawn["dispatch_key"] = key
    return spawn


def _batch(invoke: Invoke, spawns: list[Any], **kwargs: Any) -> Answer:
    answer = invoke(body={"spawns": spawns}, headers={**BATCH, **kwargs.pop("headers", {})}, **kwargs)
    if answer.status == 200:
        assert answer.headers["Content-Type"] == RESULTS
        assert len(answer.body["results"]) == len(spawns)
    return answer


def _results(answer: Answer) -> list[tuple[int, str | None]]:
    """Each result's status and the run it names (its run's, or its problem's run_id)."""
    return [
        (result["status"], result["run"]["run_id"] if "run" in result else result["problem"].get("run_id"))
        for result in answer.body["results"]
    ]


def test_a_batch_admits_each_spawn_and_answers_each_in_order(
    invoke: Invoke, dynamodb: Any, table_name: str, tenant: str
) -> None:
    # When three keyed spawns and a keyless one are sent as one batch
    answer = _batch(invoke, [_spawn("b-1"), _spawn("b-2"), _spawn(None), _spawn("b-3")])
    # Then each is a new run, answered in order as the single route answers it
    assert answer.status == 200
    results = answer.body["results"]
    assert [result["status"] for result in results] == [201, 201, 201, 201]
    assert [result["replayed"] for result in results] == [False] * 4
    assert [results[i]["run"]["run_id"] for i in (0, 1, 3)] == [keyed_run_id(tenant, f"b-{n}") for n in (1, 2, 3)]
    assert results[2]["run"]["dispatch_key"] is None
    # And the table holds those four runs, each answer's run the one stored
    stored = {item["run_id"]["S"] for item in count_runs(dynamodb, table_name, tenant)}
    assert stored == {result["run"]["run_id"] for result in results}
    # And the run in a batch's answer is the one a GET answers
    assert invoke("GET", f"/v1/runs/{results[0]['run']['run_id']}").body == results[0]["run"]


def test_a_key_repeated_in_a_batch_is_one_run_and_another_body_under_it_that_items_422(
    invoke: Invoke, dynamodb: Any, table_name: str, tenant: str
) -> None:
    # When a batch sends one key three times, the third with another workflow
    answer = _batch(invoke, [_spawn("r-1"), _spawn("r-1"), _spawn("r-1", "wf/other"), _spawn("r-2")])
    run_id = keyed_run_id(tenant, "r-1")
    # Then the first admits the run, the second replays it, the third alone is 422 naming it
    assert _results(answer) == [(201, run_id), (200, run_id), (422, run_id), (201, keyed_run_id(tenant, "r-2"))]
    assert answer.body["results"][1]["replayed"] is True
    assert answer.body["results"][1]["run"] == answer.body["results"][0]["run"]
    assert answer.body["results"][2]["problem"]["type"] == "urn:poimen:problem:dispatch-key-reused"
    assert len(count_runs(dynamodb, table_name, tenant)) == 2


def test_a_key_already_admitted_replays_in_a_batch_and_a_mismatch_is_only_its_items_422(
    invoke: Invoke, dynamodb: Any, table_name: str, tenant: str
) -> None:
    # Given runs admitted one by one
    first = invoke(body=_spawn("a-1"))
    invoke(body=_spawn("a-2"))
    # When a batch repeats the first, reuses the second's key with another input, and adds a new key
    answer = _batch(invoke, [_spawn("a-1"), _spawn("a-2", input={"n": 2}), _spawn("a-3")])
    # Then: the replay is the first answer unchanged, the mismatch that item's 422, the new key a run
    statuses = [result["status"] for result in answer.body["results"]]
    assert statuses == [200, 422, 201]
    assert answer.body["results"][0]["run"] == first.body
    assert answer.body["results"][1]["problem"]["run_id"] == keyed_run_id(tenant, "a-2")
    assert len(count_runs(dynamodb, table_name, tenant)) == 3


def test_an_invalid_or_too_large_spawn_is_its_own_result_and_the_others_are_admitted(
    invoke: Invoke, dynamodb: Any, table_name: str, tenant: str
) -> None:
    # Given a batch with an unknown field, a missing input, a non-object and an input over the body limit
    too_large = _spawn("v-big", input={"s": "x" * MAX_BODY_BYTES})
    spawns = [_spawn("v-1"), {**_spawn("v-2"), "priority": 1}, {"workflow_ref": "wf"}, too_large, _spawn("v-3")]
    # When it is sent
    answer = _batch(invoke, spawns)
    # Then each bad spawn is the problem the single route answers for it, the good ones are runs
    assert [result["status"] for result in answer.body["results"]] == [201, 400, 400, 413, 201]
    assert invoke(body=spawns[1]).body == answer.body["results"][1]["problem"]
    assert invoke(body=spawns[2]).body == answer.body["results"][2]["problem"]
    assert answer.body["results"][3]["problem"]["type"] == "urn:poimen:problem:payload-too-large"
    assert {item["dispatch_key"]["S"] for item in count_runs(dynamodb, table_name, tenant)} == {"v-1", "v-3"}


def test_a_spawns_unknown_outcome_is_its_503_naming_its_run_and_the_next_spawn_is_admitted(
    invoke: Invoke, monkeypatch: pytest.MonkeyPatch, dynamodb: Any, table_name: str, tenant: str
) -> None:
    # Given a store whose writes of the first spawn never reach DynamoDB
    script_attempts(monkeypatch, put_run=only_for('"u-1"', [lost_before_dynamodb, lost_before_dynamodb]))
    # When a batch of two keyed spawns is sent
    answer = _batch(invoke, [_spawn("u-1"), _spawn("u-2")])
    # Then the first is outcome-unknown naming its run, with its Retry-After (keyed: safe to send again)
    unknown, admitted = answer.body["results"]
    assert (unknown["status"], unknown["problem"]["type"]) == (503, "urn:poimen:problem:outcome-unknown")
    assert unknown["problem"]["run_id"] == keyed_run_id(tenant, "u-1")
    assert unknown["retry_after"] == 1
    # And the second is admitted all the same
    assert admitted["status"] == 201
    runs, fences = runs_and_fences(dynamodb, table_name, tenant)
    assert [run["dispatch_key"]["S"] for run in runs] == ["u-2"]
    assert fences == []


@pytest.mark.parametrize("fault", [throttled, lost_before_dynamodb])
def test_a_key_whose_first_spawn_failed_admits_no_later_spawn_of_it_in_the_batch(
    invoke: Invoke, monkeypatch: pytest.MonkeyPatch, dynamodb: Any, table_name: str, tenant: str, fault: Any
) -> None:
    # Given a store whose first spawn's writes fail (throttled: nothing written; lost: outcome unknown)
    script_attempts(monkeypatch, put_run=[fault, fault])
    # When a batch sends a key twice, the second with another workflow, as two records of one Kafka key
    answer = _batch(invoke, [_spawn("o-1", "wf/first"), _spawn("o-1", "wf/second")])
    # Then the second is not admitted ahead of the first: 503 store-unavailable, nothing written, to send again
    assert [result["status"] for result in answer.body["results"]] == [503, 503]
    assert answer.body["results"][1]["problem"]["type"] == "urn:poimen:problem:store-unavailable"
    assert count_runs(dynamodb, table_name, tenant) == []
    # And sent again in order, the first is the key's run and the second that item's 422, as one by one
    again = _batch(invoke, [_spawn("o-1", "wf/first"), _spawn("o-1", "wf/second")])
    assert [result["status"] for result in again.body["results"]] == [201, 422]
    assert [item["workflow_ref"]["S"] for item in count_runs(dynamodb, table_name, tenant)] == ["wf/first"]


@pytest.mark.parametrize("fault", [throttled, lost_before_dynamodb])
def test_a_spawn_after_one_of_its_ordering_key_that_failed_is_not_begun(
    invoke: Invoke, monkeypatch: pytest.MonkeyPatch, dynamodb: Any, table_name: str, tenant: str, fault: Any
) -> None:
    # Given a store whose writes of the first spawn fail (throttled: nothing written; lost: outcome unknown)
    script_attempts(monkeypatch, put_run=only_for('"x-1"', [fault, fault]))
    # When a batch sends three spawns of three dispatch keys, the first and third sharing an ordering key (two
    # records of one Kafka key, as the relay sends them), the second another
    spawns = [_spawn("x-1"), _spawn("x-2"), _spawn("x-3")]
    answer = invoke(body={"spawns": spawns, "ordering_keys": ["0", "1", "0"]}, headers=BATCH)
    # Then the third is not admitted ahead of the first: 503 store-unavailable, nothing written, to send again; the
    # second, of another ordering key, is admitted
    assert [result["status"] for result in answer.body["results"]] == [503, 201, 503]
    assert answer.body["results"][2]["problem"]["type"] == "urn:poimen:problem:store-unavailable"
    assert "ordering key" in answer.body["results"][2]["problem"]["detail"]
    # And it asks to slow down (poimen.wire.asks_to_slow_down) exactly when the spawn it waits for was throttled
    slowed = [result["problem"].get("throttled") for result in answer.body["results"] if result["status"] == 503]
    assert slowed == ([True, True] if fault is throttled else [None, None])
    assert [item["dispatch_key"]["S"] for item in count_runs(dynamodb, table_name, tenant)] == ["x-2"]


def test_spawns_linked_by_a_dispatch_key_and_an_ordering_key_are_one_sequence(
    invoke: Invoke, monkeypatch: pytest.MonkeyPatch, dynamodb: Any, table_name: str, tenant: str
) -> None:
    # Given a store that throttles the first spawn's writes
    script_attempts(monkeypatch, put_run=only_for('"y-1"', [throttled, throttled]))
    # When spawn 0 (key y-1, ordering a) fails, spawn 1 shares its key (ordering b), and spawn 2 shares only
    # spawn 1's ordering key
    spawns = [_spawn("y-1"), _spawn("y-1"), _spawn("y-2")]
    answer = invoke(body={"spawns": spawns, "ordering_keys": ["a", "b", "b"]}, headers=BATCH)
    # Then neither later spawn is begun: spawn 2 would overtake spawn 1, which waits for spawn 0
    assert [result["status"] for result in answer.body["results"]] == [503, 503, 503]
    assert count_runs(dynamodb, table_name, tenant) == []


def test_a_batch_reads_its_callers_grants_once_not_once_a_spawn(
    invoke: Invoke, monkeypatch: pytest.MonkeyPatch, dynamodb: Any, table_name: str, tenant: str
) -> None:
    # Given no grant cache (GRANTS_CACHE_SECONDS=0), and the grant reads counted
    reads: list[str] = []
    original = Store.granted_tenants

    def counting(self: Store, principal: str) -> Any:
        reads.append(principal)
        return original(self, principal)

    monkeypatch.setattr(Store, "granted_tenants", counting)
    # When a batch of 5 is sent
    answer = _batch(invoke, [_spawn(f"g-{n}") for n in range(5)])
    # Then each is admitted, and the grants were read once, for the request: a read in each spawn would add a
    # retried DynamoDB call to every admission's worst time (MIN_REMAINING_MS)
    assert [result["status"] for result in answer.body["results"]] == [201] * 5
    assert len(reads) == 1


def test_a_spawn_the_invocation_has_no_time_left_for_is_503_unwritten(
    invoke: Invoke, monkeypatch: pytest.MonkeyPatch, dynamodb: Any, table_name: str, tenant: str
) -> None:
    # Given an invocation with less time left than one admission may take
    monkeypatch.setattr("poimen.batch.MIN_REMAINING_MS", 10**9)
    # When a batch is sent
    answer = _batch(invoke, [_spawn("late-1"), _spawn(None)])
    # Then no spawn was begun: each is store-unavailable (nothing written, send it again), and nothing is stored
    assert [(r["status"], r["problem"]["type"]) for r in answer.body["results"]] == [
        (503, "urn:poimen:problem:store-unavailable")
    ] * 2
    assert [result["retry_after"] for result in answer.body["results"]] == [1, 1]
    assert count_runs(dynamodb, table_name, tenant) == []


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "body.spawns"),
        ({"spawns": []}, "body.spawns"),
        ({"spawns": {"workflow_ref": "wf"}}, "body.spawns"),
        ({"spawns": [_spawn("e")], "extra": 1}, "body.extra"),
        ({"spawns": [1]}, "body.spawns.0"),
        ({"spawns": [_spawn("e")] * (MAX_BATCH_SPAWNS + 1)}, "body.spawns"),
        ({"spawns": [_spawn("e")], "traceparents": [None, None]}, "body"),
        ({"spawns": [_spawn("e")], "ordering_keys": [None, "k"]}, "body"),
        ({"spawns": [_spawn("e")], "ordering_keys": [""]}, "body.ordering_keys.0"),
        ({"spawns": [_spawn("e")], "ordering_keys": ["k" * 256]}, "body.ordering_keys.0"),
        ({"spawns": [_spawn("e")], "ordering_keys": [7]}, "body.ordering_keys.0"),
    ],
)
def test_a_malformed_envelope_is_the_requests_400_and_nothing_is_written(
    invoke: Invoke, dynamodb: Any, table_name: str, tenant: str, body: dict[str, Any], field: str
) -> None:
    answer = invoke(body=body, headers=BATCH)

    assert (answer.status, answer.body["type"]) == (400, "urn:poimen:problem:validation-error")
    assert field in {error["field"] for error in answer.body["errors"]}
    assert count_runs(dynamodb, table_name, tenant) == []


def test_the_request_is_refused_whole_for_its_tenant_its_key_header_or_its_size(
    invoke: Invoke, store: Store, dynamodb: Any, table_name: str, tenant: str
) -> None:
    spawns = [_spawn("w-1")]
    # A tenant missing, one not granted (the stack serves it), one not served; an Idempotency-Key header
    assert _batch(invoke, spawns, tenant=None).status == 400
    not_granted = _batch(invoke, spawns, tenant=f"{tenant}-b")
    assert (not_granted.status, not_granted.body["type"]) == (403, "urn:poimen:problem:forbidden")
    not_served = _batch(invoke, spawns, tenant="nobody")
    assert (not_served.status, not_served.body["type"]) == (403, "urn:poimen:problem:tenant-not-served")
    keyed = _batch(invoke, spawns, headers={"idempotency-key": "w-1"})
    assert (keyed.status, keyed.body["type"]) == (400, "urn:poimen:problem:idempotency-key-invalid")
    # A body over the batch limit, though each spawn is under the single one
    big = [_spawn(f"w-{n}", input={"s": "x" * 200_000}) for n in range(MAX_BATCH_BODY_BYTES // 200_000 + 1)]
    too_large = _batch(invoke, big)
    assert (too_large.status, too_large.body["type"]) == (413, "urn:poimen:problem:payload-too-large")
    # A batch body on another route is refused as any other media type
    assert invoke("GET", "/v1/runs", query="dispatch_key=w-1", body={"spawns": spawns}, headers=BATCH).status == 415
    assert count_runs(dynamodb, table_name, tenant) == []
    # And a batch under the limit, the same size a spawn, is admitted
    assert [r["status"] for r in _batch(invoke, big[:4]).body["results"]] == [201] * 4


@pytest.mark.parametrize("header", [None, "Not-A-Tenant", ""])
def test_a_batchs_tenant_header_is_refused_with_the_single_routes_problem(invoke: Invoke, header: str | None) -> None:
    # When a batch and a single spawn are sent without a valid tenant header (None: none at all)
    batch = _batch(invoke, [_spawn("h-1")], tenant=header)
    single = invoke(body=_spawn("h-1"), tenant=header)
    # Then both are the same 400, field by field
    assert batch.status == single.status == 400
    assert batch.body == single.body


def test_each_spawns_traceparent_is_its_own_or_the_requests(
    invoke: Invoke, dynamodb: Any, table_name: str, tenant: str
) -> None:
    own, header = f"00-{'a' * 32}-{'b' * 16}-01", f"00-{'c' * 32}-{'d' * 16}-01"
    spawns = [_spawn("t-1"), _spawn("t-2"), _spawn("t-3")]
    answer = invoke(
        body={"spawns": spawns, "traceparents": [own, None, "not-a-traceparent"]},
        headers={**BATCH, "traceparent": header},
    )
    assert [result["status"] for result in answer.body["results"]] == [201] * 3
    items = {item["dispatch_key"]["S"]: item for item in count_runs(dynamodb, table_name, tenant)}
    assert items["t-1"]["traceparent"]["S"] == own
    assert items["t-2"]["traceparent"]["S"] == header
    assert "traceparent" not in items["t-3"]


# A plan: spawns drawn from few keys and bodies, some keys admitted before, some spawns invalid.
_plans = st.tuples(
    st.lists(st.sampled_from(["k1", "k2", "k3"]), max_size=3, unique=True),  # keys admitted before the batch
    st.lists(
        st.tuples(st.sampled_from(["k1", "k2", "k3", "k4", None]), st.sampled_from(["wf/a", "wf/b", ""])),
        min_size=1,
        max_size=8,
    ),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=_plans)
def test_a_batch_answers_each_spawn_as_the_same_requests_sent_one_by_one(
    invoke: Invoke, store: Store, dynamodb: Any, table_name: str, tenant: str, plan: Any
) -> None:
    # Given keys of this example only, some admitted before, in the batch's tenant and in a twin tenant
    before, drawn = plan
    prefix = uuid.uuid4().hex[:8]
    twin = f"{tenant}-b"
    store.grant(PRINCIPAL, twin)
    spawns = [_spawn(None if key is None else f"{prefix}-{key}", workflow) for key, workflow in drawn]
    for key in before:
        for target in (tenant, twin):
            assert invoke(body=_spawn(f"{prefix}-{key}", "wf/a"), tenant=target).status == 201
    # When the spawns are sent as one batch to the tenant, and one by one, in order, to the twin
    batch = _batch(invoke, spawns)
    singles = [invoke(body=spawn, tenant=twin) for spawn in spawns]
    # Then each result has the single answer's status, and its problem or its run (but for its tenant and times)
    for result, single in zip(batch.body["results"], singles, strict=True):
        assert result["status"] == single.status
        if single.status >= 400:
            assert _without(result["problem"], tenant) == _without(single.body, twin)
        else:
            assert result["replayed"] is (single.status == 200)
            assert _without(result["run"], tenant) == _without(single.body, twin)
    # And each key is one run in the table, which every answer naming a run of that key names
    admitted = {f"{prefix}-{key}" for key in before}
    admitted |= {spawn["dispatch_key"] for spawn in spawns if "dispatch_key" in spawn and spawn["workflow_ref"]}
    runs = count_runs(dynamodb, table_name, tenant, only="pk, dispatch_key")
    stored = Counter(item.get("dispatch_key", {}).get("S") for item in runs)
    assert {key: stored[key] for key in admitted} == dict.fromkeys(admitted, 1)
    for spawn, (status, run_id) in zip(spawns, _results(batch), strict=True):
        if "dispatch_key" in spawn and status in (200, 201, 422):
            assert run_id == keyed_run_id(tenant, spawn["dispatch_key"])


def _without(answer: dict[str, Any], tenant: str) -> dict[str, Any]:
    """An answer but for what differs between tenants and moments: run ids, tenant, time."""
    return {name: value for name, value in answer.items() if name not in ("run_id", "tenant_id", "created_at")}


def test_the_results_text_keeps_each_inputs_numbers_exactly(invoke: Invoke) -> None:
    body = '{"spawns": [{"workflow_ref": "wf", "input": {"x": 1.10, "y": 1e400000000}}, ' + (
        '{"workflow_ref": "wf", "input": {"x": 0.1000000000000000055511151231257827}}]}'
    )
    answer = invoke(raw_body=body, headers=BATCH)
    # the whole request is refused: 1e400000000 overflows a double, as in a single spawn's body
    assert answer.status == 400
    exact = invoke(raw_body=body.replace("1e400000000", "2.50"), headers=BATCH)
    assert '"input":{"x":1.10,"y":2.50}' in exact.text
    assert '"input":{"x":0.1000000000000000055511151231257827}' in exact.text
    assert json.loads(exact.text)["results"][0]["status"] == 201


# Lambda answers a synchronous invocation with at most 6 MB (https://docs.aws.amazon.com/lambda/latest/dg/gettingstarted-limits.html);
# past it the invocation fails and API Gateway answers 500, every spawn's outcome unknown.
LAMBDA_RESPONSE_BYTES = 6 * 1024 * 1024


def _response_bytes(answer: Answer) -> int:
    """The answer's size as Lambda's python3.13 runtime sends it: the proxy response as JSON, UTF-8 unescaped
    (awslambdaric's marshaller, ensure_ascii=False from python3.12)."""
    response = {"statusCode": answer.status, "headers": answer.headers, "body": answer.text, "isBase64Encoded": False}
    return len(json.dumps(response, ensure_ascii=False).encode())


def test_replays_of_runs_far_larger_than_their_spawns_answer_within_lambdas_payload(
    invoke: Invoke, dynamodb: Any, table_name: str, tenant: str
) -> None:
    # Given 25 runs of about 250 KB each, their input's one number sent long-form
    long_form = "1." + "0" * 250_000
    for n in range(25):
        raw = f'{{"workflow_ref": "wf", "input": {{"x": {long_form}}}, "dispatch_key": "big-{n}"}}'
        assert invoke(raw_body=raw).status == 201
    # When a batch of 100 small spawns of the same value (1), four a key, is sent: 100 replays of 250 KB
    answer = _batch(invoke, [_spawn(f"big-{n % 25}", "wf", input={"x": 1}) for n in range(MAX_BATCH_SPAWNS)])
    # Then the answer fits Lambda's payload, each spawn replayed or 503 store-unavailable (nothing was written:
    # send it again), the first ones replayed
    assert _response_bytes(answer) <= LAMBDA_RESPONSE_BYTES
    results = answer.body["results"]
    assert {(r["status"], r.get("problem", {}).get("type")) for r in results} == {
        (200, None),
        (503, "urn:poimen:problem:store-unavailable"),
    }
    assert results[0]["status"] == 200
    assert all(result["retry_after"] >= 0 for result in results if result["status"] == 503)
    assert len(count_runs(dynamodb, table_name, tenant, only="pk")) == 25


def test_100_spawns_refused_with_long_problems_answer_within_lambdas_payload(
    invoke: Invoke, dynamodb: Any, table_name: str, tenant: str
) -> None:
    # Given 100 spawns of 10 KB, each with 20 unknown fields named by 131 characters, 129 beyond the BMP (4 bytes
    # each as sent and in a problem, which names each field twice, and 12 in the answer's budget: runtimes before
    # python3.12 \u-escape them), and one valid spawn last
    def unknown(n: int) -> dict[str, Any]:
        return {**_spawn(f"p-{n}"), **{f"{i:02}" + "\U0001f600" * 129: 1 for i in range(20)}}

    spawns = [unknown(n) for n in range(MAX_BATCH_SPAWNS - 1)] + [_spawn("p-ok")]
    body = json.dumps({"spawns": spawns}, ensure_ascii=False)
    assert len(body.encode()) <= MAX_BATCH_BODY_BYTES
    # When they are sent as one batch
    answer = invoke(raw_body=body, headers=BATCH)
    # Then the answer fits Lambda's payload, the valid spawn is admitted and each other one is its 400 or a 503
    # store-unavailable (nothing written)
    assert answer.status == 200
    assert _response_bytes(answer) <= LAMBDA_RESPONSE_BYTES
    statuses = Counter(result["status"] for result in answer.body["results"][:-1])
    assert set(statuses) == {400, 503}
    assert answer.body["results"][-1]["status"] == 201
    assert [item["dispatch_key"]["S"] for item in count_runs(dynamodb, table_name, tenant)] == ["p-ok"]
