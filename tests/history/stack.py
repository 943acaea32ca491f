"""The system under test: `poimen dev` in a session of its own (so its whole process group can be killed),
its DynamoDB calls through the fault proxy to a moto server of this process, whose table outlives it
(and so do the DLQ and bucket it creates there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3

from poimen_tools.local.kafka_broker import free_port
from poimen_tools.local.moto import EmbeddedMoto
from poimen_tools.local.processes import SessionProcess
from tests.integration.dynamodb_proxy import FaultyProxy, faulty_proxy

POIMEN = Path(sys.executable).parent / "poimen"
TABLE = "poimen-history"
# poimen dev's DynamoDB calls time out after this, so that an answer the proxy holds is a timeout soon.
DYNAMODB_TIMEOUT_SECONDS = "0.5"


class StackError(RuntimeError):
    """`poimen dev` did not start."""


class DevProcess(SessionProcess):
    """`poimen dev` (no Kafka) serving `tenant`, on one port and one table across its restarts."""

    def __init__(self, folder: Path, dynamodb_endpoint: str, aws_endpoint: str, concurrency: int, tenant: str) -> None:
        super().__init__()
        self._folder = folder
        self._tenant = tenant
        self._dynamodb_endpoint = dynamodb_endpoint
        self._aws_endpoint = aws_endpoint
        self._concurrency = concurrency
        self.url = f"http://127.0.0.1:{free_port()}"
        self.starts = 0

    def start(self, timeout: float = 180.0) -> None:
        """Start it, and return once it serves (it prints its banner once a request would be answered)."""
        self.starts += 1
        log = self._folder / f"poimen-dev-{self.starts}.log"
        port = self.url.rsplit(":", 1)[1]
        command = [str(POIMEN), "dev", "--no-kafka", "--port", port, "--table-name", TABLE, "--tenants", self._tenant]
        command += ["--dynamodb-endpoint", self._dynamodb_endpoint, "--concurrency", str(self._concurrency)]
        # SQS and S3 (its DLQ's; unused without Kafka) on the same moto: no embedded one to start each time.
        command += ["--sqs-endpoint", self._aws_endpoint, "--s3-endpoint", self._aws_endpoint]
        environment = {**os.environ, "DYNAMODB_TIMEOUT_SECONDS": DYNAMODB_TIMEOUT_SECONDS}
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=environment
            )
        deadline = time.monotonic() + timeout
        while "Admission API: " not in log.read_text(errors="replace"):
            if self.process.poll() is not None:
                raise StackError(f"poimen dev exited with {self.process.returncode}; see {log}")
            if time.monotonic() > deadline:
                raise StackError(f"poimen dev did not serve within {timeout:.0f} s; see {log}")
            time.sleep(0.1)


@dataclass
class Stack:
    dev: DevProcess
    proxy: FaultyProxy
    moto: str  # the moto server's endpoint: the table as it is, not through the proxy

    def scan(self, tenant: str) -> tuple[list[dict[str, Any]], int]:
        """The tenant's runs (as the API answers them) and the number of its fences: one consistent scan,
        straight from moto."""
        client = boto3.client("dynamodb", endpoint_url=self.moto)
        runs, fences = [], 0
        pages = client.get_paginator("scan").paginate(
            TableName=TABLE,
            ConsistentRead=True,
            FilterExpression="begins_with(pk, :prefix)",
            ExpressionAttributeValues={":prefix": {"S": f"RUN#{tenant}#"}},
        )
        for page in pages:
            for item in page["Items"]:
                if "item_type" in item:
                    fences += 1
                    continue
                runs.append(_run(item))
        return runs, fences


def _run(item: dict[str, Any]) -> dict[str, Any]:
    """A run item as the API's body would show it."""

    def text(name: str) -> str | None:
        value = item.get(name)
        return None if value is None or "NULL" in value else str(value["S"])

    return {
        "run_id": text("run_id"),
        "tenant_id": text("tenant_id"),
        "workflow_ref": text("workflow_ref"),
        "input": json.loads(text("input") or "null"),
        "goal_id": text("goal_id"),
        "dispatch_key": text("dispatch_key"),
        "status": text("status"),
        "created_at": text("created_at"),
    }


@contextmanager
def stack(folder: Path, concurrency: int, tenant: str) -> Iterator[Stack]:
    """moto, the proxy and `poimen dev` (`concurrency` execution environments, serving `tenant`), started;
    everything stopped on the way out."""
    with EmbeddedMoto() as moto, faulty_proxy(moto.endpoint) as proxy:
        dev = DevProcess(folder, proxy.url, moto.endpoint, concurrency, tenant)
        try:
            dev.start()
            yield Stack(dev, proxy, moto.endpoint)
        finally:
            dev.stop()
