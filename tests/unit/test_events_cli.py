"""`poimen events`: the backfill's window (which runs, read from the table), its times, and tail's lines."""

from __future__ import annotations

import argparse
import re
from typing import Any

import pytest

from poimen_tools.cli import build_parser, main
from poimen_tools.events import NotAnEvent, _event_line, _runs_in_window, _timestamp
from poimen_tools.local.kafka_broker import free_port
from tests.conftest import load_event

RUN = load_event("dynamodb_stream_insert.json")["Records"][0]["dynamodb"]["NewImage"]


def _run(tenant: str, run_id: str, created_at: str, **extra: dict[str, str]) -> dict[str, Any]:
    item = {**RUN, "pk": {"S": f"RUN#{tenant}#{run_id}"}, "tenant_id": {"S": tenant}, "run_id": {"S": run_id}}
    return {**item, "created_at": {"S": created_at}, **extra}


def test_the_window_is_the_tenants_admitted_runs_from_since_until_before_until(dynamodb: Any, table_name: str) -> None:
    # Given runs of two tenants at several times, a fence and a grant
    items = [
        _run("acme", "00000000-0000-0000-0000-000000000001", "2026-11-27T11:59:59.999Z"),
        _run("acme", "00000000-0000-0000-0000-000000000002", "2026-11-27T12:00:00.000Z"),
        _run("acme", "00000000-0000-0000-0000-000000000003", "2026-11-27T12:30:00.000Z"),
        _run("acme", "00000000-0000-0000-0000-000000000004", "2026-11-27T13:00:00.000Z"),
        _run("beta", "00000000-0000-0000-0000-000000000005", "2026-11-27T12:10:00.000Z"),
        {"pk": {"S": "RUN#acme#00000000-0000-0000-0000-000000000006"}, "item_type": {"S": "fence"}},
        {"pk": {"S": "GRANT#arn:aws:iam::1:role/x"}, "tenants": {"SS": ["acme"]}},
    ]
    for item in items:
        dynamodb.put_item(TableName=table_name, Item=item)
    args = argparse.Namespace(tenant="acme", table_name=table_name, region="us-east-1", dynamodb_endpoint=None)

    # When the window [12:00, 13:00) is read
    found = list(_runs_in_window(args, "2026-11-27T12:00:00.000Z", "2026-11-27T13:00:00.000Z"))

    # Then exactly its runs of the tenant: the start included, the end not, no fence, no grant
    assert sorted(item["run_id"]["S"][-1] for item in found) == ["2", "3"]
    assert all(item == next(i for i in items if i["pk"] == item["pk"]) for item in found)  # as stored


@pytest.mark.parametrize(
    ("given", "written"),
    [
        ("2026-11-27T12:00:00Z", "2026-11-27T12:00:00.000Z"),
        ("2026-11-27T13:00:00.25+01:00", "2026-11-27T12:00:00.250Z"),
        ("2026-11-27T12:00:00.123Z", "2026-11-27T12:00:00.123Z"),
    ],
)
def test_times_are_written_as_created_at_is(given: str, written: str) -> None:
    assert _timestamp(given) == written


@pytest.mark.parametrize("given", ["2026-11-27T12:00:00", "yesterday", ""])
def test_a_time_without_offset_or_not_a_time_is_a_usage_error(given: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["events", "backfill", "--tenant", "acme", "--since", given])

    assert exited.value.code == 2
    assert "--since" in capsys.readouterr().err


