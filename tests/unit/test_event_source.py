"""The local MSK event source's bookkeeping, with a stand-in consumer (no broker): each tenant topic progresses as
its own mapping would, and an invocation past the function's timeout fails."""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from poimen_tools.local import event_source
from poimen_tools.local.devserver import ExecutionEnvironments
from poimen_tools.local.event_source import LocalMskEventSource
from poimen_tools.local.template import Template
from tests.conftest import wait_for


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
class _Error(_Message):
    """What consume() returns for a consumer error: a message carrying it."""

    _error: KafkaError | None = None

    def error(self) -> KafkaError | None:  # type: ignore[override]
        return self._error


class _Consumer:
    """A stand-in for confluent_kafka's Consumer over in-memory partitions of one partition a topic, all assigned
    to it: consume() reads from each partition not paused, from its position, as librdkafka does (a paused
    partition resumes after the last record consume() returned)."""

    def __init__(self, *topics: str) -> None:
        self.records: dict[tuple[str, int], int] = {(topic, 0): 0 for topic in topics}  # records published
        self.positions: dict[tuple[str, int], int] = dict.fromkeys(self.records, 0)
        self.revoked: set[tuple[str, int]] = set()  # partitions a rebalance gave to another member
        self.commits: dict[tuple[str, int], int] = {}
        self.paused: set[tuple[str, int]] = set()
        self.errors: list[_Message] = []  # returned by the next consume()
        self.consumed_at: list[float] = []  # when consume() was called (time.monotonic())
        self.configs: list[dict[str, Any]] = []
        self.broker_away = False  # commit() raises, as librdkafka's does while the group coordinator is unreachable
        self._lock = threading.Lock()

    def publish(self, topic: str, partition: int = 0) -> None:
        with self._lock:
            self.records.setdefault((topic, partition), 0)
            self.positions.setdefault((topic, partition), 0)
            self.records[(topic, partition)] += 1

    def revoke(self, topic: str, partition: int) -> None:
        """A rebalance gives the partition to another member: no longer assigned to this one."""
        with self._lock:
            self.revoked.add((topic, partition))
            self.paused.discard((topic, partition))

    def reassign(self, topic: str, partition: int) -> None:
        """A rebalance gives the partition back: consumed from its committed offset, unpaused."""
        with self._lock:
            self.revoked.discard((topic, partition))
            self.positions[(topic, partition)] = self.commits.get((topic, partition), 0)

    def subscribe(self, topics: list[str]) -> None:
        pass

    def close(self) -> None:
        pass

    def consume(self, num_messages: int, timeout: float) -> list[_Message]:
        with self._lock:
            self.consumed_at.append(time.monotonic())
            batch, self.errors = list(self.errors), []
            for key, end in self.records.items():
                while key not in self.paused | self.revoked and self.positions[key] < end and len(batch) < num_messages:
                    batch.append(_Message(key[0], key[1], self.positions[key]))
                    self.positions[key] += 1
        if not batch:
            time.sleep(timeout)  # librdkafka waits that long for a record
        return batch

    def pause(self, partitions: list[TopicPartition]) -> None:
        with self._lock:
            self.paused |= {(tp.topic, tp.partition) for tp in partitions}

    def resume(self, partitions: list[TopicPartition]) -> None:
        with self._lock:
            self.paused -= {(tp.topic, tp.partition) for tp in partitions}

    def seek(self, partition: TopicPartition) -> None:
        with self._lock:
            if (partition.topic, partition.partition) in self.revoked:  # as librdkafka refuses it
                raise KafkaException(KafkaError(KafkaError._UNKNOWN_PARTITION, "Local: Unknown partition"))
            self.positions[(partition.topic, partition.partition)] = partition.offset

    def assignment(self) -> list[TopicPartition]:
        with self._lock:
            return [
                TopicPartition(topic, partition)
                for topic, partition in self.records
                if (topic, partition) not in self.revoked
            ]

    def committed(self, partitions: list[TopicPartition], timeout: float) -> list[TopicPartition]:
        with self._lock:
            return [
                TopicPartition(tp.topic, tp.partition, self.commits.get((tp.topic, tp.partition), -1001))
                for tp in partitions
            ]

    def commit(self, offsets: list[TopicPartition], asynchronous: bool) -> list[TopicPartition]:
        assert asynchronous is False
        with self._lock:
            if self.broker_away:
                raise KafkaException(KafkaError(KafkaError._TRANSPORT, "Local: Broker transport failure"))
            for tp in offsets:
                assert tp.offset >= self.commits.get((tp.topic, tp.partition), 0), "a commit went backwards"
                self.commits[(tp.topic, tp.partition)] = tp.offset
        return offsets


