from __future__ import annotations

import uuid

from poimen.ids import keyed_run_id, request_fingerprint, unkeyed_run_id


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
