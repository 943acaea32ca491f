"""`poimen dlq` as a real process against `poimen dev`: its moto SQS and S3, its API over real HTTP."""

from __future__ import annotations

import base64
import json
import random
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

import boto3
import pytest
from aws_lambda_powertools.utilities.data_classes.kafka_event import KafkaEventRecord

from poimen.dead_letter import DeadLetterReason, dead_letter_body
from poimen.retention import RunRetention
from poimen_tools.local.event_source import on_failure_record
from poimen_tools.local.template import Template
from tests.conftest import count_runs
from tests.integration.conftest import POIMEN, DevServer, free_port, serve_on_loopback, wait_for


@dataclass
class Place:
    """A dead-letter queue made as template.yaml declares it, and a failed-batch bucket, on dev's moto."""

    dev: DevServer
    queue_url: str
    bucket: str

    def command(self, *argv: str, api_url: str | None = None) -> list[str]:
        where = ["--queue-url", self.queue_url, "--bucket", self.bucket, "--aws-endpoint", self.dev.aws_endpoint]
        return [str(POIMEN), "dlq", *argv, *where, "--api-url", api_url or self.dev.url, "--dev-key"]

    def dlq(self, *argv: str, api_url: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.command(*argv, api_url=api_url),
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=120,
            check=False,
        )

    def s3(self) -> Any:
        return boto3.client("s3", endpoint_url=self.dev.aws_endpoint)

    def left(self) -> tuple[int, int]:
        """(messages in the queue, objects in the bucket)."""
        attributes = self.dev.sqs().get_queue_attributes(
            QueueUrl=self.queue_url,
            AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
        )["Attributes"]
        messages = int(attributes["ApproximateNumberOfMessages"]) + int(
            attributes["ApproximateNumberOfMessagesNotVisible"]
        )
        return messages, self.s3().list_objects_v2(Bucket=self.bucket)["KeyCount"]

    def stored_keys(self) -> list[str]:
        return [entry["Key"] for entry in self.s3().list_objects_v2(Bucket=self.bucket).get("Contents", [])]

    def parked(self, key: str) -> list[int]:
        """The offsets of the records in a parked object, as it is stored."""
        document = json.loads(self.s3().get_object(Bucket=self.bucket, Key=key)["Body"].read())
        event = json.loads(document["payload"])
        return sorted(record["offset"] for group in event["records"].values() for record in group)


@pytest.fixture
def place(dev: DevServer, template: Template) -> Place:
    name = f"dlq-{uuid.uuid4().hex[:12]}"
    queue_url: str = dev.sqs().create_queue(**template.create_queue_request("RelayDeadLetterQueue", name))["QueueUrl"]
    bucket = f"failed-batches-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=dev.aws_endpoint).create_bucket(Bucket=bucket)
    return Place(dev, queue_url, bucket)


def record(tenant: str, offset: int, value: dict[str, Any], key: bytes | None = None) -> dict[str, Any]:
    """A dispatch record as MSK delivers it (a null key left out)."""
    entry: dict[str, Any] = {
        "topic": f"poimen.{tenant}.dispatch",
        "partition": 0,
        "offset": offset,
        "timestamp": 1795780800000,
        "timestampType": "CREATE_TIME",
        "value": base64.b64encode(json.dumps(value).encode()).decode(),
        "headers": [],
    }
    if key is not None:
        entry["key"] = base64.b64encode(key).decode()
    return entry


def failed_batch(records: list[dict[str, Any]]) -> bytes:
    """Lambda's S3 on-failure invocation record: metadata, and the whole MSK event as a JSON string."""
    topic_partition = f"{records[0]['topic']}-{records[0]['partition']}"
    event = {
        "eventSource": "aws:kafka",
        "eventSourceArn": "arn:aws:kafka:us-east-1:123456789012:cluster/poimen/751d2973-a626-431c-9d4e-d7975eb44dd7-2",
        "bootstrapServers": "b-1.poimen.a1bcde.c1.kafka.us-east-1.amazonaws.com:9098",
        "records": {topic_partition: records},
    }
    return json.dumps(on_failure_record(event, attempts=101)).encode()


def summary(output: str) -> dict[str, int]:
    """The summary table's rows (a dry run prints what it would send above it)."""
    lines = output.splitlines()
    start = next(n for n, line in enumerate(lines) if line.startswith("outcome ")) + 1
    rows = [line.rsplit(maxsplit=1) for line in lines[start:]]
    return {name: int(count) for name, count in rows}


