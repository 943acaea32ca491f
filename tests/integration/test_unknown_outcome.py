"""A 5xx answer is safe to retry as it says, even when DynamoDB committed the write and its answer was lost.

`poimen dev` runs against a moto server through a fault-injecting proxy (tests/integration/dynamodb_proxy.py)
with a 0.5 s DynamoDB timeout: answers held past it, connections dropped after forwarding, 500s, writes
that land late. A caller that does exactly what each answer says (201/200: done; store-unavailable: send
again; outcome-unknown: with a key send again, without one GET the run it names) ends with one run.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest
import requests

from poimen.client import AdmissionClient
from poimen.ids import keyed_run_id
from poimen_tools.local.moto import EmbeddedMoto
from tests.conftest import count_runs
from tests.integration.conftest import DevServer, signed_session, start_dev, wait_for
from tests.integration.dynamodb_proxy import Fault, FaultyProxy, faulty_proxy

TABLE = "unknown-outcome-admission"
PROBLEM = "urn:poimen:problem:"
KEY = "k-1"


@dataclass
class Stack:
    dev: DevServer
    proxy: FaultyProxy
    moto: str


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with EmbeddedMoto() as moto, faulty_proxy(moto.endpoint) as proxy, pytest.MonkeyPatch.context() as env:
        env.setenv("DYNAMODB_TIMEOUT_SECONDS", "0.5")
        server = start_dev(Path(tmp_path_factory.mktemp("unknown")), "--dynamodb-endpoint", proxy.url, table_name=TABLE)
        try:
            yield Stack(server, proxy, moto.endpoint)
        finally:
            assert server.stop() == 0


@pytest.fixture
def http() -> Iterator[requests.Session]:
    with signed_session() as session:
        yield session


def _runs_and_fences(stack: Stack, tenant: str) -> tuple[list[str], list[str]]:
    """The run ids stored for `tenant`, and the ids its fences hold, read from moto itself."""
    items = count_runs(boto3.client("dynamodb", endpoint_url=stack.moto), TABLE, tenant)
    ids = [(item["pk"]["S"].rsplit("#", 1)[1], "item_type" in item) for item in items]
    return [run_id for run_id, fence in ids if not fence], [run_id for run_id, fence in ids if fence]


def _spawn(keyed: bool) -> dict[str, Any]:
    spawn: dict[str, Any] = {"workflow_ref": "wf/hello", "input": {"n": 1}}
    return {**spawn, "dispatch_key": KEY} if keyed else spawn


def _post(http: requests.Session, stack: Stack, tenant: str, spawn: dict[str, Any]) -> requests.Response:
    headers = {"X-Poimen-Tenant": tenant}
    return http.post(f"{stack.dev.url}/v1/runs", json=spawn, headers=headers, timeout=30)


def _follow(
    http: requests.Session, stack: Stack, tenant: str, spawn: dict[str, Any]
) -> tuple[list[requests.Response], dict[str, Any]]:
    """Send the spawn and do what each answer says until one names the run; the answers, and that run."""
    answers = [_post(http, stack, tenant, spawn)]
    while len(answers) < 4:
        answer = answers[-1]
        if answer.status_code in (200, 201):
            return answers, answer.json()
        assert answer.status_code == 503, answer.text
        problem = answer.json()
        # What the faults left in flight lands first, so the next step sees the store as it will stay.
        wait_for(stack.proxy.settled, what="the proxy's held writes to be forwarded")
        if problem["type"] == PROBLEM + "outcome-unknown" and "dispatch_key" not in spawn:
            # Without a key only a GET is safe: it names the run, and Location is where to look.
            assert answer.headers["Location"] == f"/v1/runs/{problem['run_id']}"
            assert "Retry-After" not in answer.headers
            found = http.get(f"{stack.dev.url}{answer.headers['Location']}", headers={"X-Poimen-Tenant": tenant})
            assert found.status_code == 200, found.text
            return answers, found.json()
        assert problem["type"] in (PROBLEM + "store-unavailable", PROBLEM + "outcome-unknown")
        assert "Retry-After" in answer.headers
        answers.append(_post(http, stack, tenant, spawn))
    raise AssertionError(f"no run after {[a.status_code for a in answers]}")


def _outcome(answer: requests.Response) -> str:
    """201 or 200, else the problem's type without its prefix."""
    if answer.status_code < 300:
        return str(answer.status_code)
    kind: str = answer.json()["type"]
    return kind.removeprefix(PROBLEM)


