"""The pipeline checker is not vacuous: it fails the bad pipelines the system must never leave behind, naming
the keys or markers at fault and what broke, and passes the good ones, identical copies and redelivered keyless
records included (tests/history/pipeline.py); and what the soak observes for it (which records may have come
again, tests/history/observe.py and benchmarks/) never loosens it when a look-up fails. Events are built by the
outbox's own poimen.outbox.run_event."""

from __future__ import annotations

import dataclasses
import json
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from benchmarks.committed import committed
from benchmarks.soak import Dispatch, Relay, dispatched
from poimen.contract import RunRequest
from poimen.ids import keyed_run_id, unkeyed_run_id
from poimen.outbox import run_event
from tests.asyncapi_contract import document
from tests.history.observe import DispatchRecord, Redeliveries, Uncommitted, redeliveries
from tests.history.pipeline import (
    CONSTANT_ATTRIBUTES,
    DeadLetter,
    Dispatched,
    EventRecord,
    Parked,
    Pipeline,
    Redelivery,
    Report,
    Spawn,
    StoredRun,
    check,
    epoch_ms,
)

CREATED = "2026-12-01T12:00:00.482Z"
# A kill after CREATED, and a run admitted after it (a record redelivered by it)
KILLED = Redelivery("uncommitted at a kill", epoch_ms(CREATED) + 1_000)
AFTER = "2026-12-01T12:00:05.000Z"
STACK = "poimen-test"  # the stack whose outbox published the events


def spawn_of(marker: str | None) -> Spawn:
    """What the dispatches of these pipelines ask for: a keyless one its marker, a keyed one n=1."""
    return Spawn.of("wf/pipeline", {"marker": marker} if marker else {"n": 1})


def dispatch(tenant: str, key: str | None, marker: str | None = None, copies: int = 1) -> Dispatched:
    return Dispatched(tenant, key, marker, copies, spawn=spawn_of(marker))


def stored(
    tenant: str, key: str | None = None, marker: str | None = None, attempt: str = "a-1", created_at: str = CREATED
) -> StoredRun:
    run_id = keyed_run_id(tenant, key) if key is not None else unkeyed_run_id()
    return StoredRun(tenant, run_id, attempt, key, marker, created_at, spawn=spawn_of(marker), traceparent=None)


def event(run: StoredRun, **changes: str) -> EventRecord:
    """The event the outbox publishes for `run`, its image's attributes changed as given."""
    attributes = {
        "pk": f"RUN#{run.tenant}#{run.run_id}",
        "tenant_id": run.tenant,
        "run_id": run.run_id,
        "attempt_id": run.attempt_id,
        "workflow_ref": run.spawn.workflow_ref,
        "input": run.spawn.input,
        **({"goal_id": run.spawn.goal_id} if run.spawn.goal_id else {}),
        **({"traceparent": run.traceparent} if run.traceparent else {}),
        "created_at": run.created_at,
        "fingerprint": "f" * 64,
        "status": "admitted",
        **({"dispatch_key": run.dispatch_key} if run.dispatch_key else {}),
        **changes,
    }
    published = run_event({name: {"S": value} for name, value in attributes.items()}, STACK)
    return EventRecord(published.topic, published.key, published.headers, published.value)


def good() -> Pipeline:
    """Two tenants, keyed dispatches (one published twice), a keyless one; every run its event."""
    dispatched = [
        dispatch("acme", "k-1", copies=2),
        dispatch("globex", "k-1"),
        dispatch("acme", None, "m-1"),
    ]
    runs = [stored("acme", "k-1"), stored("globex", "k-1"), stored("acme", marker="m-1")]
    return Pipeline(dispatched, runs, [event(run) for run in runs], stack=STACK)


def failed(pipeline: Pipeline, rule: str, key: str) -> Report:
    """Check `pipeline`; it must fail by `rule` at `key`, named in the summary."""
    report = check(pipeline)
    assert not report.ok
    assert (rule, key) in {(failure.check, failure.key) for failure in report.failures}, report.summary()
    assert f"{rule} {key}:" in report.summary()
    return report


