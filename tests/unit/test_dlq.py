"""`poimen dlq`: reading relay dead letters (SQS) and failed batches (S3), showing them, and redriving them
through the real admission handler in-process (tests/unit/relay_harness.py), all on in-process moto."""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import boto3
import botocore.exceptions
import pytest
import urllib3
from aws_lambda_powertools.utilities.data_classes.kafka_event import KafkaEventRecord
from botocore.credentials import Credentials

from poimen.api import admission_service
from poimen.dead_letter import MAX_DEAD_LETTER_BYTES, DeadLetterReason, dead_letter_attributes, dead_letter_body
from poimen.retention import RUN_RETENTION_ENV, RunRetention, with_change
from poimen.store import Store
from poimen.wire import rfc3339
from poimen_tools import dlq
from poimen_tools.cli import main
from poimen_tools.dlq import EXIT_OK, EXIT_REMAINING, EXIT_UNREACHABLE, EXIT_USAGE, add_dlq_commands, letters, run_dlq
from poimen_tools.dlq.api import AdmissionApi
from poimen_tools.dlq.command import holding
from poimen_tools.dlq.errors import AwsUnavailable
from poimen_tools.dlq.letters import DeadLetterQueue, parse_message
from poimen_tools.dlq.model import Held, record_verdict
from poimen_tools.dlq.parked import FailedBatches, parse_object
from poimen_tools.dlq.redrive import Progress, Redrive, RedriveSummary
from poimen_tools.dlq.render import age
from poimen_tools.local.event_source import on_failure_record
from poimen_tools.local.msk import KafkaRecord, msk_event
from poimen_tools.local.template import Template
from tests.conftest import count_runs
from tests.unit.relay_harness import RELAY_KEY, RelayHarness
from tests.unit.test_run_retention import _expire

TRACEPARENT = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture(autouse=True)
def _short_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process moto answers at once; a 1 s long poll would only slow every scan down."""
    monkeypatch.setattr(letters, "SQS_WAIT_SECONDS", 0)


def spawn(dispatch_key: str | None = None, workflow_ref: str = "wf/hello", **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"workflow_ref": workflow_ref, "input": {"n": 1}, **fields}
    if dispatch_key is not None:
        body["dispatch_key"] = dispatch_key
    return body


def msk_record(record: KafkaRecord) -> dict[str, Any]:
    """The record as MSK delivers it (key and value base64)."""
    (group,) = msk_event([record])["records"].values()
    entry: dict[str, Any] = group[0]
    return entry


def on_failure_object(
    records: list[KafkaRecord], *, payload: bool = True, attempts: int = 3, failed_at: str | None = None
) -> bytes:
    """What Lambda writes to an MSK mapping's S3 on-failure destination, as the local event source writes
    it, its batch failed at `failed_at` (default: now); without `payload`, the metadata-only record of an SQS
    or SNS destination."""
    document = {**on_failure_record(msk_event(records), attempts), "timestamp": failed_at or rfc3339()}
    if not payload:
        del document["payload"]
    return json.dumps(document).encode()


def object_key(topic: str, partition: int = 0) -> str:
    return f"aws/lambda/{uuid.uuid4()}/{topic}-{partition}/2026/11/29/2026-11-29T12.00.00-{uuid.uuid4()}"


LOST = "lost"


class ScriptedHttp(urllib3.PoolManager):
    """The admission API with some answers replaced: None passes the call through, an int answers that
    status with a problem body (`problem_detail` in it), an exception is raised as the connection's, and
    LOST passes the call through but loses the answer (the connection drops as it comes back)."""

    def __init__(
        self, inner: urllib3.PoolManager, script: list[int | BaseException | str | None], problem_detail: str = ""
    ) -> None:
        super().__init__()
        self._inner, self.script, self.calls, self._detail = inner, script, 0, problem_detail

    def urlopen(self, method: str, url: str, redirect: bool = True, **kw: Any) -> urllib3.BaseHTTPResponse:  # type: ignore[override]
        self.calls += 1
        step = self.script.pop(0) if self.script else None
        if isinstance(step, BaseException):
            raise step
        if isinstance(step, str):  # LOST
            self._inner.urlopen(method, url, redirect, **kw)
            raise urllib3.exceptions.ProtocolError("Connection aborted.")
        if step is None:
            return self._inner.urlopen(method, url, redirect, **kw)
        problem: dict[str, Any] = {"type": f"urn:poimen:problem:scripted-{step}", "status": step}
        if self._detail:
            problem["detail"] = self._detail
        body = json.dumps(problem).encode()
        return urllib3.HTTPResponse(body=body, status=step, headers={"Content-Type": "application/problem+json"})


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@dataclass
class Stack:
    """The relay's queue (template.yaml), a failed-batch bucket and the admission handler, in-process."""

    harness: RelayHarness
    s3: Any
    bucket: str
    dynamodb: Any
    table_name: str

    @property
    def tenant(self) -> str:
        return self.harness.tenant

    @property
    def queue_url(self) -> str:
        return self.harness.queue_url

    @property
    def topic(self) -> str:
        return f"poimen.{self.tenant}.dispatch"

    def record(self, value: Any, offset: int, key: bytes | None = None, **changes: Any) -> KafkaRecord:
        return self.harness.record(value, offset, key, **changes)

    def dead_letter(self, record: KafkaRecord, reason: DeadLetterReason, run_retention_days: int | None = None) -> str:
        """The relay's dead letter of the record, written under a run retention of `run_retention_days`; without
        one, as a relay wrote it before letters recorded their retention."""
        delivered = KafkaEventRecord(msk_record(record))
        body = dead_letter_body(delivered, reason, RunRetention(run_retention_days))
        if run_retention_days is None:
            body = json.dumps({name: part for name, part in json.loads(body).items() if name != "runRetention"})
        message_id: str = self.harness.sqs.send_message(
            QueueUrl=self.queue_url,
            MessageBody=body,
            MessageAttributes=dead_letter_attributes(delivered),
        )["MessageId"]
        return message_id

    def park(self, records: list[KafkaRecord], **options: Any) -> str:
        key = object_key(records[0].topic)
        self.s3.put_object(Bucket=self.bucket, Key=key, Body=on_failure_object(records, **options))
        return key

    def messages(self) -> list[dict[str, Any]]:
        """Every message in the queue, left visible (a 0 s visibility timeout), as parsed bodies with ids."""
        found: dict[str, dict[str, Any]] = {}
        while True:
            answer = self.harness.sqs.receive_message(
                QueueUrl=self.queue_url, MaxNumberOfMessages=10, VisibilityTimeout=0
            )
            fresh = [m for m in answer.get("Messages", []) if m["MessageId"] not in found]
            if not fresh:
                return list(found.values())
            for message in fresh:
                try:
                    body = json.loads(message["Body"])
                except ValueError:
                    body = {"raw": message["Body"]}
                found[message["MessageId"]] = {"id": message["MessageId"], **body}

    def objects(self) -> dict[str, dict[str, Any]]:
        listing = self.s3.list_objects_v2(Bucket=self.bucket).get("Contents", [])
        return {
            entry["Key"]: json.loads(self.s3.get_object(Bucket=self.bucket, Key=entry["Key"])["Body"].read())
            for entry in listing
        }

    def runs(self) -> list[dict[str, Any]]:
        return count_runs(self.dynamodb, self.table_name, self.tenant)

    def api(self, http: urllib3.PoolManager | None = None) -> AdmissionApi:
        credentials = Credentials(RELAY_KEY.access_key, RELAY_KEY.secret_key)
        return AdmissionApi("https://api.example/", credentials, "us-east-1", http or self.harness.api)

    def redrive(
        self,
        http: urllib3.PoolManager | None = None,
        *,
        dry_run: bool = False,
        queue: bool = True,
        sqs: Any | None = None,
    ) -> tuple[RedriveSummary, list[str], list[str]]:
        """One redrive of everything; (summary, notices, plan lines)."""
        dead_letter_queue = DeadLetterQueue(sqs or self.harness.sqs, self.queue_url) if queue else None
        batches = FailedBatches(self.s3, self.bucket)
        notices, planned = io.StringIO(), list[str]()
        api = None if dry_run else self.api(http)
        with holding(dead_letter_queue, batches, 300) as parcels:
            summary = Redrive(api, dead_letter_queue, batches, Progress(99, notices), planned.append).run(parcels)
        return summary, notices.getvalue().splitlines(), planned

    def cli(self, *argv: str, http: urllib3.PoolManager | None = None, stdin: io.StringIO | None = None) -> Outcome:
        parser = argparse.ArgumentParser(prog="poimen")
        add_dlq_commands(parser.add_subparsers(dest="command", required=True))
        where = ["--queue-url", self.queue_url, "--bucket", self.bucket, "--api-url", "https://api.example"]
        args = parser.parse_args(["dlq", *argv, *where])
        out, err = io.StringIO(), io.StringIO()
        credentials = Credentials(RELAY_KEY.access_key, RELAY_KEY.secret_key)
        code = run_dlq(
            args,
            http=http or self.harness.api,
            credentials=credentials,
            stdin=stdin or io.StringIO(),
            stdout=out,
            stderr=err,
        )
        return Outcome(code, out.getvalue(), err.getvalue())


@dataclass
class Outcome:
    code: int
    out: str
    err: str


