"""The relay on the batch form of POST /v1/runs: one call a partition's chunk, and each record ends as the
per-record path ends it (admitted, or dead-lettered with the same reason), every call POST /v1/runs."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest
import urllib3

from poimen.admission import Admission
from poimen.config import ON_DEMAND_POLLERS
from poimen.ids import keyed_run_id
from poimen.relay import AdmissionApiRefused, AdmissionApiUnavailable
from poimen.store import Store
from poimen.wire import MAX_BATCH_BODY_BYTES, MAX_JSON_DEPTH, SPAWNS_MEDIA_TYPE
from poimen_tools.local.msk import KafkaRecord
from poimen_tools.local.template import Template
from tests.conftest import count_runs
from tests.unit.dynamodb_faults import only_for, runs_and_fences, script_attempts, throttled
from tests.unit.relay_harness import RelayHarness

SPAWN = {"workflow_ref": "wf/hello", "input": {"greeting": "hi"}}


@pytest.fixture
def harness(template: Template, handler: Callable[[dict[str, Any], Any], dict[str, Any]], store: Store) -> RelayHarness:
    return RelayHarness.start(template, handler, store)


def _mixed(harness: RelayHarness, prefix: str) -> list[KafkaRecord]:
    """Records of every fate: admitted, replayed, 422, 400, invalid JSON, keyless, nested too deep for a batch."""
    deep: Any = {}
    for _ in range(MAX_JSON_DEPTH):
        deep = {"d": deep}
    values: list[Any] = [
        {**SPAWN, "dispatch_key": f"{prefix}-1"},
        {**SPAWN, "dispatch_key": f"{prefix}-1"},  # replayed
        {**SPAWN, "workflow_ref": "wf/other", "dispatch_key": f"{prefix}-1"},  # 422
        {**SPAWN, "dispatch_key": f"{prefix}-2", "priority": 1},  # 400
        b"{not json",  # dead-lettered before any call
        SPAWN,  # keyless
        {**SPAWN, "dispatch_key": f"{prefix}-3"},
    ]
    return [harness.record(value, offset) for offset, value in enumerate(values)]


def _fates(harness: RelayHarness) -> list[tuple[int, str, int | None, str | None]]:
    """Each dead letter's offset, reason, status and problem type, by offset."""
    letters = [letter for _, letter in harness.dead_letters()]
    return sorted(
        (
            letter["record"]["offset"],
            letter["reason"]["kind"],
            letter["reason"].get("status"),
            (letter["reason"].get("problem") or {}).get("type"),
        )
        for letter in letters
    )


def test_a_partition_is_one_call_and_each_record_ends_as_the_per_record_path_ends_it(
    harness: RelayHarness, dynamodb: Any, table_name: str
) -> None:
    # Given the same records relayed one call a record, then (other keys) one call a partition
    single = harness.with_settings(batch_spawns=1)
    single_outcome = single.run(_mixed(single, "one"))
    single_fates, single_calls = _fates(single), len(harness.api.received)
    batched_outcome = harness.run(_mixed(harness, "all"))
    # Then the batch path made one call for the six spawns, and every record met the same fate
    assert single_calls == 6
    assert len(harness.api.received) == single_calls + 1
    assert harness.api.received[-1]["content-type"] == SPAWNS_MEDIA_TYPE
    assert _fates(harness) == single_fates
    assert [kind for _, kind, _, _ in single_fates] == ["rejected", "rejected", "invalid-json"]
    for outcome in (single_outcome, batched_outcome):
        assert (outcome.relayed, outcome.replayed, outcome.dead_lettered, outcome.keyless) == (3, 1, 3, 1)
    assert len(count_runs(dynamodb, table_name, harness.tenant)) == 6