@pytest.fixture
def consumer(monkeypatch: pytest.MonkeyPatch) -> _Consumer:
    """The stand-in the test's event sources consume from, two tenants' topics (`publish` to them); the
    configuration each source gave it in `configs`."""
    stand_in = _Consumer("poimen.a.dispatch", "poimen.b.dispatch")

    def create(config: dict[str, Any]) -> _Consumer:
        stand_in.configs.append(config)
        return stand_in

    monkeypatch.setattr(event_source, "Consumer", create)
    return stand_in


@pytest.fixture
def running() -> Iterator[Callable[[LocalMskEventSource], LocalMskEventSource]]:
    started: list[LocalMskEventSource] = []

    def start(source: LocalMskEventSource) -> LocalMskEventSource:
        source.start()
        started.append(source)
        return source

    yield start
    for source in started:
        source.stop()


def _source(handler: Any, on_failure: Any, **options: Any) -> LocalMskEventSource:
    return LocalMskEventSource("127.0.0.1:1", handler, on_failure, batching_window_seconds=0.05, **options)


def _never(_record: dict[str, Any]) -> None:
    raise AssertionError("nothing goes to the on-failure destination")


def test_commits_the_next_offset_of_each_owned_partition_only() -> None:
    consumer = _Consumer("t")
    batch: list[Any] = [_Message("t", 0, 5), _Message("t", 0, 7), _Message("u", 0, 9)]

    event_source._TopicMappings(consumer, lambda _batch: Future())._commit(batch)  # type: ignore[arg-type]

    assert consumer.commits == {("t", 0): 8}  # u-0 is not assigned to this member: not ours


def test_a_failed_topic_batch_is_rewound_alone_and_read_again(
    consumer: _Consumer, running: Callable[[LocalMskEventSource], LocalMskEventSource]
) -> None:
    # Given two tenant topics, the relay failing for one of them and the on-failure destination down
    invoked: list[str] = []

    def relay(event: dict[str, Any], _context: Any) -> dict[str, Any]:
        invoked.extend(event["records"])
        if "poimen.a.dispatch-0" in event["records"]:
            raise RuntimeError("the API refused the relay")
        return {}

    def down(_record: dict[str, Any]) -> None:
        raise ConnectionError("unreachable")

    running(_source(relay, down, max_attempts=1, retry_base_seconds=0.01, concurrency=2))

    # When each tenant publishes a record
    consumer.publish("poimen.a.dispatch")
    consumer.publish("poimen.b.dispatch")

    # Then the handled topic is committed, and the failed one is read again from its record, never committed
    wait_for(lambda: consumer.commits.get(("poimen.b.dispatch", 0)) == 1, timeout=10, what="b committed")
    wait_for(lambda: invoked.count("poimen.a.dispatch-0") >= 3, timeout=10, what="a's batch invoked again")
    assert ("poimen.a.dispatch", 0) not in consumer.commits


def test_a_failed_batch_whose_partition_was_revoked_still_rewinds_its_other_partitions(
    consumer: _Consumer, running: Callable[[LocalMskEventSource], LocalMskEventSource]
) -> None:
    # Given a tenant topic of two partitions, a record on each read into one batch, and a relay whose first
    # invocation fails while a rebalance gives partition 0 to another member, the on-failure destination down
    consumer.publish("poimen.a.dispatch", 0)
    consumer.publish("poimen.a.dispatch", 1)
    handled: list[tuple[str, int]] = []
    failures = [RuntimeError("the API refused the relay")]

    def relay(event: dict[str, Any], _context: Any) -> dict[str, Any]:
        if failures:
            consumer.revoke("poimen.a.dispatch", 0)
            raise failures.pop()
        handled.extend((name, record["offset"]) for name, group in event["records"].items() for record in group)
        return {}

    def down_once(_record: dict[str, Any]) -> None:
        raise ConnectionError("unreachable")

    # When the batch fails, then partition 1 gets its next record, and partition 0 comes back
    running(_source(relay, down_once, max_attempts=1, retry_base_seconds=0.01))
    wait_for(lambda: not failures, timeout=10, what="the batch failed")
    consumer.publish("poimen.a.dispatch", 1)
    wait_for(lambda: consumer.commits.get(("poimen.a.dispatch", 1)) == 2, timeout=10, what="partition 1 committed")
    consumer.reassign("poimen.a.dispatch", 0)
    wait_for(lambda: consumer.commits.get(("poimen.a.dispatch", 0)) == 1, timeout=10, what="partition 0 committed")

    # Then every record was handled before its partition was committed past it: partition 1's first record was
    # read again from the failed batch (not skipped by the refused seek of partition 0), and partition 0's too
    assert sorted(set(handled)) == [("poimen.a.dispatch-0", 0), ("poimen.a.dispatch-1", 0), ("poimen.a.dispatch-1", 1)]