def test_tail_prints_time_run_key_and_workflow_one_line_each() -> None:
    headers: list[tuple[str, str | bytes | None]] = [
        ("ce_time", b"2026-11-27T12:00:00.000Z"),
        ("ce_id", b"admission-1"),
    ]

    keyed = _event_line(headers, b'{"run_id": "r-1", "dispatch_key": "k-1", "workflow_ref": "wf/a"}')
    keyless = _event_line(headers, b'{"run_id": "r-1", "dispatch_key": null, "workflow_ref": "wf/b"}')
    bare = _event_line([], b'{"run_id": "r-1", "workflow_ref": "wf/b", "created_at": "2026-11-27T11:00:00.000Z"}')

    assert keyed == "2026-11-27T12:00:00.000Z r-1 k-1 wf/a"  # the run's id, whatever ce_id names
    assert keyless == "2026-11-27T12:00:00.000Z r-1 - wf/b"
    assert bare == "2026-11-27T11:00:00.000Z r-1 - wf/b"  # no ce_time: the run's created_at


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (None, "a tombstone: no value"),
        (b"\xff\xfe", "its value is not JSON"),
        (b"{", "its value is not JSON"),
        (b"[" * 100_000, "its value is not JSON"),
        (b"[1]", "not a run: no run_id and workflow_ref"),
        (b'{"run_id": 7, "workflow_ref": "wf"}', "not a run: no run_id and workflow_ref"),
        (b'{"run_id": "r-1"}', "not a run: no run_id and workflow_ref"),
    ],
    ids=["tombstone", "not-utf8", "not-json", "too-deep", "array", "run-id-not-text", "no-workflow"],
)
def test_a_record_that_is_no_event_says_why(value: bytes | None, why: str) -> None:
    with pytest.raises(NotAnEvent, match=re.escape(why)):
        _event_line([("ce_time", None), ("ce_id", b"\xff")], value)


# --- backfill: the window as given, and what cannot be an event -------------------------------------------


def _backfill(table_name: str, *arguments: str) -> list[str]:
    return [
        "events", "backfill", "--tenant", "acme", "--table-name", table_name,
        "--bootstrap-servers", f"127.0.0.1:{free_port()}", "--timeout", "2", *arguments,
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("since", "until", "counted"),
    [
        # created_at has milliseconds: a bound between two is the next one, never the one before it
        ("2026-11-27T12:00:00.0005Z", "2026-11-27T12:00:01Z", 1),
        ("2026-11-27T12:00:00Z", "2026-11-27T12:00:00.0015Z", 2),
        ("2026-11-27T12:00:00.000000001Z", "2026-11-27T12:00:01Z", 1),
    ],
)
def test_a_window_bound_finer_than_a_millisecond_takes_the_next_millisecond_and_says_so(
    dynamodb: Any, table_name: str, since: str, until: str, counted: int, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given runs created at 12:00:00.000 and .001
    for run_id, created_at in (("1", "2026-11-27T12:00:00.000Z"), ("2", "2026-11-27T12:00:00.001Z")):
        dynamodb.put_item(
            TableName=table_name, Item=_run("acme", f"00000000-0000-0000-0000-00000000000{run_id}", created_at)
        )
    # When a window whose bound falls between milliseconds is counted
    assert main(_backfill(table_name, "--since", since, "--until", until, "--dry-run")) == 0
    # Then only what the window holds is counted, and the bound as used is said
    out, err = capsys.readouterr()
    assert f"{counted} run(s) of tenant acme" in out
    assert "millisecond" in err


@pytest.mark.parametrize("until", ["2026-11-27T11:59:59Z", "2026-11-27T12:00:00Z"])
def test_an_empty_or_reversed_window_is_refused_in_one_line(
    dynamodb: Any, table_name: str, until: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(_backfill(table_name, "--since", "2026-11-27T12:00:00Z", "--until", until, "--dry-run"))

    assert status == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("poimen events backfill: --since 2026-11-27T12:00:00.000Z is not before --until ")


def test_a_malformed_run_item_is_reported_as_what_it_is_not_as_the_broker(
    dynamodb: Any, table_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a run item of the window that lacks what an event needs (its input)
    item = _run("acme", "00000000-0000-0000-0000-000000000001", "2026-11-27T12:00:00.000Z")
    del item["input"]
    dynamodb.put_item(TableName=table_name, Item=item)
    # When the window is backfilled (no broker listens: nothing can be sent)
    status = main(_backfill(table_name, "--since", "2026-11-27T12:00:00Z", "--until", "2026-11-27T13:00:00Z"))
    # Then the item is named as malformed, and the command exits 1 (refused), not 3 (the broker unavailable)
    err = capsys.readouterr().err
    assert status == 1, err
    assert "RUN#acme#00000000-0000-0000-0000-000000000001" in err
    assert "lacks string attributes ['input']" in err
    assert "did not acknowledge" not in err