@pytest.fixture
def stack(
    template: Template,
    handler: Callable[[dict[str, Any], Any], dict[str, Any]],
    store: Store,
    dynamodb: Any,
    table_name: str,
) -> Stack:
    harness = RelayHarness.start(template, handler, store)
    s3 = boto3.client("s3")
    bucket = f"failed-batches-{uuid.uuid4().hex[:8]}"
    s3.create_bucket(Bucket=bucket)
    return Stack(harness, s3, bucket, dynamodb, table_name)


RELAY_ERROR = DeadLetterReason("relay-error", "RuntimeError: the relay tripped over something")


# -- reading --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["invalid-topic", "empty-value", "undecodable", "invalid-json", "rejected"])
def test_a_relay_dead_letter_is_read_with_its_kind_record_and_time(kind: str) -> None:
    record = KafkaRecord(topic="poimen.acme.dispatch", partition=2, offset=15, timestamp_ms=0, value=b"{}", key=b"k")
    body = dead_letter_body(
        KafkaEventRecord(msk_record(record)), DeadLetterReason(kind, "why", 400, {"x": 1}), RunRetention()
    )

    parcel = parse_message("m-1", body)

    (letter,) = parcel.letters
    assert (parcel.id, letter.id, letter.kind, parcel.kind, parcel.records) == ("sqs:m-1", "sqs:m-1", kind, kind, 1)
    assert letter.reason == {"kind": kind, "detail": "why", "status": 400, "problem": {"x": 1}}
    assert letter.record is not None
    assert letter.record["offset"] == 15
    assert letter.coordinates == "poimen.acme.dispatch/2/15"
    assert letter.blocked is None
    assert letter.at is not None
    assert abs((datetime.now(UTC) - letter.at).total_seconds()) < 60


def test_a_dead_letter_whose_value_was_omitted_says_where_to_read_it_again() -> None:
    record = KafkaRecord(topic="poimen.acme.dispatch", partition=0, offset=7, timestamp_ms=0, value=b"x" * 900_000)
    body = dead_letter_body(KafkaEventRecord(msk_record(record)), RELAY_ERROR, RunRetention())

    (letter,) = parse_message("m", body).letters

    assert letter.blocked == "value omitted; read it again from Kafka at poimen.acme.dispatch/0/7"


def test_a_failed_batch_object_is_read_record_by_record_in_offset_order() -> None:
    records = [
        KafkaRecord(topic="poimen.acme.dispatch", partition=1, offset=offset, timestamp_ms=0, value=b"{}")
        for offset in (12, 10, 11)
    ]
    key = "aws/lambda/x/poimen.acme.dispatch-1/2026/11/29/2026-11-29T12.00.00-y"

    parcel = parse_object(key, on_failure_object(records, attempts=101, failed_at="2026-11-29T12:00:00.000Z"))

    assert (parcel.kind, parcel.records) == ("failed-batch", 3)
    assert [letter.id for letter in parcel.letters] == [f"s3:{key}#poimen.acme.dispatch-1@{n}" for n in (10, 11, 12)]
    assert parcel.letters[0].reason["detail"] == "the batch failed 101 invocations (RetryAttemptsExhausted, Unhandled)"
    assert parcel.at == datetime(2026, 11, 29, 12, tzinfo=UTC)


def test_a_failed_batch_without_its_records_points_at_kafka() -> None:
    records = [
        KafkaRecord(topic="poimen.acme.dispatch", partition=0, offset=n, timestamp_ms=0, value=b"{}") for n in (4, 9)
    ]

    parcel = parse_message("m", on_failure_object(records, payload=False).decode())

    (letter,) = parcel.letters
    assert (parcel.kind, parcel.records, letter.record) == ("failed-batch", 2, None)
    assert letter.blocked == "metadata only; read the batch again from Kafka at poimen.acme.dispatch-0 offsets 4..9"


@pytest.mark.parametrize(
    ("body", "note"),
    [
        ("not json", "the message body is not JSON"),
        ('{"record": {}}', "neither a relay dead letter nor a Lambda on-failure record"),
    ],
)
def test_anything_else_in_the_queue_is_unrecognised(body: str, note: str) -> None:
    parcel = parse_message("m", body)

    assert (parcel.kind, parcel.note) == ("unrecognised", note)
    assert parcel.letters[0].blocked == f"{note}; inspect it by hand"


def test_an_object_that_is_not_an_on_failure_record_is_unrecognised() -> None:
    assert parse_object("k", b"\xff").note == "the object is not JSON"
    assert parse_object("k", b"{}").note == "not a Lambda on-failure invocation record"
    broken = json.loads(on_failure_object([]))
    broken["payload"] = '{"records": 3}'
    assert parse_object("k", json.dumps(broken).encode()).note == "its payload is not an aws:kafka event"


# -- list and show --------------------------------------------------------------------------------------


def test_list_counts_by_kind_and_removes_nothing(stack: Stack) -> None:
    # Given two relay dead letters of two kinds and a failed batch of three records
    stack.dead_letter(stack.record(spawn("a"), 1), RELAY_ERROR)
    stack.dead_letter(stack.record(b"nope", 2), DeadLetterReason("invalid-json", "value is not JSON"))
    stack.park([stack.record(spawn(f"b-{n}"), 10 + n) for n in range(3)], failed_at="2026-11-29T12:00:00.000Z")

    # When they are listed, as JSON and as text
    listed = stack.cli("list", "--json")
    text = stack.cli("list", "--ids")

    # Then each kind is counted, the failed batch by object and by record
    assert listed.code == EXIT_OK
    kinds = json.loads(listed.out)["kinds"]
    assert {kind: (entry["letters"], entry["records"]) for kind, entry in kinds.items()} == {
        "invalid-json": (1, 1),
        "relay-error": (1, 1),
        "failed-batch": (1, 3),
    }
    assert kinds["failed-batch"]["oldest"] == "2026-11-29T12:00:00.000Z"
    assert kinds["relay-error"]["newestAgeSeconds"] < 60
    assert len(json.loads(listed.out)["deadLetters"]) == 5
    assert text.out.splitlines()[0].split() == ["kind", "letters", "records", "oldest", "newest"]
    assert text.out.splitlines()[4].split()[:3] == ["total", "3", "5"]
    assert "value is not JSON" in text.out
    # And nothing was deleted, and every message is visible again at once
    assert len(stack.messages()) == 2
    assert len(stack.objects()) == 1


def test_list_of_nothing(stack: Stack) -> None:
    assert stack.cli("list").out == "no dead letters\n"


def test_list_through_the_poimen_command(stack: Stack, capsys: pytest.CaptureFixture[str]) -> None:
    stack.dead_letter(stack.record(spawn("a"), 1), RELAY_ERROR)

    code = main(["dlq", "list", "--json", "--queue-url", stack.queue_url])

    assert code == EXIT_OK
    assert json.loads(capsys.readouterr().out)["kinds"]["relay-error"]["letters"] == 1


def test_show_decodes_a_rejected_dead_letter(stack: Stack) -> None:
    # Given a record the API rejects: its dispatch_key was used for another payload
    assert stack.harness.run([stack.record(spawn("k-1"), 1, b"key-1")]).relayed == 1
    headers = [("traceparent", TRACEPARENT)]
    stack.harness.run([stack.record(spawn("k-1", workflow_ref="wf/other"), 2, b"key-1", headers=headers)])
    (message,) = stack.messages()

    # When it is shown
    shown = stack.cli("show", f"sqs:{message['id']}", "--json")
    text = stack.cli("show", f"sqs:{message['id']}")

    # Then key, value and headers are decoded, and the reason carries the API's problem
    document = json.loads(shown.out)
    assert document["id"] == f"sqs:{message['id']}"
    assert document["key"] == "key-1"
    assert document["value"] == spawn("k-1", workflow_ref="wf/other")
    assert document["headers"] == {"traceparent": TRACEPARENT.decode()}
    assert document["reason"]["kind"] == "rejected"
    assert document["reason"]["status"] == 422
    assert document["reason"]["problem"]["type"] == "urn:poimen:problem:dispatch-key-reused"
    assert document["redrive"].startswith(f'POST /v1/runs for tenant {stack.tenant}, dispatch_key "k-1"')
    assert "reason:        rejected: the admission API answered 422" in text.out
    assert '"workflow_ref": "wf/other"' in text.out
    assert "dispatch-key-reused" in text.out
    assert len(stack.messages()) == 1


def test_show_one_record_of_a_failed_batch_and_the_whole_batch(stack: Stack) -> None:
    key = stack.park([stack.record(spawn("a"), 5), stack.record(b"\xff\xfe", 6)])

    one = json.loads(stack.cli("show", f"s3:{key}#{stack.topic}-0@6", "--json").out)
    both = json.loads(stack.cli("show", f"s3:{key}", "--json").out)

    assert one["value"] == {"base64": base64.b64encode(b"\xff\xfe").decode()}
    assert one["redrive"].startswith("not possible: undecodable: value is not UTF-8")
    assert [letter["offset"] for letter in both] == [5, 6]
    assert "failed-batch: the batch failed 3 invocations" in stack.cli("show", f"s3:{key}").out


def test_show_an_omitted_value(stack: Stack) -> None:
    message_id = stack.dead_letter(stack.record(b"x" * 900_000, 7), RELAY_ERROR)

    shown = json.loads(stack.cli("show", f"sqs:{message_id}", "--json").out)

    assert shown["value"]["omitted"] == {"reason": "too large for SQS", "length": 1_200_000}
    assert shown["redrive"] == f"not possible: value omitted; read it again from Kafka at {stack.topic}/0/7"


