"""What an admission does not do per request: work whose result is the same for every request, done again
(benchmarks/admission_bench.py measures the rest; docs/architecture.md#benchmarks says where the time goes)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aws_lambda_powertools.event_handler import depends
from aws_lambda_powertools.event_handler.api_gateway import APIGatewayHttpResolver, Response, ResponseBuilder
from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.data_classes import APIGatewayProxyEventV2
from botocore.hooks import EventAliaser

from poimen import api
from poimen.observability import metrics, print_count
from poimen.wire import REPLAYED_HEADER, SPAWNS_MEDIA_TYPE
from tests.conftest import count_runs, load_event
from tests.unit.conftest import Invoke


def test_a_request_builds_no_dependency_tree(
    invoke: Invoke, dynamodb: Any, table_name: str, granted: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Powertools' Depends() evaluates the route's type hints on every request (typing.get_type_hints, compile);
    # its middlewares are inspected once, on a process's first request.
    invoke(body={"workflow_ref": "wf/hot", "input": {}, "dispatch_key": "warm"})
    invoke("GET", "/v1/runs", query="dispatch_key=warm")  # a POST of a valid spawn does not reach the resolver

    def forbidden(*_: Any, **__: Any) -> Any:
        raise AssertionError("a route resolved Depends() on a request")

    monkeypatch.setattr(depends, "build_dependency_tree", forbidden)
    monkeypatch.setattr(depends, "solve_dependencies", forbidden)

    # When a run is admitted, then looked up by its key and by its id
    admitted = invoke(body={"workflow_ref": "wf/hot", "input": {}, "dispatch_key": "hot-1"})
    found = invoke("GET", "/v1/runs", query="dispatch_key=hot-1")
    got = invoke("GET", f"/v1/runs/{admitted.body['run_id']}")

    # Then each answered without one, and the run is stored once
    assert (admitted.status, found.status, got.status) == (201, 200, 200)
    assert [run["dispatch_key"]["S"] for run in count_runs(dynamodb, table_name, granted)].count("hot-1") == 1


def test_the_write_watch_is_hooked_to_the_client_once(invoke: Invoke, monkeypatch: pytest.MonkeyPatch) -> None:
    # botocore's register inspects the handler's signature on every call, even for a handler it already has.
    invoke(body={"workflow_ref": "wf/hot", "input": {}, "dispatch_key": "warm"})  # the store's client exists
    registered: list[str] = []
    original = EventAliaser.register

    def counting(self: EventAliaser, event_name: str, *args: Any, **kwargs: Any) -> Any:
        registered.append(event_name)
        return original(self, event_name, *args, **kwargs)

    monkeypatch.setattr(EventAliaser, "register", counting)

    answers = [invoke(body={"workflow_ref": "wf/hot", "input": {}, "dispatch_key": f"hot-{n}"}) for n in range(3)]

    assert [answer.status for answer in answers] == [201, 201, 201]
    assert "response-received.dynamodb.PutItem" not in registered


def test_a_valid_spawn_is_admitted_without_powertools_resolver(
    invoke: Invoke, dynamodb: Any, table_name: str, granted: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given the resolver's routing and validation made to fail (they cost more than the rest of our work)
    def forbidden(*_: Any, **__: Any) -> Any:
        raise AssertionError("a valid POST /v1/runs went through Powertools' resolver")

    monkeypatch.setattr(APIGatewayHttpResolver, "resolve", forbidden)

    # When a spawn is sent, then sent again
    spawn = {"workflow_ref": "wf/hot", "input": {"n": 1}, "dispatch_key": "direct-1"}
    first, again = invoke(body=spawn), invoke(body=spawn)

    # Then both were answered, and the run is stored once
    assert (first.status, again.status) == (201, 200)
    assert again.body["run_id"] == first.body["run_id"]
    assert [run["dispatch_key"]["S"] for run in count_runs(dynamodb, table_name, granted)].count("direct-1") == 1


def _through_resolver(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every POST /v1/runs left to Powertools' resolver, as one its models refuse is."""
    monkeypatch.setattr(api, "_validated_spawn", lambda *_: None)


