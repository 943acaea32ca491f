"""The inbox relay against `poimen dev` over real HTTP and its moto SQS: one run per dispatch message."""

from __future__ import annotations

import base64
import dataclasses
import json
import re
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto.dynamodb.exceptions import DynamodbException
from moto.dynamodb.models import DynamoDBBackend
from moto.server import ThreadedMotoServer

from poimen.aws_session import CREDENTIALS_FETCH_SECONDS, bounded_session
from poimen.config import Settings
from poimen.ids import keyed_run_id
from poimen.relay import (
    AdmissionApiRefused,
    AdmissionApiUnavailable,
    DeadLetterQueueUnavailable,
    relay_service,
)
from poimen.wire import MAX_BODY_BYTES, SPAWNS_MEDIA_TYPE
from poimen_tools.local.devserver import LocalLambdaContext
from poimen_tools.local.moto import serialise_dynamodb_writes
from poimen_tools.local.msk import KafkaRecord, msk_event
from poimen_tools.local.template import Template
from tests.conftest import count_runs, load_event
from tests.integration.conftest import DevServer, ScriptedApi, dead_letters, free_port, signed_session, start_dev

Relay = Callable[..., None]


pytestmark = pytest.mark.usefixtures("no_admission_in_process")


@pytest.fixture(autouse=True)
def fresh_relay_service() -> Iterator[None]:
    """Each test builds the relay from its own environment (the Lambda builds it once per environment)."""
    relay_service.cache_clear()
    yield
    relay_service.cache_clear()


def _point_relay_at(monkeypatch: pytest.MonkeyPatch, dev: DevServer, api_url: str, dlq_url: str) -> None:
    monkeypatch.setenv("ADMISSION_API_URL", api_url)
    monkeypatch.setenv("DLQ_URL", dlq_url)
    monkeypatch.setenv("AWS_ENDPOINT_URL_SQS", dev.aws_endpoint)
    monkeypatch.setenv("RELAY_TIME_MARGIN_SECONDS", "0.5")


@pytest.fixture
def relay_against(
    template: Template, dev: DevServer, dlq: str, monkeypatch: pytest.MonkeyPatch
) -> Callable[[str], Relay]:
    """The relay's Lambda handler (from template.yaml) pointed at an API URL, with this test's DLQ."""
    handler = template.load_handler("InboxRelayFunction")

    def pointed_at(api_url: str) -> Relay:
        _point_relay_at(monkeypatch, dev, api_url, dlq)
        relay_service.cache_clear()

        def invoke(records: list[KafkaRecord], timeout_seconds: float = 30) -> None:
            handler(msk_event(records), LocalLambdaContext("InboxRelayFunction", timeout_seconds=timeout_seconds))

        return invoke

    return pointed_at


@pytest.fixture
def relay(relay_against: Callable[[str], Relay], dev: DevServer) -> Relay:
    """The relay pointed at `poimen dev`."""
    return relay_against(dev.url)


def _record(tenant: str, body: Any, offset: int = 0, key: bytes | None = b"k", topic: str | None = None) -> KafkaRecord:
    value = body if isinstance(body, bytes) else json.dumps(body).encode()
    return KafkaRecord(
        topic=topic or f"poimen.{tenant}.dispatch",
        partition=0,
        offset=offset,
        timestamp_ms=int(time.time() * 1000) - 5000,
        value=value,
        key=key,
    )


SPAWN = {"workflow_ref": "wf/hello", "input": {"greeting": "hi"}, "goal_id": None, "dispatch_key": "order-42"}