def test_a_batch_handled_while_a_rebalance_held_its_partition_is_committed_once_the_partition_is_back(
    consumer: _Consumer, running: Callable[[LocalMskEventSource], LocalMskEventSource]
) -> None:
    # Given a tenant's batch in flight when a rebalance (a new tenant's topic appearing) takes its partition away
    consumer.publish("poimen.a.dispatch")
    handled: list[int] = []

    def relay(event: dict[str, Any], _context: Any) -> dict[str, Any]:
        consumer.revoke("poimen.a.dispatch", 0)
        handled.extend(record["offset"] for group in event["records"].values() for record in group)
        return {}

    # When the batch is handled while the partition is away, and the partition then comes back to this member
    running(_source(relay, _never, max_attempts=1))
    wait_for(lambda: handled == [0], timeout=10, what="the batch handled")
    polls = len(consumer.consumed_at)
    wait_for(lambda: len(consumer.consumed_at) >= polls + 2, timeout=10, what="the batch settled while away")
    consumer.reassign("poimen.a.dispatch", 0)

    # Then its record is committed (not left to come again after a clean restart), and not handled twice
    wait_for(lambda: consumer.commits.get(("poimen.a.dispatch", 0)) == 1, timeout=10, what="the record committed")
    assert handled == [0]


def test_a_handled_batch_whose_commit_failed_while_the_broker_was_away_is_committed_once_it_is_back(
    consumer: _Consumer, running: Callable[[LocalMskEventSource], LocalMskEventSource]
) -> None:
    # Given a tenant's last record handled while the broker is away (a broker restart), its commit refused
    consumer.publish("poimen.a.dispatch")
    handled: list[int] = []

    def relay(event: dict[str, Any], _context: Any) -> dict[str, Any]:
        consumer.broker_away = True
        handled.extend(record["offset"] for group in event["records"].values() for record in group)
        return {}

    running(_source(relay, _never, max_attempts=1))
    wait_for(lambda: handled == [0], timeout=10, what="the batch handled")
    polls = len(consumer.consumed_at)
    wait_for(lambda: len(consumer.consumed_at) >= polls + 2, timeout=10, what="the commit tried while away")
    assert consumer.commits == {}
    # When the broker is back, and no record follows on that partition
    consumer.broker_away = False

    # Then the handled record is committed (not left to come again after a restart), and not handled twice
    wait_for(lambda: consumer.commits.get(("poimen.a.dispatch", 0)) == 1, timeout=10, what="the record committed")
    assert handled == [0]


def test_stopping_invokes_no_batch_still_waiting_for_an_execution_environment(consumer: _Consumer) -> None:
    # Given one execution environment, busy with one tenant's batch while another tenant's batch waits for it
    started, release = threading.Event(), threading.Event()
    invoked: list[str] = []

    def relay(event: dict[str, Any], _context: Any) -> dict[str, Any]:
        invoked.extend(event["records"])
        started.set()
        release.wait(10)
        return {}

    source = _source(relay, _never, max_attempts=1, concurrency=1)
    source.start()
    consumer.publish("poimen.a.dispatch")
    consumer.publish("poimen.b.dispatch")
    wait_for(started.is_set, timeout=10, what="the first batch invoked")
    polls = len(consumer.consumed_at)
    wait_for(lambda: len(consumer.consumed_at) >= polls + 2, timeout=10, what="the second batch waiting")

    # When the source is stopped (Ctrl-C), then the running batch ends
    stopping = threading.Thread(target=source.stop)
    stopping.start()
    wait_for(source._stop.is_set, timeout=10, what="the stop asked for")
    release.set()
    stopping.join(10)

    # Then the waiting batch was never invoked (nor committed): it comes again after a restart; the running one is
    # committed
    assert not stopping.is_alive()
    assert len(invoked) == 1
    assert consumer.commits == {_partition(invoked[0]): 1}


def _partition(name: str) -> tuple[str, int]:
    topic, _, partition = name.rpartition("-")
    return (topic, int(partition))


