"""What an admission does not do per request: work whose result is the same for every request, done again
(benchmarks/admission_bench.py measures the rest; docs/architecture.md#benchmarks says where the time goes)."""

from __future__ import annotations

from typing import Any

import pytest
from aws_lambda_powertools.event_handler import depends
from botocore.hooks import EventAliaser

from tests.conftest import count_runs
from tests.unit.conftest import Invoke


def test_a_request_builds_no_dependency_tree(
    invoke: Invoke, dynamodb: Any, table_name: str, granted: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Powertools' Depends() evaluates the route's type hints on every request (typing.get_type_hints, compile);
    # its middlewares are inspected once, on a process's first request.
    invoke(body={"workflow_ref": "wf/hot", "input": {}, "dispatch_key": "warm"})

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