@pytest.fixture(params=["batch", "per-record"])
def wire(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The relay's two ways of sending a partition's spawns, for a test that holds on both: the batch form of
    POST /v1/runs (RELAY_BATCH_SPAWNS' default), or one spawn a request as application/json (RELAY_BATCH_SPAWNS=1)."""
    if request.param == "per-record":
        monkeypatch.setenv("RELAY_BATCH_SPAWNS", "1")
    else:
        monkeypatch.delenv("RELAY_BATCH_SPAWNS", raising=False)
    return str(request.param)


@dataclasses.dataclass(frozen=True)
class SentSpawn:
    """A spawn as the API received it, on either wire."""

    call: int  # which request carried it, in the order the API received them
    dispatch_key: str | None
    traceparent: str | None  # its request's header alone; its place in a batch's `traceparents`
    body: bytes  # the request's
    headers: dict[str, str]  # the request's


def sent_spawns(api: ScriptedApi) -> list[SentSpawn]:
    """Every spawn `api` received, in order: a request's spawn, or each of a batch's spawns."""
    sent: list[SentSpawn] = []
    for call, (headers, body) in enumerate(api.received):
        document = json.loads(body)
        if headers["content-type"] != SPAWNS_MEDIA_TYPE:
            sent.append(SentSpawn(call, document.get("dispatch_key"), headers.get("traceparent"), body, headers))
            continue
        traceparents = document.get("traceparents") or [None] * len(document["spawns"])
        for spawn, traceparent in zip(document["spawns"], traceparents, strict=True):
            sent.append(SentSpawn(call, spawn.get("dispatch_key"), traceparent, body, headers))
    return sent


def answering_each_spawn(
    answer: Callable[[dict[str, Any]], tuple[int, int | None]],
) -> Callable[[bytes], tuple[int, dict[str, str], bytes]]:
    """A ScriptedApi responder that answers each spawn `answer(spawn)`, a status and its Retry-After (None: none),
    on either wire: a spawn alone, as the whole answer (Retry-After a header); a batch's spawns in the order they
    come, each as its result in a 200 (Retry-After the result's `retry_after`). A 200 or 201 carries its run, any
    other status a problem."""

    def run_or_problem(spawn: dict[str, Any], status: int) -> dict[str, Any]:
        if status in (200, 201):
            return {"run_id": f"run-of-{spawn.get('dispatch_key')}", "status": "admitted"}
        kind = "store-unavailable" if status == 503 else f"scripted-{status}"
        return {"type": f"urn:poimen:problem:{kind}", "status": status}

    def respond(body: bytes) -> tuple[int, dict[str, str], bytes]:
        document = json.loads(body)
        if "spawns" not in document:
            status, retry_after = answer(document)
            headers = {} if retry_after is None else {"Retry-After": str(retry_after)}
            return status, headers, json.dumps(run_or_problem(document, status)).encode()
        results = []
        # As the API keeps the batch's order (poimen.batch): a spawn after one of its ordering key that was not
        # admitted is not begun, 503 store-unavailable, nothing written.
        ordering = document.get("ordering_keys") or [None] * len(document["spawns"])
        held: set[str] = set()
        for spawn, ordering_key in zip(document["spawns"], ordering, strict=True):
            status, retry_after = (503, 1) if ordering_key in held else answer(spawn)
            if status >= 500 and ordering_key is not None:
                held.add(ordering_key)
            kind = "run" if status in (200, 201) else "problem"
            result = {"status": status, kind: run_or_problem(spawn, status)}
            results.append(result if retry_after is None else {**result, "retry_after": retry_after})
        return 200, {}, json.dumps({"results": results}).encode()

    return respond


def test_one_message_is_one_run_through_one_post(relay: Relay, dev: DevServer, tenant: str, dlq: str) -> None:
    relay([_record(tenant, SPAWN)])

    runs = count_runs(dev.dynamodb(), dev.table_name, tenant)
    assert [run["run_id"]["S"] for run in runs] == [keyed_run_id(tenant, "order-42")]
    assert [entry["message"] for entry in dev.admissions(tenant)] == ["run admitted"]
    assert dead_letters(dev, dlq) == []


def test_redelivery_in_one_batch_and_a_later_one_is_still_one_run(relay: Relay, dev: DevServer, tenant: str) -> None:
    # Given the same message twice in one batch
    relay([_record(tenant, SPAWN, offset=1), _record(tenant, SPAWN, offset=2)])
    # When it is delivered again in a later batch (a rebalance)
    relay([_record(tenant, SPAWN, offset=1)])
    # Then there is one run; the API saw three POSTs, two of them replays
    assert len(count_runs(dev.dynamodb(), dev.table_name, tenant)) == 1
    assert sorted(entry["message"] for entry in dev.admissions(tenant)) == [
        "run admitted",
        "run replayed",
        "run replayed",
    ]


def test_concurrent_redelivery_under_different_keys_is_one_run(relay: Relay, dev: DevServer, tenant: str) -> None:
    # Twenty copies with distinct Kafka keys go out concurrently and race at admission.
    relay([_record(tenant, SPAWN, offset=i, key=f"k{i}".encode()) for i in range(20)])

    assert len(count_runs(dev.dynamodb(), dev.table_name, tenant)) == 1
    assert sorted(entry["message"] for entry in dev.admissions(tenant)) == ["run admitted"] + ["run replayed"] * 19


def test_malformed_records_are_dead_lettered_and_the_batch_drains(
    relay: Relay, dev: DevServer, tenant: str, dlq: str
) -> None:
    bad = [
        ("undecodable", None, b"\xff\xfe{"),
        ("invalid-json", None, b"{not json"),
        ("invalid-json", None, b'[{"workflow_ref": "wf", "input": {}}]'),
        ("rejected", 400, {"input": {}}),
        ("rejected", 400, {"workflow_ref": 7, "input": "x"}),
        ("rejected", 413, {"workflow_ref": "wf", "input": {"blob": "x" * MAX_BODY_BYTES}}),
    ]
    records = [_record(tenant, body, offset=i) for i, (_, _, body) in enumerate(bad)]
    records.append(_record(tenant, SPAWN, topic="poimen.Not_A_Tenant.dispatch"))
    records.append(_record(tenant, SPAWN, offset=len(bad)))  # a valid record after them, same Kafka key

    relay(records)

    letters = dead_letters(dev, dlq)
    got = sorted((letter["reason"]["kind"], letter["reason"]["status"]) for letter in letters)
    want = sorted([(kind, status) for kind, status, _ in bad] + [("invalid-topic", None)])
    assert got == want
    sent = {(record.topic, record.offset): record.value for record in records}
    for letter in letters:
        original = letter["record"]
        assert set(original) >= {"topic", "partition", "offset", "timestamp", "key", "value", "headers"}
        assert base64.b64decode(original["value"]) == sent[(original["topic"], original["offset"])]
    rejected = [letter for letter in letters if letter["reason"]["kind"] == "rejected"]
    assert all(letter["reason"]["problem"]["type"].startswith("urn:poimen:problem:") for letter in rejected)
    assert len(count_runs(dev.dynamodb(), dev.table_name, tenant)) == 1


def test_api_down_raises_after_the_budget_then_the_retry_admits_once(
    relay_against: Callable[[str], Relay], dev: DevServer, dlq: str, tenant: str, tmp_path: Path
) -> None:
    # Given the relay pointed at an API that is not running
    port = free_port()
    relay = relay_against(f"http://127.0.0.1:{port}")
    records = [_record(tenant, SPAWN)]
    relay([])  # its clients made (an environment's first invocation): the bound below is the retry budget's alone
    # When the batch is relayed: it raises within the function's time, and dead-letters nothing
    started = time.monotonic()
    with pytest.raises(AdmissionApiUnavailable):
        relay(records, timeout_seconds=3)
    assert time.monotonic() - started < 3
    assert dead_letters(dev, dlq) == []
    assert count_runs(dev.dynamodb(), dev.table_name, tenant) == []
    # When the API comes up on that address and the event source retries the batch (twice)
    api = start_dev(tmp_path, "--dynamodb-endpoint", dev.aws_endpoint, table_name=dev.table_name, port=port)
    try:
        relay(records)
        relay(records)
    finally:
        assert api.stop() == 0
    # Then the run exists exactly once
    assert len(count_runs(dev.dynamodb(), dev.table_name, tenant)) == 1
    assert dead_letters(dev, dlq) == []


def test_inbox_lag_is_emitted_as_emf(relay: Relay, tenant: str, capsys: pytest.CaptureFixture[str]) -> None:
    relay([_record(tenant, SPAWN)])  # the record was produced 5 s ago

    documents = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith('{"_aws"')]
    (document,) = documents
    declared = {metric["Name"]: metric["Unit"] for metric in document["_aws"]["CloudWatchMetrics"][0]["Metrics"]}
    assert declared["InboxLag"] == "Milliseconds"
    assert 5000 <= _single(document["InboxLag"]) < 65000
    assert _single(document["DispatchRelayed"]) == 1
    assert _single(document["DispatchReplayed"]) == _single(document["DispatchDeadLettered"]) == 0
    assert _single(document["RelayRetries"]) == 0
    # Per tenant: the dashboard's SEARCH('{Poimen,service,tenant} ...') finds exactly this dimension set.
    (dimension_set,) = document["_aws"]["CloudWatchMetrics"][0]["Dimensions"]
    assert sorted(dimension_set) == ["service", "tenant"]
    assert document["tenant"] == tenant


def _single(value: Any) -> float:
    values = value if isinstance(value, list) else [value]
    assert len(values) == 1
    return float(values[0])


def test_transient_failures_are_retried_and_traceparent_forwarded(
    relay_against: Callable[[str], Relay],
    dev: DevServer,
    dlq: str,
    tenant: str,
    scripted_api: ScriptedApi,
    capsys: pytest.CaptureFixture[str],
    wire: str,
) -> None:
    # Given an API that answers one spawn 503, 429 (Retry-After: 0) and 500 before it admits it, and admits another
    # at once: as the whole answer to a spawn alone, as its result in a batch's answer (a per-result retry)
    failing = {"order-42": [(503, None), (429, 0), (500, None)]}
    lock = threading.Lock()

    def answer(spawn: dict[str, Any]) -> tuple[int, int | None]:
        with lock:
            script = failing.get(spawn["dispatch_key"], [])
            return script.pop(0) if script else (201, None)

    scripted_api.responder = answering_each_spawn(answer)
    relay = relay_against(scripted_api.url)
    traceparents = {
        "order-42": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "order-43": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    }
    records = {
        key: dataclasses.replace(
            _record(tenant, {**SPAWN, "dispatch_key": key}, offset=offset, key=key.encode()),
            headers=[("traceparent", traceparent.encode())],
        )
        for offset, (key, traceparent) in enumerate(traceparents.items())
    }
    # When both are relayed
    relay(list(records.values()))
    # Then the failing spawn was sent four times and the other once (a batch's retry carries only what failed),
    # each time signed, its value verbatim, with its own trace context; nothing dead-lettered
    sent = sent_spawns(scripted_api)
    assert Counter(spawn.dispatch_key for spawn in sent) == {"order-42": 4, "order-43": 1}
    for spawn in sent:
        assert spawn.dispatch_key is not None
        value = records[spawn.dispatch_key].value
        assert value is not None
        assert value in spawn.body
        assert spawn.traceparent == traceparents[spawn.dispatch_key]
        assert spawn.headers["x-poimen-tenant"] == tenant
        assert spawn.headers["authorization"].startswith("AWS4-HMAC-SHA256 Credential=")
        assert "/us-east-1/execute-api/aws4_request" in spawn.headers["authorization"]
    assert dead_letters(dev, dlq) == []
    (document,) = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith('{"_aws"')]
    assert _single(document["RelayRetries"]) == 3
    assert _single(document["DispatchRelayed"]) == 2