def test_a_good_pipeline_holds_identical_copies_included() -> None:
    pipeline = good()
    pipeline.events.append(pipeline.events[0])  # a copy after a failure: byte-identical
    report = check(pipeline)
    assert report.ok, report.summary()
    assert (report.dispatches, report.runs, report.events, report.duplicate_events) == (3, 3, 4, 1)
    assert report.summary().startswith("pipeline holds")


def test_two_distinct_events_for_one_admission_fail() -> None:
    pipeline = good()
    pipeline.events.append(event(pipeline.runs[0], workflow_ref="wf/other"))  # same ce_id, another value
    failed(pipeline, "distinct-events", "acme/k-1")


def test_an_event_with_no_run_fails() -> None:
    pipeline = good()
    pipeline.events.append(event(stored("acme", "k-9")))  # no stored admission has its ce_id
    report = failed(pipeline, "event-without-admission", stored("acme", "k-9").admission)
    assert "on poimen.acme.events" in report.summary()


def test_a_run_of_another_attempt_than_its_event_fails_both_ways() -> None:
    # Given the table holding a second admission of a run (another attempt id) whose event never came
    pipeline = good()
    pipeline.runs[0] = dataclasses.replace(pipeline.runs[0], attempt_id="a-2")
    # Then its event is of no stored admission, and the stored admission has no event
    report = failed(pipeline, "run-without-event", "acme/k-1")
    assert "event-without-admission" in {failure.check for failure in report.failures}


def test_a_run_with_no_event_fails() -> None:
    pipeline = good()
    del pipeline.events[1]
    failed(pipeline, "run-without-event", "globex/k-1")


def test_an_event_on_another_tenants_topic_fails() -> None:
    pipeline = good()
    wrong = pipeline.events[1]
    pipeline.events[1] = dataclasses.replace(wrong, topic="poimen.acme.events")
    report = failed(pipeline, "event-on-another-tenants-topic", "globex/k-1")
    assert "on poimen.acme.events" in report.summary()


def test_an_event_naming_another_run_fails() -> None:
    pipeline = good()
    other = pipeline.runs[1].run_id
    headers = tuple(
        (name, other.encode() if name == "ce_subject" else value) for name, value in pipeline.events[0].headers
    )
    pipeline.events[0] = dataclasses.replace(pipeline.events[0], headers=headers)
    failed(pipeline, "event-misnamed", "acme/k-1")


def test_a_keyed_dispatch_with_two_runs_fails() -> None:
    pipeline = good()
    second = dataclasses.replace(pipeline.runs[0], run_id=unkeyed_run_id())
    pipeline.runs.append(second)
    pipeline.events.append(event(second))
    report = failed(pipeline, "keyed-admitted-twice", "acme/k-1")
    assert second.run_id in report.summary()


def test_a_keyless_dispatch_admitted_twice_without_an_unknown_outcome_fails() -> None:
    pipeline = good()
    again = stored("acme", marker="m-1")
    pipeline.runs.append(again)
    pipeline.events.append(event(again))
    failed(pipeline, "keyless-admitted-twice", "acme/marker:m-1")


def test_a_keyless_dispatch_redelivered_with_its_outcome_unknown_may_be_admitted_again() -> None:
    # Given a keyless record the relay was given again after a kill mid-batch, admitted by both deliveries
    pipeline = good()
    pipeline.dispatched[2] = dataclasses.replace(pipeline.dispatched[2], redelivered=(KILLED,))
    again = stored("acme", marker="m-1", created_at=AFTER)
    pipeline.runs.append(again)
    pipeline.events.append(event(again))
    # Then it holds, and says so
    report = check(pipeline)
    assert report.ok, report.summary()
    assert (report.redelivered, report.keyless_admitted_again) == (1, 1)


