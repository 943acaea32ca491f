"""Integration level: `poimen dev` as a real process, its embedded moto server, real HTTP on loopback."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest
import requests

POIMEN = Path(sys.executable).parent / "poimen"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_for(condition: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    """Poll `condition` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@dataclass
class DevServer:
    process: subprocess.Popen[bytes]
    url: str
    aws_endpoint: str
    table_name: str
    log: Path

    def dynamodb(self) -> Any:
        return boto3.client("dynamodb", endpoint_url=self.aws_endpoint)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                raise
        return self.process.returncode


def start_dev(tmp_path: Path, *extra: str, table_name: str = "poimen-admission-local") -> DevServer:
    port = free_port()
    log = tmp_path / f"poimen-dev-{port}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [str(POIMEN), "dev", "--port", str(port), "--table-name", table_name, *extra],
            stdout=out,
            stderr=subprocess.STDOUT,
        )

    def announced() -> dict[str, str] | None:
        if process.poll() is not None:
            raise AssertionError(f"poimen dev exited with {process.returncode}:\n{log.read_text()}")
        lines = dict(line.split(": ", 1) for line in log.read_text().splitlines() if ": " in line)
        return lines if "Admission API" in lines and "Local AWS (DynamoDB, SQS)" in lines else None

    try:
        lines = wait_for(announced, what="poimen dev to announce its URLs")
    except BaseException:
        process.kill()
        process.wait()
        raise
    endpoint = lines["Local AWS (DynamoDB, SQS)"].split()[0]
    return DevServer(process, lines["Admission API"].strip(), endpoint, table_name, log)


@pytest.fixture(scope="session")
def dev(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevServer]:
    server = start_dev(tmp_path_factory.mktemp("dev"))
    yield server
    assert server.stop() == 0


@pytest.fixture
def http() -> Iterator[requests.Session]:
    with requests.Session() as session:
        yield session
