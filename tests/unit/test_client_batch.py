"""AdmissionClient.spawn_many against the admission handler in-process (the relay harness's API): the spawns
split by the batch limits, one typed result each, in order, and spawns answered 5xx sent again."""

from __future__ import annotations

import argparse
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import urllib3
from botocore.credentials import Credentials

from poimen.client import (
    GENERATED_KEY_PREFIX,
    AdmissionClient,
    DispatchKeyReused,
    InvalidRequest,
    Spawned,
    SpawnRequest,
    Unavailable,
)
from poimen.contract import JSONNumber
from poimen.ids import keyed_run_id
from poimen.store import Store
from poimen.wire import MAX_BATCH_SPAWNS, MAX_JSON_DEPTH, SPAWNS_MEDIA_TYPE
from poimen_tools import runs
from tests.conftest import count_runs
from tests.unit.dynamodb_faults import Fault, lost_before_dynamodb, only_for, script_attempts, throttled
from tests.unit.relay_harness import RELAY_KEY, RELAY_ROLE, InProcessApi


@pytest.fixture
def api(handler: Callable[[dict[str, Any], Any], dict[str, Any]], store: Store, tenant: str) -> InProcessApi:
    store.grant(RELAY_ROLE, tenant)
    return InProcessApi(handler)


@pytest.fixture
def client(api: InProcessApi) -> AdmissionClient:
    credentials = Credentials(RELAY_KEY.access_key, RELAY_KEY.secret_key)
    return AdmissionClient(
        "https://api.example", region="us-east-1", credentials=credentials, http=api, sleep=lambda _: None
    )


def test_spawn_many_splits_by_count_and_answers_each_spawn_typed_in_order(
    client: AdmissionClient, api: InProcessApi, dynamodb: Any, table_name: str, tenant: str
) -> None:
    # Given 2.5 batches of spawns: new keys, a key twice, a key reused with another workflow, a keyless one,
    # one the API refuses, and a number to keep exactly
    spawns = [SpawnRequest("wf/a", {"n": n}, dispatch_key=f"m-{n}") for n in range(245)]
    spawns += [
        SpawnRequest("wf/a", {"n": 0}, dispatch_key="m-0"),  # replay
        SpawnRequest("wf/b", {"n": 1}, dispatch_key="m-1"),  # 422
        SpawnRequest("wf/a", {"x": JSONNumber("1.10")}),  # keyless
        SpawnRequest("", {}, dispatch_key="m-bad"),  # 400
        SpawnRequest("wf/a", {"n": 249}, dispatch_key="m-249"),
    ]
    # When they are spawned
    results = client.spawn_many(tenant, spawns)
    # Then three calls carried them (100, 100, 50), each a batch
    assert [headers["content-type"] for headers in api.received] == [SPAWNS_MEDIA_TYPE] * 3
    assert len(results) == len(spawns) == 2 * MAX_BATCH_SPAWNS + 50
    # And each result is the spawn's own, typed
    assert all(isinstance(result, Spawned) and not result.replayed for result in results[:245])
    assert [r.run_id for r in results[:3] if isinstance(r, Spawned)] == [
        keyed_run_id(tenant, f"m-{n}") for n in range(3)
    ]
    replay, reused, keyless, refused, last = results[245:]
    assert isinstance(replay, Spawned)
    assert replay.replayed
    assert replay.run_id == keyed_run_id(tenant, "m-0")
    assert isinstance(reused, DispatchKeyReused)
    assert reused.run_id == keyed_run_id(tenant, "m-1")
    assert reused.dispatch_key == "m-1"
    assert isinstance(keyless, Spawned)
    assert not keyless.replayed
    assert str(keyless.run.dispatch_key).startswith(GENERATED_KEY_PREFIX)
    assert str(keyless.run.input["x"]) == "1.10"
    assert isinstance(refused, InvalidRequest)
    assert refused.status == 400
    assert isinstance(last, Spawned)
    assert last.run_id == keyed_run_id(tenant, "m-249")
    # And the table holds one run per key: 245 keyed, one keyless, one more
    assert len(count_runs(dynamodb, table_name, tenant)) == 247


def test_spawn_many_splits_by_bytes(client: AdmissionClient, api: InProcessApi, tenant: str) -> None:
    spawns = [SpawnRequest("wf/a", {"s": "x" * 250_000}, dispatch_key=f"big-{n}") for n in range(5)]
    results = client.spawn_many(tenant, spawns)
    assert len(api.bodies) == 2  # 4 of 250 KB fit 1 MiB, the fifth does not
    assert all(isinstance(result, Spawned) for result in results)