def test_a_keyless_record_dead_lettered_as_outcome_unknown_must_not_be_sent_again() -> None:
    # Given a keyless record dead-lettered naming the run its lost answer may have admitted
    pipeline = good()
    named = pipeline.runs[2].run_id
    letter = DeadLetter("acme", None, "m-1", "outcome-unknown", f"GET /v1/runs/{named}", named)
    pipeline.dead_letters.append(letter)
    assert check(pipeline).ok  # its run is the one it names
    # When another run of it shows up in its place (the record was sent again)
    resent = stored("acme", marker="m-1")
    pipeline.runs[2], pipeline.events[2] = resent, event(resent)
    # Then the check fails, naming the marker
    failed(pipeline, "resent-after-unknown-outcome", "acme/marker:m-1")


def test_a_record_neither_admitted_nor_dead_lettered_fails() -> None:
    pipeline = good()
    pipeline.dispatched.append(dispatch("globex", None, "m-2"))
    failed(pipeline, "lost", "globex/marker:m-2")


def test_a_valid_record_dead_lettered_fails_with_its_reason() -> None:
    pipeline = good()
    pipeline.dispatched.append(dispatch("globex", "k-2"))
    pipeline.dead_letters.append(DeadLetter("globex", "k-2", None, "relay-error", "KeyError: 'x'"))
    report = failed(pipeline, "dead-lettered", "globex/k-2")
    assert "relay-error: KeyError" in report.summary()


def test_a_parked_batch_and_a_set_aside_event_fail() -> None:
    pipeline = good()
    pipeline.parked.append(Parked("relay", "aws/lambda/m/poimen.acme.dispatch-0/x", ("acme/k-1",)))
    run = pipeline.runs[1]
    name = f"globex/run:{run.run_id}"
    pipeline.parked.append(Parked("outbox", "undeliverable/globex/x", (name,), set_aside=True, reason="too large"))
    failed(pipeline, "parked", "acme/k-1")
    failed(pipeline, "event-set-aside", name)


def test_a_run_nothing_dispatched_fails() -> None:
    pipeline = good()
    stray = stored("globex", "k-9")
    pipeline.runs.append(stray)
    pipeline.events.append(event(stray))
    failed(pipeline, "run-of-no-dispatch", "globex/k-9")


def test_an_event_carrying_another_runs_value_fails() -> None:
    # Given acme/k-1's event, its headers right, its value (the run it announces) globex/k-1's
    pipeline = good()
    pipeline.events[0] = dataclasses.replace(pipeline.events[0], value=pipeline.events[1].value)
    # Then it does not announce its admission
    report = failed(pipeline, "event-misnamed", "acme/k-1")
    assert pipeline.runs[1].run_id in report.summary()


def test_an_event_on_its_tenants_dispatch_topic_is_not_on_its_events_topic() -> None:
    pipeline = good()
    pipeline.events[1] = dataclasses.replace(pipeline.events[1], topic="poimen.globex.dispatch")
    report = failed(pipeline, "event-on-another-tenants-topic", "globex/k-1")
    assert "on poimen.globex.dispatch" in report.summary()


def test_an_event_with_two_ce_ids_fails() -> None:
    # Given globex/k-1's event carrying acme/k-1's ce_id before its own
    pipeline = good()
    wrong = pipeline.events[1]
    stale = ("ce_id", pipeline.runs[0].admission.encode())
    pipeline.events[1] = dataclasses.replace(wrong, headers=(stale, *wrong.headers))
    # Then it is no event of one admission: malformed, not counted as globex/k-1's
    failed(pipeline, "run-without-event", "globex/k-1")


def test_an_outcome_unknown_letter_naming_no_run_fails() -> None:
    # Given a keyless record dead-lettered as outcome-unknown, but naming no run it may have admitted
    pipeline = good()
    pipeline.dispatched.append(dispatch("globex", None, "m-2"))
    pipeline.dead_letters.append(DeadLetter("globex", None, "m-2", "outcome-unknown", "GET /v1/runs/?"))
    # Then nobody can find out what became of it
    failed(pipeline, "dead-lettered", "globex/marker:m-2")


