"""Redrive bookkeeping: each record sent once through `POST /v1/runs`, whichever copies of it there are,
and a copy removed only once what replaces it is sure (the run admitted, or a letter holding its value);
the counts, and the progress line."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, TextIO

from poimen.dead_letter import DeadLetterReason, dead_letter_attributes, dead_letter_body
from poimen.retention import RunRetention
from poimen.wire import rfc3339
from poimen_tools.dlq.errors import EXIT_OK, EXIT_REMAINING, DlqError, Interrupted
from poimen_tools.dlq.letters import DeadLetterQueue
from poimen_tools.dlq.model import (
    EXPIRED,
    RETENTION_UNKNOWN,
    DeadLetter,
    Dispatch,
    Held,
    Parcel,
    holds_value,
    named_run,
    record_verdict,
)
from poimen_tools.dlq.parked import FailedBatches
from poimen_tools.dlq.render import problem_summary


class Admission(Protocol):
    def spawn(self, dispatch: Dispatch) -> str | DeadLetterReason: ...

    def exists(self, tenant: str, run_id: str) -> bool: ...


@dataclass
class RedriveSummary:
    redriven: int = 0  # 201: a run admitted now
    replayed: int = 0  # 200: the run already existed (the record was admitted before)
    still_failing: int = 0  # refused again (or not a dispatch), kept with the new reason
    skipped: int = 0  # cannot be sent from here: left as it is
    # older than the run retention, or dead-lettered as expired: sending it could admit a second run; kept
    refused: int = 0
    # older than the shortest run retention a stack can have, and held to none (none given, none recorded); kept
    retention_unknown: int = 0
    would_send: int = 0  # --dry-run
    not_attempted: int = 0  # left when redrive stopped
    stopped: DlqError | None = None
    held_to_a_retention: bool = False  # the operator gave one (--run-retention-days): the refused row is shown
    # keyless-replica letters left out of the default kinds: sent only when asked for by name
    keyless_replicas_not_chosen: int = 0

    def rows(self, dry_run: bool) -> list[tuple[str, int]]:
        refused = [("refused (older than the run retention)", self.refused)]
        if not self.held_to_a_retention and not self.refused:
            refused = []
        if self.retention_unknown:
            refused.append(("refused (run retention unknown)", self.retention_unknown))
        left: list[tuple[str, int]] = []
        if self.keyless_replicas_not_chosen:
            left = [
                (
                    "not chosen: keyless-replica (send them with --kind keyless-replica)",
                    self.keyless_replicas_not_chosen,
                )
            ]
        if dry_run:
            return [("would send", self.would_send), *refused, ("skipped", self.skipped), *left]
        rows = [
            ("redriven (201)", self.redriven),
            ("replayed (200)", self.replayed),
            ("still failing", self.still_failing),
            *refused,
            ("skipped", self.skipped),
            *left,
        ]
        return [*rows, ("not attempted", self.not_attempted)] if self.stopped else rows

    @property
    def exit_code(self) -> int:
        if self.stopped:
            return self.stopped.exit_code
        kept = self.still_failing or self.skipped or self.refused or self.retention_unknown
        return EXIT_REMAINING if kept else EXIT_OK


class Progress:
    """A counter line on stderr, redrawn in place on a terminal; notices printed above it."""

    def __init__(self, total: int, stream: TextIO) -> None:
        self._total, self._done, self._stream = total, 0, stream
        self._live = stream.isatty()

    def advance(self) -> None:
        self._done += 1
        self._draw()

    def note(self, line: str) -> None:
        if self._live:
            self._stream.write("\r\033[K")  # clear the bar, print the line, draw the bar again below it
        self._stream.write(line + "\n")
        self._draw()

    def _draw(self) -> None:
        if self._live:
            width = 30
            filled = width * self._done // max(1, self._total)
            self._stream.write(f"\rredrive [{'#' * filled}{'.' * (width - filled)}] {self._done}/{self._total}")
        self._stream.flush()

    def finish(self) -> None:
        if self._live:
            self._stream.write("\n")
        else:
            self._stream.write(f"redrive: {self._done}/{self._total} dead letters handled\n")
        self._stream.flush()


@dataclass(frozen=True)
class _Resolution:
    """What became of one record, for every copy of it."""

    done: bool  # its copies may go: the run is admitted, or `survivor` holds the record from now on
    outcome: str = ""  # admitted | replayed | dead-lettered (a progress marker's note)
    survivor: str | None = None  # the queue letter that holds the record from now on


_KEEP = _Resolution(False)


class Redrive:
    """Sends dead letters through `POST /v1/runs` one at a time, oldest first; within a failed batch in
    (topic, partition, offset) order, so records of one key keep their order. Copies of one record (two
    letters of it, or a letter and a parked record: the same topic, partition, offset, timestamp and value)
    are sent once; two records at one offset (a topic recreated) are two.

    - 201 / 200: the dead letter is deleted (an object once none of its records is left), every copy of it.
    - 400, 413, 415, 422 (the record is at fault): a relay dead letter is replaced by a new message with
      the new reason (left as it is, age included, if the reason is the same, or if the new message could
      not hold the record's value); a record of a failed batch moves to the queue as a relay dead letter
      with that reason (without --queue-url, or if it would not fit SQS whole, it stays in its object).
    - every record is judged by the relay's own rule (poimen.inbox_rule) first: a failed-batch record the
      relay would dead-letter (invalid topic, null value, not JSON, a keyless replica) moves to the queue
      the same way; a relay dead letter of those kinds cannot be sent and is skipped. What the relay holds
      back although it is a spawn (expired, keyless-replica) is sent only when its kind is asked for by
      name (--kind); keyless-replica letters are not among the default kinds.
    - an `outcome-unknown` letter (a keyless record the API may have admitted) names its run: that run is
      looked up first, and if it exists the letter is done (counted as replayed) without sending anything.
    - a record older than the run retention (the shortest of --run-retention-days and those its letters
      record; its age the older of its Kafka timestamp and its oldest copy's time, deadLetteredAt or the
      batch's on-failure time), or that the relay dead-lettered as expired, is refused and kept, every
      copy of it (exit 1): its run may have expired, and sending it would admit a second one. --kind
      expired sends it all the same.
    - a record held to no run retention (none given, none recorded: a parked batch, a letter of an earlier
      version) that is older than the shortest a stack can have (1 day) is refused and kept (exit 1):
      --run-retention-days (the stack's, or forever) judges it.
    - anything else: stop. What was not confirmed stays; an object is rewritten without what was.

    Each record of a failed batch is marked done (a progress marker beside its object) as soon as it is
    admitted or moved, so a redrive that is interrupted and run again sends none of them twice. Ctrl-C
    stops after the record in flight (exit 130); a second Ctrl-C, a kill or a crash stops at once, and
    then the one record in flight may be sent again.
    """

    def __init__(
        self,
        api: Admission | None,
        queue: DeadLetterQueue | None,
        batches: FailedBatches | None,
        progress: Progress,
        plan_line: Callable[[str], None],
        run_retention: RunRetention | None = None,
        waived: Iterable[str] = (),
    ) -> None:
        self._api, self._queue, self._batches = api, queue, batches
        self._progress, self._plan_line = progress, plan_line
        self._run_retention = run_retention
        self._waived = frozenset(waived)
        self.summary = RedriveSummary(held_to_a_retention=run_retention is not None)
        self._copies: dict[str, list[tuple[Parcel, DeadLetter]]] = {}
        self._resolved: dict[str, _Resolution] = {}
        self._marked: dict[str, set[str]] = {}  # parcel id -> records marked done by this redrive
        self._deleted: set[str] = set()  # queue letters deleted by this redrive
        self._interrupted = False

    def interrupt(self) -> None:
        """Stop before the next record (the one in flight is finished and recorded first)."""
        self._interrupted = True

    @property
    def _dry_run(self) -> bool:
        return self._api is None

    def run(self, parcels: Iterable[Parcel]) -> RedriveSummary:
        chosen = list(parcels)
        for parcel in chosen:
            for letter in parcel.letters:
                if letter.record_id is not None:
                    self._copies.setdefault(letter.record_id, []).append((parcel, letter))
        for parcel in chosen:
            try:
                if parcel.in_queue:
                    (letter,) = parcel.letters
                    self._letter(parcel, letter)
                else:
                    self._object(parcel)
            except DlqError as error:  # SQS or S3 failed: stop as for the API, counting what is left
                self.summary.stopped = error
        if self._batches is not None and self._batches.orphans and not self._dry_run and not self.summary.stopped:
            try:
                self._batches.delete_markers(self._batches.orphans)
            except DlqError as error:
                self.summary.stopped = error
        self._progress.finish()
        return self.summary

    def _object(self, parcel: Parcel) -> None:
        if any(letter.record is None for letter in parcel.letters):
            for letter in parcel.letters:
                self._letter(parcel, letter)
            return  # metadata only, or unrecognised: nothing in it can be sent
        keep: list[dict[str, Any]] = []
        for letter in parcel.letters:
            assert letter.record is not None
            try:
                done = self._letter(parcel, letter).done
            except DlqError as error:  # the queue or the bucket failed: stop, but take out what was confirmed
                self.summary.stopped = error
                done = letter.record_id in self._marked.get(parcel.id, set())
            if not done:
                keep.append(letter.record)
        if self._dry_run or (len(keep) == len(parcel.letters) and not parcel.done):
            return
        assert self._batches is not None
        self._batches.settle(parcel, keep, self._marked.get(parcel.id, set()))

    def _letter(self, parcel: Parcel, letter: DeadLetter) -> _Resolution:
        """What becomes of the letter's record, decided once for all its copies and applied to each."""
        record_id = letter.record_id
        if self._interrupted and not self.summary.stopped:
            self.summary.stopped = Interrupted(
                "interrupted: the records confirmed so far are recorded; run redrive again for the rest"
            )
        if record_id is not None and record_id in self._resolved:
            if not self.summary.stopped:
                self._progress.advance()
            return self._resolved[record_id]  # another copy of it decided it, and it was applied here too
        if self.summary.stopped:
            self.summary.not_attempted += 1
            resolution = _KEEP
        else:
            self._progress.advance()
            resolution = self._resolve(parcel, letter)
        if record_id is not None:
            self._resolved[record_id] = resolution
            if resolution.done:
                self._apply(record_id, resolution)
        return resolution

    def _resolve(self, parcel: Parcel, letter: DeadLetter) -> _Resolution:
        copies = self._copies.get(letter.record_id or "", [(parcel, letter)])
        found = record_verdict([copy for _, copy in copies], time.time() * 1000, self._run_retention)
        if found is None:
            self._skip(letter, letter.blocked or "nothing to send")
            return _KEEP
        source, dispatch = found
        if isinstance(dispatch, Held):
            if dispatch.reason.kind in self._waived:  # asked for by name: sent as it is
                dispatch = dispatch.dispatch
            elif dispatch.reason.kind == EXPIRED:
                self._refuse(letter, dispatch.reason)
                return _KEEP
            elif dispatch.reason.kind == RETENTION_UNKNOWN:
                self.summary.retention_unknown += 1
                self._progress.note(f"refused: {letter.id}: {dispatch.reason.detail} (kept)")
                return _KEEP
            else:  # where the relay puts it: a dead letter of that reason
                dispatch = dispatch.reason
        if isinstance(dispatch, DeadLetterReason):
            held = _holding(copies)
            if held is not None:  # the relay dead-letters such a record: it is where it belongs
                self._skip(letter, f"{dispatch.kind}: {dispatch.detail}; it cannot be sent as it is")
                return _KEEP if self._dry_run else _Resolution(True, "dead-lettered", held.id)
            if self._dry_run:
                self._skip(letter, f"{dispatch.kind}: {dispatch.detail}; would move to the dead-letter queue")
                return _KEEP
            return self._dead_letter(letter, source, copies, dispatch)
        admitted = self._admitted(letter, copies, dispatch)
        if admitted is not None:
            return admitted
        sent = self._send(letter, dispatch)
        if sent is None:  # planned (dry run), or redrive stopped
            return _KEEP
        if isinstance(sent, DeadLetterReason):
            return self._dead_letter(letter, source, copies, sent)
        return _Resolution(True, sent)

    def _admitted(
        self, letter: DeadLetter, copies: list[tuple[Parcel, DeadLetter]], dispatch: Dispatch
    ) -> _Resolution | None:
        """A keyless record whose admission had an unknown outcome (its letter names the run) is looked up
        before it is sent: sent again under another key, it would be a second run. Done if the run is
        there; None to send it (it is not, or no copy names a run); _KEEP when the look-up failed."""
        run_id = next((named for _, copy in copies if (named := named_run(copy)) is not None), None)
        if run_id is None:
            return None
        if self._api is None:
            self._plan_line(f"would look up run {run_id} of {letter.id} (outcome unknown) before sending it")
            return None
        try:
            found = self._api.exists(dispatch.tenant, run_id)
        except DlqError as error:
            self.summary.stopped = error
            self.summary.not_attempted += 1
            return _KEEP
        if not found:
            return None
        self.summary.replayed += 1
        return _Resolution(True, "replayed")

    def _send(self, letter: DeadLetter, dispatch: Dispatch) -> str | DeadLetterReason | None:
        """`admitted` or `replayed` when confirmed; the new reason when refused; None when planned (in a
        dry run) or when redrive stopped."""
        if self._api is None:
            key = "(none: a new run)" if dispatch.dispatch_key is None else json.dumps(dispatch.dispatch_key)
            self._plan_line(f"would send {letter.id}  tenant {dispatch.tenant}  dispatch_key {key}")
            self.summary.would_send += 1
            return None
        try:
            sent = self._api.spawn(dispatch)
        except DlqError as error:
            self.summary.stopped = error
            self.summary.not_attempted += 1
            return None
        if sent == "admitted":
            self.summary.redriven += 1
        elif sent == "replayed":
            self.summary.replayed += 1
        return sent

    def _dead_letter(
        self,
        letter: DeadLetter,
        source: DeadLetter,
        copies: list[tuple[Parcel, DeadLetter]],
        reason: DeadLetterReason,
    ) -> _Resolution:
        """The record, failing again, in one relay dead letter holding its value: a letter of it already
        in the queue if its reason is the same, else a new one; where none can hold the value, every copy
        stays as it is."""
        assert source.record is not None
        held = _holding(copies)
        if held is not None and _same_reason(held.reason, reason):
            self._failing(letter, reason, "unchanged" if held.id == letter.id else f"now {held.id}")
            return _Resolution(True, "dead-lettered", held.id)
        if self._queue is None:
            self._failing(letter, reason, "kept in its object")
            return _KEEP
        record = source.record
        # The retention the relay recorded, else the operator's: redrive holds the new letter to it too.
        recorded = next((copy.run_retention for _, copy in copies if copy.run_retention is not None), None)
        # When it was first dead-lettered (or its batch failed): a record is never younger than its letter.
        first = min((copy.at for _, copy in copies if copy.at is not None), default=None)
        at = None if first is None else rfc3339(first)
        body = dead_letter_body(record, reason, recorded or self._run_retention or RunRetention(), at)
        if json.loads(body)["record"].get("value") != source.record.get("value"):  # it would lose the value
            if held is not None:
                where = "kept as it is: a dead letter with the new reason would not hold its value"
                self._failing(letter, reason, where)
                return _Resolution(True, "dead-lettered", held.id)
            self._failing(letter, reason, "kept in its object")
            return _KEEP
        try:
            survivor = f"sqs:{self._queue.send(body, dead_letter_attributes(record))}"
        except DlqError as error:  # the queue failed: stop; every copy stays
            self.summary.stopped = error
            self._failing(letter, reason, "kept as it is" if letter.id.startswith("sqs:") else "kept in its object")
            return _KEEP
        self._failing(letter, reason, f"now {survivor}")
        return _Resolution(True, "dead-lettered", survivor)

    def _apply(self, record_id: str, resolution: _Resolution) -> None:
        """Take out every copy of a record the resolution made redundant: parked ones first (a marker
        each), then letters in the queue, so that a crash in between leaves a copy, never none."""
        copies = self._copies.get(record_id, [])
        for parcel, letter in copies:
            if not parcel.in_queue:
                assert self._batches is not None
                self._batches.mark_done(letter, resolution.outcome)
                self._marked.setdefault(parcel.id, set()).add(record_id)
        for parcel, letter in copies:
            if parcel.in_queue and letter.id != resolution.survivor and letter.id not in self._deleted:
                assert self._queue is not None
                self._queue.delete(parcel)
                self._deleted.add(letter.id)

    def _failing(self, letter: DeadLetter, reason: DeadLetterReason, where: str) -> None:
        self.summary.still_failing += 1
        problem = f" {problem_summary(reason.problem)}" if reason.problem is not None else ""
        self._progress.note(f"still failing: {letter.id}: {reason.kind}: {reason.detail}{problem} ({where})")

    def _refuse(self, letter: DeadLetter, reason: DeadLetterReason) -> None:
        self.summary.refused += 1
        self._progress.note(f"refused: {letter.id}: {reason.detail} (kept; --kind {EXPIRED} sends it)")

    def _skip(self, letter: DeadLetter, why: str) -> None:
        self.summary.skipped += 1
        self._progress.note(f"skipped: {letter.id}: {why}")


def _holding(copies: list[tuple[Parcel, DeadLetter]]) -> DeadLetter | None:
    """A relay dead letter in the queue that holds the record's value, if any copy is one."""
    return next((letter for parcel, letter in copies if parcel.in_queue and holds_value(letter)), None)


def _same_reason(kept: dict[str, Any], new: DeadLetterReason) -> bool:
    return (kept.get("kind"), kept.get("status"), kept.get("problem")) == (new.kind, new.status, new.problem)


@dataclass(frozen=True)
class Plan:
    letters: int
    sendable: int
    keyless: int


def plan(parcels: Iterable[Parcel], run_retention: RunRetention | None = None, waived: Iterable[str] = ()) -> Plan:
    """What a redrive would do, counting each record once however many copies of it there are; a record the
    relay holds back (older than the run retention, a keyless replica) is not one it would send, unless its
    kind is waived (asked for by name)."""
    letters = 0
    asked = frozenset(waived)
    copies: dict[str, list[DeadLetter]] = {}
    for parcel in parcels:
        for letter in parcel.letters:
            letters += 1
            copies.setdefault(letter.record_id or letter.id, []).append(letter)
    dispatches: list[Dispatch] = []
    now_ms = time.time() * 1000
    for found in (record_verdict(same, now_ms, run_retention) for same in copies.values()):
        verdict = None if found is None else found[1]
        if isinstance(verdict, Held):
            verdict = verdict.dispatch if verdict.reason.kind in asked else None
        if isinstance(verdict, Dispatch):
            dispatches.append(verdict)
    return Plan(letters, len(dispatches), sum(dispatch.dispatch_key is None for dispatch in dispatches))