def test_a_spawn_answered_503_is_sent_again_in_the_next_call(
    client: AdmissionClient, api: InProcessApi, monkeypatch: pytest.MonkeyPatch, tenant: str
) -> None:
    # Given a store that throttles the first write past its retries (store-unavailable: nothing written)
    script_attempts(monkeypatch, put_run=only_for('"t-0"', [throttled, throttled]))
    # When two spawns are sent
    first, second = client.spawn_many(tenant, [SpawnRequest("wf/a", {}, dispatch_key=f"t-{n}") for n in range(2)])
    # Then the first was sent again alone, and both are runs
    assert [len(json.loads(body)["spawns"]) for body in api.bodies] == [2, 1]
    assert isinstance(first, Spawned)
    assert first.attempts == 2
    assert isinstance(second, Spawned)
    assert second.attempts == 1


def test_a_refusal_of_the_whole_call_is_each_spawns_result_naming_its_key(client: AdmissionClient, tenant: str) -> None:
    # The client's principal is not granted the stack's second tenant: the call is refused whole (403)
    results = client.spawn_many(f"{tenant}-b", [SpawnRequest("wf/a", {}, dispatch_key=f"f-{n}") for n in range(3)])
    assert [type(result).__name__ for result in results] == ["Forbidden"] * 3
    assert [getattr(result, "dispatch_key", None) for result in results] == ["f-0", "f-1", "f-2"]


def test_poimen_runs_spawn_many_sends_a_file_and_prints_a_line_a_spawn_with_its_exit_code(
    client: AdmissionClient, api: InProcessApi, tenant: str, tmp_path: Path
) -> None:
    # Given a file of spawns: two new, a reuse of the first key with another workflow, a blank line, a keyless one
    spawns = tmp_path / "spawns.jsonl"
    lines = [
        '{"workflow_ref": "wf/a", "input": {"x": 1.10}, "dispatch_key": "c-1"}',
        '{"workflow_ref": "wf/a", "input": {}, "dispatch_key": "c-2"}',
        '{"workflow_ref": "wf/b", "input": {}, "dispatch_key": "c-1"}',
        "",
        '{"workflow_ref": "wf/a", "input": {}}',
    ]
    spawns.write_text("\n".join(lines) + "\n")
    # When poimen runs spawn-many sends it
    out = io.StringIO()
    code = runs.run(_runs_arguments("spawn-many", "--tenant", tenant, str(spawns)), client=client, stdout=out)
    # Then it was one call, one line a spawn in order, and the exit code that of the refused spawn (2)
    printed = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(api.bodies) == 1
    assert [(line["line"], line["status"]) for line in printed] == [(1, 201), (2, 201), (3, 422), (5, 201)]
    assert '"input":{"x":1.10}' in out.getvalue().splitlines()[0]
    assert printed[2]["dispatch_key"] == "c-1"
    assert keyed_run_id(tenant, "c-1") in printed[2]["error"]
    assert code == runs.EXIT_USAGE


def test_poimen_runs_spawn_many_refuses_a_file_with_a_line_that_is_no_spawn_before_sending(
    client: AdmissionClient, api: InProcessApi, tenant: str, tmp_path: Path
) -> None:
    spawns = tmp_path / "spawns.jsonl"
    spawns.write_text('{"workflow_ref": "wf/a", "input": {}}\n{"workflow_ref": "wf/a", "inputs": {}}\n')
    err = io.StringIO()
    code = runs.run(_runs_arguments("spawn-many", "--tenant", tenant, str(spawns)), client=client, stderr=err)
    assert code == runs.EXIT_USAGE
    assert "line 2 is no spawn" in err.getvalue()
    assert "nothing was sent" in err.getvalue()
    assert api.received == []


