"""`poimen events tail` as a process against real brokers, one that creates unknown topics and one that
refuses them as MSK does: a broker nobody answers and a missing topic end within --timeout, with one line
and the documented exit code; records on an events topic that are no event are one line each."""

from __future__ import annotations

import json
import select
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from poimen.kafka import events_topic
from poimen.kafka_client import quiet_client_settings
from poimen_tools.local.kafka_broker import KafkaBroker
from poimen_tools.topics import ensure_topics
from tests.integration.conftest import POIMEN, free_port

EXIT_NOT_FOUND, EXIT_UNAVAILABLE = 1, 3  # poimen_tools/cli.py's codes, as the reference documents them


class ConfiguredBroker(KafkaBroker):
    """The local broker with topic auto-creation set one way or the other (MSK's default is off)."""

    def __init__(self, data_dir: Path, *, auto_create: bool) -> None:
        super().__init__(data_dir)
        self.auto_create = auto_create

    def _write_config(self) -> Path:
        config = super()._write_config()
        with config.open("a") as settings:
            settings.write(f"auto.create.topics.enable={str(self.auto_create).lower()}\n")
        return config


@pytest.fixture(scope="module", params=[True, False], ids=["auto-create", "msk-like"])
def broker(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaBroker]:
    with ConfiguredBroker(tmp_path_factory.mktemp("kafka"), auto_create=request.param) as running:
        yield running


def tail(bootstrap: str, tenant: str, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [str(POIMEN), "events", "tail", "--tenant", tenant, "--bootstrap-servers", bootstrap, *extra]
    # The subprocess timeout only keeps a hung tail from hanging the suite: a hang is the failure
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


def publish(
    bootstrap: str, tenant: str, records: list[tuple[bytes | None, list[tuple[str, str | bytes | None]]]]
) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, **quiet_client_settings()})
    for value, headers in records:
        producer.produce(events_topic(tenant), value, key=b"k", headers=headers)
    assert producer.flush(30) == 0


def topics(bootstrap: str) -> set[str]:
    return set(AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=30).topics)


def test_a_broker_nobody_answers_ends_the_tail_within_its_timeout(tenant: str) -> None:
    # When tail is pointed at a port nothing listens on, with a 2 s timeout
    ended = tail(f"127.0.0.1:{free_port()}", tenant, "--timeout", "2")
    # Then it ended by itself: one line naming the broker and the fix, exit code 3, nothing on stdout
    (line,) = ended.stderr.splitlines()
    assert (ended.returncode, ended.stdout) == (EXIT_UNAVAILABLE, "")
    assert line.startswith("poimen events tail: cannot reach Kafka at 127.0.0.1:")
    assert "connection refused" in line
    assert "--bootstrap-servers" in line


def test_a_missing_events_topic_ends_the_tail_and_is_not_created(broker: KafkaBroker, tenant: str) -> None:
    # When tail is asked for a tenant whose events topic does not exist
    ended = tail(broker.bootstrap_servers, tenant, "--timeout", "10")
    # Then it says so and how to create it, exit code 1, and the broker still has no such topic
    (line,) = ended.stderr.splitlines()
    assert (ended.returncode, ended.stdout) == (EXIT_NOT_FOUND, "")
    assert f"has no topic {events_topic(tenant)}" in line
    assert f"poimen topics ensure --tenant {tenant} --bootstrap-servers {broker.bootstrap_servers}" in line
    assert events_topic(tenant) not in topics(broker.bootstrap_servers)


def test_records_that_are_no_event_are_one_line_each_and_events_still_print(broker: KafkaBroker, tenant: str) -> None:
    # Given an events topic holding, in this order: a value that is not JSON, a tombstone, JSON that is no
    # run, a run without any CloudEvents header, and an event as the outbox publishes it
    ensure_topics(broker.bootstrap_servers, tenant, partitions=1, replication_factor=1)
    run = {"run_id": "r-2", "workflow_ref": "wf/b", "dispatch_key": None, "created_at": "2026-11-27T12:00:01.000Z"}
    headers: list[tuple[str, str | bytes | None]] = [
        ("ce_id", b"e-1"),
        ("ce_time", b"2026-11-27T12:00:02.000Z"),
        ("ce_broken", b"\xff"),
    ]
    event = {"run_id": "r-3", "workflow_ref": "wf/c", "dispatch_key": "k-3"}
    publish(
        broker.bootstrap_servers,
        tenant,
        [
            (b"\xff not json", []),
            (None, []),
            (b"[1, 2]", []),
            (json.dumps(run).encode(), []),
            (json.dumps(event).encode(), headers),
        ],
    )

    # When tail reads them from the beginning, for two events
    ended = tail(broker.bootstrap_servers, tenant, "--from-beginning", "--limit", "2")

    # Then the two events are its two lines, and each other record one line on stderr, without a traceback
    assert ended.returncode == 0, ended.stderr
    assert ended.stdout.splitlines() == [
        "2026-11-27T12:00:01.000Z r-2 - wf/b",
        "2026-11-27T12:00:02.000Z r-3 k-3 wf/c",
    ]
    assert ended.stderr.splitlines() == [
        f"poimen events tail: {events_topic(tenant)} partition 0 offset 0: not an event (its value is not JSON); "
        "skipped",
        f"poimen events tail: {events_topic(tenant)} partition 0 offset 1: not an event (a tombstone: no value); "
        "skipped",
        f"poimen events tail: {events_topic(tenant)} partition 0 offset 2: not an event (not a run: no run_id "
        "and workflow_ref); skipped",
    ]


def test_a_broker_lost_while_tailing_ends_the_tail_within_its_timeout(tmp_path: Path, tenant: str) -> None:
    # Given a tail that has printed an event of a broker of its own
    with KafkaBroker(tmp_path / "kafka") as lost:
        ensure_topics(lost.bootstrap_servers, tenant, partitions=1, replication_factor=1)
        publish(lost.bootstrap_servers, tenant, [(b'{"run_id": "r-1", "workflow_ref": "wf/a"}', [])])
        command = [str(POIMEN), "events", "tail", "--tenant", tenant, "--bootstrap-servers", lost.bootstrap_servers]
        tailing = subprocess.Popen(
            [*command, "--from-beginning", "--timeout", "3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            assert tailing.stdout is not None
            readable, _, _ = select.select([tailing.stdout], [], [], 60)
            assert readable, "the tail printed nothing"
            assert tailing.stdout.readline().split()[1:] == ["r-1", "-", "wf/a"]
            # When the broker goes away for good
            lost.kill()
            # Then the tail ends by itself, with one line and exit code 3
            code = tailing.wait(timeout=60)
        finally:
            tailing.kill()
            stdout, stderr = tailing.communicate()
    assert (code, stdout) == (EXIT_UNAVAILABLE, "")
    (line,) = stderr.splitlines()
    assert line.startswith(f"poimen events tail: cannot reach Kafka at {lost.bootstrap_servers}")
