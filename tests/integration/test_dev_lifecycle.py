"""`poimen dev` as a process: it answers once it says it is up, stops quietly, takes its children along
when killed, resumes consuming soon after a crash, and keeps the broker's log when the broker fails."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import boto3
import pytest
import requests
from confluent_kafka.admin import AdminClient

from poimen.contract import RunRequest
from poimen.dispatch import DispatchPublisher
from poimen_tools.local.dev import DevOptions, _start_broker
from poimen_tools.local.devserver import LocalApiServer, PortInUse
from poimen_tools.local.event_source import local_relay_group
from poimen_tools.local.kafka_broker import BrokerError, KafkaBroker
from poimen_tools.topics import ensure_topics
from tests.conftest import count_runs
from tests.integration.conftest import POIMEN, free_port, signed_session, start_dev, wait_for

RELAY_GROUP = local_relay_group(DevOptions().table_name)  # the group of `poimen dev`'s relay on its default table
ACCESS_LINE = re.compile(r'^127\.0\.0\.1 - - \[[^]]+\] "[A-Z]+ \S+ HTTP/1\.1" \d{3} -$')

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="reads the process table in /proc")


@dataclass
class _Dev:
    """`poimen dev` in its own session, as a terminal runs it (Ctrl-C reaches its whole process group)."""

    process: subprocess.Popen[bytes]
    out: Path
    err: Path

    def line(self, label: str) -> str | None:
        """The banner line `label: value`'s value, once printed."""
        if self.process.poll() is not None:
            raise AssertionError(f"poimen dev exited with {self.process.returncode}:\n{self.err.read_text()}")
        for line in self.out.read_text().splitlines():
            if line.startswith(f"{label}: "):
                return line.split(": ", 1)[1].strip()
        return None

    def kill(self) -> None:
        """Whatever happened, nothing of it is left running."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


def _spawn(tmp_path: Path, *arguments: str) -> _Dev:
    out, err = tmp_path / "dev.out", tmp_path / "dev.err"
    with out.open("ab") as stdout, err.open("ab") as stderr:
        process = subprocess.Popen(
            [str(POIMEN), "dev", "--port", str(free_port()), *arguments],
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
            env={**os.environ, "POWERTOOLS_LOG_LEVEL": "INFO"},
        )
    return _Dev(process, out, err)


def _processes() -> dict[int, tuple[int, str]]:
    """pid → (parent pid, state) of every process."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # gone meanwhile
                continue
            state, parent = stat.rsplit(")", 1)[1].split()[:2]
            table[int(entry.name)] = (int(parent), state)
    return table


def _descendants(pid: int) -> dict[int, str]:
    """pid → command line of each process below `pid`."""
    table = _processes()
    found: dict[int, str] = {}
    todo = [pid]
    while todo:
        parent = todo.pop()
        for child, (its_parent, _) in table.items():
            if its_parent == parent and child not in found:
                with_nul = Path(f"/proc/{child}/cmdline").read_bytes() if Path(f"/proc/{child}").exists() else b""
                found[child] = with_nul.replace(b"\0", b" ").decode(errors="replace")
                todo.append(child)
    return found


def _alive(pids: list[int] | dict[int, str]) -> list[int]:
    table = _processes()
    return [pid for pid in pids if pid in table and table[pid][1] != "Z"]  # a zombie has ended


def _broker_folders(children: dict[int, str]) -> set[Path]:
    """The temporary folders of `poimen dev`'s broker (from its command line), to remove after a SIGKILL."""
    return {Path(found).parent for found in re.findall(r"configurationFile=(\S+)", " ".join(children.values()))}


def _relay_members(admin: AdminClient) -> list[str]:
    """Member ids of the relay's consumer group that hold partitions."""
    (future,) = admin.describe_consumer_groups([RELAY_GROUP], request_timeout=10).values()
    try:
        group = future.result()
    except Exception:  # the group does not exist yet
        return []
    return [member.member_id for member in group.members if member.assignment.topic_partitions]


