"""poimen.client against scripted HTTP peers on loopback: signing, retries and backoff, Retry-After, the
keyless spawn's generated key, the mapping of answers to typed errors, and failover between regional
endpoints (also through `poimen runs`). The backoff's sleep is injected and recorded: no test waits for it."""

from __future__ import annotations

import json
import random
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import urllib3.util.connection
from botocore.credentials import Credentials, ReadOnlyCredentials

from poimen.client import (
    GENERATED_KEY_PREFIX,
    AdmissionClient,
    DispatchKeyReused,
    Forbidden,
    InvalidRequest,
    NotFound,
    OutcomeUnknown,
    RegionalEndpoint,
    Unavailable,
    UnexpectedAnswer,
)
from poimen.contract import parse_json
from poimen.wire import DISPATCH_KEY_PATTERN, retry_after_seconds
from poimen_tools import cli, runs
from poimen_tools.local.sigv4 import Principal, verify

TENANT = "acme"
KEY = Principal("AKIDCLIENT", "client-secret", "arn:aws:iam::123456789012:user/client", ("*",))
RUN_ID = "0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b"
DROP = "drop"  # read the request, close the connection without an answer
STALL = "stall"  # read the request, answer nothing until the test ends


def run_body(dispatch_key: str | None = "k-1", **changes: Any) -> dict[str, Any]:
    return {
        "run_id": RUN_ID,
        "tenant_id": TENANT,
        "workflow_ref": "wf/a",
        "input": {"n": 1},
        "goal_id": None,
        "dispatch_key": dispatch_key,
        "status": "admitted",
        "created_at": "2026-01-02T03:04:05.678Z",
        **changes,
    }


def problem(status: int, kind: str, **extensions: Any) -> tuple[int, dict[str, str], Any]:
    body = {"type": f"urn:poimen:problem:{kind}", "title": "t", "status": status, "detail": f"{kind} detail"}
    return status, {"Content-Type": "application/problem+json"}, {**body, **extensions}


@dataclass
class Received:
    method: str
    target: str
    headers: list[tuple[str, str]]
    body: bytes
    at: float = 0.0  # the peer's clock when it arrived (a FakeTime's, when the test gives it one)

    @property
    def json(self) -> Any:
        return json.loads(self.body)

    def header(self, name: str) -> str | None:
        return next((value for key, value in self.headers if key.lower() == name.lower()), None)


@dataclass
class Peer:
    """Answers each request with the next scripted answer (status, headers, JSON body), DROP or STALL;
    an echo of the spawn as a 201 run when the script is empty."""

    url: str = ""
    script: list[Any] = field(default_factory=list)
    received: list[Received] = field(default_factory=list)
    released: threading.Event = field(default_factory=threading.Event)
    clock: Callable[[], float] = time.monotonic


@pytest.fixture
def peer() -> Iterator[Peer]:
    with serving() as api:
        yield api


@pytest.fixture
def second_peer() -> Iterator[Peer]:
    """Another Region's endpoint, for failover."""
    with serving() as api:
        yield api


@contextmanager
def serving() -> Iterator[Peer]:
    api = Peer()
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            with lock:
                api.received.append(Received(self.command, self.path, list(self.headers.items()), body, api.clock()))
                step = api.script.pop(0) if api.script else None
            if step == DROP:
                self.close_connection = True
                return
            if step == STALL:
                api.released.wait(10)
                self.close_connection = True
                return
            if step is None:
                sent = json.loads(body) if body else {}
                step = (201, {}, run_body(sent.get("dispatch_key"), input=sent.get("input", {})))
            status, headers, payload = step
            data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            self.send_response(status)
            for name, value in {"Content-Type": "application/json", **headers}.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _answer

        def log_message(self, format: str, *args: Any) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    api.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield api
    api.released.set()
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


class Ceiling(random.Random):
    """Backoff at its ceiling, so the delays a test sees are the exponential bounds themselves."""

    def uniform(self, a: float, b: float) -> float:
        return b


class Floor(random.Random):
    def uniform(self, a: float, b: float) -> float:
        return a


@dataclass
class Sleeps:
    delays: list[float] = field(default_factory=list)

    def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)


@dataclass
class FakeTime:
    """The client's clock and sleep together: sleeping moves the clock on, and nothing else does."""

    now: float = 1000.0
    delays: list[float] = field(default_factory=list)

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.delays.append(seconds)
        self.now += seconds


def client(peer: Peer, sleeps: Sleeps | None = None, **options: Any) -> AdmissionClient:
    defaults: dict[str, Any] = {
        "region": "us-east-1",
        "credentials": Credentials(KEY.access_key, KEY.secret_key),
        "timeout": 2.0,
        "sleep": sleeps or Sleeps(),
        "rng": Ceiling(),
    }
    return AdmissionClient(peer.url, **{**defaults, **options})


def test_a_spawn_is_signed_for_execute_api_and_answers_the_run(peer: Peer) -> None:
    spawned = client(peer).spawn(TENANT, "wf/a", {"n": 1}, goal_id="g-1", dispatch_key="k-1")

    (request,) = peer.received
    assert (request.method, request.target, request.header("X-Poimen-Tenant")) == ("POST", "/v1/runs", TENANT)
    assert verify({KEY.access_key: KEY}, request.method, request.target, request.headers, request.body) == KEY
    assert request.json == {"workflow_ref": "wf/a", "input": {"n": 1}, "goal_id": "g-1", "dispatch_key": "k-1"}
    assert (spawned.run_id, spawned.replayed, spawned.attempts) == (RUN_ID, False, 1)