def test_redrive_admits_each_dead_letter_once_and_empties_queue_and_bucket(place: Place, tenant: str) -> None:
    # Given a valid spawn the relay dead-lettered on an unforeseen fault (relay-error), and a failed batch
    # of three records: two keyed spawns, and the first again (same dispatch_key, same payload)
    letter = record(tenant, 3, {"workflow_ref": "wf/hello", "input": {}, "dispatch_key": "dl-1"})
    reason = DeadLetterReason("relay-error", "RuntimeError: something nobody foresaw")
    place.dev.sqs().send_message(
        QueueUrl=place.queue_url, MessageBody=dead_letter_body(KafkaEventRecord(letter), reason, RunRetention())
    )
    first = {"workflow_ref": "wf/hello", "input": {"n": 1}, "dispatch_key": "fb-1"}
    second = {"workflow_ref": "wf/hello", "input": {"n": 2}, "dispatch_key": "fb-2"}
    batch = [record(tenant, 10, first, b"a"), record(tenant, 11, second, b"b"), record(tenant, 12, first, b"a")]
    key = f"aws/lambda/{uuid.uuid4()}/poimen.{tenant}.dispatch-0/2026/11/29/2026-11-29T12.00.00-{uuid.uuid4()}"
    place.s3().put_object(Bucket=place.bucket, Key=key, Body=failed_batch(batch))

    listed = place.dlq("list", "--json")
    assert listed.returncode == 0, listed.stderr
    kinds = json.loads(listed.stdout)["kinds"]
    assert {kind: (entry["letters"], entry["records"]) for kind, entry in kinds.items()} == {
        "relay-error": (1, 1),
        "failed-batch": (1, 3),
    }

    # When a dry run holds them to no run retention: the parked records (a batch Lambda parked records none,
    # and these are days old) are refused, the letter (it records poimen dev's: forever) would be sent
    unknown = place.dlq("redrive", "--dry-run")
    assert summary(unknown.stdout) == {"would send": 1, "refused (run retention unknown)": 3, "skipped": 0}

    # When they are redriven through poimen dev, signed with its dev key, holding them to poimen dev's run
    # retention (none: runs kept forever)
    redriven = place.dlq("redrive", "--yes", "--run-retention-days", "forever")

    # Then three runs exist (the repeated key is a replay), each record entered the API once, all is emptied
    assert redriven.returncode == 0, redriven.stderr
    assert summary(redriven.stdout) == {
        "redriven (201)": 3,
        "replayed (200)": 1,
        "still failing": 0,
        "refused (older than the run retention)": 0,
        "skipped": 0,
    }
    assert "redrive: 4/4 dead letters handled" in redriven.stderr
    runs = count_runs(place.dev.dynamodb(), place.dev.table_name, tenant)
    assert sorted(run["dispatch_key"]["S"] for run in runs) == ["dl-1", "fb-1", "fb-2"]
    assert sorted(entry["message"] for entry in place.dev.admissions(tenant)) == [
        "run admitted",
        "run admitted",
        "run admitted",
        "run replayed",
    ]
    assert place.left() == (0, 0)

    # And a second redrive finds nothing and changes nothing
    again = place.dlq("redrive", "--yes")
    assert again.returncode == 0, again.stderr
    assert summary(again.stdout) == {"redriven (201)": 0, "replayed (200)": 0, "still failing": 0, "skipped": 0}
    assert len(count_runs(place.dev.dynamodb(), place.dev.table_name, tenant)) == 3
    assert len(place.dev.admissions(tenant)) == 4
    assert place.dlq("list").stdout == "no dead letters\n"


def test_an_unreachable_api_is_one_line_exit_3_and_removes_nothing(place: Place, tenant: str) -> None:
    letter = record(tenant, 1, {"workflow_ref": "wf/hello", "input": {}, "dispatch_key": "k"})
    reason = DeadLetterReason("relay-error", "RuntimeError: x")
    place.dev.sqs().send_message(
        QueueUrl=place.queue_url, MessageBody=dead_letter_body(KafkaEventRecord(letter), reason, RunRetention())
    )

    outcome = place.dlq("redrive", "--yes", api_url=f"http://127.0.0.1:{free_port()}")

    assert outcome.returncode == 3
    assert outcome.stderr.splitlines()[-1].startswith(
        "poimen dlq redrive: stopped: cannot reach the admission API at http://127.0.0.1:"
    )
    assert "Traceback" not in outcome.stderr
    assert summary(outcome.stdout)["not attempted"] == 1
    assert place.left() == (1, 0)
    assert count_runs(place.dev.dynamodb(), place.dev.table_name, tenant) == []


def test_redrive_without_yes_and_without_a_terminal_refuses(place: Place, tenant: str) -> None:
    letter = record(tenant, 1, {"workflow_ref": "wf/hello", "input": {}})
    reason = DeadLetterReason("relay-error", "RuntimeError: x")
    place.dev.sqs().send_message(
        QueueUrl=place.queue_url, MessageBody=dead_letter_body(KafkaEventRecord(letter), reason, RunRetention())
    )

    refused = place.dlq("redrive")

    assert refused.returncode == 2
    assert refused.stderr.count("\n") == 1
    assert "stdin is not a terminal; add --yes" in refused.stderr
    assert place.left() == (1, 0)


