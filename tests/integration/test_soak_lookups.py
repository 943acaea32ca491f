"""The soak's look-ups of the relay's committed offsets (benchmarks.soak.Relay, benchmarks.committed) against a
real broker: one process answers them all, and one that dies is replaced."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from confluent_kafka import Consumer, TopicPartition

from benchmarks.soak import PARTITIONS, RELAY_GROUP, Relay
from poimen.kafka import dispatch_topic
from poimen_tools.local.kafka_broker import KafkaBroker
from poimen_tools.topics import ensure_topics
from tests.integration.conftest import wait_for


def _lookup_processes() -> list[int]:
    """This process's children looking committed offsets up."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except OSError:  # gone meanwhile
            continue
        if parent == os.getpid() and b"benchmarks.committed" in command:
            found.append(int(entry.name))
    return found


def test_one_process_answers_every_look_up_and_a_dead_one_is_replaced(broker: KafkaBroker, tenant: str) -> None:
    # Given the relay's group having committed offset 3 of a tenant's first dispatch partition
    bootstrap = broker.bootstrap_servers
    ensure_topics(bootstrap, tenant, partitions=PARTITIONS, replication_factor=1)
    committer = Consumer({"bootstrap.servers": bootstrap, "group.id": RELAY_GROUP})
    try:
        committer.commit(offsets=[TopicPartition(dispatch_topic(tenant), 0, 3)], asynchronous=False)
    finally:
        committer.close()
    relay = Relay(bootstrap, (tenant,))
    try:
        # When its offsets are looked up several times, as the soak polls them
        answers = [wait_for(relay.committed, timeout=60, what="the committed offsets") for _ in range(5)]

        # Then each look-up reads them, all from one process (a Python start-up each costs 0.2 s of CPU)
        expected = {(dispatch_topic(tenant), partition): 3 if partition == 0 else 0 for partition in range(PARTITIONS)}
        assert answers == [expected] * 5
        (lookups,) = _lookup_processes()

        # And when that process dies (librdkafka's abort at a broker restart), the look-ups go on in another
        os.kill(lookups, signal.SIGKILL)
        assert wait_for(relay.committed, timeout=60, what="a look-up after the death") == expected
        assert relay.failed_lookups <= 1  # at most the look-up the death interrupted
        assert [pid for pid in _lookup_processes() if pid != lookups] != []
    finally:
        relay.close()
    # And closing ends it
    wait_for(lambda: not _lookup_processes(), timeout=30, what="the look-up process to end")