def test_a_host_named_with_its_trailing_dot_is_signed_as_the_host_it_is_sent_to(
    peer: Peer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an endpoint named by its fully qualified name, trailing dot and all (resolved here to the peer):
    # urllib3 sends it the Host header without the dot, as SSL certificates and servers expect
    peer_port = urlsplit(peer.url).port or 80
    connect = urllib3.util.connection.create_connection
    monkeypatch.setattr(
        urllib3.util.connection, "create_connection", lambda _, *a, **k: connect(("127.0.0.1", peer_port), *a, **k)
    )
    url = f"http://admission.example.com.:{peer_port}"
    # When a spawn is sent to it
    AdmissionClient(url, region="us-east-1", credentials=Credentials(KEY.access_key, KEY.secret_key)).spawn(
        TENANT, "wf/a", {}, dispatch_key="k"
    )
    # Then the signature is over the Host header the request arrived with, so API Gateway can verify it
    (request,) = peer.received
    assert request.header("Host") == f"admission.example.com:{peer_port}"
    assert verify({KEY.access_key: KEY}, request.method, request.target, request.headers, request.body) == KEY


def test_a_base_path_is_kept_and_signed(peer: Peer) -> None:
    AdmissionClient(
        f"{peer.url}/prod/", region="us-east-1", credentials=Credentials(KEY.access_key, KEY.secret_key)
    ).spawn(TENANT, "wf/a", {}, dispatch_key="k")

    (request,) = peer.received
    assert request.target == "/prod/v1/runs"
    assert verify({KEY.access_key: KEY}, request.method, request.target, request.headers, request.body) == KEY


def test_input_numbers_travel_exactly_both_ways(peer: Peer) -> None:
    exact = parse_json('{"amount": 12345678901234567.25, "big": 9007199254740993, "rate": 1.10}')
    peer.script.append((201, {}, b'{"run_id":"' + RUN_ID.encode() + b'","tenant_id":"acme","workflow_ref":"w",'
                        b'"input":{"amount":12345678901234567.25,"rate":1.10},"goal_id":null,'
                        b'"dispatch_key":"k","status":"admitted","created_at":"z"}'))  # fmt: skip

    run = client(peer).spawn(TENANT, "wf/a", exact, dispatch_key="k").run

    assert b'"input":{"amount":12345678901234567.25,"big":9007199254740993,"rate":1.10}' in peer.received[0].body
    assert str(run.input["amount"]) == "12345678901234567.25"
    assert str(run.input["rate"]) == "1.10"


def test_a_keyless_spawn_sends_one_generated_key_on_every_attempt_of_the_call(peer: Peer) -> None:
    # Given the first two attempts of the call get no answer
    peer.script += [DROP, (503, {}, {"message": "Service Unavailable"})]
    api = client(peer)

    # When the caller spawns without a key, twice
    first = api.spawn(TENANT, "wf/a", {"n": 1})
    second = api.spawn(TENANT, "wf/a", {"n": 1})

    # Then every attempt of the first call carried one generated key, the second call another
    keys = [request.json["dispatch_key"] for request in peer.received]
    assert len(keys) == 4
    assert keys[0] == keys[1] == keys[2] != keys[3]
    assert all(key.startswith(GENERATED_KEY_PREFIX) for key in keys)
    assert all(re.fullmatch(DISPATCH_KEY_PATTERN, key) for key in keys)  # the API takes them
    assert (first.run.dispatch_key, second.run.dispatch_key) == (keys[0], keys[3])
    assert (first.attempts, second.attempts) == (3, 1)


def test_a_replay_is_reported_for_a_callers_key_and_not_for_a_generated_one(peer: Peer) -> None:
    replay = (200, {"Idempotent-Replayed": "true"}, run_body("k-1"))
    peer.script += [replay, DROP, (200, {"Idempotent-Replayed": "true"}, run_body("generated"))]
    api = client(peer)

    keyed = api.spawn(TENANT, "wf/a", {"n": 1}, dispatch_key="k-1")
    keyless = api.spawn(TENANT, "wf/a", {"n": 1})

    assert (keyed.replayed, keyed.attempts) == (True, 1)
    # the replay of a generated key can only be of this call's own first attempt: the call admitted the run
    assert (keyless.replayed, keyless.attempts) == (False, 2)


def test_every_attempt_is_signed_again(peer: Peer) -> None:
    class Rotating(Credentials):
        def __init__(self) -> None:
            super().__init__("unused", "unused")
            self.calls = 0

        def get_frozen_credentials(self) -> ReadOnlyCredentials:
            self.calls += 1
            return ReadOnlyCredentials(f"AKID{self.calls}", KEY.secret_key, None)

    peer.script += [(500, {}, {"message": "Internal Server Error"}), DROP]

    client(peer, credentials=Rotating()).spawn(TENANT, "wf/a", {}, dispatch_key="k")

    access_keys = [(r.header("Authorization") or "").split("Credential=")[1].split("/")[0] for r in peer.received]
    assert access_keys == ["AKID1", "AKID2", "AKID3"]


def test_backoff_is_exponential_full_jitter_up_to_max_attempts(peer: Peer) -> None:
    # Given an API that answers 500 to everything
    peer.script += [problem(500, "internal-error")] * 6
    sleeps = Sleeps()

    # When a call is made with five attempts, base 0.25 s, cap 1.5 s, the jitter at its ceiling
    with pytest.raises(Unavailable) as failure:
        client(peer, sleeps, max_attempts=5, backoff_base=0.25, backoff_cap=1.5).get(TENANT, RUN_ID)

    # Then it slept between attempts only, each time up to the doubled ceiling, capped
    assert sleeps.delays == [0.25, 0.5, 1.0, 1.5]
    assert len(peer.received) == 5
    error = failure.value
    assert (error.attempts, error.status) == (5, 500)
    assert error.problem is not None
    assert error.problem.type == "urn:poimen:problem:internal-error"


def test_the_jitter_is_drawn_from_zero_to_the_ceiling(peer: Peer) -> None:
    peer.script += [DROP, DROP]
    sleeps = Sleeps()

    client(peer, sleeps, rng=Floor()).spawn(TENANT, "wf/a", {}, dispatch_key="k")

    assert sleeps.delays == [0.0, 0.0]


@pytest.mark.parametrize("status", [408, 429, 500, 502, 503, 504])
def test_transient_statuses_are_retried(peer: Peer, status: int) -> None:
    peer.script.append((status, {}, {"message": "busy"}))

    spawned = client(peer).spawn(TENANT, "wf/a", {}, dispatch_key="k")

    assert spawned.attempts == 2


def test_retry_after_in_seconds_is_waited_at_least(peer: Peer) -> None:
    peer.script += [(429, {"Retry-After": "3"}, {"message": "Too Many Requests"}), problem(503, "store-unavailable")]
    peer.script[-1][1]["Retry-After"] = "1"
    sleeps = Sleeps()

    client(peer, sleeps, rng=Floor()).spawn(TENANT, "wf/a", {}, dispatch_key="k")

    assert sleeps.delays == [3.0, 1.0]


def test_retry_after_never_shortens_the_backoff(peer: Peer) -> None:
    peer.script.append((503, {"Retry-After": "0"}, {"message": "busy"}))
    sleeps = Sleeps()

    client(peer, sleeps, rng=Ceiling(), backoff_base=0.5).spawn(TENANT, "wf/a", {}, dispatch_key="k")

    assert sleeps.delays == [0.5]


def test_retry_after_as_an_http_date_is_waited_until(peer: Peer) -> None:
    when = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=4)
    peer.script.append((503, {"Retry-After": format_datetime(when, usegmt=True)}, {"message": "busy"}))
    sleeps = Sleeps()

    client(peer, sleeps, rng=Floor()).spawn(TENANT, "wf/a", {}, dispatch_key="k")

    (delay,) = sleeps.delays
    assert 2.0 < delay <= 4.0