@dataclass
class SlowApi:
    """A proxy on loopback in front of the admission API that forwards each request at once and holds
    the API's answer for `delay` seconds: runs are admitted while the caller still waits for them."""

    upstream: str
    delay: float
    url: str = ""
    in_flight: int = 0  # requests forwarded whose answer has not come back from the API yet
    lock: threading.Lock = field(default_factory=threading.Lock)


@pytest.fixture
def slow_api(dev: DevServer) -> Iterator[SlowApi]:
    import urllib3

    api = SlowApi(upstream=dev.url, delay=0.4)
    pool = urllib3.PoolManager(retries=False)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # redrive's look-up of a keyless record's run under its key of old
            self._forward("GET")

        def do_POST(self) -> None:
            self._forward("POST")

        def _forward(self, method: str) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            with api.lock:
                api.in_flight += 1
            try:
                # The Host header goes as it came: the caller signed it (SigV4), and the API checks it.
                answer = pool.request(
                    method, f"{api.upstream}{self.path}", body=body, headers=dict(self.headers.items()), timeout=30
                )
            finally:
                with api.lock:
                    api.in_flight -= 1
            time.sleep(api.delay)  # the slowness being simulated, not a synchronisation
            try:
                self.send_response(answer.status)
                for name in ("Content-Type", "Idempotent-Replayed"):
                    if answer.headers.get(name):
                        self.send_header(name, answer.headers[name])
                self.send_header("Content-Length", str(len(answer.data)))
                self.end_headers()
                self.wfile.write(answer.data)
            except OSError:
                return  # the caller is gone (killed)

        def log_message(self, format: str, *args: Any) -> None:
            return

    with serve_on_loopback(Handler) as url:
        api.url = url
        yield api
    pool.clear()


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGKILL], ids=["sigint", "sigkill"])
def test_an_interrupted_redrive_of_a_parked_batch_sends_no_record_twice(
    place: Place, tenant: str, slow_api: SlowApi, stop: signal.Signals
) -> None:
    # Given a parked batch of twelve keyless records
    batch = [record(tenant, offset, {"workflow_ref": "wf/hello", "input": {"n": offset}}) for offset in range(12)]
    key = f"aws/lambda/{uuid.uuid4()}/poimen.{tenant}.dispatch-0/2026/11/29/2026-11-29T12.00.00-{uuid.uuid4()}"
    place.s3().put_object(Bucket=place.bucket, Key=key, Body=failed_batch(batch))

    def runs() -> int:
        return len(count_runs(place.dev.dynamodb(), place.dev.table_name, tenant))

    # When a redrive through a slow API is stopped once a random number of runs is admitted
    admitted = random.randint(2, 9)
    process = subprocess.Popen(
        place.command("redrive", "--yes", "--run-retention-days", "forever", api_url=slow_api.url),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: runs() >= admitted, what=f"{admitted} runs admitted")
        process.send_signal(stop)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    wait_for(lambda: slow_api.in_flight == 0, what="the API to answer what it was sent")
    before = runs()
    markers = [name for name in place.stored_keys() if name.startswith(f"{key}.progress/")]

    # Then it stopped with what was confirmed recorded: Ctrl-C after the record in flight, with the
    # object rewritten to the records left; a kill at once, with one progress marker per confirmed record
    if stop == signal.SIGINT:
        assert process.returncode == 130, err
        assert err.splitlines()[-1].startswith("poimen dlq redrive: stopped: interrupted:"), err
        assert summary(out)["redriven (201)"] == before
        assert summary(out)["not attempted"] == 12 - before
        assert place.stored_keys() == [key]
        assert place.parked(key) == list(range(before, 12))
        unconfirmed = 0
    else:
        assert process.returncode == -signal.SIGKILL
        assert place.parked(key) == list(range(12))
        listed = json.loads(place.dlq("list", "--json").stdout)
        assert listed["kinds"]["failed-batch"]["records"] == 12 - len(markers)
        unconfirmed = before - len(markers)  # admitted, but killed before its marker was written
        assert unconfirmed in (0, 1), (before, markers)

    # And the next redrive sends only the records left (and again the one in flight when it was killed,
    # under the same derived dispatch_key: a replay): one run per record, and no object or marker remains
    again = place.dlq("redrive", "--yes", "--run-retention-days", "forever")
    assert again.returncode == 0, again.stderr
    assert summary(again.stdout)["redriven (201)"] == 12 - before
    assert summary(again.stdout)["replayed (200)"] == unconfirmed
    assert runs() == 12
    assert place.stored_keys() == []