@pytest.mark.parametrize(
    ("dead_letter_id", "message"),
    [
        ("sqs:nope", "no message sqs:nope in "),
        ("s3:missing/key", "no object s3://"),
        ("nope", "'nope' is not a dead-letter ID"),
    ],
)
def test_show_an_unknown_id(stack: Stack, dead_letter_id: str, message: str) -> None:
    shown = stack.cli("show", dead_letter_id)

    assert shown.code == EXIT_USAGE
    assert shown.err.startswith(f"poimen dlq show: {message}")
    assert shown.err.count("\n") == 1


# -- redrive ----------------------------------------------------------------------------------------------


def test_redrive_admits_a_relay_error_once_and_deletes_it(stack: Stack) -> None:
    # Given a valid dispatch the relay dead-lettered on an unforeseen fault
    stack.dead_letter(stack.record(spawn("k-1"), 1, headers=[("traceparent", TRACEPARENT)]), RELAY_ERROR)

    # When it is redriven, twice
    first, _, _ = stack.redrive()
    second, _, _ = stack.redrive()

    # Then one run, signed and forwarded as the relay would, and the dead letter is gone
    assert (first.redriven, first.replayed, first.exit_code) == (1, 0, EXIT_OK)
    assert second == RedriveSummary()
    assert len(stack.runs()) == 1
    assert stack.messages() == []
    (received,) = stack.harness.api.received
    assert received["x-poimen-tenant"] == stack.tenant
    assert received["content-type"] == "application/json"
    assert received["traceparent"] == TRACEPARENT.decode()
    assert received["authorization"].startswith(f"AWS4-HMAC-SHA256 Credential={RELAY_KEY.access_key}/")
    assert "/execute-api/aws4_request" in received["authorization"]


def test_redrive_of_an_admitted_record_is_a_replay(stack: Stack) -> None:
    stack.harness.run([stack.record(spawn("k-1"), 1)])
    stack.dead_letter(stack.record(spawn("k-1"), 1), RELAY_ERROR)

    summary, _, _ = stack.redrive()

    assert (summary.redriven, summary.replayed) == (0, 1)
    assert len(stack.runs()) == 1
    assert stack.messages() == []


def test_a_keyless_record_redriven_is_a_new_run_and_is_gone_after(stack: Stack) -> None:
    stack.dead_letter(stack.record(spawn(), 1), RELAY_ERROR)

    assert stack.redrive()[0].redriven == 1
    assert stack.redrive()[0] == RedriveSummary()
    assert len(stack.runs()) == 1


def _rows(out: str) -> list[list[str]]:
    return [line.rsplit(maxsplit=1) for line in out.splitlines()]


KEYLESS_REPLICAS_ROW = ["not chosen: keyless-replica (send them with --kind keyless-replica)", "1"]


def test_redrive_leaves_keyless_replica_letters_unless_asked_for_by_name(stack: Stack) -> None:
    # Given a keyless spawn replicated from the cluster `west`, which the relay dead-letters (its original is
    # relayed in its own Region: every keyless spawn leaves such a letter in each peer's queue)
    record = stack.record(spawn(), 5, topic=f"west.poimen.{stack.tenant}.dispatch")
    stack.harness.run([record])
    listed = json.loads(stack.cli("list", "--json").out)
    # When the queue is redriven with the default kinds
    default = stack.cli("redrive", "--yes")
    # Then nothing was sent: the letter is kept, and the summary and a line say how many and why
    assert {kind: entry["letters"] for kind, entry in listed["kinds"].items()} == {"keyless-replica": 1}
    assert default.code == EXIT_OK
    assert stack.runs() == []
    assert len(stack.messages()) == 1
    assert KEYLESS_REPLICAS_ROW in _rows(default.out)
    assert (
        "not chosen: 1 keyless-replica dead letter: a keyless spawn replicated from another Region, relayed "
        "there from its original; send it with --kind keyless-replica only if that Region lost the original"
    ) in default.err.splitlines()
    # When it is asked for by name (its Region lost the original)
    named = stack.cli("redrive", "--yes", "--kind", "keyless-replica")
    # Then it is sent once, under the dispatch_key derived from the record, and is gone
    assert named.code == EXIT_OK
    (run,) = stack.runs()
    assert run["dispatch_key"]["S"] == dlq.model.derived_key(msk_record(record))
    assert stack.messages() == []


def test_a_parked_batch_of_a_replicated_topic_admits_its_keyless_records_no_second_time(stack: Stack) -> None:
    # Given a keyless spawn relayed in its own Region from its original topic (one run), and its replica's
    # batch parked here beside a keyed spawn, by an outage
    replica = f"west.poimen.{stack.tenant}.dispatch"
    stack.harness.run([stack.record(spawn(), 1)])
    stack.park([stack.record(spawn(), 1, topic=replica), stack.record(spawn("k-1"), 2, topic=replica)])
    # When the parked batch is redriven, as the runbook says once the outage is over
    outcome = stack.cli("redrive", "--yes")
    # Then the keyed spawn is a run and the keyless one is not admitted again: it is the queue's keyless-replica
    # letter the relay would have made, and nothing is left in the bucket
    assert sorted(str(run.get("dispatch_key", {}).get("S")) for run in stack.runs()) == ["None", "k-1"]
    (letter,) = stack.messages()
    assert (letter["record"]["topic"], letter["record"]["offset"]) == (replica, 1)
    assert letter["reason"]["kind"] == "keyless-replica"
    assert stack.objects() == {}
    assert outcome.code == EXIT_REMAINING
    assert ["still failing", "1"] in _rows(outcome.out)
    assert any(
        line.startswith("still failing: s3:") and ": keyless-replica: " in line for line in outcome.err.splitlines()
    )


def test_a_keyless_record_whose_answer_was_lost_is_one_run_when_sent_again(stack: Stack) -> None:
    # Given a keyless record, dead-lettered and parked in a batch
    stack.dead_letter(stack.record(spawn(), 1), RELAY_ERROR)
    stack.park([stack.record(spawn(), 2)])

    # When each is admitted but its answer is lost (the parked one first: it is older), and redriven again
    # (each keyless record a look-up of the run of its key of earlier versions, then its POST)
    first, _, _ = stack.redrive(ScriptedHttp(stack.harness.api, [None, LOST]))
    second, _, _ = stack.redrive(ScriptedHttp(stack.harness.api, [None, None, None, LOST]))
    last, _, _ = stack.redrive()

    # Then each was sent again under the same derived dispatch_key: a replay, one run per record
    assert isinstance(first.stopped, dlq.errors.ApiUnavailable)
    assert (second.redriven, second.replayed, last.redriven, last.replayed) == (0, 1, 0, 1)
    runs = stack.runs()
    assert len(runs) == 2
    assert all(run["dispatch_key"]["S"].startswith("poimen-redrive/") for run in runs)
    assert stack.messages() == []
    assert stack.objects() == {}


def test_redrive_of_a_failed_batch_admits_each_record_once(stack: Stack) -> None:
    # Given a parked batch of three records, the third repeating the first's dispatch_key
    stack.park([stack.record(spawn("a"), 10, b"k"), stack.record(spawn("b"), 11), stack.record(spawn("a"), 12, b"k")])

    # When it is redriven
    summary, notices, _ = stack.redrive()

    # Then two runs, one replay, and the object is gone
    assert (summary.redriven, summary.replayed, summary.still_failing, summary.skipped) == (2, 1, 0, 0)
    assert len(stack.runs()) == 2
    assert stack.objects() == {}
    assert notices == ["redrive: 3/99 dead letters handled"]


def test_a_record_rejected_again_is_replaced_with_its_new_reason(stack: Stack) -> None:
    # Given a dead letter whose cause is not fixed: its key is taken by another payload
    stack.harness.run([stack.record(spawn("k-1"), 1)])
    old = stack.dead_letter(stack.record(spawn("k-1", workflow_ref="wf/other"), 2), RELAY_ERROR)

    # When it is redriven, twice
    first, notices, _ = stack.redrive()
    second, third_notices, _ = stack.redrive()

    # Then it stays, once, with the API's answer as its reason; replaced once, then left as it is
    assert (first.still_failing, first.exit_code) == (1, EXIT_REMAINING)
    assert second.still_failing == 1
    (letter,) = stack.messages()
    assert letter["id"] != old
    assert notices[0].endswith(f"(now sqs:{letter['id']})")
    assert third_notices[0].endswith("dispatch-key-reused (unchanged)")
    assert letter["reason"]["kind"] == "rejected"
    assert letter["reason"]["status"] == 422
    assert letter["reason"]["problem"]["type"] == "urn:poimen:problem:dispatch-key-reused"
    assert letter["record"]["offset"] == 2
    assert notices[0].startswith(f"still failing: sqs:{old}: rejected: the admission API answered 422")
    assert len(stack.runs()) == 1


def test_what_cannot_be_sent_from_the_queue_is_skipped_and_left(stack: Stack) -> None:
    omitted = stack.dead_letter(stack.record(b"x" * 900_000, 1), RELAY_ERROR)
    invalid = stack.dead_letter(stack.record(b"[1]", 2), DeadLetterReason("invalid-json", "value is not a JSON object"))
    stack.harness.sqs.send_message(QueueUrl=stack.queue_url, MessageBody="hello")

    summary, notices, _ = stack.redrive()

    assert (summary.skipped, summary.exit_code) == (3, EXIT_REMAINING)
    assert len(stack.messages()) == 3
    assert f"skipped: sqs:{omitted}: value omitted; read it again from Kafka at {stack.topic}/0/1" in notices
    assert f"skipped: sqs:{invalid}: invalid-json: value is not a JSON object; it cannot be sent as it is" in notices
    assert stack.harness.api.received == []


