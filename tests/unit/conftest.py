"""Unit level: the Lambda handler in-process against in-process moto (no sockets)."""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import boto3
import pytest
from moto import mock_aws

from poimen.api import admission_service
from poimen.config import Settings
from poimen.observability import metrics, metrics_disabled
from poimen.store import Store
from poimen_tools.local.devserver import LocalLambdaContext
from poimen_tools.local.moto import serialise_dynamodb_writes
from poimen_tools.local.template import Template
from tests.conftest import load_event

PRINCIPAL = "arn:aws:iam::123456789012:role/poimen-orchestrator"
# The tenants every handler test's stack serves besides the test's own (`tenant`), as its Tenants would.
SERVED = ("acme", "globex")


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: dict[str, Any]
    text: str  # the body as answered; `body` holds its numbers as floats


Invoke = Callable[..., Answer]


@pytest.fixture(scope="session")
def handler(template: Template) -> Callable[[dict[str, Any], Any], dict[str, Any]]:
    return template.load_handler("AdmissionFunction")


@pytest.fixture
def dynamodb(template: Template, monkeypatch: pytest.MonkeyPatch, tenant: str) -> Iterator[Any]:
    """A fresh table created from template.yaml; the handler's settings point at it, serving the test's tenant,
    its second one (`<tenant>-b`) and those of SERVED."""
    serialise_dynamodb_writes()
    with mock_aws():
        client = boto3.client("dynamodb")
        table_name = f"admission-{uuid.uuid4().hex[:8]}"
        client.create_table(**template.create_table_request("AdmissionTable", table_name))
        monkeypatch.setenv("TABLE_NAME", table_name)
        monkeypatch.setenv("TENANTS", ",".join([tenant, f"{tenant}-b", *SERVED]))
        monkeypatch.setenv("GRANTS_CACHE_SECONDS", "0")
        admission_service.cache_clear()
        yield client
        admission_service.cache_clear()


@pytest.fixture
def table_name(dynamodb: Any) -> str:
    names: list[str] = dynamodb.list_tables()["TableNames"]
    return names[0]


@pytest.fixture
def store(dynamodb: Any) -> Store:
    return Store(Settings.from_env())


@pytest.fixture
def granted(store: Store, tenant: str) -> str:
    """The test's tenant, granted to PRINCIPAL."""
    store.grant(PRINCIPAL, tenant)
    return tenant


@pytest.fixture
def invoke(handler: Callable[[dict[str, Any], Any], dict[str, Any]], granted: str) -> Invoke:
    """Call the handler with the canonical HTTP API event, changed as asked."""

    def call(
        method: str = "POST",
        path: str = "/v1/runs",
        *,
        body: Any = None,
        raw_body: str | None = None,
        raw_bytes: bytes | None = None,
        tenant: str | None = granted,
        query: str = "",
        principal: str | None = "arn:aws:sts::123456789012:assumed-role/poimen-orchestrator/session-1",
        headers: dict[str, str] | None = None,
        base64_body: bool = False,
        flagged_base64: bool | None = None,
    ) -> Answer:
        event = load_event("http_api_create_run.json")
        event["routeKey"] = event["requestContext"]["routeKey"] = f"{method} {path}"
        event["rawPath"] = event["requestContext"]["http"]["path"] = path
        event["requestContext"]["http"]["method"] = method
        event["rawQueryString"] = query
        if query:
            event["queryStringParameters"] = dict(part.split("=", 1) for part in query.split("&"))
        if tenant is None:
            del event["headers"]["x-poimen-tenant"]
        else:
            event["headers"]["x-poimen-tenant"] = tenant
        event["headers"].update(headers or {})
        if principal is None:
            event["requestContext"]["authorizer"] = {}
        else:
            event["requestContext"]["authorizer"]["iam"]["userArn"] = principal
        text = raw_body if raw_body is not None else (None if body is None else json.dumps(body))
        event.pop("body", None)
        if raw_bytes is not None:
            text, base64_body = base64.b64encode(raw_bytes).decode(), True
            event["body"] = text
        elif text is not None:
            event["body"] = base64.b64encode(text.encode()).decode() if base64_body else text
        # flagged_base64: the event's isBase64Encoded as given, whatever its body is (API Gateway never flags text).
        event["isBase64Encoded"] = base64_body if flagged_base64 is None else flagged_base64
        # A minute: a batch begins no spawn with less than 8.5 s left (poimen.batch), and a loaded test machine can
        # take that long; the guard is tested on its own (test_spawn_batch.py).
        result = handler(event, LocalLambdaContext("AdmissionFunction", timeout_seconds=60))
        answered = result.get("body") or "{}"
        answer = Answer(result["statusCode"], result.get("headers") or {}, json.loads(answered), answered)
        if answer.headers.get("Content-Type") == "application/problem+json":
            # RFC 9457: the problem's status member, when present, equals the HTTP status.
            assert answer.body["status"] == answer.status
        else:
            assert answer.status < 400
        if answer.status == 201:
            assert "Idempotent-Replayed" not in answer.headers
        return answer

    return call


@pytest.fixture
def metrics_off(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """POWERTOOLS_METRICS_DISABLED, read again (the layer reads it once a process)."""
    monkeypatch.setenv("POWERTOOLS_METRICS_DISABLED", "true")
    metrics_disabled.cache_clear()
    yield
    metrics_disabled.cache_clear()


@pytest.fixture(autouse=True)
def _metrics_left_clean() -> Iterator[None]:
    """Powertools keeps every Metrics' dimensions, defaults and metrics in one process-wide set, and `clear_metrics`
    puts default dimensions back: a test that sets any would hand them to whichever test its worker runs next."""
    yield
    metrics.clear_default_dimensions()
    metrics.clear_metrics()
