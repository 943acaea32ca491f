"""Admission's first request after a SnapStart restore, when credentials come from Lambda's container
credentials endpoint rather than the environment: the store resolves them once, within a bound the
function's timeout accounts for (tests/unit/test_config_and_grants.py), and an endpoint that does not
answer is a 503 store-unavailable with nothing written."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest
from aws_lambda_powertools.utilities.data_classes import KafkaEvent

from poimen.api import admission_service
from poimen.aws_session import CREDENTIALS_ATTEMPTS, CREDENTIALS_FETCH_SECONDS, CREDENTIALS_TIMEOUT_SECONDS
from poimen.batch import ADMITTING_THREADS, MIN_REMAINING_MS
from poimen.config import Settings
from poimen.errors import StoreUnavailable
from poimen.relay import BatchOutcome, Relay
from poimen.store import Store
from poimen.wire import MAX_BATCH_SPAWNS, SPAWNS_MEDIA_TYPE
from poimen_tools.local.msk import msk_event
from poimen_tools.local.sigv4 import Principal
from poimen_tools.local.template import Template
from tests.conftest import count_runs, serve_on_loopback
from tests.unit.conftest import PRINCIPAL, Answer, Invoke
from tests.unit.relay_harness import RELAY_ROLE, RelayHarness

TOKEN = "container-authorization-token"


@dataclass
class CredentialsEndpoint:
    """Lambda's AWS_CONTAINER_CREDENTIALS_FULL_URI: answers the execution role's credentials, or (stalled)
    holds every request until the test ends."""

    url: str = ""
    stalled: bool = False
    delay: float = 0.0  # seconds before each answer
    access_key: str = "ASIAROLE"
    secret_key: str = "secret"
    lifetime: timedelta = timedelta(hours=6)  # how long the credentials it answers are valid
    requests: list[str | None] = field(default_factory=list)  # the Authorization header of each
    connections: list[float] = field(default_factory=list)  # when each connection was accepted (monotonic)
    released: threading.Event = field(default_factory=threading.Event)


@pytest.fixture
def container_credentials(granted: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[CredentialsEndpoint]:
    """After the test's grant is written: no credentials in the environment nor in files, only the
    container endpoint, as a SnapStart function's environment has them."""
    with _container_credentials(CredentialsEndpoint(), monkeypatch) as endpoint:
        admission_service.cache_clear()  # the environment a restore starts with: no store built yet
        yield endpoint


