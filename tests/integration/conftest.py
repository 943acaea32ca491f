"""Integration level: `poimen dev` as a real process, its embedded moto server, real HTTP on loopback."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import boto3
import pytest
import requests

from poimen_tools.local.kafka_broker import KafkaBroker
from poimen_tools.local.sigv4 import DEV_ACCESS_KEY, DEV_SECRET_KEY, signed_headers
from tests.conftest import serve_on_loopback as serve_on_loopback  # re-exported: integration tests import it here
from tests.conftest import wait_for

__all__ = ["wait_for"]  # the integration tests import it from here, with the other helpers

POIMEN = Path(sys.executable).parent / "poimen"
# The tenants a `poimen dev` without Kafka serves unless a test names others: next_tenant (and the `tenant`
# fixture) hands out each once, as a test's own tenant (tests never see each other's runs); each one's
# `<tenant>-other` too, the second tenant some tests use; and the fixed names tests use. A `poimen dev` with
# Kafka creates every served tenant's topics at start: those are given their tenants.
TENANT_POOL = tuple(f"t-{uuid.uuid4().hex[:12]}" for _ in range(320))
FIXED_TENANTS = ("acme", "globex")
SERVED_BY_DEFAULT = (*TENANT_POOL, *(f"{tenant}-other" for tenant in TENANT_POOL), *FIXED_TENANTS)
_unused_tenants = iter(TENANT_POOL)


def next_tenant() -> str:
    """A tenant id no other test uses, which the `poimen dev`s of these tests serve (TENANT_POOL)."""
    try:
        return next(_unused_tenants)
    except StopIteration:
        raise AssertionError("more tests ask for a tenant than TENANT_POOL holds: make it larger") from None


@pytest.fixture
def tenant() -> str:
    return next_tenant()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class DevServer:
    process: subprocess.Popen[bytes]
    url: str
    aws_endpoint: str  # DynamoDB's (and every service's, when they share the embedded moto server)
    table_name: str
    dlq_url: str
    log: Path
    kafka_bootstrap: str | None = None
    sqs_endpoint: str | None = None

    def dynamodb(self) -> Any:
        return boto3.client("dynamodb", endpoint_url=self.aws_endpoint)

    def sqs(self) -> Any:
        return boto3.client("sqs", endpoint_url=self.sqs_endpoint or self.aws_endpoint)

    def admissions(self, tenant: str) -> list[dict[str, Any]]:
        """Every admission the HTTP handler entered for `tenant`, from its structured logs."""
        entries = []
        for line in self.log.read_text().splitlines():
            if not line.startswith("{"):
                continue
            try:
                entry = json.loads(line)
            except ValueError:  # another process's line (a traceback, say); ours are whole lines
                continue
            if entry.get("message") in ("run admitted", "run replayed") and entry.get("tenant_id") == tenant:
                entries.append(entry)
        return entries

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=60)  # its environments stop one by one: slow on a loaded machine
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                raise
        return self.process.returncode


# The relay signs with the process's AWS credentials (tests/conftest.py: testing/testing).
RELAY_ROLE = "arn:aws:iam::123456789012:role/poimen-relay"


class SigV4(requests.auth.AuthBase):
    """Signs each request as the dev key of `poimen dev` (or another principal) for execute-api."""

    def __init__(self, access_key: str = DEV_ACCESS_KEY, secret_key: str = DEV_SECRET_KEY) -> None:
        self.access_key, self.secret_key = access_key, secret_key

    def __call__(self, request: requests.PreparedRequest) -> requests.PreparedRequest:
        body = request.body or b""
        body = body.encode() if isinstance(body, str) else body
        kept = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "x-poimen-tenant")}
        signed = signed_headers(
            request.method or "GET", request.url or "", kept, body, self.access_key, self.secret_key, "us-east-1"
        )
        request.headers.update(signed)
        return request


def signed_session() -> requests.Session:
    session = requests.Session()
    session.auth = SigV4()
    return session


def start_dev(
    tmp_path: Path,
    *extra: str,
    table_name: str = "poimen-admission-local",
    port: int | None = None,
    kafka: bool = False,
    test_principal: bool = True,
    tenants: Sequence[str] | None = None,
) -> DevServer:
    """`poimen dev` serving `tenants` (without Kafka: SERVED_BY_DEFAULT unless given; empty: its own default,
    as `make run` starts it)."""
    port = port or free_port()
    if tenants is None and kafka:
        raise TypeError("a poimen dev with Kafka creates each served tenant's topics at start: name its tenants")
    served = tenants if tenants is not None else SERVED_BY_DEFAULT
    extra = ("--kafka-port", "0", *extra) if kafka else ("--no-kafka", *extra)
    extra = ("--tenants", ",".join(served), *extra) if served else extra
    principals = tmp_path / "principals.json"
    # The relays these tests run in their own process sign as "testing"; `poimen dev` adds its dev key.
    # tests/conftest.py sets AWS_SESSION_TOKEN=testing: the principal declares it, as temporary credentials must.
    testing = {"secret": "testing", "session_token": "testing", "arn": RELAY_ROLE, "tenants": ["*"]}
    known = {"testing": testing} if test_principal else {}
    principals.write_text(json.dumps(known))
    extra = ("--principals", str(principals), *extra)
    log = tmp_path / f"poimen-dev-{port}.log"
    with log.open("ab") as out:  # append mode: the worker processes share this file
        process = subprocess.Popen(
            [str(POIMEN), "dev", "--port", str(port), "--table-name", table_name, *extra],
            stdout=out,
            stderr=subprocess.STDOUT,
            # INFO: the handler logs each admission it enters, which tests count.
            env={**os.environ, "POWERTOOLS_LOG_LEVEL": "INFO"},
        )

    def announced() -> dict[str, str] | None:
        if process.poll() is not None:
            raise AssertionError(f"poimen dev exited with {process.returncode}:\n{log.read_text()}")
        lines = dict(line.split(": ", 1) for line in log.read_text().splitlines() if ": " in line)
        ready = (
            "Relay dead-letter queue" in lines
            and "Admission API" in lines
            and "Credentials (SigV4, execute-api)" in lines
        )
        return lines if ready and (not kafka or "Kafka bootstrap" in lines) else None

    try:
        lines = wait_for(announced, timeout=120, what="poimen dev to announce its URLs")
    except BaseException:
        process.kill()
        process.wait()
        raise
    shared = lines.get("Local AWS (DynamoDB, SQS, S3)")
    words = (shared or lines["Local AWS"]).split()
    endpoint, sqs_endpoint = (words[0], words[0]) if shared else (words[1], words[3])
    kafka_line = lines.get("Kafka bootstrap")
    return DevServer(
        process,
        lines["Admission API"].strip(),
        endpoint,
        table_name,
        lines["Relay dead-letter queue"].strip(),
        log,
        kafka_line.split()[0] if kafka_line else None,
        sqs_endpoint,
    )


@pytest.fixture(scope="session")
def dev(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevServer]:
    server = start_dev(tmp_path_factory.mktemp("dev"))
    yield server
    assert server.stop() == 0


@pytest.fixture
def http() -> Iterator[requests.Session]:
    with signed_session() as session:
        yield session


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaBroker]:
    """A real KRaft broker, one per worker session: tests share it by topic (their own tenant's, a name of
    their own) and consumer group, and none stops it; a test that stops, kills or reconfigures a broker starts
    its own (KafkaBroker)."""
    with KafkaBroker(tmp_path_factory.mktemp("kafka")) as running:
        yield running


@pytest.fixture
def dlq(dev: DevServer) -> str:
    """A new dead-letter queue in `poimen dev`'s SQS, this test's alone."""
    url: str = dev.sqs().create_queue(QueueName=f"dlq-{uuid.uuid4().hex[:12]}")["QueueUrl"]
    return url


@dataclass
class ScriptedApi:
    """An HTTP peer on loopback that answers POSTs from a script and records what it received."""

    url: str
    script: list[tuple[int, dict[str, str], bytes]]
    received: list[tuple[dict[str, str], bytes]]
    # When set, it answers instead of the script (None: fall back to the script); it may block.
    responder: Callable[[bytes], tuple[int, dict[str, str], bytes] | None] | None = None


@pytest.fixture
def scripted_api() -> Iterator[ScriptedApi]:
    api = ScriptedApi(url="", script=[], received=[])
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            answer = api.responder(body) if api.responder else None
            with lock:
                api.received.append(({k.lower(): v for k, v in self.headers.items()}, body))
                if answer is None:
                    answer = api.script.pop(0) if api.script else (201, {}, b'{"run_id":"r"}')
            status, headers, payload = answer
            self.send_response(status)
            for name, value in {"Content-Type": "application/json", **headers}.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: Any) -> None:
            return

    with serve_on_loopback(Handler) as url:
        api.url = url
        yield api


@pytest.fixture
def no_admission_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Admission entered in this process (relay code) fails the test; the API runs in `poimen dev`."""
    from poimen.admission import Admission
    from poimen.store import Store

    def forbidden(*_: Any, **__: Any) -> Any:
        raise AssertionError("admission was entered from relay code, not through POST /v1/runs")

    monkeypatch.setattr(Admission, "admit_run", forbidden)
    monkeypatch.setattr(Store, "put_run_if_absent", forbidden)


def dead_letters(dev: DevServer, queue_url: str) -> list[dict[str, Any]]:
    """Every message in a queue of the dev server's moto (consumed)."""
    letters: list[dict[str, Any]] = []
    while True:
        batch = dev.sqs().receive_message(QueueUrl=queue_url, MaxNumberOfMessages=10, WaitTimeSeconds=0)
        messages = batch.get("Messages", [])
        if not messages:
            return letters
        letters.extend(json.loads(message["Body"]) for message in messages)