@linux_only
def test_a_request_sent_as_the_banner_prints_is_answered_and_ctrl_c_stops_quietly(tmp_path: Path, tenant: str) -> None:
    # Given `poimen dev` starting
    dev = _spawn(tmp_path, "--no-kafka", "--tenants", tenant)
    try:
        # When a request is sent the moment the banner names its URL
        url = wait_for(lambda: dev.line("Admission API"), timeout=180, what="the banner")
        answer = _spawn_by_api(url, tenant, "at-banner", timeout=30)
        # And Ctrl-C is pressed (SIGINT to the whole process group, execution environments included)
        children = _descendants(dev.process.pid)
        os.killpg(dev.process.pid, signal.SIGINT)
        returncode = dev.process.wait(timeout=120)
    finally:
        dev.kill()

    # Then the request was answered, and it stopped with one line and no traceback
    assert answer.status_code == 201
    assert returncode == 0
    stderr = dev.err.read_text()
    assert [line for line in stderr.splitlines() if not ACCESS_LINE.match(line)] == ["Stopping."]
    assert "Traceback" not in dev.out.read_text()
    assert sum("spawn_main" in command for command in children.values()) == 4
    wait_for(lambda: not _alive(children), timeout=30, what="its children to end")


@linux_only
def test_sigkill_takes_the_execution_environments_and_the_broker_along(tmp_path: Path) -> None:
    # Given `poimen dev` with its own broker, its relay subscribed before any dispatch topic exists
    dev = _spawn(tmp_path, "--kafka-port", "0")
    children: dict[int, str] = {}
    try:
        bootstrap = wait_for(lambda: dev.line("Kafka bootstrap"), timeout=300, what="the banner").split()[0]
        children = _descendants(dev.process.pid)
        # (a first tenant's topic: once the relay holds its partition, it has been consuming for a while)
        ensure_topics(bootstrap, "lifecycle", partitions=1, replication_factor=1)
        admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})  # quiet once the broker is gone
        wait_for(lambda: _relay_members(admin), timeout=60, what="the relay to be assigned the topic")

        # When it is killed with SIGKILL (its process only: nothing can clean up after it)
        dev.process.kill()
        dev.process.wait()

        # Then its execution environments (the API's four, and the relay's one: one a tenant, its default one),
        # multiprocessing's resource tracker and the broker end too
        commands = list(children.values())
        assert sum("spawn_main" in command for command in commands) == 4 + 1
        assert any("resource_tracker" in command for command in commands)
        assert any("kafka.Kafka" in command for command in commands)
        wait_for(lambda: not _alive(children), timeout=60, what="every child of the killed poimen dev to end")
    finally:
        dev.kill()
        for pid in _alive(children):
            os.kill(pid, signal.SIGKILL)
        for folder in _broker_folders(children):
            shutil.rmtree(folder, ignore_errors=True)
    # And no dispatch topic at first was no error. (What stderr may hold: the resource tracker's note
    # that it removed the semaphores the killed process could not.)
    stderr = dev.err.read_text()
    assert [line for line in stderr.splitlines() if "resource_tracker" not in line] == [], stderr


@linux_only
def test_a_restart_after_sigkill_resumes_consuming_within_seconds(tmp_path: Path, tenant: str) -> None:
    """About 60 s: a broker and `poimen dev` of its own (it kills and restarts it), the restart waiting for the
    environments to warm and the group to rebalance, as a user's restart does."""
    with KafkaBroker(tmp_path / "kafka") as broker:
        bootstrap = broker.bootstrap_servers
        ensure_topics(bootstrap, tenant, partitions=3, replication_factor=1)
        admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})  # quiet once the broker is gone
        # Given `poimen dev` consuming the tenant's topic from a broker of its own
        first = start_dev(tmp_path, "--kafka-bootstrap", bootstrap, kafka=True, tenants=[tenant])
        try:
            members = wait_for(lambda: _relay_members(admin), timeout=60, what="the relay to be assigned partitions")
            children = _descendants(first.process.pid)
            # When it is killed with SIGKILL
            first.process.kill()
            first.process.wait()
            killed = time.monotonic()
            wait_for(lambda: not _alive(children), timeout=30, what="its execution environments to end")
            # Then the broker lets the dead consumer's partitions go within seconds (its session times out)
            wait_for(
                lambda: not set(members) & set(_relay_members(admin)), timeout=15, what="the dead member to be evicted"
            )
            evicted = time.monotonic() - killed
        finally:
            first.stop()

        # And a restarted `poimen dev` admits what is published next within seconds
        second = start_dev(tmp_path, "--kafka-bootstrap", bootstrap, kafka=True, tenants=[tenant])
        try:
            publisher = DispatchPublisher(bootstrap)
            publisher.publish(tenant, RunRequest(workflow_ref="wf/hello", input={}, dispatch_key="after-restart"))
            publisher.flush()
            published = time.monotonic()
            wait_for(
                lambda: count_runs(second.dynamodb(), second.table_name, tenant), timeout=15, what="the run admitted"
            )
            resumed = time.monotonic() - published
            # And SIGTERM stops it as quietly as Ctrl-C
            second.process.send_signal(signal.SIGTERM)
            returncode = second.process.wait(timeout=120)
        finally:
            second.stop()
    print(f"dead member evicted {evicted:.1f} s after SIGKILL; restarted relay admitted {resumed:.1f} s after publish")
    assert returncode == 0
    log = second.log.read_text()
    assert (log.count("Stopping."), log.count("Traceback")) == (1, 0)