def test_a_keyless_dispatch_of_two_copies_one_admitted_one_outcome_unknown_holds() -> None:
    # Given a keyless body published twice: one copy admitted, the other dead-lettered as outcome-unknown
    # naming the run its lost answer may have admitted (never written)
    pipeline = good()
    pipeline.dispatched[2] = dataclasses.replace(pipeline.dispatched[2], copies=2)
    maybe = unkeyed_run_id()
    pipeline.dead_letters.append(DeadLetter("acme", None, "m-1", "outcome-unknown", f"GET /v1/runs/{maybe}", maybe))
    # Then it holds: each copy ended once, and no copy was sent again
    report = check(pipeline)
    assert report.ok, report.summary()
    # But a third run (a copy sent again after its unknown outcome) does not
    resent = stored("acme", marker="m-1")
    pipeline.runs.append(resent)
    pipeline.events.append(event(resent))
    failed(pipeline, "resent-after-unknown-outcome", "acme/marker:m-1")


def test_a_pipeline_with_nothing_dispatched_fails() -> None:
    # An empty history proves nothing (a workload that published nothing, topics read under the wrong names)
    failed(Pipeline([], [], [], stack=STACK), "nothing-dispatched", "")


def test_a_key_spelled_like_a_marker_is_not_that_keyless_dispatch() -> None:
    # Given a keyed dispatch whose opaque key reads "marker:m-2", and a keyless one carrying marker m-2
    pipeline = good()
    pipeline.dispatched += [dispatch("acme", None, "m-2"), dispatch("acme", "marker:m-2")]
    keyed = stored("acme", "marker:m-2")
    pipeline.runs.append(keyed)
    pipeline.events.append(event(keyed))
    # When only the keyed one was admitted, then the keyless one is lost, not admitted as the keyed one's run
    failed(pipeline, "lost", "acme/marker:m-2")


def test_a_keyless_body_published_twice_and_admitted_once_lost_a_record() -> None:
    # Given a keyless body published twice (two spawns: no key makes them one) that left one run, no dead letter
    pipeline = good()
    pipeline.dispatched[2] = dataclasses.replace(pipeline.dispatched[2], copies=2)
    # Then one of its records is lost
    report = failed(pipeline, "lost", "acme/marker:m-1")
    assert "2 record(s) published: 1 run(s), 0 dead letter(s)" in report.summary()


def test_a_keyless_dispatch_redelivered_once_may_be_admitted_once_more_not_five_times() -> None:
    # Given a keyless record past its group's committed offset at one kill: two deliveries at most
    pipeline = good()
    pipeline.dispatched[2] = dataclasses.replace(pipeline.dispatched[2], redelivered=(KILLED,))
    # When it left five runs
    for _ in range(4):
        again = stored("acme", marker="m-1", created_at=AFTER)
        pipeline.runs.append(again)
        pipeline.events.append(event(again))
    # Then three of them came from deliveries no disruption explains
    report = failed(pipeline, "keyless-admitted-twice", "acme/marker:m-1")
    assert "5 runs of 1 record(s), redelivered 1 time(s)" in report.summary()


def test_a_keyless_record_past_the_committed_offset_at_two_disruptions_may_be_admitted_three_times() -> None:
    # Given a keyless record the relay may have been given again at a kill and again at the broker's restart
    pipeline = good()
    why = (KILLED, Redelivery("uncommitted at a broker restart", KILLED.at_ms + 1_000))
    pipeline.dispatched[2] = dataclasses.replace(pipeline.dispatched[2], redelivered=why)
    for _ in range(2):
        again = stored("acme", marker="m-1", created_at=AFTER)
        pipeline.runs.append(again)
        pipeline.events.append(event(again))
    # Then three runs hold (one a delivery), and a fourth does not
    report = check(pipeline)
    assert report.ok, report.summary()
    assert report.keyless_admitted_again == 1
    fourth = stored("acme", marker="m-1", created_at=AFTER)
    pipeline.runs.append(fourth)
    pipeline.events.append(event(fourth))
    failed(pipeline, "keyless-admitted-twice", "acme/marker:m-1")