@pytest.mark.parametrize(
    "wire",
    ["batch", "per-record"],
    indirect=True,
)
def test_records_sharing_a_key_are_admitted_in_offset_order(
    relay_against: Callable[[str], Relay], tenant: str, scripted_api: ScriptedApi, wire: str
) -> None:
    # Given ten records under one Kafka key among twenty others (keyed and keyless), delivered shuffled, and an
    # API that answers the first same-key record 503 once and admits every other spawn in the order it gets them
    admitted: list[str] = []
    failed: list[str] = []
    lock = threading.Lock()

    def answer(spawn: dict[str, Any]) -> tuple[int, int | None]:
        with lock:
            if spawn["dispatch_key"] == "same-0" and not failed:
                failed.append(spawn["dispatch_key"])
                return (503, None)
            admitted.append(spawn["dispatch_key"])
            return (201, None)

    scripted_api.responder = answering_each_spawn(answer)
    relay = relay_against(scripted_api.url)
    same = [_record(tenant, {**SPAWN, "dispatch_key": f"same-{i}"}, offset=i, key=b"same") for i in range(10)]
    others = [
        _record(
            tenant, {**SPAWN, "dispatch_key": f"other-{i}"}, offset=100 + i, key=f"o{i}".encode() if i % 2 else None
        )
        for i in range(20)
    ]
    shuffled = [record for pair in zip(reversed(same), others[:10], strict=True) for record in pair] + others[10:]
    # When the batch is relayed
    relay(shuffled)
    # Then the failed one was admitted, retried, before any later record of its key, and every record once
    assert failed == ["same-0"]
    assert [key for key in admitted if key.startswith("same-")] == [f"same-{i}" for i in range(10)]
    assert sorted(key for key in admitted if key.startswith("other-")) == sorted(f"other-{i}" for i in range(20))