@pytest.mark.parametrize(
    ("spawn", "headers", "served"),
    [
        ({"workflow_ref": "wf/hot", "input": {"n": 1}, "dispatch_key": "same"}, {}, True),  # a replay, 200
        ({"workflow_ref": "wf/other", "input": {}, "dispatch_key": "same"}, {}, True),  # dispatch-key-reused, 422
        ({"workflow_ref": "wf/hot", "input": {}}, {"idempotency-key": '"unterminated'}, True),  # 400
        ({"workflow_ref": "wf/other", "input": {}}, {"idempotency-key": "same"}, True),  # the header's key, 422
        ({"workflow_ref": "wf/hot", "input": {}}, {}, True),  # keyless: a new run each, 201
        ({"workflow_ref": "wf/hot", "input": {}, "dispatch_key": "b"}, {"idempotency-key": "c"}, True),  # 400
        ({"workflow_ref": "wf/hot", "input": {}}, {}, False),  # tenant-not-served, 403
    ],
    ids=["replay", "key-reused", "key-invalid", "header-key", "key-mismatch", "keyless", "not-served"],
)
def test_the_single_route_answers_as_powertools_resolver_does(
    invoke: Invoke,
    granted: str,
    monkeypatch: pytest.MonkeyPatch,
    spawn: dict[str, Any],
    headers: dict[str, str],
    served: bool,
) -> None:
    # Given a run admitted under the key "same"
    assert invoke(body={"workflow_ref": "wf/hot", "input": {"n": 1}, "dispatch_key": "same"}).status == 201

    # When the request is answered before the resolver, then by it
    direct = invoke(body=spawn, headers=headers, tenant=granted if served else "not-served")
    _through_resolver(monkeypatch)
    resolved = invoke(body=spawn, headers=headers, tenant=granted if served else "not-served")

    # Then both answers are the same: status, headers and body (a new run's own id and time aside)
    assert direct.status == resolved.status
    if direct.status == 201:
        assert direct.headers.keys() == resolved.headers.keys()
        assert direct.body.keys() == resolved.body.keys()
        assert direct.body["run_id"] != resolved.body["run_id"]
    else:
        assert (direct.headers, direct.text) == (resolved.headers, resolved.text)


@pytest.mark.parametrize(("status", "headers"), [(201, {"Location": "/v1/runs/r-1"}), (200, {REPLAYED_HEADER: "true"})])
def test_a_runs_answer_is_the_response_powertools_builder_makes_of_it(
    status: int, headers: dict[str, str] | None
) -> None:
    # An admission's answer (a new run's, a replay's) is built without the resolver's builder.
    def answer() -> Response[str]:
        return Response(status_code=status, content_type="application/json", body='{"run_id":"r-1"}', headers=headers)

    builder: ResponseBuilder[APIGatewayProxyEventV2] = ResponseBuilder(answer())
    built = builder.build(APIGatewayProxyEventV2(load_event("http_api_create_run.json")))

    assert list(api._run_response(answer()).items()) == list(built.items())
    assert list(api._run_response(answer())["headers"].items()) == list(built["headers"].items())


AUDIT = {
    "message": "run admitted",
    "tenant_id": "t-1",
    "dispatch_key": None,
    "run_id": "r-1",
    "status": 201,
    "correlation_id": "c-1",
    "latency_ms": 1.5,
}


