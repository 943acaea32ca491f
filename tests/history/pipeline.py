"""The pipeline's history check (dispatch → inbox relay → admission → outbox): what was dispatched, checked
against what the pipeline left behind once nothing could change any more (the table's final consistent
scan, every record of every `poimen.<tenant>.events` topic, the relay's dead letters and parked batches,
the outbox's set-aside events and parked batches). tests/history/observe.py reads those from a stack;
`make soak` (benchmarks/soak.py) and tests/integration/test_pipeline_history.py check them here.

The rules (issue 29, part 2), each a `check` of the report:
- `run-without-event`, `event-without-admission`, `distinct-events`, `event-on-another-tenants-topic`,
  `event-misnamed`, `event-attributes`: runs and events form a bijection. Every stored admission (its `ce_id`,
  poimen.ids.admission_id) has exactly one distinct event, on its own tenant's `poimen.<tenant>.events` topic,
  naming its run (`ce_subject`, and the tenant, run and key its value announces), its Kafka key and
  CloudEvents attributes its run's as infra/asyncapi.yaml's `runAdmitted` says (key `<tenant_id>/<run_id>`,
  `ce_source` `urn:poimen:<stack>:<tenant_id>`, `ce_time` its `created_at`, `ce_type`, `ce_specversion` and
  `content-type` the document's constants, `traceparent` its run's, if it has one), its value the run as
  the API answers it (`event-value`: every field of the stored run, none other); copies of it only
  byte-identical (key, headers, value); no event without a stored admission. A header given twice (two
  `ce_id`s) is no header: such an event is of no one admission, and an event with two `ce_type`s has no type.
- `keyed-admitted-twice`: one run per (tenant, dispatch_key); `run-unlike-its-dispatch`: a run carries its
  dispatch's workflow_ref, input and goal_id.
- `keyless-admitted-twice`: a keyless dispatch (told by its unique marker) at most one run for each delivery
  of it the observation proves: one for each copy published, and one more each time the relay may have been
  given a record of it again with its outcome unknown to it (`redelivered`, one entry a time, with why and
  when: a disruption during which the record was past its group's committed offset); and a redelivery comes
  after its disruption, so of the runs admitted before a disruption, at most one for each copy and each
  earlier redelivery;
  `resent-after-unknown-outcome`: a keyless record dead-lettered as `outcome-unknown` names the run it may
  have admitted (`dead-lettered` if it names none; `letter-misnamed` if that run is another dispatch's), and
  is not sent again: the runs no such letter names are no more than the deliveries not dead-lettered. A letter
  naming a run sent twice (identical: the relay sends again a SendMessage whose answer was lost) is one ending.
- `lost`: every dispatch ends admitted or dead-lettered, a keyless one once for each copy published;
  `dead-lettered`: every dispatch of this workload is a valid spawn, so the only dead letter it may end as
  is a keyless `outcome-unknown` (with its reason);
  `parked`, `event-set-aside`: nothing is given up on (a relay's or the outbox's parked batch, an event set
  aside as undeliverable); `run-of-no-dispatch`, `dead-letter-of-no-dispatch`: nothing comes from nowhere;
  `nothing-dispatched`: a history of no dispatch proves nothing, and fails; `unobserved`: what the
  observation could not read (the relay group's committed offsets at a disruption) fails the check, for a
  rule judged without it would be judged on a guess.
"""

from __future__ import annotations

import abc
import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from poimen.ids import admission_id
from poimen.kafka import events_topic
from tests.history.check import Failure, failure_lines

Headers = tuple[tuple[str, bytes | None], ...]
# What matches a run and a dead letter to its dispatch: (tenant, True, key) or (tenant, False, marker). Not the
# `name` shown, which a key spelled "marker:m" shares with the keyless dispatch of marker m.
Identity = tuple[str | None, bool, str | None]
# The attributes infra/asyncapi.yaml's runAdmitted gives every event, whatever its run (a test holds them equal).
CONSTANT_ATTRIBUTES = {"ce_specversion": "1.0", "ce_type": "poimen.run.admitted", "content-type": "application/json"}