def test_failed_batch_records_that_fail_again_move_to_the_queue(stack: Stack) -> None:
    # Given a batch with a good record, one whose key is taken, and one that is not JSON
    stack.harness.run([stack.record(spawn("taken"), 1)])
    stack.park(
        [stack.record(spawn("good"), 5), stack.record(spawn("taken", workflow_ref="x"), 6), stack.record(b"{", 7)]
    )

    # When it is redriven
    summary, _, _ = stack.redrive()

    # Then the good one is admitted and the two others are relay dead letters with their reasons
    assert (summary.redriven, summary.still_failing) == (1, 2)
    assert stack.objects() == {}
    letters = sorted(stack.messages(), key=lambda letter: letter["record"]["offset"])
    assert [(letter["record"]["offset"], letter["reason"]["kind"]) for letter in letters] == [
        (6, "rejected"),
        (7, "invalid-json"),
    ]
    assert letters[0]["reason"]["status"] == 422
    assert len(stack.runs()) == 2


def test_without_a_queue_still_failing_records_stay_in_their_object(stack: Stack) -> None:
    stack.harness.run([stack.record(spawn("taken"), 1)])
    key = stack.park([stack.record(spawn("good"), 5), stack.record(spawn("taken", workflow_ref="x"), 6)])

    summary, notices, _ = stack.redrive(queue=False)

    assert (summary.redriven, summary.still_failing) == (1, 1)
    assert "(kept in its object)" in notices[0]
    kept = parse_object(key, json.dumps(stack.objects()[key]).encode())
    assert [letter.id for letter in kept.letters] == [f"s3:{key}#{stack.topic}-0@6"]
    assert stack.objects()[key]["KafkaBatchInfo"]["batchSize"] == 1
    assert isinstance(stack.objects()[key]["payload"], str)


class FailingSends:
    """An SQS client whose SendMessage cannot reach SQS."""

    def __init__(self, sqs: Any) -> None:
        self._sqs = sqs

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sqs, name)

    def send_message(self, **_: Any) -> Any:
        raise botocore.exceptions.EndpointConnectionError(endpoint_url="https://sqs.us-east-1.amazonaws.com")


def test_a_queue_failing_mid_batch_stops_but_takes_the_confirmed_records_out(stack: Stack) -> None:
    # Given a batch of a record that fails again, then a good one, then another
    stack.harness.run([stack.record(spawn("taken"), 1)])
    records = [stack.record(spawn("good"), 4), stack.record(spawn("taken", workflow_ref="x"), 5)]
    key = stack.park([*records, stack.record(spawn("later"), 6)])

    # When the queue cannot take the failing record's dead letter
    summary, _, _ = stack.redrive(sqs=FailingSends(stack.harness.sqs))

    # Then redrive stops; the object keeps exactly what was neither confirmed nor moved
    assert isinstance(summary.stopped, AwsUnavailable)
    assert str(summary.stopped).startswith("cannot send a dead letter to ")
    assert (summary.redriven, summary.not_attempted, summary.exit_code) == (1, 1, EXIT_UNREACHABLE)
    kept = parse_object(key, json.dumps(stack.objects()[key]).encode())
    assert [letter.record["offset"] for letter in kept.letters if letter.record] == [5, 6]
    assert stack.messages() == []


def test_an_unavailable_api_stops_redrive_and_leaves_what_was_not_confirmed(stack: Stack) -> None:
    # Given a batch of three, and a relay dead letter dead-lettered after it
    key = stack.park([stack.record(spawn(f"k-{n}"), n) for n in range(3)])
    later = stack.dead_letter(stack.record(spawn("later"), 9), RELAY_ERROR)
    http = ScriptedHttp(stack.harness.api, [None, 503])

    # When the API answers the first record, then 503
    summary, _, _ = stack.redrive(http)

    # Then the first is admitted and removed from the object; the rest stays, nothing more is sent
    assert (summary.redriven, summary.not_attempted, summary.exit_code) == (1, 3, EXIT_UNREACHABLE)
    assert "answered 503" in str(summary.stopped)
    assert http.calls == 2
    kept = parse_object(key, json.dumps(stack.objects()[key]).encode())
    assert [letter.record["offset"] for letter in kept.letters if letter.record] == [1, 2]
    assert [letter["id"] for letter in stack.messages()] == [later]

    # And a second redrive, with the API back, finishes the job without a second run
    assert stack.redrive()[0].redriven == 3
    assert len(stack.runs()) == 4


def value_filling(stack: Stack, offset: int, reason: DeadLetterReason) -> KafkaRecord:
    """A keyed dispatch whose dead letter with `reason` holds its value, padded as far as it can be (to
    within a few bytes of SQS's limit): with a longer reason, that letter would leave something out."""

    def letter(pad: int) -> tuple[KafkaRecord, str]:
        record = stack.record(spawn("big", input={"pad": "x" * pad}), offset)
        return record, dead_letter_body(KafkaEventRecord(msk_record(record)), reason, RunRetention())

    low, high = 0, MAX_DEAD_LETTER_BYTES  # the letter holds its value with `low`, not with `high`
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if "valueOmitted" not in json.loads(letter(middle)[1])["record"] else (low, middle)
    return letter(low)[0]


def test_a_letter_holding_its_value_is_kept_when_its_replacement_would_lose_it(stack: Stack) -> None:
    # Given a dead letter of a large record that holds its value, under a short reason
    reason = DeadLetterReason("relay-error", "x")
    record = value_filling(stack, 4, reason)
    original = stack.dead_letter(record, reason)
    (letter,) = stack.messages()
    assert letter["record"]["value"] is not None

    # When its redrive is refused with a large problem: a letter with that reason would not hold the value
    http = ScriptedHttp(stack.harness.api, [422], problem_detail="y" * 5000)
    summary, notices, _ = stack.redrive(http)

    # Then the original letter is kept, value and all, and nothing replaces it
    assert (summary.still_failing, summary.exit_code) == (1, EXIT_REMAINING)
    (kept,) = stack.messages()
    assert kept["id"] == original
    assert kept["record"]["value"] == letter["record"]["value"]
    assert kept["reason"] == letter["reason"]
    assert notices[0].endswith("(kept as it is: a dead letter with the new reason would not hold its value)")
    assert stack.runs() == []


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt(), RuntimeError("the redrive broke")], ids=repr)
def test_an_interrupted_redrive_of_a_parked_batch_sends_nothing_twice(stack: Stack, interrupt: BaseException) -> None:
    # Given a parked batch of twelve keyless records
    stack.park([stack.record(spawn(), offset) for offset in range(12)])

    # When redrive is interrupted while it sends the fifth (each keyless record a look-up of the run of its
    # key of earlier versions, then its POST)
    with pytest.raises(type(interrupt)):
        stack.redrive(ScriptedHttp(stack.harness.api, [*[None] * 9, interrupt]))

    # Then four runs, and the parked batch reads as the eight records left
    assert len(stack.runs()) == 4
    (parcel,) = FailedBatches(stack.s3, stack.bucket).read_all()
    assert [letter.record["offset"] for letter in parcel.letters if letter.record] == list(range(4, 12))
    assert json.loads(stack.cli("list", "--json").out)["kinds"]["failed-batch"]["records"] == 8

    # And the next redrive admits exactly those: one run per record, and nothing is left
    summary, _, _ = stack.redrive()
    assert (summary.redriven, summary.replayed) == (8, 0)
    assert len(stack.runs()) == 12
    assert stack.objects() == {}


def test_a_parked_batchs_bad_record_is_dead_lettered_once_across_interrupted_redrives(stack: Stack) -> None:
    # Given a parked batch of a record that is not JSON and two keyless dispatches
    stack.park([stack.record(b"{", 5), stack.record(spawn(), 6), stack.record(spawn(), 7)])

    # When a redrive moves the bad one to the queue, admits the next, and is interrupted on the last (each
    # keyless record a look-up of the run of its key of earlier versions, then its POST)
    with pytest.raises(KeyboardInterrupt):
        stack.redrive(ScriptedHttp(stack.harness.api, [None, None, None, KeyboardInterrupt()]))
    summary, _, _ = stack.redrive()

    # Then the bad record is one dead letter, the two dispatches two runs, and the object is gone
    assert (summary.redriven, summary.still_failing) == (1, 0)
    (letter,) = stack.messages()
    assert (letter["record"]["offset"], letter["reason"]["kind"]) == (5, "invalid-json")
    assert len(stack.runs()) == 2
    assert stack.objects() == {}


