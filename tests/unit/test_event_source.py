"""The local MSK event source's bookkeeping, with a stand-in consumer (no broker)."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import pytest
from confluent_kafka import KafkaError, TopicPartition

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

    def error(self) -> None:
        return None

    def timestamp(self) -> tuple[int, int]:
        return (1, 1_700_000_000_000)

    def value(self) -> bytes:
        return b"{}"

    def key(self) -> None:
        return None

    def headers(self) -> None:
        return None


@dataclass
class _Consumer:
    owned: list[tuple[str, int]]
    committed: list[tuple[str, int, int]] = field(default_factory=list)
    polled: list[_Message] = field(default_factory=list)
    positions: dict[tuple[str, int], int] = field(default_factory=dict)

    def consume(self, num_messages: int, timeout: float) -> list[_Message]:
        for message in self.polled:
            self.positions[(message.topic(), message.partition())] = message.offset() + 1
        return self.polled

    def seek(self, partition: TopicPartition) -> None:
        self.positions[(partition.topic, partition.partition)] = partition.offset

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


def test_a_failed_topic_batch_rewinds_every_uncommitted_topic_of_the_poll() -> None:
    # Given one poll holding records of two tenant topics, and a relay and on-failure destination both down
    polled = [
        _Message("poimen.a.dispatch", 0, 0),
        _Message("poimen.a.dispatch", 0, 1),
        _Message("poimen.b.dispatch", 0, 0),
    ]
    polled += [_Message("poimen.b.dispatch", 0, 1), _Message("poimen.b.dispatch", 0, 2)]
    consumer = _Consumer(owned=[("poimen.a.dispatch", 0), ("poimen.b.dispatch", 0)], polled=polled)

    def down(*_: Any) -> Any:
        raise ConnectionError("unreachable")

    source = LocalMskEventSource("127.0.0.1:1", down, down, max_attempts=1)

    # When the first topic's batch cannot be handled
    with pytest.raises(ConnectionError):
        source._poll_once(consumer)  # type: ignore[arg-type]

    # Then nothing is committed and both topics read again from their first record of the poll
    assert consumer.committed == []
    assert consumer.positions == {("poimen.a.dispatch", 0): 0, ("poimen.b.dispatch", 0): 0}


@dataclass
class _Error(_Message):
    """What consume() returns for a consumer error: a message carrying it."""

    _error: KafkaError | None = None

    def error(self) -> KafkaError | None:  # type: ignore[override]
        return self._error


def test_no_dispatch_topic_yet_is_not_logged_as_a_problem(caplog: pytest.LogCaptureFixture) -> None:
    # Given a subscription no topic matches yet (no tenant has published), then a real consumer error
    not_yet = KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART, "Subscribed topic not available")
    down = KafkaError(KafkaError._TRANSPORT, "Connection refused")
    consumer = _Consumer(owned=[], polled=[_Error("", -1, -1001, not_yet), _Error("", -1, -1001, down)])
    source = LocalMskEventSource("127.0.0.1:1", lambda *_: {}, lambda _: None)

    # When one poll returns both
    with caplog.at_level(logging.DEBUG, logger="poimen_tools.local.event_source"):
        source._poll_once(consumer)  # type: ignore[arg-type]

    # Then only the real error is a warning; the missing topic is a debug line
    levels = [(record.levelno, "Subscribed topic" in record.getMessage()) for record in caplog.records]
    assert levels == [(logging.DEBUG, True), (logging.WARNING, False)]


def test_the_batches_of_several_topics_are_invoked_at_once() -> None:
    # Given one poll holding one record of each of two tenant topics, and a relay whose invocations each wait
    # until the other has begun (as 100 tenants' one-record batches would each wait for all before them)
    polled: list[Any] = [_Message("poimen.a.dispatch", 0, 0), _Message("poimen.b.dispatch", 0, 0)]
    consumer = _Consumer(owned=[("poimen.a.dispatch", 0), ("poimen.b.dispatch", 0)], polled=polled)
    both_running = threading.Barrier(2, timeout=10)
    invoked: list[str] = []

    def relay(event: dict[str, Any], _context: Any) -> dict[str, Any]:
        both_running.wait()
        invoked.extend(event["records"])
        return {}

    source = LocalMskEventSource("127.0.0.1:1", relay, _never, max_attempts=1, concurrency=2)

    # When the poll is handled
    source._poll_once(consumer)  # type: ignore[arg-type]

    # Then both ran together and both topics' offsets are committed
    assert sorted(invoked) == ["poimen.a.dispatch-0", "poimen.b.dispatch-0"]
    assert sorted(consumer.committed) == [("poimen.a.dispatch", 0, 1), ("poimen.b.dispatch", 0, 1)]


def test_a_failed_topic_batch_is_rewound_and_the_others_of_its_poll_are_committed() -> None:
    # Given one poll of two tenant topics, the relay failing for one of them and the on-failure destination down
    polled: list[Any] = [_Message("poimen.a.dispatch", 0, 3), _Message("poimen.b.dispatch", 0, 7)]
    consumer = _Consumer(owned=[("poimen.a.dispatch", 0), ("poimen.b.dispatch", 0)], polled=polled)

    def relay(event: dict[str, Any], _context: Any) -> dict[str, Any]:
        if "poimen.a.dispatch-0" in event["records"]:
            raise RuntimeError("the API refused the relay")
        return {}

    def down(_record: dict[str, Any]) -> None:
        raise ConnectionError("unreachable")

    source = LocalMskEventSource("127.0.0.1:1", relay, down, max_attempts=1, concurrency=2)

    # When the poll is handled
    with pytest.raises(ConnectionError):
        source._poll_once(consumer)  # type: ignore[arg-type]

    # Then the handled topic is committed, and the failed one reads again from its record
    assert consumer.committed == [("poimen.b.dispatch", 0, 8)]
    assert consumer.positions[("poimen.a.dispatch", 0)] == 3


def _never(_record: dict[str, Any]) -> None:
    raise AssertionError("nothing goes to the on-failure destination")


def test_a_poll_of_every_topic_failing_through_an_outage_ends_before_the_group_evicts_the_relay() -> None:
    # Given the relay of `poimen dev`'s settings: 100-record polls over up to 100 tenant topics, 4 batches at a
    # time, each batch up to 3 attempts of the function's 120 s with backoff
    source = LocalMskEventSource("127.0.0.1:1", lambda *_: {}, _never, function_timeout_seconds=120.0, concurrency=4)
    one_batch_ms = 3 * (120 + 0.5 * 2**3) * 1000

    # When the API is down for the whole poll, every batch spending all its attempts, 25 rounds of 4
    poll_ms = 25 * one_batch_ms

    # Then the consumer's max.poll.interval.ms outlasts that poll: the group does not evict it mid-poll
    assert source.max_poll_interval_ms() > poll_ms