def test_no_dispatch_topic_yet_is_not_logged_as_a_problem(
    consumer: _Consumer,
    running: Callable[[LocalMskEventSource], LocalMskEventSource],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a subscription no topic matches yet (no tenant has published), then a real consumer error
    not_yet = KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART, "Subscribed topic not available")
    down = KafkaError(KafkaError._TRANSPORT, "Connection refused")
    consumer.errors = [_Error("", -1, -1001, not_yet), _Error("", -1, -1001, down)]

    # When one poll returns both
    with caplog.at_level(logging.DEBUG, logger="poimen_tools.local.event_source"):
        running(_source(lambda *_: {}, _never))
        wait_for(lambda: len(consumer.consumed_at) >= 2, timeout=10, what="two polls")

    # Then only the real error is a warning; the missing topic is a debug line
    levels = [(record.levelno, "Subscribed topic" in record.getMessage()) for record in caplog.records]
    assert levels == [(logging.DEBUG, True), (logging.WARNING, False)]


def test_the_batches_of_several_topics_are_invoked_at_once(
    consumer: _Consumer, running: Callable[[LocalMskEventSource], LocalMskEventSource]
) -> None:
    # Given a relay whose invocations each wait until the other has begun (as 100 tenants' one-record batches
    # would each wait for all before them)
    both_running = threading.Barrier(2, timeout=10)
    invoked: list[str] = []

    def relay(event: dict[str, Any], _context: Any) -> dict[str, Any]:
        both_running.wait()
        invoked.extend(event["records"])
        return {}

    running(_source(relay, _never, max_attempts=1, concurrency=2))

    # When two tenant topics each get a record
    consumer.publish("poimen.a.dispatch")
    consumer.publish("poimen.b.dispatch")

    # Then both ran together and both topics' offsets are committed
    wait_for(lambda: len(consumer.commits) == 2, timeout=10, what="both topics committed")
    assert sorted(invoked) == ["poimen.a.dispatch-0", "poimen.b.dispatch-0"]
    assert consumer.commits == {("poimen.a.dispatch", 0): 1, ("poimen.b.dispatch", 0): 1}


def test_the_consumer_is_polled_while_a_batch_is_retried_through_an_outage(
    consumer: _Consumer,
    running: Callable[[LocalMskEventSource], LocalMskEventSource],
) -> None:
    # Given a relay failing through an API outage, a batch spending 3 attempts with backoff (at least 1.5 s)
    parked: list[dict[str, Any]] = []

    def down(_event: dict[str, Any], _context: Any) -> dict[str, Any]:
        raise ConnectionError("the API is down")

    running(_source(down, parked.append, max_attempts=3, retry_base_seconds=0.5))

    # When a tenant publishes a record and its batch is retried until it is parked
    consumer.publish("poimen.a.dispatch")
    wait_for(lambda: consumer.commits, timeout=30, what="the batch parked and committed")
    started = consumer.consumed_at[0]
    polls = [at for at in consumer.consumed_at if at >= started]

    # Then the consumer was polled all along (what keeps a member in its group: max.poll.interval.ms bounds
    # the time between two polls), never left for a batch's whole retries
    longest_gap = max(later - earlier for earlier, later in itertools.pairwise(polls))
    assert longest_gap < 1.0
    assert longest_gap * 1000 < consumer.configs[0]["max.poll.interval.ms"]
    assert consumer.commits == {("poimen.a.dispatch", 0): 1}
    assert len(parked) == 1


SLOW_TEMPLATE = """\
Resources:
  Relay:
    Type: AWS::Serverless::Function
    Properties:
      CodeUri: relay/
      Handler: app.handler
      Timeout: 2
"""
# Tenant a's first record takes a minute (its process's id written first); every other record is answered.
SLOW_HANDLER = """\
import os
import time
from pathlib import Path


def handler(event, context):
    if any(record["offset"] == 0 for record in event["records"].get("poimen.a.dispatch-0", [])):
        Path(os.environ["PIDS"], str(os.getpid())).touch()
        time.sleep(60)
    return {}
"""


@pytest.fixture
def slow_relay(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ExecutionEnvironments]:
    """Two execution environments of a relay whose timeout is 2 s and whose first batch of tenant a takes 60 s."""
    (tmp_path / "relay").mkdir()
    (tmp_path / "relay" / "app.py").write_text(SLOW_HANDLER)
    (tmp_path / "template.yaml").write_text(SLOW_TEMPLATE)
    (tmp_path / "pids").mkdir()
    monkeypatch.setenv("PIDS", str(tmp_path / "pids"))
    environments = ExecutionEnvironments(str(tmp_path / "template.yaml"), "Relay", 2)
    environments.start()
    try:
        environments.wait_ready()
        yield environments
    finally:
        environments.close()