def test_progress_markers_are_read_with_their_object_and_go_with_it(stack: Stack) -> None:
    # Given a parked batch of three that a stopped redrive rewrote to the two it did not admit, a progress
    # marker saying the first of those is done, and the marker of an object that is gone
    key = stack.park([stack.record(spawn("a"), 1), stack.record(spawn("b"), 2), stack.record(spawn("c"), 3)])
    assert stack.redrive(ScriptedHttp(stack.harness.api, [None, 503]))[0].redriven == 1
    stack.s3.put_object(Bucket=stack.bucket, Key=f"{key}.progress/{stack.topic}-0@2", Body=b'{"outcome": "admitted"}')
    orphan = f"{object_key(stack.topic)}.progress/{stack.topic}-0@9"
    stack.s3.put_object(Bucket=stack.bucket, Key=orphan, Body=b'{"outcome": "admitted"}')

    # When the bucket is listed, and redriven
    listed = json.loads(stack.cli("list", "--json").out)
    summary, _, _ = stack.redrive()

    # Then the markers are no dead letters: the object reads as the record left, then all of it is gone
    assert listed["kinds"] == {"failed-batch": {**listed["kinds"]["failed-batch"], "letters": 1, "records": 1}}
    assert [letter["id"] for letter in listed["deadLetters"]] == [f"s3:{key}#{stack.topic}-0@3"]
    assert (summary.redriven, summary.replayed) == (1, 0)
    assert len(stack.runs()) == 2
    assert stack.objects() == {}


def test_two_letters_of_one_record_are_one_record(stack: Stack) -> None:
    # Given a keyless record dead-lettered twice (a crash repeated its dead letter)
    record = stack.record(spawn(), 3)
    letters = {stack.dead_letter(record, RELAY_ERROR), stack.dead_letter(record, RELAY_ERROR)}

    # When they are listed
    listed = json.loads(stack.cli("list", "--json").out)
    text = stack.cli("list", "--ids").out

    # Then two letters of one record, each shown with the record's topic/partition/offset
    assert (listed["kinds"]["relay-error"]["letters"], listed["kinds"]["relay-error"]["records"]) == (2, 1)
    assert {entry["where"] for entry in listed["deadLetters"]} == {f"{stack.topic}/0/3"}
    assert all(f"{stack.topic}/0/3" in line for line in text.splitlines() if line.startswith("sqs:"))

    # When a redrive is stopped by the API, then one goes through
    stopped, _, _ = stack.redrive(ScriptedHttp(stack.harness.api, [503]))
    assert {letter["id"] for letter in stack.messages()} == letters
    summary, _, _ = stack.redrive()

    # Then the record was sent once: one run, and both letters are gone only then
    assert (stopped.not_attempted, summary.redriven, summary.replayed) == (1, 1, 0)
    assert len(stack.runs()) == 1
    assert stack.messages() == []


def test_two_records_at_one_offset_of_a_recreated_topic_are_two_records(stack: Stack) -> None:
    # Given two letters at the same topic, partition and offset: order-A, 9 days old, and order-B, new (the
    # topic was recreated, its offsets started again), written by a relay keeping runs 30 days
    order_a = stack.record(spawn("order-A"), 3, timestamp_ms=days_ago(9))
    order_b = stack.record(spawn("order-B"), 3)
    stack.dead_letter(order_a, RELAY_ERROR, 30)
    stack.dead_letter(order_b, RELAY_ERROR, 30)
    listed = json.loads(stack.cli("list", "--json").out)
    # When the queue is redriven
    outcome = stack.cli("redrive", "--yes")
    # Then both were listed as records of their own, each is a run, and no letter is left
    assert (listed["kinds"]["relay-error"]["letters"], listed["kinds"]["relay-error"]["records"]) == (2, 2)
    assert outcome.code == EXIT_OK
    assert sorted(run["dispatch_key"]["S"] for run in stack.runs()) == ["order-A", "order-B"]
    assert stack.messages() == []


def test_a_parked_record_and_a_letter_at_one_offset_with_other_values_are_two_records(stack: Stack) -> None:
    # Given a parked record, and a letter of another record at the same coordinates and time but with another
    # value, its value left out of the letter (too large for SQS): its digest still tells them apart
    stack.park([stack.record(spawn("parked"), 4)])
    other = stack.record(spawn("lettered"), 4)
    body = json.loads(dead_letter_body(KafkaEventRecord(msk_record(other)), RELAY_ERROR, RunRetention()))
    value = body["record"].pop("value")
    body["record"] |= {"value": None, "valueOmitted": {"reason": "too large for SQS", "length": len(value)}}
    body["record"]["valueSha256"] = hashlib.sha256(value.encode()).hexdigest()
    stack.harness.sqs.send_message(QueueUrl=stack.queue_url, MessageBody=json.dumps(body))
    # When everything is redriven
    summary, notices, _ = stack.redrive()
    # Then the parked record is a run, and the letter without its value is skipped, not taken for a copy of it
    assert [run["dispatch_key"]["S"] for run in stack.runs()] == ["parked"]
    assert (summary.redriven, summary.skipped) == (1, 1)
    assert len(stack.messages()) == 1
    assert any("value omitted; read it again from Kafka" in line for line in notices)


def test_a_record_both_parked_and_dead_lettered_is_sent_once(stack: Stack) -> None:
    # Given a keyless record still in its parked batch and also in the queue
    record = stack.record(spawn(), 8)
    stack.dead_letter(record, RELAY_ERROR)
    stack.park([record, stack.record(spawn(), 9)])

    # When everything is redriven
    summary, _, _ = stack.redrive()

    # Then each record became one run, and neither copy is left
    assert summary.redriven == 2
    assert len(stack.runs()) == 2
    assert stack.messages() == []
    assert stack.objects() == {}


@pytest.mark.parametrize(
    ("failure", "message"),
    [
        (urllib3.exceptions.ProtocolError("Connection aborted."), "cannot reach the admission API at"),
        (403, "the admission API refused the caller with 403"),
        (404, "the admission API refused the caller with 404"),
        (429, "the admission API answered 429"),
    ],
)
def test_the_api_unreachable_or_refusing_ends_in_one_line_and_exit_3(
    stack: Stack, failure: int | Exception, message: str
) -> None:
    stack.dead_letter(stack.record(spawn("k-1"), 1), RELAY_ERROR)

    outcome = stack.cli("redrive", "--yes", http=ScriptedHttp(stack.harness.api, [failure]))

    assert outcome.code == EXIT_UNREACHABLE
    (line,) = outcome.err.splitlines()[-1:]
    assert line.startswith(f"poimen dlq redrive: stopped: {message}")
    assert "not attempted" in outcome.out
    assert len(stack.messages()) == 1
    assert stack.runs() == []


def test_a_dry_run_sends_and_changes_nothing(stack: Stack) -> None:
    message_id = stack.dead_letter(stack.record(spawn("k-1"), 1), RELAY_ERROR)
    key = stack.park([stack.record(spawn(), 5), stack.record(b"{", 6)])

    summary, notices, planned = stack.redrive(dry_run=True)

    assert (summary.would_send, summary.skipped) == (2, 1)
    assert sorted(planned) == [
        f"would send s3:{key}#{stack.topic}-0@5  tenant {stack.tenant}  dispatch_key (none: a new run)",
        f'would send sqs:{message_id}  tenant {stack.tenant}  dispatch_key "k-1"',
    ]
    assert any("would move to the dead-letter queue" in line for line in notices)
    assert len(stack.messages()) == 1
    assert len(stack.objects()) == 1
    assert stack.harness.api.received == []


def test_redrive_only_the_chosen_kinds(stack: Stack) -> None:
    stack.dead_letter(stack.record(spawn("k-1"), 1), RELAY_ERROR)
    stack.park([stack.record(spawn("k-2"), 5)])

    outcome = stack.cli("redrive", "--yes", "--kind", "failed-batch")

    assert outcome.code == EXIT_OK
    assert outcome.out.splitlines()[1].split() == ["redriven", "(201)", "1"]
    assert len(stack.messages()) == 1
    assert stack.objects() == {}


def test_redrive_refuses_without_a_terminal_and_asks_on_one(stack: Stack) -> None:
    stack.dead_letter(stack.record(spawn(), 1), RELAY_ERROR)

    refused = stack.cli("redrive")
    declined = stack.cli("redrive", stdin=FakeTerminal("n\n"))
    accepted = stack.cli("redrive", stdin=FakeTerminal("y\n"))

    assert refused.code == EXIT_USAGE
    assert refused.err == (
        "poimen dlq redrive: refusing to redrive without confirmation: stdin is not a terminal; "
        "add --yes (or --dry-run)\n"
    )
    assert declined.code == EXIT_USAGE
    assert "1 have no dispatch_key: each becomes a new run. [y/N]" in declined.err
    assert declined.err.endswith("poimen dlq redrive: redrive not confirmed: nothing was sent\n")
    assert accepted.code == EXIT_OK
    assert len(stack.runs()) == 1


