"""Shared by every test level: fake AWS settings, the template, canonical events, table helpers."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from poimen_tools.local.template import Template

REPO = Path(__file__).resolve().parent.parent
EVENTS = Path(__file__).resolve().parent / "events"

# Powertools reads these when its objects are created at import; no test may reach a real AWS account.
os.environ.update(
    {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_REGION": "us-east-1",
        "POWERTOOLS_SERVICE_NAME": "poimen-admission",
        "POWERTOOLS_METRICS_NAMESPACE": "PoimenTest",
        "POWERTOOLS_LOG_LEVEL": "WARNING",
    }
)
for name in [name for name in os.environ if name.startswith("AWS_ENDPOINT_URL")]:
    del os.environ[name]


def wait_for(condition: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    """Poll `condition` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="session")
def template() -> Template:
    return Template(REPO / "template.yaml")


@contextlib.contextmanager
def serve_on_loopback(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """`handler` served by a thread on a free loopback port: yields its base URL, shuts it down on exit."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def load_event(name: str) -> dict[str, Any]:
    event: dict[str, Any] = json.loads((EVENTS / name).read_text())
    return copy.deepcopy(event)


def count_runs(client: Any, table_name: str, tenant_id: str) -> list[dict[str, Any]]:
    """Every run item of a tenant, read by scanning the table (not by counting answers)."""
    items: list[dict[str, Any]] = []
    kwargs: dict[str, Any] = {
        "TableName": table_name,
        "ConsistentRead": True,
        "FilterExpression": "begins_with(pk, :prefix)",
        "ExpressionAttributeValues": {":prefix": {"S": f"RUN#{tenant_id}#"}},
    }
    while True:
        page = client.scan(**kwargs)
        items.extend(page["Items"])
        if "LastEvaluatedKey" not in page:
            return items
        kwargs["ExclusiveStartKey"] = page["LastEvaluatedKey"]


@pytest.fixture
def tenant() -> str:
    """A tenant id no other test uses, so tests never see each other's runs."""
    return f"t-{uuid.uuid4().hex[:12]}"