def test_a_spawn_the_envelope_cannot_carry_is_sent_alone_and_the_others_still_in_the_batch_answer(
    harness: RelayHarness, dynamodb: Any, table_name: str
) -> None:
    # Given a spawn nested deeper than a body may be, beside two good ones
    deep: Any = {}
    for _ in range(MAX_JSON_DEPTH):
        deep = {"d": deep}
    records = [
        harness.record({**SPAWN, "dispatch_key": "ok-1"}, 0),
        harness.record({**SPAWN, "input": deep, "dispatch_key": "deep"}, 1),
        harness.record({**SPAWN, "dispatch_key": "ok-2"}, 2),
    ]
    # When they are relayed
    outcome = harness.run(records)
    # Then the batch was refused whole, each spawn was sent alone, and only the deep one is dead-lettered
    assert [headers["content-type"] for headers in harness.api.received] == [SPAWNS_MEDIA_TYPE] + [
        "application/json"
    ] * 3
    assert _fates(harness) == [(1, "rejected", 400, "urn:poimen:problem:malformed-json")]
    assert (outcome.relayed, outcome.dead_lettered) == (2, 1)
    assert len(count_runs(dynamodb, table_name, harness.tenant)) == 2


def test_records_are_sent_in_chunks_of_the_count_and_byte_limits_in_offset_order(
    harness: RelayHarness, dynamodb: Any, table_name: str
) -> None:
    # Given 7 records of 300 KB-ish each would not fit one 1 MiB batch, nor 5 small ones a batch of 2
    big = [harness.record({**SPAWN, "input": {"s": "x" * 250_000}, "dispatch_key": f"b-{n}"}, n) for n in range(7)]
    outcome = harness.run(big)
    sizes = [len(json.loads(body)["spawns"]) for body in harness.api.bodies]
    assert sizes == [4, 3]
    assert all(len(body) <= MAX_BATCH_BODY_BYTES for body in harness.api.bodies)
    small = harness.with_settings(batch_spawns=2)
    small.run([small.record({**SPAWN, "dispatch_key": f"s-{n}"}, 10 + n) for n in range(5)])
    sizes = [len(json.loads(body)["spawns"]) for body in harness.api.bodies[2:]]
    assert sizes == [2, 2, 1]
    keys = [spawn["dispatch_key"] for body in harness.api.bodies for spawn in json.loads(body)["spawns"]]
    assert keys == [f"b-{n}" for n in range(7)] + [f"s-{n}" for n in range(5)]
    assert outcome.relayed == 7
    assert len(count_runs(dynamodb, table_name, harness.tenant)) == 12