def test_redrive_of_nothing_prints_an_empty_summary(stack: Stack) -> None:
    outcome = stack.cli("redrive")

    assert outcome.code == EXIT_OK
    assert [line.rsplit(maxsplit=1) for line in outcome.out.splitlines()] == [
        ["outcome", "records"],
        ["redriven (201)", "0"],
        ["replayed (200)", "0"],
        ["still failing", "0"],
        ["skipped", "0"],
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["list"], "nothing to read: give --queue-url"),
        (["redrive", "--queue-url", "https://sqs/q"], "redrive needs --api-url"),
        (["show", "s3:k", "--queue-url", "https://sqs/q"], "an s3: ID needs --bucket"),
        (["show", "sqs:m", "--bucket", "b"], "an sqs: ID needs --queue-url"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(argv: list[str], message: str) -> None:
    err = io.StringIO()
    parser = argparse.ArgumentParser()
    add_dlq_commands(parser.add_subparsers(dest="command"))

    code = run_dlq(parser.parse_args(["dlq", *argv]), stderr=err)

    assert code == EXIT_USAGE
    assert err.getvalue().startswith(f"poimen dlq {argv[0]}: {message}")
    assert err.getvalue().count("\n") == 1


def test_aws_refusing_is_one_line_and_exit_3_and_a_traceback_with_debug(stack: Stack) -> None:
    parser = argparse.ArgumentParser()
    add_dlq_commands(parser.add_subparsers(dest="command"))
    missing = stack.queue_url + "-missing"
    err = io.StringIO()

    code = run_dlq(parser.parse_args(["dlq", "list", "--queue-url", missing]), stderr=err)

    assert code == EXIT_UNREACHABLE
    assert err.getvalue().startswith("poimen dlq list: AWS refused to read the dead-letter queue")
    assert "check --queue-url (stack output RelayDeadLetterQueueUrl)" in err.getvalue()
    assert err.getvalue().count("\n") == 1
    with pytest.raises(AwsUnavailable):
        run_dlq(parser.parse_args(["dlq", "list", "--queue-url", missing, "--debug"]))


def test_progress_is_a_bar_on_a_terminal_with_notices_above_it() -> None:
    terminal = FakeTerminal()
    progress = Progress(2, terminal)

    progress.advance()
    progress.note("skipped: x")
    progress.advance()
    progress.finish()

    assert terminal.getvalue().endswith(
        "skipped: x\n\rredrive [###############...............] 1/2\rredrive [##############################] 2/2\n"
    )


def test_ages_read_as_one_unit() -> None:
    now = datetime(2026, 11, 29, tzinfo=UTC)
    assert [age(now - timedelta(seconds=s), now) for s in (5, 300, 7200, 200000)] == ["5s", "5m", "2h", "2d"]
    assert age(None, now) == "-"


# -- outcome unknown ------------------------------------------------------------------------------------


def _outcome_unknown(run_id: str) -> DeadLetterReason:
    problem = {"type": "urn:poimen:problem:outcome-unknown", "status": 503, "run_id": run_id}
    return DeadLetterReason("outcome-unknown", f"the admission API may have admitted run {run_id}", 503, problem)


def test_a_keyless_letter_of_unknown_outcome_whose_run_exists_is_not_sent_again(stack: Stack) -> None:
    # Given a keyless record the relay admitted, and a letter of it saying the outcome was unknown
    keyless = stack.record(spawn(), 1)
    assert stack.harness.run([keyless]).relayed == 1
    (run,) = stack.runs()
    run_id = run["run_id"]["S"]
    stack.dead_letter(keyless, _outcome_unknown(run_id))

    # When it is redriven
    summary, _, _ = stack.redrive()

    # Then the run it names is found: no second run, and the letter is gone
    assert (summary.redriven, summary.replayed) == (0, 1)
    assert [r["run_id"]["S"] for r in stack.runs()] == [run_id]
    assert stack.messages() == []


def test_a_keyless_letter_of_unknown_outcome_whose_run_is_absent_is_sent(stack: Stack) -> None:
    # Given a letter of unknown outcome naming a run that was never written
    stack.dead_letter(stack.record(spawn(), 1), _outcome_unknown("0190f4c2-6d1e-7a3b-8c4d-5e6f7a8b9c0d"))

    # When it is redriven twice
    first, _, _ = stack.redrive()
    second, _, _ = stack.redrive()

    # Then it is admitted once, and nothing is left
    assert (first.redriven, second.redriven) == (1, 0)
    assert len(stack.runs()) == 1
    assert stack.messages() == []


# -- run retention --------------------------------------------------------------------------------------

DAY_MS = 86_400_000


def an_hour_ago() -> str:
    """A batch's on-failure time an hour ago: before the dead letters a test writes now."""
    return rfc3339(datetime.now(UTC) - timedelta(hours=1))


def days_ago(days: float) -> int:
    return int(datetime.now(UTC).timestamp() * 1000 - days * DAY_MS)


def test_redrive_refuses_and_keeps_records_older_than_the_run_retention(stack: Stack) -> None:
    # Given, with runs kept 3 days: a relay dead letter of a record published 5 days ago, and a parked batch
    # of a record 4 days old and one of a day ago
    message_id = stack.dead_letter(stack.record(spawn("old-1"), 1, timestamp_ms=days_ago(5)), RELAY_ERROR)
    key = stack.park(
        [
            stack.record(spawn("old-2"), 5, timestamp_ms=days_ago(4)),
            stack.record(spawn("fresh"), 6, timestamp_ms=days_ago(1)),
        ],
        failed_at=an_hour_ago(),
    )

    # When they are redriven with --run-retention-days 3
    outcome = stack.cli("redrive", "--yes", "--run-retention-days", "3")

    # Then only the fresh record is a run; each old one is named on a line of its own and kept where it was
    assert outcome.code == EXIT_REMAINING
    assert [run["dispatch_key"]["S"] for run in stack.runs()] == ["fresh"]
    refused = [line for line in outcome.err.splitlines() if line.startswith("refused: ")]
    older = "older than the run retention of 3 days: its run may have expired, and admitting it again would be"
    suffix = "a second run (kept; --kind expired sends it)"
    assert refused == [  # oldest parcel first: the batch failed before the record was dead-lettered
        f"refused: s3:{key}#{stack.topic}-0@5: the record is 4 days old, {older} {suffix}",
        f"refused: sqs:{message_id}: the record is 5 days old, {older} {suffix}",
    ]
    assert [message["id"] for message in stack.messages()] == [message_id]
    (parked,) = stack.objects().values()
    (batch,) = json.loads(parked["payload"])["records"].values()
    assert [record["offset"] for record in batch] == [5]
    rows = [line.rsplit(maxsplit=1) for line in outcome.out.splitlines()]
    assert ["refused (older than the run retention)", "2"] in rows
    assert ["redriven (201)", "1"] in rows


def test_a_record_whose_run_retention_is_unknown_is_refused_unless_one_is_given(stack: Stack) -> None:
    # Given a dead letter of a record a year old written before letters recorded their run retention, and a
    # parked batch (Lambda records none) of a record 2 days old and one of an hour ago
    message_id = stack.dead_letter(stack.record(spawn("k-1"), 1, timestamp_ms=days_ago(365)), RELAY_ERROR)
    key = stack.park(
        [
            stack.record(spawn("k-2"), 5, timestamp_ms=days_ago(2)),
            stack.record(spawn("fresh"), 6, timestamp_ms=days_ago(1 / 24)),
        ],
        failed_at=an_hour_ago(),
    )
    # When they are redriven without --run-retention-days
    outcome = stack.cli("redrive", "--yes")
    # Then only the fresh record is a run (younger than any run retention a stack can have); each old one is
    # named on a line of its own, counted, and kept where it was
    assert outcome.code == EXIT_REMAINING
    assert [run["dispatch_key"]["S"] for run in stack.runs()] == ["fresh"]
    refused = [line for line in outcome.err.splitlines() if line.startswith("refused: ")]
    unknown = (
        "older than the shortest run retention a stack can have (1 day), and no run retention is known for it "
        "(a parked batch, or a letter of an earlier version): its run may have expired; give --run-retention-days "
        "(the stack's RunRetentionDays, or forever) to judge it (kept)"
    )
    assert refused == [
        f"refused: s3:{key}#{stack.topic}-0@5: the record is 2 days old, {unknown}",
        f"refused: sqs:{message_id}: the record is 365 days old, {unknown}",
    ]
    assert ["refused (run retention unknown)", "2"] in _rows(outcome.out)
    assert [message["id"] for message in stack.messages()] == [message_id]
    (parked,) = stack.objects().values()
    (batch,) = json.loads(parked["payload"])["records"].values()
    assert [record["offset"] for record in batch] == [5]
    # When they are redriven again, holding them to runs kept forever (the stack's RunRetentionDays is empty)
    forever = stack.cli("redrive", "--yes", "--run-retention-days", "forever")
    # Then both are runs, and nothing is left
    assert forever.code == EXIT_OK
    assert sorted(run["dispatch_key"]["S"] for run in stack.runs()) == ["fresh", "k-1", "k-2"]
    assert stack.messages() == []
    assert stack.objects() == {}
    assert ["refused (older than the run retention)", "0"] in _rows(forever.out)
    assert "unknown" not in forever.out


def test_a_record_without_a_timestamp_is_redriven_whatever_the_run_retention(stack: Stack) -> None:
    stack.dead_letter(stack.record(spawn("k-1"), 1, timestamp_ms=-1), RELAY_ERROR)

    outcome = stack.cli("redrive", "--yes", "--run-retention-days", "1")

    assert outcome.code == EXIT_OK
    assert len(stack.runs()) == 1
    assert ["refused (older than the run retention)", "0"] in [
        line.rsplit(maxsplit=1) for line in outcome.out.splitlines()
    ]


def test_a_dry_run_counts_what_the_run_retention_refuses_and_asks_only_for_the_rest(stack: Stack) -> None:
    # Given an old and a fresh dead letter, with runs kept 2 days
    stack.dead_letter(stack.record(spawn("old"), 1, timestamp_ms=days_ago(3)), RELAY_ERROR)
    stack.dead_letter(stack.record(spawn("fresh"), 2, timestamp_ms=days_ago(1)), RELAY_ERROR)

    # When a dry run and a redrive on a terminal that declines are asked for
    dry = stack.cli("redrive", "--dry-run", "--run-retention-days", "2")
    declined = stack.cli("redrive", "--run-retention-days", "2", stdin=FakeTerminal("n\n"))

    # Then the dry run would send one and refuse one, the question counts one to send, and nothing changed
    assert dry.code == EXIT_OK
    rows = [line.rsplit(maxsplit=1) for line in dry.out.splitlines()]
    assert ["would send", "1"] in rows
    assert ["refused (older than the run retention)", "1"] in rows
    assert "Send 1 of 2 dead letters" in declined.err
    assert len(stack.messages()) == 2
    assert stack.runs() == []


def test_the_relays_expired_letter_says_its_retention_and_redrive_refuses_it_unless_named(stack: Stack) -> None:
    # Given, with runs kept 3 days, a record published 4 days ago, which the relay dead-letters as expired
    retained = stack.harness.with_settings(run_retention=RunRetention(3))
    retained.run([stack.record(spawn("k-1"), 1, timestamp_ms=days_ago(4))])
    (letter,) = stack.messages()
    shown = stack.cli("show", f"sqs:{letter['id']}")
    # When the queue is redriven without --run-retention-days
    outcome = stack.cli("redrive", "--yes")
    # Then the letter says which retention made it expire, nothing was admitted, and the letter is kept
    assert letter["reason"]["kind"] == "expired"
    assert letter["runRetention"] == {"days": 3}
    assert "retention:     3 days\n" in shown.out
    assert outcome.code == EXIT_REMAINING
    assert stack.runs() == []
    assert [message["id"] for message in stack.messages()] == [letter["id"]]
    (refused,) = [line for line in outcome.err.splitlines() if line.startswith("refused: ")]
    assert refused.startswith(
        f"refused: sqs:{letter['id']}: the record is 4 days old, older than the run retention of 3 days: its run may"
    )
    assert refused.endswith("(kept; --kind expired sends it)")
    assert ["refused (older than the run retention)", "1"] in _rows(outcome.out)
    # When it is asked for by name (its spawn was never admitted, say: the relay was down past the retention)
    named = stack.cli("redrive", "--yes", "--kind", "expired")
    # Then it is sent, and gone
    assert named.code == EXIT_OK
    assert [run["dispatch_key"]["S"] for run in stack.runs()] == ["k-1"]
    assert stack.messages() == []


def test_a_future_timestamp_letter_is_kept_while_it_is_still_ahead_unless_named(stack: Stack) -> None:
    # Given, with runs kept 3 days, a record stamped an hour ahead of the relay's clock: a future-timestamp letter
    retained = stack.harness.with_settings(run_retention=RunRetention(3))
    retained.run([stack.record(spawn("k-1"), 1, timestamp_ms=days_ago(-1 / 24))])
    # When the queue is redriven, then redriven with its kind named
    default = stack.cli("redrive", "--yes")
    kept = stack.messages()
    named = stack.cli("redrive", "--yes", "--kind", "future-timestamp")
    # Then it was skipped and kept while still ahead, and sent when named
    assert [letter["reason"]["kind"] for letter in kept] == ["future-timestamp"]
    assert default.code == EXIT_REMAINING
    assert ["skipped", "1"] in _rows(default.out)
    assert named.code == EXIT_OK
    assert [run["dispatch_key"]["S"] for run in stack.runs()] == ["k-1"]
    assert stack.messages() == []


def test_a_letter_is_held_to_the_retention_it_records_and_an_older_expired_letter_to_its_kind(stack: Stack) -> None:
    # Given a relay-error letter of a record 5 days old that records a run retention of 3 days, and an expired
    # letter written before letters recorded their retention
    recorded = stack.dead_letter(stack.record(spawn("k-1"), 1, timestamp_ms=days_ago(5)), RELAY_ERROR, 3)
    older = stack.dead_letter(stack.record(spawn("k-2"), 2, timestamp_ms=days_ago(2)), EXPIRED_BEFORE)
    # When the queue is redriven without --run-retention-days
    outcome = stack.cli("redrive", "--yes")
    # Then neither is sent, and both are kept
    assert outcome.code == EXIT_REMAINING
    assert stack.runs() == []
    assert {message["id"] for message in stack.messages()} == {recorded, older}
    assert ["refused (older than the run retention)", "2"] in _rows(outcome.out)


EXPIRED_BEFORE = DeadLetterReason(
    "expired",
    "the record is 1 day 2 h old, older than the run retention of 1 days: its run may have expired, and "
    "admitting it again would be a second run",
)


def _raised_from_1_to_7(changed_at: str) -> list[str]:
    """Redrive's flags for a stack whose RunRetentionDays was raised from 1 to 7 days at `changed_at`."""
    return [
        "--run-retention-days",
        "7",
        "--previous-run-retention-days",
        "1",
        "--run-retention-changed-at",
        changed_at,
    ]


def test_redrive_holds_a_parked_record_from_before_a_raise_to_the_retention_before_it(stack: Stack) -> None:
    # Given a parked record published 2 days ago, and RunRetentionDays raised from 1 to 7 an hour ago
    stack.park([stack.record(spawn("k-1"), 1, timestamp_ms=days_ago(2))])
    changed_at = rfc3339(datetime.now(UTC) - timedelta(hours=1))
    # When it is redriven with the stack's retention and the record of its change, as make deploy printed them
    outcome = stack.cli("redrive", "--yes", *_raised_from_1_to_7(changed_at))
    # Then it is refused and kept: its run was written under 1 day
    assert outcome.code == EXIT_REMAINING
    assert stack.runs() == []
    assert len(stack.objects()) == 1
    assert "older than the run retention of 1 day (it was 1 day until" in outcome.err


def test_a_previous_run_retention_needs_the_time_it_changed(stack: Stack) -> None:
    outcome = stack.cli("redrive", "--yes", "--run-retention-days", "7", "--previous-run-retention-days", "1")

    assert outcome.code == EXIT_USAGE
    assert "--previous-run-retention-days needs --run-retention-changed-at" in outcome.err


@pytest.mark.parametrize("days", ["0", "-1", "three", "3651"])
def test_an_invalid_run_retention_is_a_usage_error(days: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["dlq", "redrive", "--queue-url", "https://sqs/q", "--run-retention-days", days])

    assert exited.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("poimen dlq redrive: argument --run-retention-days: ")
    assert err.count("\n") == 1


def test_a_future_timestamp_letter_is_as_old_as_its_letter_once_its_timestamp_has_passed(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given RunRetentionDays raised from 1 to 7 days 10 days ago, and a spawn whose run, admitted over 8 days ago,
    # has expired (DynamoDB not yet having deleted it)
    monkeypatch.setenv(RUN_RETENTION_ENV, "7")
    admission_service.cache_clear()
    changed_at = rfc3339(datetime.now(UTC) - timedelta(days=10))
    first = stack.harness.with_settings(run_retention=RunRetention(7)).run([stack.record(spawn("k-1"), 0)])
    assert first.relayed == 1
    (admitted,) = stack.runs()
    _expire(stack.dynamodb, stack.table_name, stack.tenant, admitted["run_id"]["S"])
    # And a record of it dead-lettered 8 days ago as future-timestamp, its timestamp 2 days ahead of that
    record = msk_record(stack.record(spawn("k-1"), 1, timestamp_ms=days_ago(6)))
    reason = DeadLetterReason("future-timestamp", "the record's timestamp is 2 days ahead of the relay's clock")
    letter = json.loads(dead_letter_body(KafkaEventRecord(record), reason, with_change(7, 1, changed_at)))
    letter["deadLetteredAt"] = rfc3339(datetime.now(UTC) - timedelta(days=8))
    stack.harness.sqs.send_message(
        QueueUrl=stack.queue_url, MessageBody=json.dumps(letter), MessageAttributes=dead_letter_attributes(record)
    )
    # When the queue is redriven with the runbook's flags, its timestamp now 6 days past
    outcome = stack.cli("redrive", "--yes", *_raised_from_1_to_7(changed_at))
    # Then it is refused as older than the retention (8 days, its letter's age), the letter kept, and the
    # table holds the first admission only
    assert outcome.code == EXIT_REMAINING
    assert ["refused (older than the run retention)", "1"] in _rows(outcome.out)
    assert "the record is 8 days old (dead-lettered, or its batch failed, that long ago)" in outcome.err
    (after,) = stack.runs()
    assert after["attempt_id"] == admitted["attempt_id"]
    assert len(stack.messages()) == 1


def test_two_keyless_records_at_one_position_are_two_runs_and_one_sent_before_the_digest_is_not_sent_again(
    stack: Stack,
) -> None:
    # Given two keyless records at one topic, partition, offset and timestamp (a topic recreated), with other
    # values, each dead-lettered; and at another position two more, the first of which a redrive of an earlier
    # version (its key without the value's digest) admitted, interrupted before deleting its letter
    at = days_ago(0.1)
    records = [
        stack.record(spawn(workflow_ref=f"wf/{name}"), offset, timestamp_ms=at)
        for name, offset in (("a", 3), ("b", 3), ("c", 9), ("d", 9))
    ]
    for record in records:
        stack.dead_letter(record, RELAY_ERROR, 30)
    earlier = stack.api()._client.spawn(
        stack.tenant, "wf/c", {"n": 1}, dispatch_key=legacy_derived_key(msk_record(records[2]))
    )
    # When the queue is redriven
    outcome = stack.cli("redrive", "--yes")
    # Then each record is one run, the interrupted one's the run it already had, and no letter is left
    assert outcome.code == EXIT_OK
    assert sorted(run["workflow_ref"]["S"] for run in stack.runs()) == ["wf/a", "wf/b", "wf/c", "wf/d"]
    assert earlier.run_id in {run["run_id"]["S"] for run in stack.runs()}
    assert ["replayed (200)", "1"] in _rows(outcome.out)
    assert stack.messages() == []


def legacy_derived_key(record: dict[str, Any]) -> str:
    """The dispatch_key redrive derived for a keyless record before it held the value's digest."""
    identity = "\n".join(str(record.get(name)) for name in ("topic", "partition", "offset", "timestamp"))
    return "poimen-redrive/" + hashlib.sha256(identity.encode()).hexdigest()


def test_show_flags_a_record_held_to_no_run_retention_as_redrive_would_refuse_it(stack: Stack) -> None:
    # Given a parked record 2 days old (Lambda records no run retention), and one of an hour ago
    key = stack.park(
        [
            stack.record(spawn("old"), 5, timestamp_ms=days_ago(2)),
            stack.record(spawn("fresh"), 6, timestamp_ms=days_ago(1 / 24)),
        ],
        failed_at=an_hour_ago(),
    )
    # When each is shown
    old = stack.cli("show", f"s3:{key}#{stack.topic}-0@5")
    fresh = json.loads(stack.cli("show", f"s3:{key}#{stack.topic}-0@6", "--json").out)
    # Then the old one says redrive refuses it unless a run retention is given, and the fresh one is sendable
    shown = dict(line.split(":", 1) for line in old.out.splitlines() if line[:1].isalpha() and ":" in line)
    assert shown["redrive"].strip().startswith("refused: held to no run retention")
    assert "--run-retention-days" in shown["redrive"]
    assert shown["retention"].strip().startswith("- (not recorded: held to the shortest a stack can have, 1 day")
    assert fresh["redrive"].startswith("POST /v1/runs for tenant")


def test_every_printed_reason_is_bounded_however_many_errors_the_value_has(stack: Stack) -> None:
    # Given a letter whose value has 18,000 unknown fields
    value = {**spawn("k-1"), **{f"f{n:05}": n for n in range(18_000)}}
    stack.dead_letter(stack.record(value, 1), RELAY_ERROR)
    # When it is redriven dry, and shown
    dry = stack.cli("redrive", "--dry-run")
    (letter,) = stack.messages()
    shown = stack.cli("show", f"sqs:{letter['id']}")
    # Then every line naming its errors names the first few and counts them all, on a line of bounded length
    lines = [line for line in (dry.out + dry.err).splitlines() if "Extra inputs are not permitted" in line]
    assert lines
    assert all(len(line) < 2_000 and "18000 errors" in line for line in lines)
    (redrive,) = [line for line in shown.out.splitlines() if line.startswith("redrive:")]
    assert len(redrive) < 2_000
    assert "18000 errors" in redrive


def test_redrive_takes_a_cell_map_as_the_other_commands_do(
    stack: Stack, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given two letters, and a cell map whose cell serves their tenant at the admission API
    stack.dead_letter(stack.record(spawn("k-1"), 1), RELAY_ERROR)
    stack.dead_letter(stack.record(spawn("k-2"), 2), RELAY_ERROR)
    cells = {"cells": {"c1": {"endpoints": ["https://api.example"], "tenants": [stack.tenant]}}}
    (tmp_path / "cells.json").write_text(json.dumps(cells))

    def redrive(*argv: str) -> Outcome:
        parser = argparse.ArgumentParser(prog="poimen")
        add_dlq_commands(parser.add_subparsers(dest="command", required=True))
        args = parser.parse_args(["dlq", "redrive", "--yes", "--queue-url", stack.queue_url, *argv])
        out, err = io.StringIO(), io.StringIO()
        credentials = Credentials(RELAY_KEY.access_key, RELAY_KEY.secret_key)
        code = run_dlq(
            args, http=stack.harness.api, credentials=credentials, stdin=io.StringIO(), stdout=out, stderr=err
        )
        return Outcome(code, out.getvalue(), err.getvalue())

    # When one is redriven with --cells, once both --cells and --api-url are given, and the other with the map
    # POIMEN_CELLS holds
    both = redrive("--cells", str(tmp_path / "cells.json"), "--api-url", "https://api.example", "--region", "x")
    given = redrive("--cells", str(tmp_path / "cells.json"), "--region", "us-east-1")
    stack.dead_letter(stack.record(spawn("k-3"), 3), RELAY_ERROR)
    monkeypatch.setenv("POIMEN_CELLS", json.dumps(cells))
    from_environment = redrive("--region", "us-east-1")
    # Then the two redrives through the map admit every letter, and the one given both is a usage error
    assert both.code == EXIT_USAGE
    assert "--api-url or --cells" in both.err
    assert (given.code, from_environment.code) == (EXIT_OK, EXIT_OK)
    assert sorted(run["dispatch_key"]["S"] for run in stack.runs()) == ["k-1", "k-2", "k-3"]
    assert stack.messages() == []


def test_a_letter_replaced_with_a_new_reason_keeps_the_time_its_record_was_first_dead_lettered(stack: Stack) -> None:
    # Given a letter dead-lettered 3 days ago of a record whose key is taken by another payload, its timestamp
    # ahead of that (a publisher's clock): the letter's time is what bounds its age
    stack.harness.run([stack.record(spawn("k-1"), 1)])
    record = msk_record(stack.record(spawn("k-1", workflow_ref="wf/other"), 2, timestamp_ms=days_ago(1)))
    letter = json.loads(dead_letter_body(KafkaEventRecord(record), RELAY_ERROR, RunRetention(30)))
    letter["deadLetteredAt"] = first_at = rfc3339(datetime.now(UTC) - timedelta(days=3))
    stack.harness.sqs.send_message(
        QueueUrl=stack.queue_url, MessageBody=json.dumps(letter), MessageAttributes=dead_letter_attributes(record)
    )
    # When it is redriven and refused again (422), and is redriven with a retention of 2 days
    stack.redrive()
    again = stack.cli("redrive", "--yes", "--run-retention-days", "2")
    # Then its new letter keeps the time it was first dead-lettered, and is refused as 3 days old
    (replaced,) = stack.messages()
    assert replaced["reason"]["kind"] == "rejected"
    assert replaced["deadLetteredAt"] == first_at
    assert ["refused (older than the run retention)", "1"] in _rows(again.out)


@pytest.mark.parametrize("source", ["queue", "bucket"])
def test_a_copy_stamped_by_a_clock_running_ahead_is_as_old_as_aws_says_it_is(source: str) -> None:
    # Given a record stamped 2 days ahead, dead-lettered (or its batch parked) 8 days ago by AWS's clock (SQS's
    # SentTimestamp, the object's LastModified), the copy's own time written by a clock running 3 days ahead
    record = KafkaRecord(
        topic="poimen.acme.dispatch",
        partition=0,
        offset=4,
        timestamp_ms=days_ago(6),
        value=json.dumps(spawn("k")).encode(),
    )
    written = rfc3339(datetime.now(UTC) + timedelta(days=3))
    aws_time = datetime.now(UTC) - timedelta(days=8)
    if source == "queue":
        reason = DeadLetterReason("future-timestamp", "the record's timestamp is 2 days ahead of the relay's clock")
        document = json.loads(dead_letter_body(KafkaEventRecord(msk_record(record)), reason, RunRetention(7)))
        document["deadLetteredAt"] = written
        (copy,) = parse_message("m", json.dumps(document), aws_time).letters
    else:
        document = json.loads(on_failure_object([record]))
        document["timestamp"] = written
        (copy,) = parse_object("o", json.dumps(document).encode(), aws_time).letters
    # When redrive judges it with runs kept 7 days, its timestamp now 6 days past
    found = record_verdict([copy], datetime.now(UTC).timestamp() * 1000, RunRetention(7))
    # Then it is held back as older than the retention: no younger than AWS saw it
    assert found is not None
    assert isinstance(found[1], Held)
    assert found[1].reason.kind == "expired"


def test_a_letter_of_a_tenant_in_no_cell_of_the_map_is_kept_and_the_map_named(stack: Stack, tmp_path: Any) -> None:
    # Given a letter, and a cell map whose one cell serves another tenant only
    stack.dead_letter(stack.record(spawn(), 1), RELAY_ERROR)
    cells = {"cells": {"c1": {"endpoints": ["https://api.example"], "tenants": ["other"]}}}
    (tmp_path / "cells.json").write_text(json.dumps(cells))
    # When it is redriven through the map
    parser = argparse.ArgumentParser(prog="poimen")
    add_dlq_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(
        ["dlq", "redrive", "--yes", "--queue-url", stack.queue_url, "--cells", str(tmp_path / "cells.json")]
    )
    out, err = io.StringIO(), io.StringIO()
    credentials = Credentials(RELAY_KEY.access_key, RELAY_KEY.secret_key)
    code = run_dlq(args, http=stack.harness.api, credentials=credentials, stdin=io.StringIO(), stdout=out, stderr=err)
    # Then nothing is sent (neither under its key nor its key of earlier versions), the letter is kept, and the
    # refusal names the map to fix, not the API
    assert code != EXIT_OK
    assert stack.runs() == []
    assert len(stack.messages()) == 1
    assert f"tenant {stack.tenant} is in no cell of" in err.getvalue()
    assert "check --api-url and that the API is up" not in err.getvalue()