HELD = [Fault.COMMIT_THEN_HOLD, Fault.COMMIT_THEN_HOLD]
LATE = [Fault.HOLD_THEN_LATE, Fault.HOLD_THEN_LATE]
SCENARIOS = {
    # name: (faults, first answer keyless, first answer keyed)
    "late-answers": ({"put_run": HELD}, "201", "201"),
    "dropped-after-commit": ({"put_run": [Fault.COMMIT_THEN_DROP, Fault.COMMIT_THEN_DROP]}, "201", "201"),
    "late-then-500": ({"put_run": [Fault.COMMIT_THEN_HOLD, Fault.ANSWER_500]}, "201", "201"),
    "500-after-commit": ({"put_run": [Fault.COMMIT_THEN_500]}, "201", "201"),
    "lands-late": ({"put_run": LATE}, "store-unavailable", "outcome-unknown"),
    "unresolvable": (
        {"put_run": HELD, "put_fence": [Fault.HOLD_THEN_DROP], "get_run": [Fault.HOLD_THEN_DROP]},
        "outcome-unknown",
        "outcome-unknown",
    ),
}


@pytest.mark.parametrize("keyed", [False, True], ids=["keyless", "keyed"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_caller_doing_what_each_answer_says_ends_with_one_run(
    stack: Stack, http: requests.Session, tenant: str, scenario: str, keyed: bool
) -> None:
    faults, keyless_first, keyed_first = SCENARIOS[scenario]
    # Given DynamoDB attempts failing as the scenario scripts (a keyless write is resolved by a fence, a
    # keyed one by a read)
    unused = "put_fence" if keyed else "get_run"
    stack.proxy.script(**{kind: queue for kind, queue in faults.items() if kind != unused})
    # When a spawn is sent, and then whatever its answers ask for
    answers, run = _follow(http, stack, tenant, _spawn(keyed))
    wait_for(stack.proxy.settled, what="the proxy's held writes to be forwarded")
    # Then the first answer is the one expected, and exactly one run is stored: the run the caller has
    assert _outcome(answers[0]) == (keyed_first if keyed else keyless_first)
    runs, fences = _runs_and_fences(stack, tenant)
    assert runs == [run["run_id"]]
    if keyed:
        assert run["run_id"] == keyed_run_id(tenant, KEY)
        assert fences == []  # a key is never fenced


def test_a_keyless_write_that_lands_late_is_kept_out_by_its_fence(
    stack: Stack, http: requests.Session, tenant: str
) -> None:
    # Given a keyless write whose attempts reach DynamoDB only after their client gave up
    stack.proxy.script(put_run=LATE)
    # When it is sent
    answer = _post(http, stack, tenant, _spawn(keyed=False))
    wait_for(stack.proxy.settled, what="the late writes to be forwarded")
    # Then it is store-unavailable, the late writes found the fence, no run exists and its id is a 404
    assert answer.status_code == 503
    assert answer.json()["type"] == PROBLEM + "store-unavailable"
    runs, fences = _runs_and_fences(stack, tenant)
    assert runs == []
    assert len(fences) == 1
    gone = http.get(f"{stack.dev.url}/v1/runs/{fences[0]}", headers={"X-Poimen-Tenant": tenant}, timeout=30)
    assert gone.status_code == 404
    assert gone.json()["type"] == PROBLEM + "run-not-found"


def test_a_keyed_retry_after_a_late_write_is_a_200_replay(stack: Stack, http: requests.Session, tenant: str) -> None:
    # Given a keyed write that lands after admission looked for it
    stack.proxy.script(put_run=LATE)
    unknown = _post(http, stack, tenant, _spawn(keyed=True))
    wait_for(stack.proxy.settled, what="the late writes to be forwarded")
    # When the caller sends it again, as the outcome-unknown answer allows
    retried = _post(http, stack, tenant, _spawn(keyed=True))
    # Then the first answer named the run, the retry replays it (200), and it is the one run
    problem = unknown.json()
    run_id = keyed_run_id(tenant, KEY)
    assert (unknown.status_code, problem["type"], problem["run_id"]) == (503, PROBLEM + "outcome-unknown", run_id)
    assert unknown.headers["Location"] == f"/v1/runs/{run_id}"
    assert (retried.status_code, retried.headers.get("Idempotent-Replayed")) == (200, "true")
    assert _runs_and_fences(stack, tenant) == ([run_id], [])


def test_the_client_retries_an_unknown_outcome_into_the_one_run(stack: Stack, tenant: str) -> None:
    # Given a spawn whose write lands only after admission looked for it (outcome-unknown)
    stack.proxy.script(put_run=LATE)
    # When poimen.client spawns it, without a key of the caller's
    with AdmissionClient(stack.dev.url) as client:
        spawned = client.spawn(tenant, "wf/hello", {"n": 1})
    wait_for(stack.proxy.settled, what="the late writes to be forwarded")
    # Then its retry, with the key it generated, got the one run
    assert spawned.attempts == 2
    assert spawned.replayed is False
    assert _runs_and_fences(stack, tenant) == ([spawned.run_id], [])