@contextlib.contextmanager
def _container_credentials(
    endpoint: CredentialsEndpoint, monkeypatch: pytest.MonkeyPatch
) -> Iterator[CredentialsEndpoint]:

    class Handler(BaseHTTPRequestHandler):
        def setup(self) -> None:
            endpoint.connections.append(time.monotonic())  # before a byte is read: a silent connection counts too
            super().setup()

        def do_GET(self) -> None:
            endpoint.requests.append(self.headers.get("Authorization"))
            if endpoint.stalled:
                endpoint.released.wait(30)
                return
            time.sleep(endpoint.delay)
            expiration = (datetime.now(UTC) + endpoint.lifetime).strftime("%Y-%m-%dT%H:%M:%SZ")
            keys = {"AccessKeyId": endpoint.access_key, "SecretAccessKey": endpoint.secret_key, "Token": "token"}
            body = json.dumps({**keys, "Expiration": expiration}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            return

    with serve_on_loopback(Handler) as url:
        endpoint.url = url
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/dev/null")
        monkeypatch.setenv("AWS_CONFIG_FILE", "/dev/null")
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
        monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", f"{url}/2018-06-01/credentials")
        monkeypatch.setenv("AWS_CONTAINER_AUTHORIZATION_TOKEN", TOKEN)
        try:
            yield endpoint
        finally:
            endpoint.released.set()


SPAWN = {"workflow_ref": "wf/first", "input": {}, "dispatch_key": "k-first"}


def test_the_first_admission_resolves_the_container_credentials_once(
    invoke: Invoke, container_credentials: CredentialsEndpoint, dynamodb: Any, table_name: str, tenant: str
) -> None:
    # When the first request after a restore reads the grant and writes the run
    answer = invoke(body=SPAWN)
    # And the store's client for resolving an unknown outcome is there too
    assert admission_service()._store.resolution_client is not None

    # Then the credentials were fetched once, for all three, with the container's token
    assert answer.status == 201
    assert container_credentials.requests == [TOKEN]
    assert len(count_runs(dynamodb, table_name, tenant)) == 1


def test_a_credentials_endpoint_that_does_not_answer_is_503_store_unavailable(
    invoke: Invoke, container_credentials: CredentialsEndpoint, dynamodb: Any, table_name: str, tenant: str
) -> None:
    # Given a container credentials endpoint that accepts connections and never answers
    container_credentials.stalled = True

    # When the first request after a restore needs credentials
    answer = invoke(body=SPAWN)

    # Then it is the answer that says nothing was written, after the bounded attempts; and nothing was
    assert (answer.status, answer.body["type"]) == (503, "urn:poimen:problem:store-unavailable")
    assert "Retry-After" in answer.headers
    assert len(container_credentials.requests) == 2
    container_credentials.stalled = False
    assert count_runs(dynamodb, table_name, tenant) == []


def _in_another_thread(call: Callable[[], object]) -> tuple[object, float]:
    """What `call` returned or raised in a thread of its own, and the seconds it took."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(call())
        except Exception as error:
            outcome.append(error)

    started = time.monotonic()
    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    return outcome[0], time.monotonic() - started


def test_a_store_used_from_another_thread_fetches_its_credentials_within_the_bound(
    container_credentials: CredentialsEndpoint, tenant: str
) -> None:
    # Given a store built in this thread, and a container endpoint that accepts connections and never answers
    store = Store(Settings.from_env())
    container_credentials.stalled = True

    # When another thread (a batch's admitting thread, a request thread of poimen dev) is the first to call it
    outcome, took = _in_another_thread(lambda: store.get_run(tenant, "0190a4f2-8d3b-7c4e-9f00-000000000001"))

    # Then that thread's fetch is the bounded one (botocore's own: 3 connections of 2 s each, 1 s apart), and fails
    # as the store's unavailability (nothing was sent)
    connections = len(container_credentials.connections)
    assert (type(outcome), connections) == (StoreUnavailable, CREDENTIALS_ATTEMPTS), f"{connections} in {took:.1f} s"
    assert took < CREDENTIALS_FETCH_SECONDS


def test_a_threads_clients_of_a_store_share_one_credentials_fetch(
    container_credentials: CredentialsEndpoint, tenant: str
) -> None:
    # Given a store built in this thread
    store = Store(Settings.from_env())

    # When another thread reads a run, a grant and builds the client that resolves unknown outcomes
    def use() -> object:
        store.get_run(tenant, "0190a4f2-8d3b-7c4e-9f00-000000000001")
        store.granted_tenants(PRINCIPAL)
        return store.resolution_client

    outcome, _ = _in_another_thread(use)

    # Then that thread fetched the credentials once, for its three clients
    assert not isinstance(outcome, Exception), outcome
    assert container_credentials.requests == [TOKEN]


RELAY_SESSION = RELAY_ROLE.replace(":iam::", ":sts::").replace(":role/", ":assumed-role/") + "/awslambda_1"
STORE_UNAVAILABLE = (503, "urn:poimen:problem:store-unavailable")


def _relay_batch(invoke: Invoke, spawns: int, monkeypatch: pytest.MonkeyPatch) -> tuple[Answer, float]:
    """A batch of `spawns` from the stack's relay, trusted by the deploy (so no grant is read before its spawns,
    whose writes make the first call for credentials), the first request after a restore; and its seconds."""
    monkeypatch.setenv("RELAY_PRINCIPAL", RELAY_ROLE)
    admission_service.cache_clear()
    body = {"spawns": [{"workflow_ref": "wf/first", "input": {}, "dispatch_key": f"k-{n}"} for n in range(spawns)]}
    started = time.monotonic()
    answer = invoke(body=body, headers={"content-type": SPAWNS_MEDIA_TYPE}, principal=RELAY_SESSION)
    return answer, time.monotonic() - started


@pytest.mark.parametrize("spawns", [1, ADMITTING_THREADS, MAX_BATCH_SPAWNS])
def test_a_batchs_admitting_threads_fetch_credentials_within_the_bound(
    invoke: Invoke,
    container_credentials: CredentialsEndpoint,
    dynamodb: Any,
    table_name: str,
    tenant: str,
    monkeypatch: pytest.MonkeyPatch,
    spawns: int,
) -> None:
    # Given a container endpoint that accepts connections and never answers
    container_credentials.stalled = True

    # When a batch of one, of one spawn an admitting thread, or of the most a batch takes comes first after a restore
    answer, took = _relay_batch(invoke, spawns, monkeypatch)

    # Then the batch fetched once, the bounded fetch (botocore's own makes 3 connections of 2 s each, 1 s apart; a
    # fetch a thread, 2 connections each; a fetch a spawn, one after another in each thread), far within
    # MIN_REMAINING_MS
    connections = len(container_credentials.connections)
    assert connections <= CREDENTIALS_ATTEMPTS, f"{connections} connections in {took:.1f} s"
    assert took < 2 * CREDENTIALS_FETCH_SECONDS < MIN_REMAINING_MS / 1000, f"the batch took {took:.1f} s"
    # And every spawn is 503 store-unavailable (nothing written, send it again), and nothing was written
    assert answer.status == 200
    results = [(result["status"], result["problem"]["type"]) for result in answer.body["results"]]
    assert results == [STORE_UNAVAILABLE] * spawns
    assert all(result["retry_after"] >= 1 for result in answer.body["results"])
    container_credentials.stalled = False
    assert count_runs(dynamodb, table_name, tenant) == []


def test_a_cold_batch_fetches_its_credentials_once_for_all_its_admitting_threads(
    invoke: Invoke,
    container_credentials: CredentialsEndpoint,
    dynamodb: Any,
    table_name: str,
    tenant: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # When a batch of one spawn an admitting thread comes first after a restore
    answer, _ = _relay_batch(invoke, ADMITTING_THREADS, monkeypatch)

    # Then each spawn is a run, and the credentials were fetched once (not once a thread: each a session of its
    # own, and a read of the service model)
    assert [result["status"] for result in answer.body["results"]] == [201] * ADMITTING_THREADS
    assert container_credentials.requests == [TOKEN]
    assert len(count_runs(dynamodb, table_name, tenant)) == ADMITTING_THREADS


def test_a_slow_credentials_endpoint_is_waited_for_once_by_a_batch(
    invoke: Invoke,
    container_credentials: CredentialsEndpoint,
    dynamodb: Any,
    table_name: str,
    tenant: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a container endpoint that answers, slowly: within the bounded fetch's read timeout, not much within it
    container_credentials.delay = 0.6 * CREDENTIALS_TIMEOUT_SECONDS

    # When a batch of the most a batch takes comes first after a restore
    answer, took = _relay_batch(invoke, MAX_BATCH_SPAWNS, monkeypatch)

    # Then its spawns are runs, after one wait for the endpoint, not one a thread (nor a spawn)
    assert [result["status"] for result in answer.body["results"]] == [201] * MAX_BATCH_SPAWNS
    assert container_credentials.requests == [TOKEN]
    assert len(count_runs(dynamodb, table_name, tenant, only="pk")) == MAX_BATCH_SPAWNS
    assert took < MIN_REMAINING_MS / 1000, f"the batch took {took:.1f} s"


def test_a_batch_refreshes_expiring_credentials_once_not_once_a_thread(
    invoke: Invoke,
    container_credentials: CredentialsEndpoint,
    dynamodb: Any,
    table_name: str,
    tenant: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given credentials that botocore must refresh before it signs a call (they expire within its mandatory refresh
    # window, 10 minutes), a first batch admitted with them, and then a container endpoint that stops answering
    container_credentials.lifetime = timedelta(minutes=9)
    first, _ = _relay_batch(invoke, ADMITTING_THREADS, monkeypatch)
    assert [result["status"] for result in first.body["results"]] == [201] * ADMITTING_THREADS
    container_credentials.stalled = True
    container_credentials.connections.clear()

    # When the next batch of one spawn an admitting thread comes (the same store, its clients built)
    body = {"spawns": [{"workflow_ref": "wf/first", "input": {}, "dispatch_key": f"n-{n}"} for n in range(8)]}
    started = time.monotonic()
    answer = invoke(body=body, headers={"content-type": SPAWNS_MEDIA_TYPE}, principal=RELAY_SESSION)
    took = time.monotonic() - started

    # Then the refresh was tried once for the batch, not by each thread in turn (botocore's refresh lock makes each
    # thread that waited for a failed refresh try again itself: 8 bounded fetches one after another), and every
    # spawn is 503 store-unavailable, nothing written
    connections = len(container_credentials.connections)
    assert connections <= CREDENTIALS_ATTEMPTS, f"{connections} connections in {took:.1f} s"
    assert took < 2 * CREDENTIALS_FETCH_SECONDS, f"the batch took {took:.1f} s"
    results = [(result["status"], result["problem"]["type"]) for result in answer.body["results"]]
    assert results == [STORE_UNAVAILABLE] * ADMITTING_THREADS
    container_credentials.stalled = False
    assert len(count_runs(dynamodb, table_name, tenant)) == ADMITTING_THREADS


@pytest.fixture
def harness(template: Template, handler: Callable[[dict[str, Any], Any], dict[str, Any]], store: Store) -> RelayHarness:
    return RelayHarness.start(template, handler, store)


def test_the_relays_credentials_refresh_never_outlives_its_batchs_deadline(
    harness: RelayHarness, monkeypatch: pytest.MonkeyPatch, dynamodb: Any, table_name: str
) -> None:
    # Given a relay restored from a snapshot: its credentials from the container endpoint, valid 12 minutes
    # more (botocore refreshes them from 15 minutes before they expire), and the admission API it calls
    harness.run([harness.record({"workflow_ref": "wf/warm", "input": {}, "dispatch_key": "warm"}, 0)])
    role = Principal("ASIARELAY", "relay-role-secret", RELAY_ROLE, ("*",), session_token="token")
    harness.api.principals[role.access_key] = role
    endpoint = CredentialsEndpoint(
        access_key=role.access_key, secret_key=role.secret_key, lifetime=timedelta(minutes=12)
    )
    with _container_credentials(endpoint, monkeypatch):
        relay = Relay(harness.relay._settings, sqs=harness.sqs, http=harness.api)
        assert len(endpoint.requests) == 1
        # When the endpoint stops answering, and a batch with 6 s left (4 s to its deadline) signs a call
        endpoint.stalled = True
        started = time.monotonic()
        outcome = BatchOutcome()
        deadline = started + 6
        spawn = {"workflow_ref": "wf/first", "input": {}, "dispatch_key": "k-relay"}
        relay.relay_batch(
            KafkaEvent(msk_event([harness.record(spawn, 1)])),
            lambda: int((deadline - time.monotonic()) * 1000),
            outcome,
        )
        took = time.monotonic() - started
    # Then the refresh gave up within its bound (botocore's own fetch waits 3 attempts of 2 s, 1 s apart), the
    # call was signed with the credentials still valid, and the record is a run, well within the invocation
    assert took < 6, f"the batch took {took:.1f} s of an invocation's 6"
    assert len(endpoint.requests) > 1  # the refresh was tried
    assert (outcome.relayed, len(count_runs(dynamodb, table_name, harness.tenant))) == (1, 2)


def test_a_batch_in_the_advisory_refresh_window_tries_the_refresh_once_not_once_a_thread(
    invoke: Invoke,
    container_credentials: CredentialsEndpoint,
    dynamodb: Any,
    table_name: str,
    tenant: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given credentials botocore would like to refresh before it signs (they expire in 12 minutes: inside its advisory
    # window, 15 minutes, outside the mandatory one, 10), a first batch admitted with them, and then a container
    # endpoint that stops answering
    container_credentials.lifetime = timedelta(minutes=12)
    first, _ = _relay_batch(invoke, ADMITTING_THREADS, monkeypatch)
    assert [result["status"] for result in first.body["results"]] == [201] * ADMITTING_THREADS
    container_credentials.stalled = True
    container_credentials.connections.clear()

    # When the next batch, of the most a batch takes, comes (the same store, its clients built)
    body = {"spawns": [{"workflow_ref": "wf/first", "input": {}, "dispatch_key": f"a-{n}"} for n in range(100)]}
    started = time.monotonic()
    answer = invoke(body=body, headers={"content-type": SPAWNS_MEDIA_TYPE}, principal=RELAY_SESSION)
    took = time.monotonic() - started

    # Then every spawn is admitted with the credentials still valid, and the refresh was tried once for the batch (its
    # connect), not again by its admitting threads: botocore tries an advisory refresh on every signing while the
    # last one failed, one thread at a time, each a bounded fetch of its own. (8 connections in 4.1 s: the batch's
    # fetch, then 3 more by its threads, one after another; nothing bounds their number but the batch's length.)
    assert [result["status"] for result in answer.body["results"]] == [201] * MAX_BATCH_SPAWNS
    connections = len(container_credentials.connections)
    assert connections <= CREDENTIALS_ATTEMPTS, f"{connections} connections in {took:.1f} s"
    assert took < 2 * CREDENTIALS_FETCH_SECONDS, f"the batch took {took:.1f} s"
    container_credentials.stalled = False
    assert len(count_runs(dynamodb, table_name, tenant, only="pk")) == ADMITTING_THREADS + MAX_BATCH_SPAWNS


def test_credentials_the_endpoint_answers_already_expired_make_each_spawn_of_a_batch_503_not_the_batch_500(
    invoke: Invoke,
    container_credentials: CredentialsEndpoint,
    dynamodb: Any,
    table_name: str,
    tenant: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a container endpoint whose credentials are expired when they arrive (its clock ahead, or a stale cache):
    # botocore refreshes them before signing, and raises RuntimeError("... refreshed credentials are still expired")
    container_credentials.lifetime = timedelta(minutes=-5)

    # When a batch comes first after a restore
    answer, _ = _relay_batch(invoke, ADMITTING_THREADS, monkeypatch)

    # Then nothing was sent to DynamoDB, and the answer says so: each spawn 503 store-unavailable, to send again.
    # (The batch was answered 500 internal-error whole, "the outcome is unknown": the batch's connect() turns only
    # StoreUnavailable into its spawns' answers, and lets botocore's RuntimeError out of the batch.)
    assert answer.status == 200, answer.body
    results = [(result["status"], result["problem"]["type"]) for result in answer.body["results"]]
    assert results == [STORE_UNAVAILABLE] * ADMITTING_THREADS
    assert count_runs(dynamodb, table_name, tenant) == []


def test_a_batch_given_credentials_already_due_for_refresh_fetches_them_once_not_once_a_signing(
    invoke: Invoke,
    container_credentials: CredentialsEndpoint,
    dynamodb: Any,
    table_name: str,
    tenant: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a container endpoint that answers within the bounded fetch (0.3 s) with credentials inside botocore's
    # mandatory refresh window (9 minutes left: a role session near its end, served until it is rotated)
    container_credentials.lifetime = timedelta(minutes=9)
    container_credentials.delay = 0.6 * CREDENTIALS_TIMEOUT_SECONDS

    # When a batch of one spawn an admitting thread comes first after a restore
    answer, took = _relay_batch(invoke, ADMITTING_THREADS, monkeypatch)

    # Then each spawn is a run, and the batch fetched the credentials in its connect only (botocore's load, and at
    # most its refresh of what it loaded): they are valid for minutes, the batch lasts seconds. (19 fetches in 5.8 s:
    # botocore refreshes credentials in that window before every signing, and the threads share the one credentials
    # object connect() made, so they wait on its lock and fetch one after another, 1.1 s at 7a47790 where each thread
    # built its own; a batch of 100 took 56 s and deferred 11 spawns, and a spawn begun with MIN_REMAINING_MS left may
    # wait 7 fetches for the lock before its write, past the 3 s that budget keeps for credentials.)
    assert [result["status"] for result in answer.body["results"]] == [201] * ADMITTING_THREADS
    fetches = len(container_credentials.requests)
    assert fetches <= 2, f"{fetches} fetches in {took:.1f} s"
    assert len(count_runs(dynamodb, table_name, tenant)) == ADMITTING_THREADS
