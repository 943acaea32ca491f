"""The history checker is not vacuous: it fails the bad histories the API must never produce, names their
keys and draws them, and passes the good ones, indeterminate operations included (tests/history)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.history.check import Report, check
from tests.history.history import History, Op

TENANT = "acme"
KEY = "k-1"
X = "3d7b1368-cb64-8e4b-b3d9-a9f4d69125b4"
Y = "160c3a4d-a623-8818-aea1-9ed86cada948"
CREATED = "2026-12-01T12:00:00.482Z"
REQUEST = {"workflow_ref": "wf/history", "input": {"a": 1, "b": [1, 2]}, "goal_id": None}
# The same request, its input's keys in another order; and another request for the same key.
REORDERED = {"workflow_ref": "wf/history", "input": {"b": [1, 2], "a": 1}}
OTHER = {"workflow_ref": "wf/history", "input": {"a": 2}, "goal_id": None}


def run(
    run_id: str = X, key: str | None = KEY, request: dict[str, Any] = REQUEST, created_at: str = CREATED
) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "tenant_id": TENANT,
        "workflow_ref": request["workflow_ref"],
        "input": request["input"],
        "goal_id": request.get("goal_id"),
        "dispatch_key": key,
        "status": "admitted",
        "created_at": created_at,
    }


class Builder:
    """A history written by hand: operations at given times (arbitrary units), then the final scan."""

    def __init__(self) -> None:
        self.history = History({"about": "synthetic"})
        self.stored: list[dict[str, Any]] = []

    def op(self, f: str, call: int, returned: int | None, client: int = 0, **fields: Any) -> Op:
        op = Op(id=len(self.history.ops), client=client, f=f, tenant=TENANT, call=call, **fields)
        op.return_ = returned
        self.history.ops.append(op)
        return op

    def spawn(
        self,
        call: int,
        returned: int | None,
        status: int | None,
        *,
        key: str | None = KEY,
        request: dict[str, Any] = REQUEST,
        answer: dict[str, Any] | None = None,
        problem: str | None = None,
        named: str | None = None,
        client: int = 0,
        marker: str | None = None,
    ) -> Op:
        return self.op(
            "spawn",
            call,
            returned,
            client,
            key=key,
            via="body" if key else None,
            marker=marker,
            request=request,
            status=status,
            run=answer,
            problem=problem,
            named=named,
            replayed=status == 200,
        )

    def get(self, call: int, returned: int, status: int, answer: dict[str, Any] | None = None, client: int = 0) -> Op:
        problem = "run-not-found" if status == 404 else None
        return self.op("get-key", call, returned, client, key=KEY, status=status, run=answer, problem=problem)

    def check(self, folder: Path, scan_at: int = 1000) -> Report:
        path = folder / "history.jsonl"
        self.history.write(path, scan_at, self.stored, fences=0)
        return check(path)


def keyless(marker: str) -> dict[str, Any]:
    return {"workflow_ref": "wf/history", "input": {"marker": marker}, "goal_id": None}


def test_a_history_of_racing_first_writes_and_unknown_outcomes_holds(tmp_path: Path) -> None:
    # Given two concurrent first writes of one key (201 and a 200 replay of its reordered twin), another
    # request for it (422), a GET agreeing, a keyed spawn never answered whose key is another's run, a
    # keyless 201, a keyless outcome-unknown whose run landed, and a keyless store-unavailable
    history = Builder()
    history.spawn(10, 20, 201, answer=run(), client=0)
    history.spawn(11, 21, 200, request=REORDERED, answer=run(), client=1)
    history.spawn(22, 30, 422, request=OTHER, problem="dispatch-key-reused", named=X, client=2)
    history.get(31, 35, 200, run(), client=3)
    history.spawn(40, None, None, key="k-2", client=4)
    history.spawn(41, 45, 201, key=None, request=keyless("m-1"), answer=run(Y, None, keyless("m-1")), marker="m-1")
    z = "01900000-0000-7000-8000-000000000001"
    history.spawn(46, 50, 503, key=None, request=keyless("m-2"), problem="outcome-unknown", named=z, marker="m-2")
    history.spawn(51, 52, 503, key=None, request=keyless("m-3"), problem="store-unavailable", marker="m-3")
    history.stored = [run(), run(Y, None, keyless("m-1")), run(z, None, keyless("m-2"))]
    history.stored.append(run("7a1e2b0c-0000-8000-8000-000000000000", "k-2", created_at="2026-12-01T12:00:01.000Z"))
    # When it is checked
    report = history.check(tmp_path)
    # Then it holds, and the report counts what it checked
    assert report.ok, report.summary()
    assert (report.ops, report.indeterminate, report.keys, report.keyless_runs) == (8, 2, 2, 2)
    assert report.answers["spawn 201"] == 2
    assert report.visualization is None


Bad = Callable[[Builder], None]


def two_run_ids_for_one_key(history: Builder) -> None:
    history.spawn(10, 20, 201, answer=run(X))
    history.spawn(30, 40, 200, answer=run(Y))
    history.stored = [run(X)]


def a_201_after_a_200(history: Builder) -> None:
    history.spawn(10, 20, 201, answer=run())
    history.spawn(30, 40, 200, answer=run())
    history.spawn(50, 60, 201, answer=run())
    history.stored = [run()]


def a_store_unavailable_whose_write_shows_up_later(history: Builder) -> None:
    history.spawn(10, 20, 503, problem="store-unavailable")
    history.get(30, 40, 404)
    history.stored = [run()]


def a_keyless_store_unavailable_whose_run_shows_up_later(history: Builder) -> None:
    history.spawn(10, 20, 503, key=None, request=keyless("m-1"), problem="store-unavailable", marker="m-1")
    history.stored = [run(X, None, keyless("m-1"))]


def a_keyless_request_leaving_two_runs(history: Builder) -> None:
    history.spawn(10, 20, 201, key=None, request=keyless("m-1"), answer=run(X, None, keyless("m-1")), marker="m-1")
    history.stored = [run(X, None, keyless("m-1")), run(Y, None, keyless("m-1"))]


def a_keyless_outcome_unknown_naming_a_run_never_written_while_another_appears(history: Builder) -> None:
    # The answer told its caller to GET X: a 404 there means "not written", and the caller sends again. The
    # table's run Y of the marker is then a second run of one spawn.
    m1 = keyless("m-1")
    history.spawn(10, 20, 503, key=None, request=m1, problem="outcome-unknown", named=X, marker="m-1")
    history.stored = [run(Y, None, m1)]


def a_keyless_run_of_no_answer_unlike_its_request(history: Builder) -> None:
    # A spawn never answered may have written one run of its marker: its request's, not another workflow's
    m1 = keyless("m-1")
    history.spawn(10, None, None, key=None, request=m1, marker="m-1")
    history.stored = [run(Y, None, {**m1, "workflow_ref": "wf/other"})]


def a_keyless_run_of_no_answer_in_another_tenant(history: Builder) -> None:
    m1 = keyless("m-1")
    history.spawn(10, None, None, key=None, request=m1, marker="m-1")
    history.stored = [{**run(Y, None, m1), "tenant_id": "globex"}]


def a_keyless_run_stored_not_admitted(history: Builder) -> None:
    m1 = keyless("m-1")
    history.spawn(10, 20, 201, key=None, request=m1, answer=run(X, None, m1), marker="m-1")
    history.stored = [{**run(X, None, m1), "status": "cancelled"}]


def a_keyless_201s_run_stored_in_another_tenant(history: Builder) -> None:
    m1 = keyless("m-1")
    history.spawn(10, 20, 201, key=None, request=m1, answer=run(X, None, m1), marker="m-1")
    history.stored = [{**run(X, None, m1), "tenant_id": "globex"}]


def a_keyed_run_stored_not_admitted(history: Builder) -> None:
    history.spawn(10, 20, 201, answer=run())
    history.stored = [{**run(), "status": "cancelled"}]


def two_keyless_201s_of_one_run(history: Builder) -> None:
    history.spawn(10, 20, 201, key=None, request=keyless("m-1"), answer=run(X, None, keyless("m-1")), marker="m-1")
    history.spawn(30, 40, 201, key=None, request=keyless("m-2"), answer=run(X, None, keyless("m-2")), marker="m-2")
    history.stored = [run(X, None, keyless("m-1"))]


def a_replay_with_another_created_at(history: Builder) -> None:
    history.spawn(10, 20, 201, answer=run())
    history.spawn(30, 40, 200, answer=run(created_at="2026-12-01T12:00:09.000Z"))
    history.stored = [run()]


def a_422_naming_another_run(history: Builder) -> None:
    history.spawn(10, 20, 201, answer=run(X))
    history.spawn(30, 40, 422, request=OTHER, problem="dispatch-key-reused", named=Y)
    history.stored = [run(X)]


def a_replay_of_another_request(history: Builder) -> None:
    history.spawn(10, 20, 201, answer=run(X))
    history.spawn(30, 40, 200, request=OTHER, answer=run(X, request=OTHER))
    history.stored = [run(X)]


def a_get_missing_an_admitted_run(history: Builder) -> None:
    history.spawn(10, 20, 201, answer=run())
    history.get(30, 40, 404)
    history.stored = [run()]


def two_runs_for_one_key_in_the_table(history: Builder) -> None:
    history.spawn(10, 20, 201, answer=run(X))
    history.stored = [run(X), run(Y)]


def an_answered_run_missing_from_the_table(history: Builder) -> None:
    history.spawn(10, 20, 201, answer=run())


@pytest.mark.parametrize(
    ("bad", "check_name", "key"),
    [
        (two_run_ids_for_one_key, "linearizable", f"{TENANT}/{KEY}"),
        (a_201_after_a_200, "linearizable", f"{TENANT}/{KEY}"),
        (a_store_unavailable_whose_write_shows_up_later, "linearizable", f"{TENANT}/{KEY}"),
        (a_keyless_store_unavailable_whose_run_shows_up_later, "keyless-runs", "marker:m-1"),
        (a_keyless_request_leaving_two_runs, "keyless-runs", "marker:m-1"),
        (a_keyless_outcome_unknown_naming_a_run_never_written_while_another_appears, "keyless-runs", "marker:m-1"),
        (a_keyless_run_of_no_answer_unlike_its_request, "keyless-runs", "marker:m-1"),
        (a_keyless_run_of_no_answer_in_another_tenant, "keyless-runs", "marker:m-1"),
        (a_keyless_run_stored_not_admitted, "stored-run", f"run:{TENANT}/{X}"),
        (a_keyless_201s_run_stored_in_another_tenant, "linearizable", f"run:{TENANT}/{X}"),
        (a_keyed_run_stored_not_admitted, "stored-run", f"{TENANT}/{KEY}"),
        (two_keyless_201s_of_one_run, "linearizable", f"run:{TENANT}/{X}"),
        (a_replay_with_another_created_at, "linearizable", f"{TENANT}/{KEY}"),
        (a_422_naming_another_run, "linearizable", f"{TENANT}/{KEY}"),
        (a_replay_of_another_request, "linearizable", f"{TENANT}/{KEY}"),
        (a_get_missing_an_admitted_run, "linearizable", f"{TENANT}/{KEY}"),
        (two_runs_for_one_key_in_the_table, "one-run-per-key", f"{TENANT}/{KEY}"),
        (an_answered_run_missing_from_the_table, "answered-run-exists", f"{TENANT}/{KEY}"),
    ],
    ids=lambda value: value.__name__.replace("_", "-") if callable(value) else None,
)
def test_a_bad_history_fails_naming_its_key_and_is_drawn(tmp_path: Path, bad: Bad, check_name: str, key: str) -> None:
    # Given a history the API must never produce
    history = Builder()
    bad(history)
    # When it is checked
    report = history.check(tmp_path)
    # Then it fails that check on that key, and the visualization of the keys at fault is written
    assert not report.ok
    assert (check_name, key) in {(failure.check, failure.key) for failure in report.failures}, report.summary()
    assert key in report.summary()
    if key.startswith(("marker:",)):
        return  # a marker is no register: there is nothing to draw
    assert report.visualization == str(tmp_path / "history.html")
    assert "<html" in Path(report.visualization).read_text()


def test_an_unknown_outcome_explains_a_write_a_store_unavailable_did_not_make(tmp_path: Path) -> None:
    # Given the store-unavailable spawn of the bad history above, and a concurrent twin never answered
    history = Builder()
    a_store_unavailable_whose_write_shows_up_later(history)
    history.spawn(5, None, None, client=1)
    # When it is checked, then the twin's write explains the run
    report = history.check(tmp_path)
    assert report.ok, report.summary()


def test_a_keyless_unknown_outcome_naming_no_run_explains_any_one_run_of_its_marker(tmp_path: Path) -> None:
    # Given a keyless spawn never answered, one whose answer was not the function's (a 502 of the API in front),
    # and one outcome-unknown naming X, each of its own marker
    history = Builder()
    history.spawn(10, None, None, key=None, request=keyless("m-1"), marker="m-1")
    history.spawn(11, 20, 502, key=None, request=keyless("m-2"), marker="m-2", client=1)
    history.spawn(12, 20, 503, key=None, request=keyless("m-3"), problem="outcome-unknown", named=X, marker="m-3")
    # When the first two landed (runs no answer named) and X never did
    history.stored = [run(Y, None, keyless("m-1")), run("7a1e2b0c-0000-7000-8000-000000000000", None, keyless("m-2"))]
    report = history.check(tmp_path)
    # Then it holds: each run is its spawn's one write, and X's spawn wrote nothing
    assert report.ok, report.summary()
    assert report.indeterminate == 3


def test_an_unreadable_history_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "history.jsonl"
    path.write_text('{"type": "op", "id": 0}\n')
    with pytest.raises(RuntimeError, match="could not read"):
        check(path)