@pytest.mark.parametrize(
    "second_line",
    [
        # inputs that are no JSON object (a list of pairs would pass for one to dict())
        *(b'{"workflow_ref": "wf/a", "input": %s}' % i for i in (b'[["a", 1]]', b"[]", b'"x"', b"null", b"1")),
        b'{"workflow_ref": "wf/\xff", "input": {}}',  # a byte that is not UTF-8
    ],
    ids=["pairs", "list", "string", "null", "number", "not-utf8"],
)
def test_poimen_runs_spawn_many_refuses_a_line_that_is_no_spawn_before_sending(
    client: AdmissionClient, api: InProcessApi, tenant: str, tmp_path: Path, second_line: bytes
) -> None:
    # Given a file whose second line is no spawn: its input is not a JSON object, or it is not UTF-8
    spawns = tmp_path / "spawns.jsonl"
    spawns.write_bytes(b'{"workflow_ref": "wf/a", "input": {}}\n' + second_line + b"\n")
    # When poimen runs spawn-many is given it
    err = io.StringIO()
    code = runs.run(_runs_arguments("spawn-many", "--tenant", tenant, str(spawns)), client=client, stderr=err)
    # Then, as for `poimen runs spawn --input`, it is a usage error naming the line, and nothing was sent
    assert code == runs.EXIT_USAGE
    assert "line 2 is no spawn" in err.getvalue()
    assert "nothing was sent" in err.getvalue()
    assert api.received == []


def _runs_arguments(*words: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="poimen")
    runs.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["runs", *words])


def test_a_spawn_answered_outcome_unknown_then_store_unavailable_is_outcome_unknown_as_spawn_says(
    api: InProcessApi, monkeypatch: pytest.MonkeyPatch, tenant: str
) -> None:
    # Given two attempts a spawn, and a store whose first call for a key loses its write (503 outcome-unknown: the
    # run may be there) and whose next call for it is throttled (503 store-unavailable: that call wrote nothing)
    credentials = Credentials(RELAY_KEY.access_key, RELAY_KEY.secret_key)
    client = AdmissionClient(
        "https://api.example",
        region="us-east-1",
        credentials=credentials,
        http=api,
        sleep=lambda _: None,
        max_attempts=2,
    )
    lost_then_throttled: list[Fault] = [lost_before_dynamodb, lost_before_dynamodb, throttled, throttled]
    # When a key is spawned alone, and another in a batch, each meeting those answers
    script_attempts(monkeypatch, put_run=only_for('"u-one"', lost_then_throttled))
    with pytest.raises(Unavailable) as single:
        client.spawn(tenant, "wf/a", {}, dispatch_key="u-one")
    script_attempts(monkeypatch, put_run=only_for('"u-many"', lost_then_throttled))
    (many,) = client.spawn_many(tenant, [SpawnRequest("wf/a", {}, dispatch_key="u-many")])
    # Then both failed, and both say their outcome is unknown: the first call may have admitted the run, which a
    # later answer that wrote nothing does not undo (a generated key's spawn run again would admit a second one)
    assert single.value.outcome_unknown
    assert isinstance(many, Unavailable)
    assert many.outcome_unknown


class _InterruptedOnCall(InProcessApi):
    """The API, but the user presses Ctrl-C while the `nth` call's answer is on its way: the call was admitted."""

    def __init__(self, api: InProcessApi, nth: int) -> None:
        super().__init__(api._handler)
        self._nth = nth

    def urlopen(self, method: str, url: str, redirect: bool = True, **kw: Any) -> urllib3.BaseHTTPResponse:  # type: ignore[override]
        answer = super().urlopen(method, url, redirect, **kw)
        if len(self.received) == self._nth:
            raise KeyboardInterrupt
        return answer


def test_poimen_runs_spawn_many_interrupted_names_every_spawn_it_may_have_admitted(
    api: InProcessApi, dynamodb: Any, table_name: str, tenant: str, tmp_path: Path
) -> None:
    # Given a file of 250 keyless spawns, and Ctrl-C pressed while the second call's answer is on its way
    spawns = tmp_path / "spawns.jsonl"
    spawns.write_text("".join(f'{{"workflow_ref": "wf/a", "input": {{"n": {n}}}}}\n' for n in range(250)))
    interrupted = _InterruptedOnCall(api, nth=2)
    credentials = Credentials(RELAY_KEY.access_key, RELAY_KEY.secret_key)
    client = AdmissionClient(
        "https://api.example", region="us-east-1", credentials=credentials, http=interrupted, sleep=lambda _: None
    )
    # When poimen runs spawn-many sends it
    out = io.StringIO()
    with pytest.raises(KeyboardInterrupt):
        runs.run(_runs_arguments("spawn-many", "--tenant", tenant, str(spawns)), client=client, stdout=out)
    # Then two calls were made, and 200 runs admitted under keys generated for them
    assert len(interrupted.bodies) == 2
    admitted = {item["dispatch_key"]["S"] for item in count_runs(dynamodb, table_name, tenant)}
    assert len(admitted) == 200
    # And what it printed names every one of them, by its key: a run (the first call's), or a spawn whose outcome is
    # unknown (the second's), so that none is sent again under a new key; the lines of the spawns never sent are not
    # printed
    printed = [json.loads(line) for line in out.getvalue().splitlines()]
    named = {line["run"]["dispatch_key"] if "run" in line else line["dispatch_key"] for line in printed}
    assert admitted <= named
    assert [line["line"] for line in printed] == list(range(1, 201))
    assert all(line["status"] == 201 for line in printed[:100])
    assert all(line["status"] is None and line["outcome_unknown"] for line in printed[100:])