def _changed(record: EventRecord, name: str, value: bytes | None) -> EventRecord:
    """`record` with header `name` (or the Kafka key, `key`) set to `value`; None leaves the header out."""
    if name == "key":
        return dataclasses.replace(record, key=value)
    headers = tuple((header, raw) for header, raw in record.headers if header != name)
    return dataclasses.replace(record, headers=headers if value is None else (*headers, (name, value)))


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("key", None),
        ("key", b"globex/3d7b1368-cb64-8e4b-b3d9-a9f4d69125b4"),
        ("ce_type", b"poimen.run.deleted"),
        ("ce_type", None),
        ("ce_source", b"urn:poimen:another-stack:acme"),
        ("ce_source", b"urn:poimen:poimen-test:globex"),
        ("ce_time", b"2026-12-01T12:00:09.000Z"),
        ("ce_specversion", b"0.3"),
        ("ce_specversion", None),
        ("content-type", b"text/plain"),
    ],
)
def test_an_event_whose_key_or_attributes_are_not_its_runs_fails(name: str, value: bytes | None) -> None:
    # Given acme/k-1's event, its ce_id and subject right, one of its key and CloudEvents attributes wrong
    pipeline = good()
    pipeline.events[0] = _changed(pipeline.events[0], name, value)
    # Then it is not the event of its stored run, and the check says which attribute
    report = failed(pipeline, "event-attributes", "acme/k-1")
    assert name in report.summary()


def test_an_event_with_an_attribute_given_twice_fails() -> None:
    # Given acme/k-1's event carrying a second ce_type, poimen.run.deleted, after its own
    pipeline = good()
    record = pipeline.events[0]
    pipeline.events[0] = dataclasses.replace(record, headers=(*record.headers, ("ce_type", b"poimen.run.deleted")))
    # Then which type it has cannot be known: the check fails
    failed(pipeline, "event-attributes", "acme/k-1")


def test_the_attributes_every_event_carries_are_the_asyncapi_documents() -> None:
    headers = document()["components"]["messages"]["runAdmitted"]["headers"]["properties"]
    assert {name: headers[name]["const"] for name in CONSTANT_ATTRIBUTES} == CONSTANT_ATTRIBUTES


AT_KILL_MS = 2_000.0
TOPIC = "poimen.acme.dispatch"


def keyless_record(offset: int, timestamp_ms: int = 1_000, marker: str = "m-1") -> DispatchRecord:
    return DispatchRecord((TOPIC, 0), offset, timestamp_ms, "acme", None, marker)


def observed(again: Redeliveries, runs_of_m1: int) -> Pipeline:
    """good(), its keyless dispatch m-1 redelivered as `again` says and admitted `runs_of_m1` times."""
    pipeline = good()
    pipeline.dispatched[2] = dataclasses.replace(
        pipeline.dispatched[2], redelivered=tuple(again.by_dispatch.get(("acme", "m-1"), ()))
    )
    pipeline.unobserved = again.unobserved
    for _ in range(runs_of_m1 - 1):
        run = stored("acme", marker="m-1")
        pipeline.runs.append(run)
        pipeline.events.append(event(run))
    return pipeline