def _printed_by_metrics(name: str, metadata: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> str:
    """What Powertools' Metrics prints for a Count of 1 and `metadata`, flushed as `log_metrics` flushes it."""
    metrics.add_metric(name=name, unit=MetricUnit.Count, value=1)
    for key, value in metadata.items():
        metrics.add_metadata(key=key, value=value)
    metrics.flush_metrics()
    return capsys.readouterr().out


@pytest.mark.parametrize("name", ["RunsAdmitted", "RunsReplayed"])
def test_an_admissions_emf_line_is_the_one_powertools_metrics_prints(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given the line an admission prints directly, then the one Powertools prints for the same metric and metadata
    capsys.readouterr()
    print_count(name, AUDIT)
    ours = json.loads(capsys.readouterr().out)
    theirs = json.loads(_printed_by_metrics(name, AUDIT, capsys))

    # Then they are the same line, key for key in the same order, but for the moment each was printed
    assert abs(ours["_aws"]["Timestamp"] - theirs["_aws"]["Timestamp"]) < 60_000
    ours["_aws"]["Timestamp"] = theirs["_aws"]["Timestamp"]
    assert list(ours.items()) == list(theirs.items())


@pytest.mark.parametrize("setup", ["no-service", "a-dimension", "default-dimensions"])
def test_an_admissions_emf_line_is_powertools_own_when_metrics_are_set_up_otherwise(
    setup: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given Metrics set up otherwise than the admission function sets them up: no POWERTOOLS_SERVICE_NAME (no
    # service dimension), a dimension added, default dimensions set
    def set_up() -> None:
        if setup == "a-dimension":
            metrics.add_dimension(name="tenant", value="t-1")
        elif setup == "default-dimensions":
            metrics.set_default_dimensions(stage="dev")

    if setup == "no-service":
        monkeypatch.setattr(metrics, "service", None)
    capsys.readouterr()

    # When an admission's line is printed, and the invocation's metrics flushed as log_metrics flushes them
    set_up()
    print_count("RunsAdmitted", AUDIT)
    metrics.flush_metrics()
    ours = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    metrics.clear_default_dimensions()
    set_up()
    theirs = [json.loads(line) for line in _printed_by_metrics("RunsAdmitted", AUDIT, capsys).splitlines()]
    metrics.clear_default_dimensions()

    # Then it is the one line Powertools prints, but for the moment each was printed
    assert len(ours) == len(theirs) == 1
    ours[0]["_aws"]["Timestamp"] = theirs[0]["_aws"]["Timestamp"]
    assert list(ours[0].items()) == list(theirs[0].items())


@pytest.mark.usefixtures("metrics_off")
def test_no_emf_line_is_printed_when_metrics_are_disabled(capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    print_count("RunsAdmitted", AUDIT)
    assert capsys.readouterr().out == "" == _printed_by_metrics("RunsAdmitted", AUDIT, capsys)
    metrics.clear_metrics()


@pytest.mark.usefixtures("metrics_off")
def test_an_invocations_metrics_and_metadata_end_with_it_when_metrics_are_disabled(
    invoke: Invoke, capsys: pytest.CaptureFixture[str]
) -> None:
    # Powertools clears only a metric set it prints: disabled, each invocation's would be kept for the next one
    # (and printed, metrics disabled, at its 100th value).
    # Given a run admitted under a key
    assert invoke(body={"workflow_ref": "wf/hot", "input": {}, "dispatch_key": "off-1"}).status == 201

    # When the key is reused, a refusal that adds its metric and audit metadata
    assert invoke(body={"workflow_ref": "wf/other", "input": {}, "dispatch_key": "off-1"}).status == 422

    # Then nothing of it is left for the next invocation, and no line was printed
    assert (metrics.metric_set, metrics.metadata_set) == ({}, {})
    assert "_aws" not in capsys.readouterr().out


def test_a_batch_that_adds_no_metric_leaves_no_metadata_to_the_next_requests_line(
    invoke: Invoke, granted: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a batch whose one spawn is refused before it is written (a workflow_ref its model refuses): no metric
    refused = invoke(body={"spawns": [{"workflow_ref": "", "input": {}}]}, headers={"content-type": SPAWNS_MEDIA_TYPE})
    assert refused.status == 200
    assert refused.body["results"][0]["status"] == 400
    assert invoke(body={"workflow_ref": "wf/hot", "input": {}, "dispatch_key": "leak-1"}).status == 201
    capsys.readouterr()

    # When the next request's line is Powertools' (a key reused: its metric and the spawn's audit metadata)
    assert invoke(body={"workflow_ref": "wf/other", "input": {}, "dispatch_key": "leak-1"}).status == 422

    # Then it carries that request's fields and none of the batch's
    (line,) = [json.loads(text) for text in capsys.readouterr().out.splitlines() if '"_aws"' in text]
    assert (line["message"], line["tenant_id"]) == ("dispatch key reused", granted)
    assert "spawns" not in line


def _emf_lines_of_a_batch_of_100_refusals(invoke: Invoke, capsys: pytest.CaptureFixture[str], keys: str) -> list[Any]:
    """The EMF lines printed while a batch of 100 spawns is refused, each a key already admitted with another
    workflow_ref: 100 refusals that each add DispatchKeyConflicts, whose 100th value makes Powertools' add_metric
    print the set midway (whether or not metrics are disabled), before the batch's end."""
    spawns = [{"workflow_ref": "wf/hot", "input": {}, "dispatch_key": f"{keys}-{i}"} for i in range(100)]
    batch = {"content-type": SPAWNS_MEDIA_TYPE}
    assert invoke(body={"spawns": spawns}, headers=batch).status == 200
    capsys.readouterr()
    reused = invoke(body={"spawns": [{**spawn, "workflow_ref": "wf/other"} for spawn in spawns]}, headers=batch)
    assert [result["status"] for result in reused.body["results"]] == [422] * 100
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if '"_aws"' in line]


def test_every_emf_line_of_a_batch_of_100_refusals_names_its_tenant(
    invoke: Invoke, capsys: pytest.CaptureFixture[str], granted: str
) -> None:
    # Given runs admitted under 100 keys, when each key is sent again in one batch with another request
    printed = _emf_lines_of_a_batch_of_100_refusals(invoke, capsys, "on-batch")
    # Then the conflicts are counted, 100, and every EMF line printed (the runbook's query finds a line by its
    # tenant_id) carries the batch's tenant and size, the one printed midway too
    counts = [line.get("DispatchKeyConflicts", []) for line in printed]
    assert sum(sum(count) if isinstance(count, list) else count for count in counts) == 100
    assert [(line["tenant_id"], line["spawns"]) for line in printed] == [(granted, 100)] * len(printed)


@pytest.mark.usefixtures("metrics_off")
def test_a_batch_of_refusals_prints_no_emf_line_when_metrics_are_disabled(
    invoke: Invoke, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given runs admitted under 100 keys, when each key is sent again in one batch with another request (100 is the
    # batch's largest size, and the first count of values at which Powertools prints, disabled or not)
    printed = _emf_lines_of_a_batch_of_100_refusals(invoke, capsys, "off-batch")
    # Then no EMF line was printed, and nothing of it is left for the next invocation
    assert printed == []
    assert (metrics.metric_set, metrics.metadata_set) == ({}, {})