# A cold environment's relay takes this long to build, on top of building its clients: the bounded fetch of its
# credentials from Lambda's container endpoint after a SnapStart restore, at most CREDENTIALS_FETCH_SECONDS.
COLD_CREDENTIALS_SECONDS = CREDENTIALS_FETCH_SECONDS


@pytest.mark.parametrize(
    ("environment", "timeout_seconds"),
    [
        # Its relay built, as a warm environment's is: the bound is the retry budget's alone (building the clients
        # took up to 4 s on a loaded machine, which the invocation's time counts and this case is not about).
        ("warm", 2.5),
        # Built in the timed invocation, as a cold one builds it: the bound counts the build too, so a relay that
        # took its budget from before its build would end COLD_CREDENTIALS_SECONDS and more past the deadline. 6 s:
        # the build's 2 s and up to 3.5 s of clients on a loaded machine, and the 0.5 s margin.
        ("cold", 6.0),
    ],
)
def test_a_hanging_api_still_ends_the_invocation_within_its_time(
    relay_against: Callable[[str], Relay],
    dev: DevServer,
    dlq: str,
    tenant: str,
    scripted_api: ScriptedApi,
    monkeypatch: pytest.MonkeyPatch,
    environment: str,
    timeout_seconds: float,
) -> None:
    # Given an API that accepts the connection and answers only once the test is over
    over = threading.Event()

    def hanging(_: bytes) -> tuple[int, dict[str, str], bytes]:
        over.wait(30)
        return (201, {}, b'{"run_id": "late"}')

    scripted_api.responder = hanging
    relay = relay_against(scripted_api.url)
    # and an environment whose relay is built (warm), or one that builds it, its credentials fetched (cold)

    def fetching_credentials() -> Any:
        time.sleep(COLD_CREDENTIALS_SECONDS)
        return bounded_session()

    if environment == "warm":
        relay_service()
    else:
        monkeypatch.setattr("poimen.relay.bounded_session", fetching_credentials)
    # When the function has `timeout_seconds` left
    started = time.monotonic()
    try:
        with pytest.raises(AdmissionApiUnavailable):
            relay([_record(tenant, SPAWN)], timeout_seconds=timeout_seconds)
        # Then it gave up before its deadline, and dead-lettered nothing
        ended = time.monotonic() - started
        assert ended < timeout_seconds, f"ended {ended:.2f} s into a {timeout_seconds} s invocation"
    finally:
        over.set()
    assert dead_letters(dev, dlq) == []