def test_a_tenant_whose_batch_outlasts_the_timeout_stalls_no_other_tenant(
    consumer: _Consumer,
    running: Callable[[LocalMskEventSource], LocalMskEventSource],
    slow_relay: ExecutionEnvironments,
    tmp_path: Path,
) -> None:
    # Given the relay in two execution environments, its timeout 2 s, 3 attempts a batch with 0.5 s backoff
    # (tenant a's failing batch ends after at least 7.5 s), and tenant a's first record taking 60 s
    parked: list[dict[str, Any]] = []
    running(_source(slow_relay.handler, parked.append, max_attempts=3, retry_base_seconds=0.5, concurrency=2))
    began = time.monotonic()
    consumer.publish("poimen.a.dispatch")
    consumer.publish("poimen.b.dispatch")
    wait_for(lambda: any((tmp_path / "pids").iterdir()), timeout=10, what="tenant a's slow invocation")

    # When tenant a publishes its next record, and tenant b its next, while a's batch is still in its first attempt
    consumer.publish("poimen.a.dispatch")
    consumer.publish("poimen.b.dispatch")

    # Then b's records are handled and committed without waiting for a's batch (well within its 7.5 s), and a's
    # next record is not (its mapping never commits past an unhandled record)
    wait_for(
        lambda: consumer.commits.get(("poimen.b.dispatch", 0)) == 2, timeout=4, what="tenant b's records committed"
    )
    assert ("poimen.a.dispatch", 0) not in consumer.commits
    assert parked == []
    # And a's invocations end at the timeout, each a failure: after its 3 attempts the batch of its first record
    # is parked (long before its 60 s), then its next record handled and both committed
    wait_for(lambda: consumer.commits.get(("poimen.a.dispatch", 0)) == 2, timeout=30, what="tenant a committed")
    assert time.monotonic() - began >= 7.5
    assert _parked_records(parked[0]) == [("poimen.a.dispatch", 0, 0)]
    assert parked[0]["requestContext"]["approximateInvokeCount"] == 3
    # And each timed-out invocation's process was ended, as Lambda resets the environment
    pids = [int(path.name) for path in (tmp_path / "pids").iterdir()]
    assert len(pids) == 3
    wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in pids), timeout=10, what="all three ended")


def _parked_records(parked: dict[str, Any]) -> list[tuple[str, int, int]]:
    """The (topic, partition, offset) of each record of a parked batch."""
    event = json.loads(parked["payload"])
    return [(r["topic"], r["partition"], r["offset"]) for group in event["records"].values() for r in group]


def test_without_bounded_retries_a_failing_batch_is_retried_until_handled_and_never_parked(
    consumer: _Consumer,
    running: Callable[[LocalMskEventSource], LocalMskEventSource],
) -> None:
    # Given a mapping as the template's under on-demand pollers (no retry bound, no on-failure destination), and a
    # relay failing its first 5 invocations (an outage) then handling the batch
    calls: list[float] = []

    def recovering(_event: dict[str, Any], _context: Any) -> dict[str, Any]:
        calls.append(time.monotonic())
        if len(calls) <= 5:
            raise ConnectionError("the API is down")
        return {}

    running(_source(recovering, _never, max_attempts=None, retry_base_seconds=0.01))
    # When a tenant publishes a record
    consumer.publish("poimen.a.dispatch")
    # Then the batch is tried past any bound the provisioned mapping has (LOCAL_MAX_ATTEMPTS), handled by its sixth
    # invocation, committed, and nothing was parked (_never)
    wait_for(lambda: consumer.commits, timeout=30, what="the batch handled and committed")
    assert len(calls) == 6 > event_source.LOCAL_MAX_ATTEMPTS
    assert consumer.commits == {("poimen.a.dispatch", 0): 1}


@pytest.mark.parametrize(("mode", "attempts"), [("provisioned", event_source.LOCAL_MAX_ATTEMPTS), ("on-demand", None)])
def test_the_local_mapping_retries_and_parks_as_the_templates_mode_says(mode: str, attempts: int | None) -> None:
    template = Template(Path(__file__).parents[2] / "template.yaml")
    parameters = {"Tenants": "acme,globex", "RelayEventPollers": mode}

    assert event_source.relay_mapping_attempts(template, parameters) == attempts


def test_a_template_declaring_no_relay_mapping_gets_the_local_attempts(tmp_path: Path) -> None:
    (tmp_path / "template.yaml").write_text(SLOW_TEMPLATE)

    assert (
        event_source.relay_mapping_attempts(Template(tmp_path / "template.yaml"), {}) == event_source.LOCAL_MAX_ATTEMPTS
    )