def test_a_broker_that_cannot_start_keeps_its_log() -> None:
    # Given the Kafka port held by something that is not Kafka
    with socket.socket() as taken, contextlib.ExitStack() as cleanup:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        # When `poimen dev` starts its broker there
        with pytest.raises(BrokerError) as failed:
            _start_broker(taken.getsockname()[1], cleanup)
    logs = [Path(path) for path in re.findall(r"(/\S+/broker\.log)", str(failed.value))]
    try:
        # Then the error names the broker's log, which is still there and says why
        assert logs, str(failed.value)
        assert "Address already in use" in logs[0].read_text() + (logs[0].parent / "broker.out").read_text()
    finally:
        for log in logs:
            shutil.rmtree(log.parent, ignore_errors=True)


def test_a_taken_port_is_named_with_its_fix() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]

        with pytest.raises(PortInUse) as refused:
            LocalApiServer(("127.0.0.1", port), None, [], lambda *_: "")  # type: ignore[arg-type]

    assert isinstance(refused.value, OSError)
    assert str(refused.value) == (
        f"127.0.0.1:{port} is already in use (another poimen dev?): stop what listens there, "
        "or choose another port with --port (0: any free port)"
    )


@linux_only
def test_execution_environments_killed_are_replaced_and_nothing_is_parked(tmp_path: Path, tenant: str) -> None:
    """About 60 s: a broker and `poimen dev` of its own (it kills its execution environments), each environment
    replaced and warmed (imports of the layer) before the spawns that show nothing was parked."""
    with KafkaBroker(tmp_path / "kafka") as broker:
        bootstrap = broker.bootstrap_servers
        ensure_topics(bootstrap, tenant, partitions=3, replication_factor=1)
        # Given `poimen dev` relaying a tenant's topic, every execution environment of it (the API's and the
        # relay's) killed with SIGKILL while idle, and each death seen: the process reaped by its pool, not only
        # a zombie (an invocation given to an environment whose death is not seen yet fails, as that pool's)
        dev = start_dev(tmp_path, "--kafka-bootstrap", bootstrap, kafka=True, tenants=[tenant])
        try:
            environments = [pid for pid, command in _descendants(dev.process.pid).items() if "spawn_main" in command]
            for pid in environments:
                os.kill(pid, signal.SIGKILL)
            wait_for(
                lambda: not set(environments) & set(_processes()), timeout=30, what="the killed environments reaped"
            )

            # When a spawn is posted to the API and another published to the tenant's topic
            answer = _spawn_by_api(dev.url, tenant, "after-kill-api", timeout=60)
            publisher = DispatchPublisher(bootstrap)
            publisher.publish(tenant, RunRequest(workflow_ref="wf/hello", input={}, dispatch_key="after-kill-relay"))
            publisher.flush()

            # Then both are admitted, by new environments, and no batch is parked in the failed-batches bucket
            runs = wait_for(
                lambda: len(count_runs(dev.dynamodb(), dev.table_name, tenant)) == 2 or None,
                timeout=60,
                what="both runs admitted",
            )
            s3 = boto3.client("s3", endpoint_url=dev.aws_endpoint)
            parked = s3.list_objects_v2(Bucket=DevOptions().failed_batches_bucket).get("KeyCount", 0)
        finally:
            dev.stop()
    assert answer.status_code == 201
    assert runs
    assert parked == 0


def _spawn_by_api(url: str, tenant: str, dispatch_key: str, *, timeout: float) -> requests.Response:
    """POST /v1/runs of a spawn under `dispatch_key`, signed as the dev principal."""
    with signed_session() as http:
        return http.post(
            f"{url}/v1/runs",
            json={"workflow_ref": "wf/hello", "input": {}, "dispatch_key": dispatch_key},
            headers={"X-Poimen-Tenant": tenant},
            timeout=timeout,
        )
