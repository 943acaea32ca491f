"""Shared by every test level: fake AWS settings, the template, canonical events, table helpers."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import botocore.loaders
import botocore.session
import pytest
from _pytest.nodeid import NodeId

from poimen_tools.local.template import Template
from tests import run_guard

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


# One botocore data loader for every session a test process makes. A session parses the service models,
# endpoint rules and partitions it needs, megabytes of JSON, on its first client; a function makes its few
# sessions once an execution environment, but the tests make hundreds (a fresh store, relay or client each),
# and parsing the same files again took more than half of the unit tests' CPU (380 s, now 180). botocore
# shares a loader's parsed data among the clients of one session; this shares it among sessions, for the
# default search path.
_SHARED_LOADER = botocore.loaders.create_loader()


def _shared_loader(search_path_string: str | None = None) -> botocore.loaders.Loader:
    if search_path_string:  # AWS_DATA_PATH given: a loader of its own, as botocore makes
        return botocore.loaders.create_loader(search_path_string)
    return _SHARED_LOADER


botocore.session.create_loader = _shared_loader  # botocore.session's own import of it

# A folder of this test run's, shared by its pytest-xdist workers: the process that starts the run creates it
# (pytest_configure) before the workers start, so they inherit the variable, and removes it when the run ends.
RUN_FOLDER = "POIMEN_TEST_RUN_FOLDER"
_OWNS_RUN_FOLDER = pytest.StashKey[bool]()


def pytest_configure(config: pytest.Config) -> None:
    run_guard.install(config)  # every selected test runs (tests/run_guard.py)
    if RUN_FOLDER not in os.environ:
        os.environ[RUN_FOLDER] = tempfile.mkdtemp(prefix="poimen-tests-")
        config.stash[_OWNS_RUN_FOLDER] = True


def pytest_unconfigure(config: pytest.Config) -> None:
    if config.stash.get(_OWNS_RUN_FOLDER, False):
        shutil.rmtree(os.environ.pop(RUN_FOLDER), ignore_errors=True)


def run_folder(name: str) -> Path:
    """`name` in this run's folder (RUN_FOLDER), created on first use."""
    folder = Path(os.environ[RUN_FOLDER]) / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


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


def count_runs(client: Any, table_name: str, tenant_id: str, *, only: str | None = None) -> list[dict[str, Any]]:
    """Every run item of a tenant, read by scanning the table (not by counting answers); with `only` (a
    ProjectionExpression), just those attributes of each: a count needs no run's input, and returning every item
    whole cost the property tests, whose tables fill with runs of up to 256 KB, nine tenths of their CPU."""
    items: list[dict[str, Any]] = []
    kwargs: dict[str, Any] = {
        "TableName": table_name,
        "ConsistentRead": True,
        "FilterExpression": "begins_with(pk, :prefix)",
        "ExpressionAttributeValues": {":prefix": {"S": f"RUN#{tenant_id}#"}},
    }
    if only is not None:
        kwargs["ProjectionExpression"] = only
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


def _restore_parameters(item: pytest.Item) -> None:
    """The id of a test whose name carries parameters its id lost: Schemathesis names its tests of each operation
    `<function>[POST /v1/runs]`, but pytest 9.2 builds a function's id from its `originalname` and its callspec,
    which Schemathesis gives none, so its three operations shared one id, and pytest-xdist, which keys work by id,
    ran one of them (tests/run_guard.py refuses such a run)."""
    base = getattr(item, "originalname", None)
    if not base or not item.name.startswith(f"{base}[") or not item.name.endswith("]"):
        return
    if item.nodeid.rsplit("::", 1)[-1] == base:
        item._id = NodeId.parse(f"{item.nodeid}{item.name[len(base) :]}")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`make test`: `-n`, with `--dist loadgroup` from pyproject.toml) tests are handed
    to the workers one by one, but a test using a fixture its own module scopes wider than one test (a module
    fixture: `poimen dev`s, a broker, a build; a session fixture defined in the module) goes to the same
    worker as the rest of its module, so that fixture is set up once, as a serial run sets it up. The
    conftest fixtures (`dev`, `broker`, `template`) are one per worker: tests share them by tenant, topic,
    table or key. A test with an `xdist_group` mark of its own keeps it (shared files, tests/integration/
    test_rie.py)."""
    for item in items:
        _restore_parameters(item)
    for item in items:
        if item.get_closest_marker("xdist_group") is not None or not isinstance(item, pytest.Function):
            continue
        module = item.nodeid.split("::", 1)[0]
        for definitions in item._fixtureinfo.name2fixturedefs.values():
            fixture = definitions[-1]
            if fixture.scope == "module" or (fixture.scope != "function" and fixture.baseid == module):
                item.add_marker(pytest.mark.xdist_group(module))
                break
    if not config.getoption("loadgroup", default=False):  # set in a worker of `--dist loadgroup` only
        return
    # The group travels to the scheduler as a suffix of the test's id, `<id>@<group>`. pytest-xdist 3.8.0 sets
    # it as `item._nodeid`, which pytest 9.2 no longer reads (the id is `item._id`): set here, where both look.
    for item in items:
        groups = sorted(
            {
                str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                for mark in item.iter_markers("xdist_group")
            }
        )
        if groups and "@" not in item.nodeid:
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(groups)}")
