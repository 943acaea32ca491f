"""The local MSK event source's bookkeeping, with a stand-in consumer (no broker)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import TopicPartition

from poimen_tools.local.event_source import LocalMskEventSource


@dataclass
class _Message:
    _topic: str
    _partition: int
    _offset: int

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset


@dataclass
class _Consumer:
    owned: list[tuple[str, int]]
    committed: list[tuple[str, int, int]] = field(default_factory=list)

    def assignment(self) -> list[TopicPartition]:
        return [TopicPartition(topic, partition) for topic, partition in self.owned]

    def commit(self, offsets: list[TopicPartition], asynchronous: bool) -> list[TopicPartition]:
        assert asynchronous is False
        self.committed.extend((tp.topic, tp.partition, tp.offset) for tp in offsets)
        return offsets


def test_commits_the_next_offset_of_each_owned_partition_only() -> None:
    consumer = _Consumer(owned=[("t", 0), ("t", 1)])
    batch: list[Any] = [_Message("t", 0, 5), _Message("t", 0, 7), _Message("t", 1, 2), _Message("t", 2, 9)]

    LocalMskEventSource._commit(consumer, batch)  # type: ignore[arg-type]

    assert sorted(consumer.committed) == [("t", 0, 8), ("t", 1, 3)]  # partition 2 was revoked: not ours