def test_a_result_that_says_admitted_without_its_run_is_that_spawns_unknown_outcome_alone(
    client: AdmissionClient, api: InProcessApi, tenant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an API whose batch answer says the second spawn was admitted but carries no run
    answer = api.urlopen

    def garbled(method: str, url: str, redirect: bool = True, **kw: Any) -> urllib3.BaseHTTPResponse:
        response = answer(method, url, redirect, **kw)
        document = json.loads(response.data)
        del document["results"][1]["run"]
        body = json.dumps(document).encode()
        return urllib3.HTTPResponse(body=body, status=response.status, headers=response.headers, preload_content=True)

    monkeypatch.setattr(api, "urlopen", garbled)
    spawns = [SpawnRequest("wf/a", {"n": n}, dispatch_key=f"g-{n}") for n in range(3)]
    # When they are spawned
    first, second, third = client.spawn_many(tenant, spawns)
    # Then the others are answered as admitted, and the second alone is an unexpected answer, its outcome unknown
    assert isinstance(first, Spawned)
    assert isinstance(third, Spawned)
    assert not isinstance(second, Spawned)
    assert second.outcome_unknown
    assert second.dispatch_key == "g-1"


def _nested(depth: int) -> dict[str, Any]:
    """An input `depth` objects deep: inside a spawn's body (the body, then the input) past MAX_JSON_DEPTH."""
    value: dict[str, Any] = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


TOO_DEEP = _nested(MAX_JSON_DEPTH)
MALFORMED_JSON = "urn:poimen:problem:malformed-json"


def test_one_spawn_a_batch_cannot_carry_is_refused_alone_and_the_others_are_admitted(
    client: AdmissionClient, api: InProcessApi, dynamodb: Any, table_name: str, tenant: str
) -> None:
    # Given a valid spawn, and one nested deeper than the API reads (it refuses the whole batch that carries it)
    spawns = [SpawnRequest("wf/a", {}, dispatch_key="d-ok"), SpawnRequest("wf/a", TOO_DEEP, dispatch_key="d-deep")]

    # When they are spawned together
    valid, deep = client.spawn_many(tenant, spawns)

    # Then each got what `spawn` gives it alone: the valid one its run, the deep one its own refusal, in order
    assert isinstance(valid, Spawned), valid
    assert (valid.run_id, valid.replayed) == (keyed_run_id(tenant, "d-ok"), False)
    assert isinstance(deep, InvalidRequest)
    assert (deep.status, deep.problem and deep.problem.type, deep.dispatch_key) == (400, MALFORMED_JSON, "d-deep")
    # And the batch refused whole was sent again one spawn a call, as the relay does
    assert [headers["content-type"] for headers in api.received] == [SPAWNS_MEDIA_TYPE] + ["application/json"] * 2
    # And the table holds the one run
    assert [item["dispatch_key"]["S"] for item in count_runs(dynamodb, table_name, tenant)] == ["d-ok"]


def test_a_batch_of_spawns_none_of_which_a_batch_can_carry_is_each_refused_alone(
    client: AdmissionClient, api: InProcessApi, dynamodb: Any, table_name: str, tenant: str
) -> None:
    # Given only spawns the API refuses in any body, one of them keyless
    spawns = [SpawnRequest("wf/a", TOO_DEEP, dispatch_key="d-1"), SpawnRequest("wf/a", TOO_DEEP)]

    # When they are spawned together
    results = client.spawn_many(tenant, spawns)

    # Then each is its own refusal, naming its key (the keyless one's generated), and nothing was written
    refusals = [result for result in results if isinstance(result, InvalidRequest)]
    assert [(r.status, r.problem and r.problem.type) for r in refusals] == [(400, MALFORMED_JSON)] * len(spawns)
    assert refusals[0].dispatch_key == "d-1"
    assert str(refusals[1].dispatch_key).startswith(GENERATED_KEY_PREFIX)
    assert [headers["content-type"] for headers in api.received] == [SPAWNS_MEDIA_TYPE] + ["application/json"] * 2
    assert count_runs(dynamodb, table_name, tenant) == []


def test_a_spawn_sent_alone_after_its_batch_was_refused_is_retried_as_spawn_retries_it(
    client: AdmissionClient, api: InProcessApi, monkeypatch: pytest.MonkeyPatch, tenant: str
) -> None:
    # Given a store that throttles the valid spawn's first write past its retries (store-unavailable: nothing written)
    script_attempts(monkeypatch, put_run=only_for('"t-ok"', [throttled, throttled]))

    # When it is spawned beside one a batch cannot carry
    valid, deep = client.spawn_many(
        tenant, [SpawnRequest("wf/a", {}, dispatch_key="t-ok"), SpawnRequest("wf/a", TOO_DEEP, dispatch_key="t-deep")]
    )

    # Then alone it was answered 503, sent again, and is its run: its attempts count the batch that carried it
    assert isinstance(valid, Spawned), valid
    assert (valid.run_id, valid.replayed, valid.attempts) == (keyed_run_id(tenant, "t-ok"), False, 3)
    assert isinstance(deep, InvalidRequest)
    assert deep.dispatch_key == "t-deep"
    assert [headers["content-type"] for headers in api.received] == [SPAWNS_MEDIA_TYPE] + ["application/json"] * 3


def test_a_spawn_too_large_for_any_batch_is_refused_by_the_single_route_and_the_next_admitted(
    client: AdmissionClient, api: InProcessApi, dynamodb: Any, table_name: str, tenant: str
) -> None:
    # Given a spawn over a batch's 1 MiB (the API refuses its batch 413 whole), then a valid one
    huge = SpawnRequest("wf/a", {"s": "x" * 1_100_000}, dispatch_key="z-huge")

    # When they are spawned together
    refused, valid = client.spawn_many(tenant, [huge, SpawnRequest("wf/a", {}, dispatch_key="z-ok")])

    # Then the large one is the single route's 413, the other its run; one run in the table
    assert isinstance(refused, InvalidRequest)
    assert (refused.status, refused.problem and refused.problem.type) == (413, "urn:poimen:problem:payload-too-large")
    assert refused.dispatch_key == "z-huge"
    assert isinstance(valid, Spawned)
    assert [item["dispatch_key"]["S"] for item in count_runs(dynamodb, table_name, tenant)] == ["z-ok"]


class _NoBatchAfterTheFirst(InProcessApi):
    """The API, until a second batch call: that one, and every later one, answered 415 as an API that takes no batch
    (a deploy rolled back under the client) answers it; single spawns still reach the handler."""

    def urlopen(self, method: str, url: str, redirect: bool = True, **kw: Any) -> urllib3.BaseHTTPResponse:  # type: ignore[override]
        batches = sum(headers.get("content-type") == SPAWNS_MEDIA_TYPE for headers in self.received)
        if dict(kw["headers"]).get("Content-Type") == SPAWNS_MEDIA_TYPE and batches >= 1:
            self.received.append({"content-type": SPAWNS_MEDIA_TYPE})
            problem = {"type": "urn:poimen:problem:unsupported-media-type", "title": "Unsupported Media Type"}
            return urllib3.HTTPResponse(
                body=json.dumps({**problem, "status": 415}).encode(),
                status=415,
                headers={"Content-Type": "application/problem+json"},
                preload_content=True,
            )
        return super().urlopen(method, url, redirect, **kw)


def test_a_spawn_whose_earlier_call_may_have_admitted_it_stays_outcome_unknown_when_sent_alone(
    handler: Callable[[dict[str, Any], Any], dict[str, Any]], store: Store, monkeypatch: pytest.MonkeyPatch, tenant: str
) -> None:
    # Given two attempts a call, an API that takes a first batch and refuses every later one 415, and a store that
    # loses the key's first write (503 outcome-unknown: the run may be there) and throttles every later one
    store.grant(RELAY_ROLE, tenant)
    api = _NoBatchAfterTheFirst(handler)
    credentials = Credentials(RELAY_KEY.access_key, RELAY_KEY.secret_key)
    client = AdmissionClient(
        "https://api.example",
        region="us-east-1",
        credentials=credentials,
        http=api,
        sleep=lambda _: None,
        max_attempts=2,
    )
    script_attempts(monkeypatch, put_run=only_for('"v-lost"', [lost_before_dynamodb] * 2 + [throttled] * 4))

    # When it is spawned: the first batch answers it outcome-unknown, the second is refused whole, and alone it is
    # answered store-unavailable twice
    (result,) = client.spawn_many(tenant, [SpawnRequest("wf/a", {}, dispatch_key="v-lost")])

    # Then it is Unavailable, and says its outcome is unknown: the first call may have admitted it
    assert isinstance(result, Unavailable), result
    assert (result.outcome_unknown, result.dispatch_key) == (True, "v-lost")
    assert [headers["content-type"] for headers in api.received] == [SPAWNS_MEDIA_TYPE] * 2 + ["application/json"] * 2


class _LostThenNoBatch(InProcessApi):
    """The API, but the first batch call's answer is lost after the handler admitted it (API Gateway's 500 as the
    function timed out past its write), and every later batch call is answered 415 (a deploy rolled back under the
    client, or a failover to an endpoint that takes no batch); single spawns reach the handler."""

    def urlopen(self, method: str, url: str, redirect: bool = True, **kw: Any) -> urllib3.BaseHTTPResponse:  # type: ignore[override]
        batch = dict(kw["headers"]).get("Content-Type") == SPAWNS_MEDIA_TYPE
        batches = sum(headers.get("content-type") == SPAWNS_MEDIA_TYPE for headers in self.received)
        if batch and batches >= 1:
            self.received.append({"content-type": SPAWNS_MEDIA_TYPE})
            problem = {"type": "urn:poimen:problem:unsupported-media-type", "title": "Unsupported Media Type"}
            return urllib3.HTTPResponse(
                body=json.dumps({**problem, "status": 415, "detail": "no batch"}).encode(),
                status=415,
                headers={"Content-Type": "application/problem+json"},
                preload_content=True,
            )
        answer = super().urlopen(method, url, redirect, **kw)
        if batch:
            return urllib3.HTTPResponse(
                body=b'{"message":"Internal Server Error"}',
                status=500,
                headers={"Content-Type": "application/json"},
                preload_content=True,
            )
        return answer


def test_a_spawn_whose_batch_call_was_lost_then_refused_whole_stays_outcome_unknown_when_sent_alone(
    handler: Callable[[dict[str, Any], Any], dict[str, Any]],
    store: Store,
    monkeypatch: pytest.MonkeyPatch,
    dynamodb: Any,
    table_name: str,
    tenant: str,
) -> None:
    # Given two attempts a call, an API whose first batch call admits and loses its answer (500), whose second
    # attempt of that call is refused whole (415), and a store that throttles the spawn's writes after the first
    store.grant(RELAY_ROLE, tenant)
    api = _LostThenNoBatch(handler)
    credentials = Credentials(RELAY_KEY.access_key, RELAY_KEY.secret_key)
    client = AdmissionClient(
        "https://api.example",
        region="us-east-1",
        credentials=credentials,
        http=api,
        sleep=lambda _: None,
        max_attempts=2,
    )
    script_attempts(monkeypatch, put_run=only_for('"poimen-client/', [lambda send, _: send()] + [throttled] * 4))

    # When a keyless spawn is spawned: the batch call's first attempt admits it (answer lost), its second is refused
    # whole, and alone the spawn is answered store-unavailable twice
    (result,) = client.spawn_many(tenant, [SpawnRequest("wf/a", {})])

    # Then its run is in the table, and the result says its outcome is unknown, naming the generated key that finds it:
    # a keyless spawn told "nothing was written" is sent again without that key, a second run. (It said
    # outcome_unknown False: the fallback carries the outcome of earlier *batch calls* per spawn, not that of the
    # earlier attempts of the call refused whole, which the refusal itself carries: InvalidRequest.outcome_unknown.)
    assert len(count_runs(dynamodb, table_name, tenant)) == 1
    assert isinstance(result, Unavailable), result
    assert str(result.dispatch_key).startswith(GENERATED_KEY_PREFIX)
    assert result.outcome_unknown