def test_a_keyless_record_comes_again_once_for_each_disruption_it_was_past_the_committed_offset() -> None:
    # Given a kill at which offset 5 was committed, and a broker stop later at which offset 8 was
    disruptions = [
        Uncommitted("kill", AT_KILL_MS, {(TOPIC, 0): 5}),
        Uncommitted("broker", AT_KILL_MS + 1_000, {(TOPIC, 0): 8}),
    ]
    records = [
        keyless_record(4, marker="committed"),
        keyless_record(6, marker="past-one"),
        keyless_record(9, marker="past-both"),
        keyless_record(10, timestamp_ms=int(AT_KILL_MS) + 500, marker="after-the-kill"),
    ]
    # Then each record may have come again once for each disruption it was produced before and past the offset of
    again = redeliveries(records, disruptions)
    at_kill, at_broker = Redelivery("uncommitted at kill", AT_KILL_MS), Redelivery("uncommitted at broker", 3_000.0)
    assert again.by_dispatch == {
        ("acme", "past-one"): [at_kill],
        ("acme", "past-both"): [at_kill, at_broker],
        ("acme", "after-the-kill"): [at_broker],
    }
    assert again.unobserved == []


def test_a_failed_committed_offset_look_up_fails_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given the soak's look-up of the relay group's committed offsets failing at a kill (the broker not answering)
    relay = Relay("127.0.0.1:9", ("acme",))
    monkeypatch.setattr(relay, "committed", lambda: None)
    at_kill = Uncommitted("SIGKILL #1", AT_KILL_MS, relay.wait_committed(0.0))
    # And a keyless record produced before it and admitted twice
    again = redeliveries([keyless_record(7)], [at_kill])
    pipeline = observed(again, runs_of_m1=2)
    # Then no redelivery is taken for granted, and the check fails for what it could not observe
    assert again.by_dispatch == {}
    report = failed(pipeline, "unobserved", "SIGKILL #1")
    assert "committed offsets could not be looked up" in report.summary()
    failed(pipeline, "keyless-admitted-twice", "acme/marker:m-1")
    # Even when nothing was admitted twice
    failed(observed(again, runs_of_m1=1), "unobserved", "SIGKILL #1")


def test_a_look_up_that_leaves_out_a_records_partition_fails_the_check() -> None:
    # Given a look-up at a kill that answered no offset of the keyless record's partition
    again = redeliveries([keyless_record(7)], [Uncommitted("SIGKILL #1", AT_KILL_MS, {("poimen.acme.dispatch", 1): 3})])
    # Then its partition is not taken to be uncommitted: the check fails, naming it
    assert again.by_dispatch == {}
    report = failed(observed(again, runs_of_m1=1), "unobserved", "SIGKILL #1")
    assert "poimen.acme.dispatch[0]" in report.summary()


def test_a_partition_whose_committed_offset_is_an_error_fails_the_look_up() -> None:
    # Given the broker answering a look-up with an error for one partition (its offset -1001, OFFSET_INVALID)
    error = KafkaError(KafkaError.COORDINATOR_LOAD_IN_PROGRESS)
    partitions = [
        SimpleNamespace(topic=TOPIC, partition=0, offset=12, error=None),
        SimpleNamespace(topic=TOPIC, partition=1, offset=-1001, error=error),
    ]
    answer = Future()  # type: ignore[var-annotated]
    answer.set_result(SimpleNamespace(topic_partitions=partitions))
    admin = SimpleNamespace(list_consumer_group_offsets=lambda requests, request_timeout: {"group": answer})
    # Then the look-up fails (its caller asks again) rather than answer 0 for it
    with pytest.raises(KafkaException):
        committed(admin, "group", [TopicPartition(TOPIC, 0), TopicPartition(TOPIC, 1)])  # type: ignore[arg-type]


def _valued(record: EventRecord, **fields: object) -> EventRecord:
    """`record` with its value's fields set as given (its headers and key unchanged)."""
    return dataclasses.replace(record, value=json.dumps({**json.loads(record.value or b"{}"), **fields}).encode())


