"""The API's history under faults is linearizable, as Porcupine checks it (tests/history): twelve clients on a
small rotating pool of keys against `poimen dev` while its DynamoDB calls fail in every way the fault proxy
knows, it is killed with SIGKILL and restarted on its table, and its connections to DynamoDB are refused
for a while. The check is not vacuous: the same clients against an admission without its condition fail it
(tests/unit/test_history_checker.py holds it to bad histories written by hand)."""

from __future__ import annotations

from pathlib import Path

from tests.history.nemesis import Plan
from tests.history.run import Options, record_and_check
from tests.integration.dynamodb_proxy import Fault

# About two minutes on two cores: the first start, one kill and restart, 2,000 operations.
BOUNDED = Options(ops=2_000, kills=1, plan=Plan(kill_every=2), deadline_seconds=600)


def test_the_api_history_under_faults_is_linearizable(tmp_path: Path) -> None:
    """Over 60 s (BOUNDED's comment: about two minutes on two cores): `poimen dev` is started, then killed and
    restarted by the nemesis's first cycle, and the clients send 2,000 operations through the fault proxy, over
    which every fault kind, a refusal and indeterminate spawns land among racing first writes (the assertions
    below); the long history, 20,000 operations, is `make soak`'s."""
    # Given poimen dev under the nemesis, when the clients have sent their operations and the table is scanned
    outcome = record_and_check(tmp_path, BOUNDED)
    print(f"\n{outcome.table()}\n{outcome.report.summary()}")  # the run's figures (pytest -rP shows them)
    report = outcome.report
    # Then every key and keyless run is a first-writer-wins register, and the table agrees with every answer
    assert report.ok, report.summary()
    # And it was a history under faults, with every fault, answers of each kind and indeterminate operations
    assert report.ops >= BOUNDED.ops
    assert outcome.kills >= 1
    assert outcome.refusals >= 1
    assert {fault.name.lower() for fault in Fault} <= set(outcome.injected)
    assert report.indeterminate > 0
    assert report.answers["spawn 503 store-unavailable"] > 0
    kinds = {"spawn 200", "spawn 201", "spawn 422 dispatch-key-reused", "get-key 404 run-not-found", "get-id 200"}
    assert kinds <= set(report.answers)
    # And the table holds a run for each 201, and no more runs than 201s and unknown outcomes
    assert report.answers["spawn 201"] <= report.scanned_runs <= report.answers["spawn 201"] + report.indeterminate


def test_the_check_fails_an_admission_without_its_condition(tmp_path: Path) -> None:
    # Given an admission whose run write lost its condition (the proxy strips it: no hook in the product)
    options = Options(ops=300, faults=False, strip_condition=True)
    # When the same clients run against it
    outcome = record_and_check(tmp_path, options)
    report = outcome.report
    # Then the table shows it (more 201s than runs: later writes overwrote first ones), and the check fails,
    # naming the keys at fault and drawing them
    assert report.answers["spawn 201"] > report.scanned_runs
    assert not report.ok
    keys = {failure.key for failure in report.failures if failure.check == "linearizable"}
    assert keys, report.summary()
    assert all(key in report.summary() for key in keys)
    assert report.visualization is not None
    assert report.visualization in report.summary()
    assert "<html" in Path(report.visualization).read_text()
