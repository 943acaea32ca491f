"""Admission's first request after a SnapStart restore, when credentials come from Lambda's container
credentials endpoint rather than the environment: the store resolves them once, within a bound the
function's timeout accounts for (tests/unit/test_config_and_grants.py), and an endpoint that does not
answer is a 503 store-unavailable with nothing written."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest

from poimen.api import admission_service
from tests.conftest import count_runs, serve_on_loopback
from tests.unit.conftest import Invoke

TOKEN = "container-authorization-token"


@dataclass
class CredentialsEndpoint:
    """Lambda's AWS_CONTAINER_CREDENTIALS_FULL_URI: answers the execution role's credentials, or (stalled)
    holds every request until the test ends."""

    url: str = ""
    stalled: bool = False
    requests: list[str | None] = field(default_factory=list)  # the Authorization header of each
    released: threading.Event = field(default_factory=threading.Event)


@pytest.fixture
def container_credentials(granted: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[CredentialsEndpoint]:
    """After the test's grant is written: no credentials in the environment nor in files, only the
    container endpoint, as a SnapStart function's environment has them."""
    endpoint = CredentialsEndpoint()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            endpoint.requests.append(self.headers.get("Authorization"))
            if endpoint.stalled:
                endpoint.released.wait(30)
                return
            expiration = (datetime.now(UTC) + timedelta(hours=6)).strftime("%Y-%m-%dT%H:%M:%SZ")
            body = json.dumps(
                {"AccessKeyId": "ASIAROLE", "SecretAccessKey": "secret", "Token": "token", "Expiration": expiration}
            ).encode()
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
        admission_service.cache_clear()  # the environment a restore starts with: no store built yet
        yield endpoint
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