def test_retry_after_is_read_as_seconds_or_an_http_date() -> None:
    now = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)

    assert retry_after_seconds("120", now) == 120.0
    assert retry_after_seconds("Fri, 02 Jan 2026 03:04:35 GMT", now) == 30.0
    assert retry_after_seconds("Fri, 02 Jan 2026 03:00:00 GMT", now) == 0.0  # past: at once
    assert [retry_after_seconds(value, now) for value in (None, "", "soon", "-1", "1.5")] == [None] * 5


@pytest.mark.parametrize("value", ["\u00b2", "\u0661\u0662", "\uff13", "1_000", "+5", "0x10", "1e3", " 1 2 "])
def test_retry_after_is_ascii_delay_seconds_or_nothing(value: str) -> None:
    # RFC 9110: delay-seconds = 1*DIGIT, ASCII digits; Unicode digits ("²".isdigit() is true) and other
    # number syntaxes are no Retry-After at all
    assert retry_after_seconds(value) is None


def test_a_retry_after_of_unicode_digits_is_ignored_not_raised(peer: Peer) -> None:
    # Given an answer whose Retry-After is a superscript two (sent as Latin-1, as HTTP/1.1 allows obs-text)
    peer.script.append((503, {"Retry-After": "\u00b2"}, {"message": "busy"}))
    sleeps = Sleeps()
    # When the client retries
    spawned = client(peer, sleeps, rng=Ceiling(), backoff_base=0.5).spawn(TENANT, "wf/a", {}, dispatch_key="k")
    # Then it waited its own backoff and the retry admitted the run
    assert (spawned.attempts, sleeps.delays) == (2, [0.5])


def test_a_retry_after_beyond_max_retry_after_ends_the_call_at_once(peer: Peer) -> None:
    peer.script.append((503, {"Retry-After": "3600"}, {"message": "busy"}))
    sleeps = Sleeps()

    with pytest.raises(Unavailable) as failure:
        client(peer, sleeps, max_retry_after=60).spawn(TENANT, "wf/a", {}, dispatch_key="k")

    assert (failure.value.retry_after, failure.value.attempts, sleeps.delays) == (3600.0, 1, [])


def test_a_timeout_is_retried(peer: Peer) -> None:
    peer.script.append(STALL)

    spawned = client(peer, timeout=0.3).spawn(TENANT, "wf/a", {}, dispatch_key="k")

    assert (spawned.attempts, [r.json["dispatch_key"] for r in peer.received]) == (2, ["k", "k"])


def test_no_answer_at_all_is_unavailable_after_max_attempts() -> None:
    # Given a port nothing listens on
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    sleeps = Sleeps()
    api = AdmissionClient(
        url, region="us-east-1", credentials=Credentials("a", "b"), max_attempts=3, sleep=sleeps, rng=Floor()
    )

    with pytest.raises(Unavailable) as failure:
        api.find(TENANT, "k")

    assert (failure.value.attempts, failure.value.status, len(sleeps.delays)) == (3, None, 2)
    assert "NewConnectionError" in str(failure.value)


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (problem(400, "validation-error", errors=[{"field": "body.input"}]), InvalidRequest),
        (problem(400, "malformed-json"), InvalidRequest),
        (problem(413, "payload-too-large"), InvalidRequest),
        (problem(415, "unsupported-media-type"), InvalidRequest),
        (problem(403, "forbidden"), Forbidden),
        ((403, {}, {"message": "The security token included in the request is invalid."}), Forbidden),
        ((401, {}, {"message": "Unauthorized"}), UnexpectedAnswer),
        ((302, {"Location": "/elsewhere"}, b""), UnexpectedAnswer),
        ((201, {}, {"not": "a run"}), UnexpectedAnswer),
        ((201, {}, b"<html>"), UnexpectedAnswer),
    ],
)
def test_answers_map_to_typed_errors_without_retrying(
    peer: Peer, answer: tuple[int, dict[str, str], Any], error: type[Exception]
) -> None:
    peer.script.append(answer)

    with pytest.raises(error) as raised:
        client(peer).spawn(TENANT, "wf/a", {}, dispatch_key="k")

    assert len(peer.received) == 1
    assert type(raised.value) is error
    assert getattr(raised.value, "status", None) == answer[0]


