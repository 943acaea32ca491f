"""JSON as the API reads and writes it: strict, every number exact, nesting bounded."""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

import pytest

from poimen.contract import JSONNumber, JSONTooDeep, Run, json_text, parse_json, run_json
from poimen.wire import MAX_JSON_DEPTH


def test_numbers_are_read_exactly_and_written_as_sent() -> None:
    text = '{"a": 12345678901234567.25, "b": 9007199254740993, "c": [1e15, 1E-7, -0.0, 1.10], "d": 1e-400}'

    value = parse_json(text)

    assert value["a"] == Decimal("12345678901234567.25")
    assert value["b"] == 2**53 + 1
    assert isinstance(value["c"][0], JSONNumber)
    assert value["d"] > 0
    assert json_text(value) == text.replace(", ", ",").replace(": ", ":")


def test_json_text_keeps_key_order_and_writes_characters_out() -> None:
    value = parse_json('{"z": "\\u4e2d\\n\\"", "a": [true, false, null, {}], "\\u00e9": -7}')

    assert json_text(value) == '{"z":"中\\n\\"","a":[true,false,null,{}],"é":-7}'


def test_floats_of_callers_in_process_are_written_as_json_writes_them() -> None:
    assert json_text({"x": 1.5, "y": 1e16, "z": 0.1}) == '{"x":1.5,"y":1e+16,"z":0.1}'
    with pytest.raises(ValueError, match="Out of range"):
        json_text({"x": float("nan")})


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('{"n": NaN}', "NaN is not JSON"),
        ('{"n": -Infinity}', "Infinity is not JSON"),
        ('{"n": 1e400}', "overflows a double"),
        ('{"n": 1e-99999999999999999999}', "out of range"),
        ('{"n": ' + "9" * 5000 + "}", "4300 digits"),
    ],
    ids=["nan", "infinity", "overflow", "beyond-decimal", "huge-int"],
)
def test_numbers_out_of_range_are_refused(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        parse_json(text)


def test_a_lone_surrogate_is_refused_and_a_pair_is_read() -> None:
    assert parse_json('{"s": "\\ud83d\\udd11"}') == {"s": "🔑"}
    with pytest.raises(UnicodeEncodeError):
        parse_json('{"s": "\\ud800"}')


def test_nesting_is_bounded_the_outermost_value_counting() -> None:
    deepest = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH

    assert parse_json(deepest) is not None
    with pytest.raises(JSONTooDeep):
        parse_json("[" + deepest + "]")
    with pytest.raises(RecursionError):  # too deep for the parser itself: the API answers it alike
        parse_json("[" * 100_000 + "]" * 100_000)


def test_a_run_is_answered_as_the_contract_describes_it_with_input_verbatim() -> None:
    fields: dict[str, Any] = {
        "run_id": "r",
        "tenant_id": "t",
        "workflow_ref": "wf/ü",
        "goal_id": None,
        "dispatch_key": "k",
        "created_at": "2026-11-29T12:00:00.000Z",
    }

    text = run_json(input_json='{"n":1.10}', **fields)

    assert Run.model_validate_json(text) == Run(input={"n": 1.1}, status="admitted", **fields)
    assert list(json.loads(text)) == list(Run.model_fields)
    assert '"input":{"n":1.10}' in text


@pytest.mark.parametrize("text", ["wf/ü", 'a " and \\', "tab\t newline\n \x00 \u2028", "lone \ud800", ""])
@pytest.mark.parametrize("keyed", [True, False])
def test_a_runs_json_is_the_text_json_dumps_writes_for_it(text: str, keyed: bool) -> None:
    # The answer is written string by string, as json.dumps(ensure_ascii=False) writes each string.
    fields: dict[str, Any] = {
        "run_id": f"r{text}",
        "tenant_id": f"t{text}",
        "workflow_ref": text,
        "goal_id": f"g{text}" if keyed else None,
        "dispatch_key": f"k{text}" if keyed else None,
        "created_at": f"c{text}",
    }
    run = {**fields, "input": {"n": 1}, "status": "admitted"}
    dumped = json.dumps({key: run[key] for key in Run.model_fields}, ensure_ascii=False, separators=(",", ":"))

    assert run_json(input_json='{"n":1}', **fields) == dumped