@pytest.mark.parametrize(
    "fields",
    [
        {"workflow_ref": "wf/other"},
        {"input": {"n": 2}},
        {"input": {"n": True}},  # equal to 1 in Python, not in JSON
        {"input": {"n": 1.0}},  # not the number as admitted
        {"goal_id": "g-9"},
        {"created_at": "2026-12-01T12:00:09.000Z"},
        {"status": "cancelled"},
        {"attempt_id": "a-1"},
    ],
    ids=[
        "workflow_ref",
        "input",
        "input-true-for-1",
        "input-1.0-for-1",
        "goal_id",
        "created_at",
        "status",
        "attempt_id",
    ],
)
def test_an_event_whose_value_is_not_its_runs_fails(fields: dict[str, object]) -> None:
    # Given acme/k-1's event, its key and headers right, its value (the run as the API answers it) another run's
    pipeline = good()
    pipeline.events[0] = _valued(pipeline.events[0], **fields)
    # Then it is not its stored run's event, and the check says which field
    report = failed(pipeline, "event-value", "acme/k-1")
    assert next(iter(fields)) in report.summary()


def test_a_copy_of_an_event_with_another_value_is_a_distinct_event() -> None:
    # Given acme/k-1's event, and a copy whose value differs in workflow_ref only
    pipeline = good()
    pipeline.events.append(_valued(pipeline.events[0], workflow_ref="wf/other"))
    # Then the check fails: the copy is no byte-identical copy, and not its run's event
    failed(pipeline, "distinct-events", "acme/k-1")
    failed(pipeline, "event-value", "acme/k-1")


def test_an_outcome_unknown_letter_naming_another_dispatchs_run_fails() -> None:
    # Given a keyless record of globex dead-lettered as outcome-unknown, naming acme/k-1's run: an operator who GETs
    # it finds a run and redrives nothing, and the record is lost
    pipeline = good()
    pipeline.dispatched.append(dispatch("globex", None, "m-2"))
    named = pipeline.runs[0].run_id
    pipeline.dead_letters.append(DeadLetter("globex", None, "m-2", "outcome-unknown", f"GET /v1/runs/{named}", named))
    # Then the letter names a run that is not its record's
    report = failed(pipeline, "letter-misnamed", "globex/marker:m-2")
    assert named in report.summary()


def test_a_dead_letter_sent_twice_is_one_ending() -> None:
    # Given a keyless record dead-lettered as outcome-unknown whose SendMessage was answered late and sent again
    # (the relay retries a send that timed out; both landed: two identical letters)
    pipeline = good()
    pipeline.dispatched.append(dispatch("globex", None, "m-2"))
    maybe = unkeyed_run_id()
    letter = DeadLetter("globex", None, "m-2", "outcome-unknown", f"GET /v1/runs/{maybe}", maybe)
    pipeline.dead_letters += [letter, letter]
    # Then it holds: one delivery, dead-lettered once, its named run never written, nothing sent again
    report = check(pipeline)
    assert report.ok, report.summary()


@pytest.mark.parametrize(
    "spawn",
    [
        Spawn.of("wf/other", {"n": 1}),
        Spawn.of("wf/pipeline", {"n": 2}),
        Spawn.of("wf/pipeline", {"n": 1}, "g-9"),
    ],
    ids=["workflow_ref", "input", "goal_id"],
)
def test_a_run_unlike_its_dispatch_fails(spawn: Spawn) -> None:
    # Given acme/k-1's run (and its event, the run's) carrying another workflow_ref, input or goal_id than dispatched
    pipeline = good()
    pipeline.runs[0] = dataclasses.replace(pipeline.runs[0], spawn=spawn)
    pipeline.events[0] = event(pipeline.runs[0])
    # Then the run is not what was dispatched
    report = failed(pipeline, "run-unlike-its-dispatch", "acme/k-1")
    assert repr(spawn) in report.summary()