def test_a_problem_rides_on_the_error(peer: Peer) -> None:
    peer.script.append(problem(400, "validation-error", errors=[{"field": "body.input"}]))

    with pytest.raises(InvalidRequest) as raised:
        client(peer).spawn(TENANT, "wf/a", {}, dispatch_key="k")

    assert raised.value.problem is not None
    assert raised.value.problem.type == "urn:poimen:problem:validation-error"
    assert raised.value.problem.model_extra == {"errors": [{"field": "body.input"}]}
    assert "validation-error detail" in str(raised.value)


def test_a_reused_dispatch_key_carries_the_existing_run_id(peer: Peer) -> None:
    peer.script.append(problem(422, "dispatch-key-reused", run_id=RUN_ID))

    with pytest.raises(DispatchKeyReused) as raised:
        client(peer).spawn(TENANT, "wf/b", {}, dispatch_key="k-1")

    assert (raised.value.run_id, raised.value.status) == (RUN_ID, 422)
    assert len(peer.received) == 1


def test_get_reads_one_run_and_raises_not_found(peer: Peer) -> None:
    peer.script += [(200, {}, run_body()), problem(404, "run-not-found")]
    api = client(peer)

    run = api.get(TENANT, RUN_ID)
    with pytest.raises(NotFound):
        api.get(TENANT, RUN_ID)

    assert run.run_id == RUN_ID
    assert [(r.method, r.target) for r in peer.received] == [("GET", f"/v1/runs/{RUN_ID}")] * 2


def test_get_cannot_be_steered_to_another_path(peer: Peer) -> None:
    peer.script.append(problem(400, "validation-error"))

    with pytest.raises(InvalidRequest):
        client(peer).get(TENANT, "../runs?dispatch_key=x")

    assert peer.received[0].target == "/v1/runs/..%2Fruns%3Fdispatch_key%3Dx"


def test_find_answers_none_only_for_the_apis_run_not_found(peer: Peer) -> None:
    peer.script += [(200, {}, run_body()), problem(404, "run-not-found"), (404, {}, {"message": "Not Found"})]
    api = client(peer)

    assert api.find(TENANT, "k-1") is not None
    assert api.find(TENANT, "k-1") is None
    with pytest.raises(NotFound) as raised:  # a route the API does not have: a wrong base URL
        api.find(TENANT, "k-1")

    assert raised.value.problem is None


@pytest.mark.parametrize("dispatch_key", ["k-1", "a b", "x/y+z", "#%~*'()!,", "é日本", GENERATED_KEY_PREFIX + "1"])
def test_find_sends_the_key_in_a_query_it_signed(peer: Peer, dispatch_key: str) -> None:
    peer.script.append((200, {}, run_body(dispatch_key)))

    client(peer).find(TENANT, dispatch_key)

    (request,) = peer.received
    path, _, query = request.target.partition("?")
    assert path == "/v1/runs"
    assert query.startswith("dispatch_key=")
    assert verify({KEY.access_key: KEY}, request.method, request.target, request.headers, request.body) == KEY
    assert parse_qs(query) == {"dispatch_key": [dispatch_key]}


def test_requests_that_cannot_be_sent_are_refused_before_sending(peer: Peer) -> None:
    api = client(peer)

    with pytest.raises(InvalidRequest) as bad_tenant:
        api.spawn("Acme\r\nX-Evil: 1", "wf/a", {})
    with pytest.raises(InvalidRequest) as bad_input:
        api.spawn(TENANT, "wf/a", {"x": float("nan")})

    assert (bad_tenant.value.status, bad_input.value.status, peer.received) == (None, None, [])


@pytest.mark.parametrize("text", ["\udcff", "run-\ud800"])
def test_a_run_id_or_key_that_is_not_utf8_is_an_invalid_request_before_sending(peer: Peer, text: str) -> None:
    api = client(peer)

    with pytest.raises(InvalidRequest) as by_id:
        api.get(TENANT, text)
    with pytest.raises(InvalidRequest) as by_key:
        api.find(TENANT, text)

    assert (by_id.value.status, by_key.value.status, peer.received) == (None, None, [])


def outcome_unknown(run_id: str = RUN_ID) -> tuple[int, dict[str, str], Any]:
    status, headers, body = problem(503, "outcome-unknown", run_id=run_id)
    return status, {**headers, "Location": f"/v1/runs/{run_id}", "Retry-After": "1"}, body


def test_an_unknown_outcome_of_a_spawn_is_retried_with_its_key_into_the_one_run(peer: Peer) -> None:
    # Given an API that could not tell whether the spawn's first attempt admitted the run
    peer.script.append(outcome_unknown())
    # When a spawn without a key of the caller's is made
    spawned = client(peer).spawn(TENANT, "wf/a", {})
    # Then it was sent again with the same (generated) key, which can only admit that run
    first, second = peer.received
    assert first.json["dispatch_key"] == second.json["dispatch_key"]
    assert (spawned.attempts, spawned.replayed) == (2, False)


def test_an_outcome_still_unknown_after_every_attempt_names_the_run(peer: Peer) -> None:
    peer.script += [outcome_unknown()] * 3

    with pytest.raises(OutcomeUnknown) as unknown:
        client(peer, max_attempts=3).spawn(TENANT, "wf/a", {}, dispatch_key="k-1")

    error = unknown.value
    assert isinstance(error, Unavailable)
    assert (error.run_id, error.dispatch_key, error.attempts, error.status) == (RUN_ID, "k-1", 3, 503)
    assert RUN_ID in str(error)


def test_unavailable_after_a_keyless_spawn_names_the_generated_key(peer: Peer) -> None:
    # Given an API that answers every attempt 503 (each may have committed: a gateway timeout, say)
    peer.script += [(504, {}, {"message": "Endpoint request timed out"})] * 2
    # When a keyless spawn gives up
    with pytest.raises(Unavailable) as failure:
        client(peer, max_attempts=2).spawn(TENANT, "wf/a", {})
    # Then the error carries the key both attempts sent: the one way to retry it, or find its run, safely
    sent = {request.json["dispatch_key"] for request in peer.received}
    assert {failure.value.dispatch_key} == sent
    assert (failure.value.attempts, failure.value.outcome_unknown) == (2, True)