def canonical(value: Any) -> str:
    """A JSON value's text with its objects' keys sorted: two inputs equal as the API compares them are one."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class Spawn:
    """What a dispatch asks for, and so what its run must carry: its workflow_ref, input and goal_id."""

    workflow_ref: str
    input: str  # canonical JSON text (canonical())
    goal_id: str | None = None

    @classmethod
    def of(cls, workflow_ref: str, value: Any, goal_id: str | None = None) -> Spawn:
        return cls(workflow_ref, canonical(value), goal_id)


def identity(tenant: str | None, key: str | None, marker: str | None) -> Identity:
    return (tenant, True, key) if key is not None else (tenant, False, marker)


class _Named(abc.ABC):
    """A dispatch, its run or its dead letter: named in reports `<tenant>/<key>` or `<tenant>/marker:<m>`."""

    @abc.abstractmethod
    def _who(self) -> tuple[str | None, str | None, str | None]:
        """(tenant, dispatch key, marker)."""

    @property
    def name(self) -> str:
        tenant, key, marker = self._who()
        return f"{tenant}/{key}" if key is not None else f"{tenant}/marker:{marker}"

    @property
    def identity(self) -> Identity:
        return identity(*self._who())


@dataclass(frozen=True)
class Redelivery:
    """One time the relay may have been given a record again: why (the disruption), and when it was (epoch ms,
    the clock of the runs' created_at): the record came again after it."""

    why: str
    at_ms: float


@dataclass(frozen=True)
class Dispatched(_Named):
    """One dispatch of the workload: a keyed one, or a keyless one carrying a unique `marker` in its input."""

    tenant: str
    key: str | None
    marker: str | None = None
    copies: int = 1  # records published with this body (a keyed duplicate is a replay)
    # Each time the relay may have been given a record of it again, its outcome unknown, and why: one delivery
    # more each (a record past its group's committed offset at a kill is delivered again once after it).
    redelivered: tuple[Redelivery, ...] = ()
    spawn: Spawn = field(kw_only=True)

    def _who(self) -> tuple[str | None, str | None, str | None]:
        return self.tenant, self.key, self.marker


@dataclass(frozen=True)
class StoredRun(_Named):
    """A run item of the table's final scan (fences left out)."""

    tenant: str
    run_id: str
    attempt_id: str
    dispatch_key: str | None
    marker: str | None
    created_at: str
    spawn: Spawn = field(kw_only=True)
    traceparent: str | None = field(kw_only=True)  # the admission request's, which its event carries on

    @property
    def admission(self) -> str:
        return admission_id(self.run_id, self.attempt_id)

    def _who(self) -> tuple[str | None, str | None, str | None]:
        return self.tenant, self.dispatch_key, self.marker


@dataclass(frozen=True)
class EventRecord:
    """A record read from a `poimen.<tenant>.events` topic, as it is on the topic."""

    topic: str
    key: bytes | None
    headers: Headers
    value: bytes | None

    def header(self, name: str) -> str | None:
        """The header's value; None if it is missing, or given more than once (which one is meant cannot be known:
        an event with two ce_ids is the event of no one admission)."""
        found = [value for header, value in self.headers if header == name]
        return found[0].decode(errors="replace") if len(found) == 1 and found[0] is not None else None

    def announced(self) -> tuple[str | None, str | None, str | None]:
        """The (tenant_id, run_id, dispatch_key) of the run its value announces; Nones if it is not a run."""
        try:
            body = json.loads(self.value or b"null")
        except ValueError:
            body = None
        fields = [
            body.get(name) if isinstance(body, dict) else None for name in ("tenant_id", "run_id", "dispatch_key")
        ]
        tenant, run_id, key = (value if isinstance(value, str) else None for value in fields)
        return tenant, run_id, key


@dataclass(frozen=True)
class DeadLetter(_Named):
    """A relay dead letter: the tenant of its record's topic, what its value names, and its reason."""

    tenant: str | None
    key: str | None
    marker: str | None
    kind: str | None
    detail: str | None
    run_id: str | None = None  # the run an outcome-unknown letter names

    def _who(self) -> tuple[str | None, str | None, str | None]:
        return self.tenant, self.key, self.marker


@dataclass(frozen=True)
class Parked:
    """What a relay gave up on: a parked batch of the inbox relay (its dispatches, by name) or of the outbox
    (its runs), or an event the outbox set aside as undeliverable (`set_aside`, with its reason)."""

    where: str  # "relay" or "outbox"
    object_key: str
    names: tuple[str, ...]
    set_aside: bool = False
    reason: str = ""


@dataclass
class Pipeline:
    dispatched: list[Dispatched]
    runs: list[StoredRun]
    events: list[EventRecord]
    dead_letters: list[DeadLetter] = field(default_factory=list)
    parked: list[Parked] = field(default_factory=list)
    # The stack whose outbox published the events: their ce_source names it.
    stack: str = field(kw_only=True)
    # What the observation could not read, each a `unobserved` failure: (what, why).
    unobserved: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class Report:
    ok: bool
    dispatches: int
    keyless: int
    redelivered: int  # keyless dispatches the relay may have been given again
    runs: int
    events: int  # records on the events topics
    duplicate_events: int  # identical copies beyond the first
    dead_letters: dict[str, int]  # by kind
    keyless_admitted_again: int  # keyless dispatches with more runs than copies, allowed as redelivered
    failures: list[Failure] = field(default_factory=list)

    def keys_at_fault(self) -> list[str]:
        return sorted({failure.key for failure in self.failures if failure.key})

    def summary(self) -> str:
        """What a person reads: the verdict, and each violation named by its check and its key."""
        if self.ok:
            return (
                f"pipeline holds: {self.dispatches} dispatches ({self.keyless} keyless, {self.redelivered} of them "
                f"redelivered), {self.runs} runs, {self.events} events ({self.duplicate_events} identical "
                f"copies), dead letters {dict(self.dead_letters)}"
            )
        head = f"pipeline check FAILED: {len(self.failures)} violations, keys {', '.join(self.keys_at_fault())}"
        return "\n".join([head, *failure_lines(self.failures)])

    def figures(self) -> list[tuple[str, str]]:
        return [
            ("dispatches (keyless)", f"{self.dispatches} ({self.keyless})"),
            (
                "keyless redelivered (outcome unknown)",
                f"{self.redelivered}, admitted again {self.keyless_admitted_again}",
            ),
            ("runs in the table (final scan)", f"{self.runs}"),
            ("events on the .events topics", f"{self.events}, identical copies {self.duplicate_events}"),
            ("dead letters by kind", ", ".join(f"{k} {n}" for k, n in sorted(self.dead_letters.items())) or "0"),
            ("violations", f"{len(self.failures)}"),
        ]


def check(pipeline: Pipeline) -> Report:
    """Judge `pipeline` by every rule of the module's docstring."""
    failures: list[Failure] = []
    if not pipeline.dispatched:  # a workload that published nothing, or dispatches read under the wrong names
        failures.append(Failure("nothing-dispatched", "", "no dispatch to judge the pipeline by: it proves nothing"))
    copies = _events(pipeline, failures)
    _admissions(pipeline, failures)
    admitted_again = _outcomes(pipeline, failures)
    for what, why in pipeline.unobserved:
        failures.append(Failure("unobserved", what, why))
    for parked in pipeline.parked:
        check_name = "event-set-aside" if parked.set_aside else "parked"
        what = f"set aside by the outbox ({parked.reason})" if parked.set_aside else f"a {parked.where} parked batch"
        for name in parked.names or ("",):
            failures.append(Failure(check_name, name, f"in {what}: {parked.object_key}"))
    return Report(
        ok=not failures,
        dispatches=len(pipeline.dispatched),
        keyless=sum(dispatch.key is None for dispatch in pipeline.dispatched),
        redelivered=sum(dispatch.key is None and bool(dispatch.redelivered) for dispatch in pipeline.dispatched),
        runs=len(pipeline.runs),
        events=len(pipeline.events),
        duplicate_events=copies,
        dead_letters=dict(Counter(letter.kind or "?" for letter in pipeline.dead_letters)),
        keyless_admitted_again=admitted_again,
        failures=failures,
    )


def _events(pipeline: Pipeline, failures: list[Failure]) -> int:
    """The bijection, from the events' side and the runs'; the identical copies counted."""
    admissions = {run.admission: run for run in pipeline.runs}
    first: dict[str, EventRecord] = {}
    copies = 0
    for event in pipeline.events:
        event_id = event.header("ce_id") or ""
        run = admissions.get(event_id)
        if run is None:
            failures.append(
                Failure("event-without-admission", event_id, f"on {event.topic}, subject {event.header('ce_subject')}")
            )
        else:
            if event.topic != events_topic(run.tenant):
                failures.append(
                    Failure(
                        "event-on-another-tenants-topic", run.name, f"event {event_id} of {run.tenant} on {event.topic}"
                    )
                )
            wrong = _attributes(event, run, pipeline.stack)
            if wrong:
                failures.append(Failure("event-attributes", run.name, f"event {event_id}: {'; '.join(wrong)}"))
            wrong = _value(event, run)
            if wrong:
                failures.append(Failure("event-value", run.name, f"event {event_id}'s value: {'; '.join(wrong)}"))
            if event.header("ce_subject") != run.run_id:
                detail = f"event {event_id} names run {event.header('ce_subject')}, its admission is run {run.run_id}'s"
                failures.append(Failure("event-misnamed", run.name, detail))
            announced = event.announced()
            if announced != (run.tenant, run.run_id, run.dispatch_key):
                tenant, run_id, key = announced
                detail = f"event {event_id}'s value announces run {run_id} of {tenant} (key {key}), not {run.run_id}"
                failures.append(Failure("event-misnamed", run.name, detail))
        seen = first.get(event_id)
        if seen is None:
            first[event_id] = event
        else:
            if (seen.key, seen.headers, seen.value) == (event.key, event.headers, event.value):
                copies += 1
            else:
                name = run.name if run is not None else event_id
                failures.append(Failure("distinct-events", name, f"two different events of admission {event_id}"))
    for event_id, run in admissions.items():
        if event_id not in first:
            failures.append(Failure("run-without-event", run.name, f"run {run.run_id}, admission {event_id}: no event"))
    return copies


def _attributes(event: EventRecord, run: StoredRun, stack: str) -> list[str]:
    """What of `event`'s Kafka key and CloudEvents attributes is not its stored run's (infra/asyncapi.yaml's
    runAdmitted: the key is the run's PartitionKey, the source its stack's and tenant's, the time its
    created_at); ce_id and ce_subject are judged where the event is matched to its admission."""
    expected = {
        **CONSTANT_ATTRIBUTES,
        "ce_source": f"urn:poimen:{stack}:{run.tenant}",
        "ce_time": run.created_at,
    }
    wrong = [
        f"{name} {event.header(name)!r}, not {value!r}"
        for name, value in expected.items()
        if event.header(name) != value
    ]
    traces = [value for header, value in event.headers if header == "traceparent"]
    if traces != ([run.traceparent.encode()] if run.traceparent else []):
        wrong.append(f"traceparent {traces}, not {run.traceparent!r} (the run's admission request's)")
    key = f"{run.tenant}/{run.run_id}".encode()
    if event.key != key:
        wrong.insert(0, f"key {event.key!r}, not {key!r}")
    return wrong


def _value(event: EventRecord, run: StoredRun) -> list[str]:
    """What of `event`'s value is not its stored run as the API answers it (infra/asyncapi.yaml's Run: these
    fields, no other)."""
    expected: dict[str, Any] = {
        "run_id": run.run_id,
        "tenant_id": run.tenant,
        "workflow_ref": run.spawn.workflow_ref,
        "input": json.loads(run.spawn.input),
        "goal_id": run.spawn.goal_id,
        "dispatch_key": run.dispatch_key,
        "status": "admitted",
        "created_at": run.created_at,
    }
    try:
        body = json.loads(event.value or b"null")
    except ValueError:
        body = None
    if not isinstance(body, dict):
        return [f"not a JSON object: {(event.value or b'')[:80]!r}"]
    return [
        f"{name} {body.get(name, '(absent)')!r}, not {expected.get(name, '(absent)')!r}"
        for name in sorted(expected.keys() | body.keys())
        # as JSON, not as Python: true is not 1, nor 1.0 the number 1 as admitted
        if name not in body or name not in expected or canonical(body[name]) != canonical(expected[name])
    ]


def _admissions(pipeline: Pipeline, failures: list[Failure]) -> None:
    """No keyed dispatch admitted twice, no run of no dispatch, every run its dispatch's request."""
    dispatched = {dispatch.identity: dispatch for dispatch in pipeline.dispatched}
    by_identity: dict[Identity, list[StoredRun]] = defaultdict(list)
    for run in pipeline.runs:
        by_identity[run.identity].append(run)
        dispatch = dispatched.get(run.identity)
        if dispatch is None:
            failures.append(Failure("run-of-no-dispatch", run.name, f"run {run.run_id}: nothing dispatched it"))
        elif run.spawn != dispatch.spawn:
            detail = f"run {run.run_id} carries {run.spawn}, its dispatch asked for {dispatch.spawn}"
            failures.append(Failure("run-unlike-its-dispatch", run.name, detail))
    for runs in by_identity.values():
        if len(runs) > 1 and runs[0].dispatch_key is not None:
            ids = ", ".join(run.run_id for run in runs)
            failures.append(Failure("keyed-admitted-twice", runs[0].name, f"{len(runs)} runs: {ids}"))


def _outcomes(pipeline: Pipeline, failures: list[Failure]) -> int:
    """Each dispatch ends admitted or dead-lettered, a keyless one admitted no more often than it may be;
    the keyless dispatches admitted again as redelivered, counted."""
    runs: dict[Identity, list[StoredRun]] = defaultdict(list)
    for run in pipeline.runs:
        runs[run.identity].append(run)
    by_id = {run.run_id: run for run in pipeline.runs}
    letters: dict[Identity, list[DeadLetter]] = defaultdict(list)
    dispatched = {dispatch.identity: dispatch for dispatch in pipeline.dispatched}
    # A letter naming a run, sent twice (identical), is one ending: each POST names a run of its own. Letters that
    # name none may be of two copies of one body, alike.
    once = [letter for letter in dict.fromkeys(pipeline.dead_letters) if letter.run_id]
    for letter in once + [letter for letter in pipeline.dead_letters if not letter.run_id]:
        letters[letter.identity].append(letter)
        if letter.identity not in dispatched:
            failures.append(Failure("dead-letter-of-no-dispatch", letter.name, f"{letter.kind}: {letter.detail}"))
        other = by_id.get(letter.run_id or "")
        if other is not None and other.identity != letter.identity:
            detail = f"{letter.kind} letter names run {other.run_id}, which is {other.name}'s"
            failures.append(Failure("letter-misnamed", letter.name, detail))
    admitted_again = 0
    for dispatch in dispatched.values():
        name = dispatch.name
        mine, own_letters = runs.get(dispatch.identity, []), letters.get(dispatch.identity, [])
        unknown = [letter for letter in own_letters if letter.kind == "outcome-unknown"]
        for letter in own_letters:
            if dispatch.key is not None or letter.kind != "outcome-unknown" or not letter.detail or not letter.run_id:
                why = f"{letter.kind or 'no reason'}: {letter.detail}" + ("" if letter.run_id else " (names no run)")
                failures.append(Failure("dead-lettered", name, why))
        # A record is delivered once for each copy published and once more for each redelivery the observation
        # proves; each delivery ends once: as a run, or as an outcome-unknown letter and (maybe) the run it
        # names. A run no letter names, beyond the deliveries not dead-lettered, is a dead-lettered one sent again.
        deliveries = dispatch.copies + len(dispatch.redelivered)
        named = {letter.run_id for letter in unknown}
        others = [run.run_id for run in mine if run.run_id not in named]
        if unknown and len(others) > deliveries - len(unknown):
            detail = (
                f"{len(unknown)} of {deliveries} deliveries dead-lettered as outcome-unknown naming run(s) "
                f"{', '.join(sorted(str(each) for each in named))}, yet admitted as {', '.join(others)}"
            )
            failures.append(Failure("resent-after-unknown-outcome", name, detail))
        # Every record ends admitted or dead-lettered: a keyed dispatch's copies are replays of one run, each copy
        # of a keyless one is a spawn of its own (a letter and the run it names are one copy's ending).
        if len(others) + len(own_letters) < (1 if dispatch.key is not None else dispatch.copies):
            detail = f"{dispatch.copies} record(s) published: {len(mine)} run(s), {len(own_letters)} dead letter(s)"
            failures.append(Failure("lost", name, detail))
        if dispatch.key is None and len(mine) > deliveries:
            ids = ", ".join(run.run_id for run in mine)
            again = len(dispatch.redelivered)
            detail = f"{len(mine)} runs of {dispatch.copies} record(s), redelivered {again} time(s): {ids}"
            failures.append(Failure("keyless-admitted-twice", name, detail))
        elif dispatch.key is None and (early := _before_redelivery(dispatch, mine)):
            failures.append(Failure("keyless-admitted-twice", name, early))
        elif dispatch.key is None and len(mine) > dispatch.copies:
            admitted_again += 1
    return admitted_again


def _before_redelivery(dispatch: Dispatched, runs: list[StoredRun]) -> str:
    """Why `runs` are more than the deliveries of `dispatch` before one of its redeliveries ("" if they are not):
    before the j-th redelivery's disruption (in time) it was delivered once for each copy and each earlier one."""
    created = sorted(epoch_ms(run.created_at) for run in runs)
    for earlier, redelivery in enumerate(sorted(dispatch.redelivered, key=lambda each: each.at_ms)):
        before = sum(at < redelivery.at_ms for at in created)
        if before > dispatch.copies + earlier:
            return (
                f"{before} runs admitted before {redelivery.why}, which redelivered it after them: "
                f"{dispatch.copies} record(s), {earlier} earlier redelivery(ies)"
            )
    return ""


def epoch_ms(timestamp: str) -> float:
    """A run's created_at (ISO 8601, UTC, "Z") in epoch milliseconds."""
    return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp() * 1000