def test_a_throttled_spawn_of_a_batch_is_sent_again_into_its_one_run(
    harness: RelayHarness, dynamodb: Any, table_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a store that throttles the first spawn's write past its retries (store-unavailable, nothing written)
    script_attempts(monkeypatch, put_run=only_for('"t-1"', [throttled, throttled]))
    # When two keyed records and a keyless one are relayed
    records = [harness.record({**SPAWN, "dispatch_key": "t-1"}, 0), harness.record(SPAWN, 1)]
    records.append(harness.record({**SPAWN, "dispatch_key": "t-2"}, 2))
    outcome = harness.run(records)
    # Then the throttled one was in a second call, alone, and each record is one run; nothing dead-lettered
    assert [len(json.loads(body)["spawns"]) for body in harness.api.bodies] == [3, 1]
    runs, _ = runs_and_fences(dynamodb, table_name, harness.tenant)
    assert keyed_run_id(harness.tenant, "t-1") in {run["run_id"]["S"] for run in runs}
    assert len(runs) == 3
    assert (outcome.relayed, outcome.retries, outcome.dead_lettered) == (3, 1, 0)


def test_every_relayed_record_reaches_admission_through_post_v1_runs(
    harness: RelayHarness, dynamodb: Any, table_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given the API instrumented: each route key the relay's requests reach, each spawn they carry, and each
    # admission the handler makes, with the route of the request it serves
    admitted: list[tuple[str, str | None]] = []
    admit_run = Admission.admit_run

    def instrumented(self: Admission, principal: str | None, tenant_id: str, request: Any, **kwargs: Any) -> Any:
        admitted.append((harness.api.routes[-1], request.dispatch_key))
        return admit_run(self, principal, tenant_id, request, **kwargs)

    monkeypatch.setattr(Admission, "admit_run", instrumented)
    records = [harness.record({**SPAWN, "dispatch_key": f"r-{n}"}, n, partition=n % 3) for n in range(30)]
    # When a batch of three partitions is relayed
    outcome = harness.run(records)
    # Then every call was POST /v1/runs, one a partition, and they carried every record's spawn, once
    assert harness.api.routes == ["POST /v1/runs"] * 3
    carried = sorted(spawn["dispatch_key"] for body in harness.api.bodies for spawn in json.loads(body)["spawns"])
    assert carried == sorted(f"r-{n}" for n in range(30))
    assert outcome.relayed == 30
    # And each record was admitted once, by the admission rule, serving POST /v1/runs
    assert sorted(admitted) == sorted(("POST /v1/runs", f"r-{n}") for n in range(30))
    assert len(count_runs(dynamodb, table_name, harness.tenant)) == 30


@pytest.mark.parametrize("batch_spawns", [1, 100])
def test_a_key_whose_first_record_is_throttled_is_that_records_run_and_the_later_one_its_422(
    harness: RelayHarness, dynamodb: Any, table_name: str, monkeypatch: pytest.MonkeyPatch, batch_spawns: int
) -> None:
    # Given a store that throttles the first write past its retries (store-unavailable, nothing written)
    script_attempts(monkeypatch, put_run=[throttled, throttled])
    relay = harness.with_settings(batch_spawns=batch_spawns)
    # When two records of one key are relayed, the second under the same dispatch_key with another workflow
    first, second = {**SPAWN, "dispatch_key": "o-1"}, {**SPAWN, "workflow_ref": "wf/later", "dispatch_key": "o-1"}
    outcome = relay.run([relay.record(first, 0, key=b"k"), relay.record(second, 1, key=b"k")])
    # Then, on either path, the first record is the key's run and the second its 422, in offset order
    (run,) = count_runs(dynamodb, table_name, relay.tenant)
    assert run["workflow_ref"]["S"] == SPAWN["workflow_ref"]
    assert _fates(relay) == [(1, "rejected", 422, "urn:poimen:problem:dispatch-key-reused")]
    assert (outcome.relayed, outcome.dead_lettered) == (1, 1)


@pytest.mark.parametrize("batch_spawns", [1, 100])
def test_a_value_over_the_body_limit_though_small_compacted_is_rejected_on_either_path(
    harness: RelayHarness, dynamodb: Any, table_name: str, batch_spawns: int
) -> None:
    # Given a value of 300 KB, mostly whitespace and escapes (its compact JSON, a batch's measure, is 20 KB)
    padded = json.dumps({**SPAWN, "input": {"s": "\u00e9" * 10_000}, "dispatch_key": "pad"}, ensure_ascii=True)
    value = (padded[:-1] + " " * (300_000 - len(padded)) + "}").encode()
    relay = harness.with_settings(batch_spawns=batch_spawns)
    # When it is relayed beside a good record
    outcome = relay.run([relay.record(value, 0), relay.record({**SPAWN, "dispatch_key": "fine"}, 1)])
    # Then it is rejected as the single route answers a body over 256 KiB (413), whatever the path
    assert _fates(relay) == [(0, "rejected", 413, "urn:poimen:problem:payload-too-large")]
    assert (outcome.relayed, outcome.dead_lettered) == (1, 1)
    assert [item["dispatch_key"]["S"] for item in count_runs(dynamodb, table_name, relay.tenant)] == ["fine"]


class _BatchAnsweredWith:
    """An API (a proxy, another version) answering every batch 200 spawn-results with this body."""

    def __init__(self, body: bytes) -> None:
        self._body = body

    def request(self, *_: Any, **__: Any) -> Any:
        headers = {"Content-Type": "application/vnd.poimen.spawn-results+json"}
        return urllib3.HTTPResponse(body=self._body, status=200, headers=headers, preload_content=True)


@pytest.mark.parametrize(
    "body",
    [
        b'{"results": [null]}',
        b'{"results": [["status", 201]]}',
        b'{"results": [{"run": {"run_id": "r"}}]}',
        b'{"results": [{"status": 503, "retry_after": "soon", "problem": {}}]}',
    ],
    ids=["null", "a-list", "no-status", "retry-after-no-number"],
)
def test_results_that_are_not_results_fail_the_batch_as_a_refusal_of_the_relay_which_on_demand_gives_up(
    harness: RelayHarness, body: bytes
) -> None:
    # Given an API answering the batch with results of the right count that are not results
    record = harness.record({**SPAWN, "dispatch_key": "odd-1"}, 0, timestamp_ms=int(time.time() * 1000) - 7_200_000)
    provisioned = harness.with_settings()
    provisioned.relay._http = _BatchAnsweredWith(body)  # type: ignore[assignment]
    # When it is relayed under provisioned pollers, the batch fails as for any answer blaming the relay, to be retried
    with pytest.raises(AdmissionApiRefused):
        provisioned.run([record], seconds=10)
    # And under on-demand pollers, 2 h past a 1 h age limit, the batch is given up: the record is dead-lettered
    on_demand = harness.with_settings(event_pollers=ON_DEMAND_POLLERS, max_record_age_seconds=3600)
    on_demand.relay._http = _BatchAnsweredWith(body)  # type: ignore[assignment]
    on_demand.run([record], seconds=10)
    assert [letter["reason"]["kind"] for _, letter in on_demand.dead_letters()] == ["retries-exhausted"]


@pytest.mark.parametrize("batch_spawns", [1, 100])
def test_a_later_record_of_a_kafka_key_is_not_admitted_while_an_earlier_one_fails(
    harness: RelayHarness, dynamodb: Any, table_name: str, monkeypatch: pytest.MonkeyPatch, batch_spawns: int
) -> None:
    # Given a store that throttles every write of the first record's dispatch_key (store-unavailable, nothing
    # written), and records of another Kafka key beside them
    script_attempts(monkeypatch, put_run=only_for('"ko-first"', [throttled] * 1000))
    relay = harness.with_settings(batch_spawns=batch_spawns)
    records = [
        relay.record({**SPAWN, "dispatch_key": "ko-first"}, 0, key=b"k"),
        relay.record({**SPAWN, "dispatch_key": "ko-other"}, 1, key=b"other"),
        relay.record({**SPAWN, "dispatch_key": "ko-second"}, 2, key=b"k"),
    ]
    # When two records of one Kafka key, under different dispatch_keys, are relayed and the first cannot be written
    with pytest.raises(AdmissionApiUnavailable):
        relay.run(records, seconds=4)
    # Then, on either path, the later record of that key was not admitted ahead of it: the batch fails (to be
    # retried whole) with neither of the key's records a run; the other key's record is
    keys = {item["dispatch_key"]["S"] for item in count_runs(dynamodb, table_name, relay.tenant)}
    assert "ko-second" not in keys
    assert keys <= {"ko-other"}


def test_the_records_of_a_kafka_key_share_an_ordering_key_in_the_batch_and_no_other_record_has_one(
    harness: RelayHarness, dynamodb: Any, table_name: str
) -> None:
    # Given a partition of records of keys a, b, a, a keyless one, and c
    keys = [b"a", b"b", b"a", None, b"c"]
    records = [harness.record({**SPAWN, "dispatch_key": f"ok-{n}"}, n, key=key) for n, key in enumerate(keys)]
    # When it is relayed, and then a partition whose every key is its own
    harness.run(records)
    harness.run([harness.record({**SPAWN, "dispatch_key": f"own-{n}"}, n, key=f"{n}".encode()) for n in range(3)])
    # Then the first call gave key a's two records one ordering key and the others none; the second had none
    first, second = (json.loads(body) for body in harness.api.bodies)
    assert first["ordering_keys"] == ["0", None, "0", None, None]
    assert "ordering_keys" not in second
    assert len(count_runs(dynamodb, table_name, harness.tenant)) == 8
