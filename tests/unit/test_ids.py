from __future__ import annotations

import hashlib
import json
import os
import uuid

import pytest

from poimen.contract import parse_json
from poimen.ids import _uuid_text, keyed_run_id, new_attempt_id, request_fingerprint, unkeyed_run_id


def test_keyed_run_id_is_a_stable_uuidv8_per_tenant_and_key() -> None:
    run_id = keyed_run_id("acme", "order-42")

    assert run_id == keyed_run_id("acme", "order-42")
    assert uuid.UUID(run_id).version == 8
    assert uuid.UUID(run_id).variant == uuid.RFC_4122
    assert run_id != keyed_run_id("acme", "order-43")
    assert run_id != keyed_run_id("acme2", "order-42")


def test_keyed_run_id_does_not_confuse_tenant_and_key_boundaries() -> None:
    assert keyed_run_id("a", "b-c") != keyed_run_id("a-b", "c")
    assert keyed_run_id("a", "#b") != keyed_run_id("a#", "b")


def test_unkeyed_run_ids_are_uuidv7_distinct_and_time_ordered() -> None:
    ids = [unkeyed_run_id() for _ in range(1000)]

    assert len(set(ids)) == 1000
    assert {uuid.UUID(run_id).version for run_id in ids} == {7}
    timestamps = [uuid.UUID(run_id).int >> 80 for run_id in ids]
    assert timestamps == sorted(timestamps)


def test_fingerprint_ignores_key_order_but_not_values() -> None:
    base = request_fingerprint("wf", {"a": 1, "b": {"c": [1, 2]}}, None)

    assert base == request_fingerprint("wf", {"b": {"c": [1, 2]}, "a": 1}, None)
    assert base != request_fingerprint("wf", {"a": 1, "b": {"c": [2, 1]}}, None)
    assert base != request_fingerprint("wf", {"a": 1, "b": {"c": [1, 2]}}, "goal")
    assert base != request_fingerprint("wf2", {"a": 1, "b": {"c": [1, 2]}}, None)


def _fingerprint(run_input: str) -> str:
    return request_fingerprint("wf", parse_json(run_input), None)


def test_fingerprint_compares_numbers_by_exact_decimal_value() -> None:
    one = _fingerprint('{"n": 1}')

    assert {_fingerprint('{"n": ' + same + "}") for same in ("1.0", "1e0", "10E-1", "0.01e2", "1.000")} == {one}
    assert request_fingerprint("wf", {"n": 1.0}, None) == one  # a float from a caller in-process
    assert _fingerprint('{"n": 0}') == _fingerprint('{"n": -0.0}') == _fingerprint('{"n": 0e9}')
    assert _fingerprint('{"n": 1e300}') == _fingerprint('{"n": 1' + "0" * 300 + "}")
    assert _fingerprint('{"n": 0.1}') == request_fingerprint("wf", {"n": 0.1}, None)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("12345678901234567.25", "12345678901234567.0"),  # one IEEE-754 double
        ("9007199254740993", "9007199254740992"),  # 2^53 + 1 and 2^53
        ("0.1", "0.1000000000000000055511151231257827"),  # the double nearest 0.1, written out
        ("1e-400", "0"),
        ("-1", "1"),
        ("1", '"1"'),
    ],
)
def test_fingerprint_tells_numerically_different_values_apart(a: str, b: str) -> None:
    assert _fingerprint('{"n": ' + a + "}") != _fingerprint('{"n": ' + b + "}")


def test_fingerprints_of_inputs_without_fractions_are_those_computed_before() -> None:
    # Runs stored before numbers were exact keep replaying on the fast path (no re-read of their input)
    run_input = {"b": [1, -2, {"c": "ü\n"}], "a": None, "t": True, "s": "#"}
    before = json.dumps(
        {"workflow_ref": "wf", "input": run_input, "goal_id": "g"},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )

    assert request_fingerprint("wf", run_input, "g") == hashlib.sha256(before.encode()).hexdigest()


def test_fingerprint_refuses_what_json_cannot_hold() -> None:
    with pytest.raises(ValueError, match="not a JSON number"):
        request_fingerprint("wf", {"n": float("inf")}, None)


def test_ids_are_written_as_the_uuid_module_writes_them() -> None:
    for raw in [bytes(16), b"\xff" * 16, *(os.urandom(16) for _ in range(200))]:
        assert _uuid_text(raw) == str(uuid.UUID(bytes=raw))
    for attempt in (new_attempt_id() for _ in range(200)):
        parsed = uuid.UUID(hex=attempt)
        assert (parsed.version, parsed.variant, parsed.hex) == (4, uuid.RFC_4122, attempt)