def test_a_redelivery_is_its_own_tenants_dispatchs_not_another_of_the_same_marker() -> None:
    # Given two tenants' keyless dispatches carrying one marker, only acme's record past the committed offset at a kill
    request = RunRequest(workflow_ref="wf/soak", input={"marker": "m-1"})
    stream = [Dispatch("acme", request, duplicate=False), Dispatch("globex", request, duplicate=False)]
    records = [keyless_record(7), DispatchRecord(("poimen.globex.dispatch", 0), 2, 1_000, "globex", None, "m-1")]
    at_kill = Uncommitted("kill", AT_KILL_MS, {(TOPIC, 0): 5, ("poimen.globex.dispatch", 0): 3})
    # When the soak reads the stream with what may have come again
    again = redeliveries(records, [at_kill])
    judged = {each.tenant: each.redelivered for each in dispatched(stream, again.by_dispatch)}
    # Then only acme's dispatch may have been given again: globex's admitted twice would be a defect
    assert judged == {"acme": (Redelivery("uncommitted at kill", AT_KILL_MS),), "globex": ()}


def test_a_keyless_record_admitted_twice_before_the_kill_that_redelivers_it_fails() -> None:
    # Given a keyless record past the committed offset at a kill, so that it may come once again after the kill
    pipeline = good()
    kill_ms = epoch_ms(CREATED) + 1_000
    redelivered = (Redelivery("uncommitted at a kill", kill_ms),)
    pipeline.dispatched[2] = dataclasses.replace(pipeline.dispatched[2], redelivered=redelivered)
    # When it left two runs, both admitted before that kill (a relay admitting it twice in one delivery)
    again = stored("acme", marker="m-1")
    pipeline.runs.append(again)
    pipeline.events.append(event(again))
    # Then the redelivery explains neither: it came after them
    report = failed(pipeline, "keyless-admitted-twice", "acme/marker:m-1")
    assert "2 runs admitted before uncommitted at a kill" in report.summary()
    # But the same second run admitted after the kill (its redelivery's) holds
    later = dataclasses.replace(again, created_at="2026-12-01T12:00:05.000Z")
    pipeline.runs[-1], pipeline.events[-1] = later, event(later)
    assert check(pipeline).ok, check(pipeline).summary()


TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.mark.parametrize(
    ("stored_trace", "header"),
    [
        (TRACEPARENT, None),  # the run's trace dropped
        (TRACEPARENT, b"00-0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7-01"),  # another span's
        (None, TRACEPARENT.encode()),  # a trace the run never had
    ],
    ids=["dropped", "another", "invented"],
)
def test_an_event_whose_traceparent_is_not_its_runs_fails(stored_trace: str | None, header: bytes | None) -> None:
    # Given acme/k-1's run admitted with (or without) a traceparent, and its event carrying another (or none)
    pipeline = good()
    pipeline.runs[0] = dataclasses.replace(pipeline.runs[0], traceparent=stored_trace)
    pipeline.events[0] = _changed(event(pipeline.runs[0]), "traceparent", header)
    # Then the event does not carry its run's trace on
    report = failed(pipeline, "event-attributes", "acme/k-1")
    assert "traceparent" in report.summary()


def test_an_event_carrying_its_runs_traceparent_holds() -> None:
    pipeline = good()
    pipeline.runs[0] = dataclasses.replace(pipeline.runs[0], traceparent=TRACEPARENT)
    pipeline.events[0] = event(pipeline.runs[0])
    assert check(pipeline).ok, check(pipeline).summary()


def test_two_identical_letters_naming_no_run_are_two_records_endings() -> None:
    # Given a keyless body published twice, both copies dead-lettered alike (a letter naming no run is no one POST's)
    pipeline = good()
    pipeline.dispatched.append(dispatch("globex", None, "m-2", copies=2))
    letter = DeadLetter("globex", None, "m-2", "relay-error", "KeyError: 'x'")
    pipeline.dead_letters += [letter, letter]
    # Then each copy ended (dead-lettered, which fails by itself), none was lost
    report = failed(pipeline, "dead-lettered", "globex/marker:m-2")
    assert "lost" not in {failure.check for failure in report.failures}, report.summary()