@pytest.fixture
def trickling_api() -> Iterator[Callable[..., str]]:
    """An HTTP peer on loopback that reads each request, then answers one byte a second (or every `interval`
    seconds): either a 201 whose headers come at once and whose 40-byte body trickles ("body"), or the whole
    answer trickling ("headers")."""
    stop = threading.Event()
    servers: list[socket.socket] = []
    threads: list[threading.Thread] = []
    answer = b'{"run_id": "trickled", "status": "admitted"}'[:40]
    head = b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nContent-Length: 40\r\n\r\n"

    def serve(connection: socket.socket, slow: str, interval: float) -> None:
        with connection:
            request = b""
            while b"\r\n\r\n" not in request:
                request += connection.recv(65536)
            headers, _, body = request.partition(b"\r\n\r\n")
            length = int(re.search(rb"(?i)content-length: *(\d+)", headers).group(1))  # type: ignore[union-attr]
            while len(body) < length:
                body += connection.recv(65536)
            if slow == "body":
                connection.sendall(head)
            for byte in (head if slow == "headers" else b"") + answer:
                if stop.wait(interval):
                    return
                try:
                    connection.sendall(bytes([byte]))
                except OSError:  # the relay gave up and closed the connection
                    return

    def accept(server: socket.socket, slow: str, interval: float) -> None:
        while not stop.is_set():
            try:
                connection, _ = server.accept()
            except OSError:  # closed at teardown
                return
            thread = threading.Thread(target=serve, args=(connection, slow, interval), daemon=True)
            thread.start()
            threads.append(thread)

    def start(slow: str, interval: float = 1.0) -> str:
        server = socket.create_server(("127.0.0.1", 0))
        servers.append(server)
        thread = threading.Thread(target=accept, args=(server, slow, interval), daemon=True)
        thread.start()
        threads.append(thread)
        return f"http://127.0.0.1:{server.getsockname()[1]}"

    yield start
    stop.set()
    for server in servers:
        server.close()
    for thread in threads:
        thread.join(timeout=5)


