"""Admission against a second DynamoDB engine: `poimen dev --dynamodb-endpoint` on dynalite (npm, LevelDB).

Nothing may rely on moto's quirks. dynalite answers a failed condition without the stored item
(as older emulators do), so every replay here takes the store's one consistent GetItem fallback.
"""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import boto3
import pytest
import requests

from tests.conftest import REPO, count_runs
from tests.integration.conftest import DevServer, free_port, signed_session, start_dev, wait_for

DYNALITE = REPO / ".cache" / "dynalite" / "node_modules" / ".bin" / "dynalite"
TABLE = "dynalite-admission"
# Raw text: a Python float could not carry these numbers to the API unchanged.
INPUT = '{"n": 12345678901234567.25, "big": 1180591620717411303424}'
SPAWN = f'{{"workflow_ref": "wf/hello", "input": {INPUT}, "dispatch_key": "k-1"}}'
CHANGED = SPAWN.replace("567.25", "567.5")
UNKEYED = '{"workflow_ref": "wf/hello", "input": {}}'


def _accepts(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def dynalite() -> Iterator[str]:
    assert DYNALITE.is_file(), "dynalite is not installed: run `make dynalite`"
    port = free_port()
    process = subprocess.Popen(
        [str(DYNALITE), "--port", str(port), "--createTableMs", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: process.poll() is None and _accepts(port), what="dynalite to listen")
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture(scope="module")
def dev_on_dynalite(dynalite: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevServer]:
    server = start_dev(tmp_path_factory.mktemp("dynalite"), "--dynamodb-endpoint", dynalite, table_name=TABLE)
    yield server
    assert server.stop() == 0


def _post(session: requests.Session, dev: DevServer, tenant: str, body: str) -> requests.Response:
    headers = {"X-Poimen-Tenant": tenant, "Content-Type": "application/json"}
    return session.post(f"{dev.url}/v1/runs", data=body.encode(), headers=headers, timeout=30)


def _runs(dynalite: str, tenant: str) -> list[dict[str, Any]]:
    return count_runs(boto3.client("dynamodb", endpoint_url=dynalite), TABLE, tenant)


def test_dev_serves_admissions_on_dynalite(dev_on_dynalite: DevServer, dynalite: str, tenant: str) -> None:
    with signed_session() as session:
        # Given a keyed spawn admitted on dynalite
        first = _post(session, dev_on_dynalite, tenant, SPAWN)
        # When it is repeated, and then its key reused with another payload
        again = _post(session, dev_on_dynalite, tenant, SPAWN)
        changed = _post(session, dev_on_dynalite, tenant, CHANGED)

    # Then 201, a 200 replay with the same body, a 422 naming the run; one run, numbers as sent
    assert (first.status_code, again.status_code, changed.status_code) == (201, 200, 422)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.text == first.text
    assert '"n":12345678901234567.25' in first.text.replace(" ", "")
    assert '"big":1180591620717411303424' in first.text.replace(" ", "")
    assert changed.json()["run_id"] == first.json()["run_id"]
    assert len(_runs(dynalite, tenant)) == 1
    # and --dynamodb-endpoint is DynamoDB's only: the DLQ lives in the embedded moto server
    assert dev_on_dynalite.aws_endpoint == dynalite
    assert dev_on_dynalite.sqs_endpoint not in (None, dynalite)


def test_concurrent_duplicates_on_dynalite_make_one_run(dev_on_dynalite: DevServer, dynalite: str, tenant: str) -> None:
    def spawn(_: int) -> requests.Response:
        with signed_session() as session:
            return _post(session, dev_on_dynalite, tenant, SPAWN)

    with ThreadPoolExecutor(max_workers=10) as pool:
        answers = list(pool.map(spawn, range(10)))

    assert sorted(answer.status_code for answer in answers) == [200] * 9 + [201]
    assert len({answer.json()["run_id"] for answer in answers}) == 1
    assert len(_runs(dynalite, tenant)) == 1


def test_unkeyed_spawns_on_dynalite_are_each_a_run(dev_on_dynalite: DevServer, dynalite: str, tenant: str) -> None:
    with signed_session() as session:
        statuses = [_post(session, dev_on_dynalite, tenant, UNKEYED).status_code for _ in range(3)]

    assert statuses == [201, 201, 201]
    assert len(_runs(dynalite, tenant)) == 3