def test_a_refusal_on_a_retry_is_an_unknown_outcome_that_names_the_key(peer: Peer) -> None:
    # Given a first attempt whose answer never came, and a retry the gateway refuses
    peer.script += [DROP, (403, {}, {"message": "The security token included in the request is expired"})]
    with pytest.raises(Forbidden) as retried:
        client(peer).spawn(TENANT, "wf/a", {})
    # And, elsewhere, a refusal of a first attempt
    peer.script.append(problem(400, "validation-error"))
    with pytest.raises(InvalidRequest) as refused:
        client(peer).spawn(TENANT, "wf/a", {}, dispatch_key="k-1")
    # Then the first may have admitted its run under the key it names; the second admitted nothing
    assert retried.value.dispatch_key == peer.received[0].json["dispatch_key"] == peer.received[1].json["dispatch_key"]
    assert (retried.value.attempts, retried.value.outcome_unknown) == (2, True)
    assert (refused.value.dispatch_key, refused.value.attempts, refused.value.outcome_unknown) == ("k-1", 1, False)


def test_poimen_runs_spawn_without_a_key_says_how_to_retry_it_safely(
    peer: Peer, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given an API whose every answer says the outcome is unknown
    peer.script += [outcome_unknown()] * 2
    argv = ["runs", "spawn", "--base-url", f"{WEST}={peer.url}", "--tenant", TENANT, "--workflow-ref", "wf/a b"]
    argv += ["--input", '{"n": 1.10, "s": "it\'s"}', "--goal-id", "g-1", "--max-attempts", "2"]

    # When `poimen runs spawn` without --dispatch-key gives up
    code = cli.main(argv)

    # Then its one line names the generated key, and the exact commands to find its run or retry it with it
    (line,) = capsys.readouterr().err.splitlines()
    key = peer.received[0].json["dispatch_key"]
    where = f"--base-url {WEST}={peer.url} --tenant {TENANT}"
    assert code == runs.EXIT_UNAVAILABLE
    assert f"dispatch_key generated for it, {key}," in line
    assert f"see whether it did with poimen runs find {where} {key}," in line
    retry = f'poimen runs spawn {where} --workflow-ref \'wf/a b\' --input \'{{"n":1.10,"s":"it\'"\'"\'s"}}\' '
    retry += f"--goal-id g-1 --max-attempts 2 --dispatch-key {key}"
    assert line.endswith(f"admits at most one run: {retry}")


def test_a_keyless_spawn_that_reached_no_api_admitted_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    # Given an endpoint nothing listens on: no attempt can carry the spawn anywhere
    argv = ["runs", "spawn", "--base-url", closed_url(), "--tenant", TENANT, "--workflow-ref", "wf/a", "--input", "{}"]

    code = cli.main([*argv, "--max-attempts", "2"])

    (line,) = capsys.readouterr().err.splitlines()
    assert code == runs.EXIT_UNAVAILABLE
    assert line.endswith("then try again (no attempt reached it: nothing admitted)")
    assert "--dispatch-key" not in line


def test_store_unavailable_and_throttling_are_answers_that_wrote_nothing(peer: Peer) -> None:
    peer.script += [problem(503, "store-unavailable"), (429, {}, {"message": "Too Many Requests"})]

    with pytest.raises(Unavailable) as failure:
        client(peer, max_attempts=2).spawn(TENANT, "wf/a", {})

    assert (failure.value.attempts, failure.value.outcome_unknown) == (2, False)
    assert failure.value.dispatch_key == peer.received[0].json["dispatch_key"]


def test_poimen_runs_spawn_with_a_key_is_told_to_try_again_with_it(
    peer: Peer, capsys: pytest.CaptureFixture[str]
) -> None:
    peer.script += [outcome_unknown()] * 2
    argv = ["runs", "spawn", "--base-url", peer.url, "--tenant", TENANT, "--workflow-ref", "wf/a", "--input", "{}"]

    code = cli.main([*argv, "--dispatch-key", "k-1", "--max-attempts", "2"])

    (line,) = capsys.readouterr().err.splitlines()
    assert code == runs.EXIT_UNAVAILABLE
    assert line.endswith("then try again with the same --dispatch-key")
    assert "generated" not in line


def test_region_comes_from_an_execute_api_host_or_the_sdk(monkeypatch: pytest.MonkeyPatch) -> None:
    credentials = Credentials("a", "b")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")

    hosted = AdmissionClient("https://abc123.execute-api.ap-south-1.amazonaws.com", credentials=credentials)
    custom = AdmissionClient("https://admission.example.com", credentials=credentials)
    explicit = AdmissionClient("https://admission.example.com", region="us-west-2", credentials=credentials)

    assert (hosted.region, custom.region, explicit.region) == ("ap-south-1", "eu-west-1", "us-west-2")
    monkeypatch.delenv("AWS_DEFAULT_REGION")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    with pytest.raises(ValueError, match="no region"):
        AdmissionClient("https://admission.example.com", credentials=credentials)


def test_credentials_come_from_the_botocore_chain_by_default(peer: Peer) -> None:
    # tests/conftest.py: AWS_ACCESS_KEY_ID=testing, with a session token
    AdmissionClient(peer.url, region="us-east-1").spawn(TENANT, "wf/a", {}, dispatch_key="k")

    (request,) = peer.received
    assert "Credential=testing/" in (request.header("Authorization") or "")
    assert request.header("X-Amz-Security-Token") == "testing"


@pytest.mark.parametrize("url", ["127.0.0.1:8080", "ftp://host", "http://host/?q=1", "http://"])
def test_a_base_url_must_be_http(url: str) -> None:
    with pytest.raises(ValueError, match="base_url"):
        AdmissionClient(url, region="us-east-1", credentials=Credentials("a", "b"))


def test_the_client_never_imports_the_store_admission_api_or_relay() -> None:
    code = "import sys, poimen.client; print(sorted(m for m in sys.modules if m.startswith('poimen')))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout

    expected = ["poimen", "poimen.cells", "poimen.client", "poimen.contract", "poimen.endpoints", "poimen.wire"]
    assert json.loads(loaded.replace("'", '"')) == expected


# --- failover between regional endpoints --------------------------------------------------------------

EAST, WEST = "us-east-1", "us-west-2"


def closed_url() -> str:
    """A loopback URL nothing listens on: connecting is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def regional(first: str, second: str, sleeps: Sleeps | None = None, **options: Any) -> AdmissionClient:
    defaults: dict[str, Any] = {
        "credentials": Credentials(KEY.access_key, KEY.secret_key),
        "timeout": 2.0,
        "sleep": sleeps or Sleeps(),
        "rng": Ceiling(),
    }
    endpoints = [RegionalEndpoint(first, EAST), RegionalEndpoint(second, WEST)]
    return AdmissionClient(endpoints, **{**defaults, **options})


def signed_region(request: Received) -> str:
    return (request.header("Authorization") or "").split("Credential=")[1].split("/")[2]


def test_a_refused_connection_moves_to_the_next_endpoint_signed_for_its_region(peer: Peer) -> None:
    # Given a first endpoint that refuses connections and a second in another Region
    api = regional(closed_url(), peer.url)

    # When the caller spawns
    spawned = api.spawn(TENANT, "wf/a", {"n": 1}, dispatch_key="k-1")

    # Then the second endpoint answered a request signed for its own Region, which it verifies
    (request,) = peer.received
    assert verify({KEY.access_key: KEY}, request.method, request.target, request.headers, request.body, region=WEST)
    assert (spawned.attempts, spawned.endpoint) == (2, RegionalEndpoint(peer.url, WEST))
    assert api.endpoint == spawned.endpoint  # sticky: the next call goes there first


def test_a_5xx_moves_a_keyless_spawn_with_its_generated_key(peer: Peer, second_peer: Peer) -> None:
    # Given a first endpoint whose Region is failing
    peer.script.append(problem(503, "store-unavailable"))
    api = regional(peer.url, second_peer.url)

    # When a keyless spawn is made
    spawned = api.spawn(TENANT, "wf/a", {"n": 1})

    # Then the second attempt went to the second endpoint, signed for its Region, with the same key
    (east,), (west,) = peer.received, second_peer.received
    assert (signed_region(east), signed_region(west)) == (EAST, WEST)
    assert verify({KEY.access_key: KEY}, west.method, west.target, west.headers, west.body, region=WEST)
    assert east.body == west.body
    assert east.json["dispatch_key"].startswith(GENERATED_KEY_PREFIX)
    assert spawned.run.dispatch_key == east.json["dispatch_key"]
    assert (spawned.attempts, spawned.replayed, spawned.endpoint.region) == (2, False, WEST)


@pytest.mark.parametrize("status", [408, 429, 500, 502, 504])
def test_every_retryable_status_moves(peer: Peer, second_peer: Peer, status: int) -> None:
    peer.script.append((status, {}, {"message": "busy"}))

    spawned = regional(peer.url, second_peer.url).spawn(TENANT, "wf/a", {}, dispatch_key="k")

    assert (len(peer.received), len(second_peer.received), spawned.endpoint.url) == (1, 1, second_peer.url)


def test_a_timeout_moves(peer: Peer, second_peer: Peer) -> None:
    peer.script.append(STALL)
    second_peer.script.append((200, {}, run_body()))

    run = regional(peer.url, second_peer.url, timeout=0.3).get(TENANT, RUN_ID)

    assert run.run_id == RUN_ID
    assert (len(peer.received), len(second_peer.received)) == (1, 1)


@pytest.mark.parametrize(
    "answer",
    [
        problem(400, "validation-error"),
        problem(403, "forbidden"),
        problem(404, "run-not-found"),
        problem(422, "dispatch-key-reused", run_id=RUN_ID),
    ],
)
def test_a_4xx_never_fails_over(peer: Peer, second_peer: Peer, answer: tuple[int, dict[str, str], Any]) -> None:
    peer.script.append(answer)
    api = regional(peer.url, second_peer.url)

    with pytest.raises((InvalidRequest, Forbidden, NotFound, DispatchKeyReused)) as raised:
        api.spawn(TENANT, "wf/a", {}, dispatch_key="k")

    assert (raised.value.status, len(peer.received), second_peer.received) == (answer[0], 1, [])
    assert api.endpoint.url == peer.url


def test_the_client_stays_on_the_endpoint_it_moved_to_and_moves_round_robin(peer: Peer, second_peer: Peer) -> None:
    # Given a client that moved to the second endpoint after a 503 of the first
    peer.script.append(problem(503, "internal-error"))
    second_peer.script += [None, (200, {}, run_body()), (200, {}, run_body())]  # None: the spawn's echo
    api = regional(peer.url, second_peer.url)
    api.spawn(TENANT, "wf/a", {}, dispatch_key="k-1")

    # When later calls are made, and then the second endpoint fails too
    api.get(TENANT, RUN_ID)
    api.find(TENANT, "k-1")
    second_peer.script.append(DROP)
    back = api.spawn(TENANT, "wf/a", {}, dispatch_key="k-2")

    # Then they went to the second endpoint without trying the first, until it failed: then back to the first
    assert [r.target for r in peer.received] == ["/v1/runs", "/v1/runs"]
    moved = ["/v1/runs", f"/v1/runs/{RUN_ID}", "/v1/runs?dispatch_key=k-1", "/v1/runs"]
    assert [r.target for r in second_peer.received] == moved
    assert [r.json["dispatch_key"] for r in peer.received] == ["k-1", "k-2"]
    assert (back.endpoint.url, back.attempts, signed_region(peer.received[1])) == (peer.url, 2, EAST)


def test_threads_failing_on_one_endpoint_move_the_client_once(peer: Peer, second_peer: Peer) -> None:
    api = regional(peer.url, second_peer.url)

    # two calls that both failed on the first endpoint: the second to report it must not skip past the second
    assert (api._rotation(TENANT).next(0, 0.0, 0.0), api._rotation(TENANT).next(0, 0.0, 0.0)) == ((1, 0.0), (1, 0.0))
    assert api.endpoint.url == second_peer.url


def test_an_unknown_outcome_is_retried_on_the_next_endpoint_with_the_same_key(peer: Peer, second_peer: Peer) -> None:
    # Given a Region that could not tell whether it admitted the run
    peer.script.append(outcome_unknown())
    # When a keyless spawn is made
    spawned = regional(peer.url, second_peer.url).spawn(TENANT, "wf/a", {})
    # Then the other Region was sent the same key, which can only admit or replay that run
    assert peer.received[0].json["dispatch_key"] == second_peer.received[0].json["dispatch_key"]
    assert (spawned.attempts, spawned.replayed, spawned.endpoint.url) == (2, False, second_peer.url)


def test_a_long_retry_after_from_one_endpoint_does_not_hold_back_the_other(peer: Peer, second_peer: Peer) -> None:
    peer.script.append((503, {"Retry-After": "3600"}, {"message": "busy"}))
    sleeps = Sleeps()

    spawned = regional(peer.url, second_peer.url, sleeps, rng=Floor()).spawn(TENANT, "wf/a", {}, dispatch_key="k")

    assert (spawned.endpoint.url, sleeps.delays) == (second_peer.url, [0.0])


def on_fake_time(*peers: Peer) -> FakeTime:
    clock = FakeTime()
    for each in peers:
        each.clock = clock
    return clock


def test_round_robin_never_comes_back_to_an_endpoint_before_its_retry_after(peer: Peer, second_peer: Peer) -> None:
    # Given us-east-1 asking for 30 s, and us-west-2 then failing without asking for anything
    peer.script.append((503, {"Retry-After": "30"}, {"message": "busy"}))
    second_peer.script.append(problem(503, "internal-error"))
    clock = on_fake_time(peer, second_peer)
    api = regional(peer.url, second_peer.url, sleep=clock.sleep, clock=clock, rng=Floor())

    # When a spawn has to retry twice
    spawned = api.spawn(TENANT, "wf/a", {}, dispatch_key="k")

    # Then no request reached us-east-1 before its 30 s had passed: the retry went to us-west-2 again
    east = [request.at - peer.received[0].at for request in peer.received]
    assert east == [0.0]
    assert (len(second_peer.received), spawned.endpoint.url, spawned.attempts) == (2, second_peer.url, 3)


def test_when_every_endpoint_holds_back_the_retry_waits_for_the_first_to_accept(peer: Peer, second_peer: Peer) -> None:
    # Given both Regions asking to wait, us-east-1 30 s and us-west-2 10 s
    peer.script.append((503, {"Retry-After": "30"}, {"message": "busy"}))
    second_peer.script.append((429, {"Retry-After": "10"}, {"message": "Too Many Requests"}))
    clock = on_fake_time(peer, second_peer)
    api = regional(peer.url, second_peer.url, sleep=clock.sleep, clock=clock, rng=Floor())

    # When a spawn retries
    spawned = api.spawn(TENANT, "wf/a", {}, dispatch_key="k")

    # Then the third attempt went where the wait was shorter, once it had passed
    assert clock.delays == [0.0, 10.0]
    assert [request.at for request in second_peer.received] == [1000.0, 1010.0]
    assert (len(peer.received), spawned.endpoint.url) == (1, second_peer.url)


def test_every_endpoint_holding_back_beyond_max_retry_after_ends_the_call(peer: Peer, second_peer: Peer) -> None:
    peer.script.append((503, {"Retry-After": "3600"}, {"message": "busy"}))
    second_peer.script.append((503, {"Retry-After": "120"}, {"message": "busy"}))
    clock = on_fake_time(peer, second_peer)
    api = regional(peer.url, second_peer.url, sleep=clock.sleep, clock=clock, rng=Floor(), max_retry_after=60)

    with pytest.raises(Unavailable) as failure:
        api.spawn(TENANT, "wf/a", {}, dispatch_key="k")

    assert (failure.value.attempts, failure.value.retry_after, clock.delays) == (2, 120.0, [0.0])
    assert f"the API at {second_peer.url} ({WEST}) asks to retry after 120 s" in str(failure.value)


def test_a_retry_after_holds_back_the_next_call_too(peer: Peer) -> None:
    # Given a call that ended on an answer asking for 5 s
    peer.script.append((503, {"Retry-After": "5"}, {"message": "busy"}))
    clock = on_fake_time(peer)
    api = client(peer, max_attempts=1, sleep=clock.sleep, clock=clock)
    with pytest.raises(Unavailable) as failure:
        api.spawn(TENANT, "wf/a", {}, dispatch_key="k")
    clock.now += 2

    # When the caller spawns again 2 s later
    spawned = api.spawn(TENANT, "wf/a", {}, dispatch_key="k")

    # Then the new call's first attempt waited the 3 s left
    assert failure.value.retry_after == 5.0
    assert clock.delays == [3.0]
    assert [request.at for request in peer.received] == [1000.0, 1005.0]
    assert spawned.attempts == 1


@pytest.mark.parametrize("asked", ["9" * 400, "1000000000"])
def test_a_retry_after_beyond_max_retry_after_holds_the_endpoint_back_no_longer_than_it(peer: Peer, asked: str) -> None:
    # Given a call that ended at once on an answer asking for hundreds of digits of seconds (float: inf), or 31
    # years, more than the client's max_retry_after of 60 s
    peer.script.append((503, {"Retry-After": asked}, {"message": "busy"}))
    clock = on_fake_time(peer)
    api = client(peer, max_retry_after=60, sleep=clock.sleep, clock=clock)
    with pytest.raises(Unavailable) as failure:
        api.spawn(TENANT, "wf/a", {}, dispatch_key="k")
    clock.now += 61

    # When the caller spawns again 61 s later
    spawned = api.spawn(TENANT, "wf/a", {}, dispatch_key="k")

    # Then the endpoint was called again, without waiting: it was held back max_retry_after, not for the client's
    # lifetime, and the first call said how long it was asked to wait in a number
    assert (failure.value.attempts, clock.delays) == (1, [])
    assert [request.at for request in peer.received] == [1000.0, 1061.0]
    assert spawned.attempts == 1
    assert "more than the 60 s this client waits (max_retry_after)" in str(failure.value)


def test_unavailable_names_its_attempts_and_every_endpoint_tried() -> None:
    first, second = closed_url(), closed_url()
    sleeps = Sleeps()

    with pytest.raises(Unavailable) as failure:
        regional(first, second, sleeps, max_attempts=3).find(TENANT, "k")

    error = failure.value
    assert (error.attempts, error.status, len(sleeps.delays)) == (3, None, 2)
    assert error.endpoints == (RegionalEndpoint(first, EAST), RegionalEndpoint(second, WEST))
    assert f"after 3 attempts at {first} ({EAST}), {second} ({WEST}): NewConnectionError" in str(error)


def test_endpoints_are_urls_or_regional_endpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    credentials = Credentials("a", "b")

    api = AdmissionClient(
        [
            "https://abc123.execute-api.us-east-2.amazonaws.com/prod/",
            RegionalEndpoint("https://admission.example.com/", WEST),
            "https://admission-eu.example.com",
        ],
        credentials=credentials,
    )
    single = AdmissionClient(RegionalEndpoint("https://admission.example.com", WEST), credentials=credentials)
    # A host name's trailing dot (the DNS root) hides nothing: its Region is the execute-api host's
    rooted = AdmissionClient("https://abc123.execute-api.us-east-2.amazonaws.com./prod", credentials=credentials)

    assert api.endpoints == (
        RegionalEndpoint("https://abc123.execute-api.us-east-2.amazonaws.com/prod", "us-east-2"),
        RegionalEndpoint("https://admission.example.com", WEST),
        RegionalEndpoint("https://admission-eu.example.com", "eu-west-1"),
    )
    assert (api.base_url, api.region, single.region, rooted.region) == (
        api.endpoints[0].url,
        "us-east-2",
        WEST,
        "us-east-2",
    )
    with pytest.raises(ValueError, match="at least one endpoint"):
        AdmissionClient([], credentials=credentials)
    with pytest.raises(ValueError, match="base_url"):
        AdmissionClient([RegionalEndpoint("ftp://host", WEST)], credentials=credentials)
    with pytest.raises(ValueError, match=r"no region for https://x\.example\.com"):
        AdmissionClient([RegionalEndpoint("https://x.example.com", "")], credentials=credentials)


# --- poimen runs with several endpoints -----------------------------------------------------------------


def test_poimen_runs_fails_over_to_the_next_base_url_signed_for_its_region(
    peer: Peer, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a first --base-url nothing answers and a second given as REGION=URL
    argv = ["runs", "spawn", "--base-url", closed_url(), "--base-url", f"{WEST}={peer.url}", "--tenant", TENANT]
    argv += ["--workflow-ref", "wf/a", "--input", '{"n": 1}', "--dispatch-key", "k-1"]

    # When the spawn is run
    code = cli.main(argv)

    # Then the second answered, signed for its Region (tests/conftest.py's credentials: not the dev key)
    out, err = capsys.readouterr()
    (request,) = peer.received
    assert (code, err, json.loads(out)["run"]["run_id"]) == (0, "", RUN_ID)
    assert signed_region(request) == WEST
    assert "Credential=testing/" in (request.header("Authorization") or "")
    assert request.json["dispatch_key"] == "k-1"


def test_poimen_runs_unavailable_names_every_base_url(capsys: pytest.CaptureFixture[str]) -> None:
    first, second = closed_url(), closed_url()
    argv = ["runs", "find", "--base-url", first, "--base-url", f"eu-west-1={second}", "--region", WEST]

    code = cli.main([*argv, "--tenant", TENANT, "--max-attempts", "2", "k"])

    (line,) = capsys.readouterr().err.splitlines()
    assert code == runs.EXIT_UNAVAILABLE
    assert f"after 2 attempts at {first} ({WEST}), {second} (eu-west-1)" in line


@pytest.mark.parametrize(
    ("value", "parsed"),
    [
        ("http://127.0.0.1:8080", ("http://127.0.0.1:8080", None)),
        (f"{WEST}=http://127.0.0.1:8081/prod", ("http://127.0.0.1:8081/prod", WEST)),
        ("https://api.example.com/a=b", ("https://api.example.com/a=b", None)),  # an = in the path is the URL's
    ],
)
def test_a_base_url_is_a_url_or_region_equals_url(value: str, parsed: tuple[str, str | None]) -> None:
    assert runs.regional_base_url(value) == parsed


@pytest.mark.parametrize(
    "value", [f"{WEST}=127.0.0.1:8081", "=http://127.0.0.1:8081", "bad!=http://127.0.0.1:8081", "us-west-2="]
)
def test_a_bad_regional_base_url_is_a_one_line_usage_error(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["runs", "get", "--base-url", "http://127.0.0.1:1", "--base-url", value, "--tenant", TENANT, "r"])

    (line,) = capsys.readouterr().err.splitlines()
    assert exited.value.code == runs.EXIT_USAGE
    assert ": argument --base-url: " in line
    assert "is not REGION=URL" in line
