"""The relay never turns an unknown outcome into a second run: the API's outcome-unknown 503 is retried for
a keyed record (it can only admit that run) and dead-lettered, naming the run, for a keyless one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from poimen.ids import keyed_run_id
from poimen.store import Store
from poimen_tools.local.template import Template
from tests.unit.dynamodb_faults import (
    Fault,
    committed_then_timed_out,
    connect_refused,
    runs_and_fences,
    script_attempts,
)
from tests.unit.relay_harness import RelayHarness

SPAWN = {"workflow_ref": "wf/hello", "input": {"greeting": "hi"}}
# The write commits with its answers late, and the store cannot be asked after: outcome-unknown.
UNRESOLVABLE: dict[str, list[Fault]] = {
    "put_run": [committed_then_timed_out, committed_then_timed_out],
    "put_fence": [connect_refused],
    "get_run": [connect_refused],
}


@pytest.fixture
def harness(template: Template, handler: Callable[[dict[str, Any], Any], dict[str, Any]], store: Store) -> RelayHarness:
    return RelayHarness.start(template, handler, store)


def test_a_keyless_record_of_unknown_outcome_is_dead_lettered_naming_its_run_and_not_sent_again(
    harness: RelayHarness, dynamodb: Any, table_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a keyless record whose admission commits but cannot be told
    script_attempts(monkeypatch, **UNRESOLVABLE)
    # When the relay relays it
    outcome = harness.run([harness.record(SPAWN, 0)])
    # Then it was POSTed once, and dead-lettered as outcome-unknown naming the one run stored
    runs, _ = runs_and_fences(dynamodb, table_name, harness.tenant)
    ((_, letter),) = harness.dead_letters()
    assert len(harness.api.received) == 1
    assert [run["run_id"]["S"] for run in runs] == [letter["reason"]["problem"]["run_id"]]
    run_id = runs[0]["run_id"]["S"]
    assert letter["reason"]["kind"] == "outcome-unknown"
    assert letter["reason"]["status"] == 503
    assert f"/v1/runs/{run_id}" in letter["reason"]["detail"]
    assert (outcome.relayed, outcome.dead_lettered, outcome.keyless) == (0, 1, 1)  # counted keyless once sent


def test_a_keyed_record_of_unknown_outcome_is_retried_into_its_one_run(
    harness: RelayHarness, dynamodb: Any, table_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a keyed record whose first admission commits but cannot be told
    script_attempts(monkeypatch, **UNRESOLVABLE)
    # When the relay relays it
    outcome = harness.run([harness.record({**SPAWN, "dispatch_key": "k-1"}, 0)])
    # Then it retried, the retry replayed the run, and nothing was dead-lettered
    runs, _ = runs_and_fences(dynamodb, table_name, harness.tenant)
    assert [run["run_id"]["S"] for run in runs] == [keyed_run_id(harness.tenant, "k-1")]
    assert len(harness.api.received) == 2
    assert (outcome.replayed, outcome.retries, outcome.dead_lettered) == (1, 1, 0)
    assert harness.dead_letters() == []