@pytest.mark.parametrize("slow", ["body", "headers"])
def test_an_answer_trickling_in_still_ends_the_invocation_within_its_time(
    relay_against: Callable[[str], Relay],
    dev: DevServer,
    dlq: str,
    tenant: str,
    trickling_api: Callable[..., str],
    capsys: pytest.CaptureFixture[str],
    slow: str,
) -> None:
    # Given an API whose answer arrives one byte a second (40 s for the body alone), each byte within
    # any read timeout
    relay = relay_against(trickling_api(slow))
    # When the function has 6 s left (0.5 s of margin: a 5.5 s budget)
    started = time.monotonic()
    with pytest.raises(AdmissionApiUnavailable):
        relay([_record(tenant, SPAWN)], timeout_seconds=6)
    # Then the batch failed before the function's deadline, dead-lettered nothing, and published its metrics
    assert time.monotonic() - started < 6
    assert dead_letters(dev, dlq) == []
    (document,) = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith('{"_aws"')]
    assert _single(document["DispatchRelayed"]) == _single(document["DispatchDeadLettered"]) == 0


def test_a_dead_letter_queue_answer_trickling_in_still_ends_the_invocation_within_its_time(
    relay_against: Callable[[str], Relay],
    dev: DevServer,
    tenant: str,
    trickling_api: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a record to dead-letter, and a dead-letter queue endpoint whose answer to a SendMessage arrives one
    # byte every half second, each within the send's read timeout (1 s)
    relay = relay_against(dev.url)
    monkeypatch.setenv("AWS_ENDPOINT_URL_SQS", trickling_api("headers", 0.5))
    # When the function has 6 s left (0.5 s of margin: a 5.5 s budget)
    started = time.monotonic()
    with pytest.raises(DeadLetterQueueUnavailable):
        relay([_record(tenant, b"{not json")], timeout_seconds=6)
    # Then the batch failed before the function's deadline (retried from Kafka, the record is not lost)
    assert time.monotonic() - started < 6


@pytest.mark.parametrize("status", [401, 403, 404, 405, 302])
def test_an_api_refusing_the_relay_fails_the_batch_instead_of_dead_lettering(
    relay_against: Callable[[str], Relay],
    dev: DevServer,
    dlq: str,
    tenant: str,
    scripted_api: ScriptedApi,
    status: int,
) -> None:
    scripted_api.responder = lambda _: (status, {}, b'{"message": "Forbidden"}')
    relay = relay_against(scripted_api.url)

    with pytest.raises(AdmissionApiRefused):
        relay([_record(tenant, SPAWN, offset=i, key=f"k{i}".encode()) for i in range(3)])

    assert dead_letters(dev, dlq) == []


@pytest.mark.parametrize(("mode", "given_up"), [("provisioned", False), ("on-demand", True)])
def test_an_api_refusing_the_relay_for_hours_ends_as_dead_letters_only_under_on_demand_pollers(
    relay_against: Callable[[str], Relay],
    dev: DevServer,
    dlq: str,
    tenant: str,
    scripted_api: ScriptedApi,
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
    given_up: bool,
) -> None:
    # Given the API refusing the relay, and a batch of three records two hours old, the age limit an hour
    scripted_api.responder = lambda _: (403, {}, b'{"message": "Forbidden"}')
    monkeypatch.setenv("RELAY_EVENT_POLLERS", mode)
    monkeypatch.setenv("RELAY_MAX_RECORD_AGE_SECONDS", "3600")
    relay = relay_against(scripted_api.url)
    old = int(time.time() * 1000) - 2 * 3600 * 1000
    records = [
        dataclasses.replace(_record(tenant, SPAWN, offset=i, key=f"k{i}".encode()), timestamp_ms=old) for i in range(3)
    ]
    # When the batch is relayed
    if given_up:
        relay(records)
    else:
        with pytest.raises(AdmissionApiRefused):
            relay(records)
    # Then provisioned it failed, nothing dead-lettered (its mapping retries it, then parks it in S3); on-demand,
    # where nothing would park it, each record is one retries-exhausted letter and the batch is done
    letters = dead_letters(dev, dlq)
    kinds = sorted((int(letter["record"]["offset"]), letter["reason"]["kind"]) for letter in letters)
    assert kinds == ([(offset, "retries-exhausted") for offset in range(3)] if given_up else [])


def test_tombstones_keyless_records_and_oversize_values(relay: Relay, dev: DevServer, tenant: str, dlq: str) -> None:
    tombstone = KafkaRecord(
        topic=f"poimen.{tenant}.dispatch", partition=0, offset=1, timestamp_ms=0, value=None, key=b"k"
    )
    oversize = _record(tenant, b"x" * (1024 * 1024), offset=2, key=None)  # not JSON, and too big for SQS whole
    keyless_dispatch = _record(tenant, {"workflow_ref": "wf/no-key", "input": {}}, offset=3, key=None)

    relay([tombstone, oversize, keyless_dispatch])

    letters = {letter["record"]["offset"]: letter for letter in dead_letters(dev, dlq)}
    assert set(letters) == {1, 2}
    assert letters[1]["reason"]["kind"] == "empty-value"
    assert letters[1]["record"]["value"] is None
    assert letters[2]["reason"]["kind"] == "invalid-json"
    assert letters[2]["record"]["value"] is None
    assert letters[2]["record"]["valueOmitted"]["length"] > 1024 * 1024
    runs = count_runs(dev.dynamodb(), dev.table_name, tenant)
    assert [run["workflow_ref"]["S"] for run in runs] == ["wf/no-key"]


def test_a_dead_letter_that_cannot_be_sent_fails_the_batch(
    relay: Relay, dev: DevServer, tenant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing_queue = f"{dev.aws_endpoint}/000000000000/no-such-queue-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("DLQ_URL", missing_queue)
    relay_service.cache_clear()

    with pytest.raises(DeadLetterQueueUnavailable, match="NonExistentQueue"):
        relay([_record(tenant, b"{not json")])


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """A loopback address that takes connections (the kernel's backlog) and never answers."""
    with socket.create_server(("127.0.0.1", 0), backlog=64) as server:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"


def test_a_dlq_that_does_not_answer_fails_the_batch_within_the_functions_time(
    relay: Relay, dev: DevServer, tenant: str, silent_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a dead-letter queue endpoint that never answers, and a valid record beside a malformed one
    monkeypatch.setenv("AWS_ENDPOINT_URL_SQS", silent_endpoint)
    relay_service.cache_clear()
    records = [_record(tenant, b"{not json", offset=0, key=b"bad"), _record(tenant, SPAWN, offset=1, key=b"good")]
    # When the function has 5 s (0.5 s of margin)
    started = time.monotonic()
    with pytest.raises(DeadLetterQueueUnavailable, match="ReadTimeoutError"):
        relay(records, timeout_seconds=5)
    # Then the batch failed before the function's deadline, so the event source retries it: nothing lost
    assert time.monotonic() - started < 5


def test_a_crlf_traceparent_stalls_no_record_of_the_batch(
    relay_against: Callable[[str], Relay],
    dev: DevServer,
    dlq: str,
    tenant: str,
    scripted_api: ScriptedApi,
    wire: str,
) -> None:
    # Given 21 records over 20 Kafka keys, the first of the shared key with a CR/LF in its traceparent, and an
    # API that admits every spawn
    traceparent = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    records = [
        _record(tenant, {**SPAWN, "dispatch_key": f"d-{i}"}, offset=i, key=f"k{min(i, 19)}".encode()) for i in range(21)
    ]
    records = [
        dataclasses.replace(record, headers=[("traceparent", traceparent + (b"\r\n" if i == 19 else b""))])
        for i, record in enumerate(records)
    ]
    scripted_api.responder = answering_each_spawn(lambda _: (201, None))
    # When the batch is relayed
    relay_against(scripted_api.url)(records)
    # Then every record was posted once, the malformed trace context left behind and the others forwarded
    sent = sent_spawns(scripted_api)
    by_key = {spawn.dispatch_key: spawn.traceparent for spawn in sent}
    assert sorted(str(spawn.dispatch_key) for spawn in sent) == sorted(f"d-{i}" for i in range(21))
    assert by_key.pop("d-19") is None
    assert set(by_key.values()) == {traceparent.decode()}
    assert dead_letters(dev, dlq) == []


def test_the_malformed_record_corpus_is_dead_lettered_and_never_stops_the_batch(
    relay: Relay, dev: DevServer, tenant: str, dlq: str
) -> None:
    corpus = load_event("relay_malformed_records.json")["records"]
    records = []
    for offset, entry in enumerate(corpus):
        if "value_base64" in entry:
            value: bytes | None = base64.b64decode(entry["value_base64"])
        elif entry.get("value_null"):
            value = None
        else:
            text = (
                entry["value_text"]
                .replace("{big}", "x" * (256 * 1024))
                .replace("{deep}", "[" * 100_000 + "]" * 100_000)
            )
            value = text.encode("utf-8", "surrogatepass")
        topic = entry.get("topic", "poimen.{tenant}.dispatch").replace("{tenant}", tenant)
        headers = [(name, bytes([byte]) * count) for name, byte, count in entry.get("headers", [])]
        records.append(
            KafkaRecord(
                topic=topic, partition=0, offset=offset, timestamp_ms=0, value=value, key=b"same", headers=headers
            )
        )
    records.append(_record(tenant, SPAWN, offset=len(corpus)))  # valid, after all of them, same key

    relay(records)

    letters = {letter["record"]["offset"]: letter["reason"] for letter in dead_letters(dev, dlq)}
    assert len(corpus) >= 20
    for offset, entry in enumerate(corpus):
        assert (letters[offset]["kind"], letters[offset]["status"]) == (entry["kind"], entry.get("status")), entry[
            "name"
        ]
    assert len(letters) == len(corpus)
    assert [run["run_id"]["S"] for run in count_runs(dev.dynamodb(), dev.table_name, tenant)] == [
        keyed_run_id(tenant, "order-42")
    ]


def test_dynamodb_throttling_is_503_and_the_relay_retries_until_one_run(
    relay_against: Callable[[str], Relay],
    dev: DevServer,
    dlq: str,
    tenant: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given an API whose DynamoDB (a moto server in this process) throttles the next run writes
    serialise_dynamodb_writes()
    throttled = {"remaining": 0}
    original = DynamoDBBackend.put_item

    def throttling(self: DynamoDBBackend, *args: Any, **kwargs: Any) -> Any:
        if throttled["remaining"] > 0:
            throttled["remaining"] -= 1
            raise DynamodbException("ProvisionedThroughputExceededException", "injected throttling")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(DynamoDBBackend, "put_item", throttling)
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    moto.start()
    host, port = moto.get_host_and_port()
    api = start_dev(tmp_path, "--dynamodb-endpoint", f"http://{host}:{port}", table_name="throttled")
    try:
        # When the store throttles every attempt of a request (DYNAMODB_MAX_ATTEMPTS, by default)
        throttled["remaining"] = Settings.dynamodb_max_attempts
        direct = signed_session().post(
            f"{api.url}/v1/runs", json={"workflow_ref": "wf", "input": {}}, headers={"X-Poimen-Tenant": tenant}
        )
        # Then the API answers 503 with Retry-After, having retried
        assert (direct.status_code, direct.headers["Retry-After"]) == (503, "1")
        assert direct.json()["type"] == "urn:poimen:problem:store-unavailable"
        assert throttled["remaining"] == 0
        # When it throttles one request and one more attempt, and the relay sends a dispatch
        throttled["remaining"] = Settings.dynamodb_max_attempts + 1
        relay_against(api.url)([_record(tenant, SPAWN)])
        # Then the relay retried the 503 and the run exists exactly once, nothing dead-lettered
        runs = count_runs(boto3.client("dynamodb", endpoint_url=f"http://{host}:{port}"), "throttled", tenant)
        assert [run["run_id"]["S"] for run in runs] == [keyed_run_id(tenant, "order-42")]
        assert dead_letters(dev, dlq) == []
    finally:
        assert api.stop() == 0
        moto.stop()
