"""The local stand-in for Lambda's MSK event source mapping: consume, build the MSK event, invoke.

It consumes `poimen.<tenant>.dispatch` topics and their replicas from other Regions
(`<alias>.poimen.<tenant>.dispatch`) with a consumer group, builds events in the `aws:kafka`
shape (poimen_tools.local.msk), one topic per event as a mapping per tenant topic would, invokes the
*same* relay handler, the batches of several topics at once (`concurrency`: as each tenant's mapping invokes
the function on its own, each in an execution environment of its own), and commits a batch's offsets only
once it is handled: the handler
returned, or, after `max_attempts` failures, it went to the on-failure destination in the record
Lambda writes to an S3 destination (metadata plus the whole event). Stopping while a batch is still
failing commits nothing: it comes again.
"""

from __future__ import annotations

import functools
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from confluent_kafka import TIMESTAMP_LOG_APPEND_TIME, Consumer, KafkaError, Message, TopicPartition

from poimen.kafka import DISPATCH_TOPIC_PATTERN
from poimen_tools.local.devserver import LambdaHandler
from poimen_tools.local.mapping import LocalMapping, OnFailure, invocation_record, parked_batch_key
from poimen_tools.local.msk import KafkaRecord, msk_event

log = logging.getLogger(__name__)
SESSION_TIMEOUT_MS = 6000
MAX_POLL_INTERVAL_MS = 86_400_000  # librdkafka's largest max.poll.interval.ms
# Not errors: the end of a partition, and no dispatch topic yet (no tenant has published), which the
# subscription picks up once one is created.
_NOT_YET = (KafkaError._PARTITION_EOF, KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC)


def local_relay_group(table_name: str) -> str:
    """The consumer group of `poimen dev`'s relay: its table's. A cell's relays are its own, as its mappings'
    groups are (`poimen-relay-<tenant>`): two `poimen dev`s serving two cells on one broker never share a group
    (a shared one would split their topics' partitions in one rebalance, one cell's restart stalling the
    other's relay), and a dev restarted on its table with other tenants resumes where its group left off."""
    return f"poimen-relay-local.{table_name}"


class LocalMskEventSource(LocalMapping):
    def __init__(
        self,
        bootstrap_servers: str,
        handler: LambdaHandler,
        on_failure: OnFailure,
        *,
        function_name: str = "InboxRelayFunction",
        group_id: str = "poimen-relay-local",
        batch_size: int = 100,
        batching_window_seconds: float = 0.5,
        max_attempts: int = 3,
        retry_base_seconds: float = 0.5,
        function_timeout_seconds: float = 120.0,
        topics: list[str] | None = None,
        concurrency: int = 1,
    ) -> None:
        super().__init__(
            handler,
            on_failure,
            function_name=function_name,
            max_attempts=max_attempts,
            retry_base_seconds=retry_base_seconds,
            function_timeout_seconds=function_timeout_seconds,
        )
        self.bootstrap_servers = bootstrap_servers
        self.group_id = group_id
        self._batch_size = batch_size
        self._window = batching_window_seconds
        # Names, or ^patterns (librdkafka): every tenant's dispatch topic, local or replicated, unless told
        # otherwise.
        self._topics = topics or [DISPATCH_TOPIC_PATTERN]
        # Topic batches of one poll invoked at once: more than 1 only for a handler whose invocations do not
        # share a process (poimen_tools.local.devserver.ExecutionEnvironments); Powertools' logger and
        # metrics are one per process and were never meant for two invocations at a time.
        self._concurrency = concurrency

    def _run(self) -> None:
        consumer = Consumer(
            {
                "bootstrap.servers": self.bootstrap_servers,
                "group.id": self.group_id,
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
                "max.poll.interval.ms": self.max_poll_interval_ms(),
                # New tenant topics are picked up within a second, as a new mapping would start them.
                "topic.metadata.refresh.interval.ms": 1000,
                # A member that died without leaving (`poimen dev` killed) keeps its partitions until its
                # session times out: 45 s by default, 6 s here (the broker's least, group.min.session.
                # timeout.ms), so a restart resumes within seconds. Not static membership
                # (group.instance.id): a static member never leaves, so even a clean stop would hold the
                # partitions for the timeout unless restarted under the same id, and two `poimen dev`s
                # sharing one broker with one id would fence each other. Heartbeats come from
                # librdkafka's own thread, so a slow relay cannot miss them (max.poll.interval.ms bounds
                # the handling).
                "session.timeout.ms": SESSION_TIMEOUT_MS,
                "heartbeat.interval.ms": SESSION_TIMEOUT_MS // 3,
            }
        )
        try:
            consumer.subscribe(self._topics)
            while not self._stop.is_set():
                try:
                    self._poll_once(consumer)
                except Exception:  # keep the relay alive: log, back off, go on (uncommitted records return)
                    log.exception("local MSK event source failed a cycle")
                    self._stop.wait(1.0)
        finally:
            consumer.close()

    def max_poll_interval_ms(self) -> int:
        """How long one poll may take before the group evicts this member (and its records come again, a keyless
        one admitted twice): a batch may take max_attempts invocations plus backoff, and a poll holds up to
        batch_size topics' batches, relayed `concurrency` at a time, all of them failing through an API outage.
        At most librdkafka's bound (24 h)."""
        batch_ms = self._max_attempts * (self._timeout + self._retry_base * 2**self._max_attempts) * 1000
        rounds = -(-self._batch_size // self._concurrency)
        return min(int(rounds * batch_ms) + 60_000, MAX_POLL_INTERVAL_MS)

    def _poll_once(self, consumer: Consumer) -> None:
        messages = []
        for message in consumer.consume(self._batch_size, self._window):
            error = message.error()
            if error is None:
                messages.append(message)
            elif error.code() in _NOT_YET:
                log.debug("consumer: %s", error)
            else:
                log.warning("consumer: %s", error)
        by_topic: dict[str, list[Message]] = {}
        for message in messages:
            by_topic.setdefault(message.topic() or "", []).append(message)
        batches = list(by_topic.values())  # one topic per event, as one mapping per tenant topic delivers
        if not batches:
            return
        # Each topic's batch is one invocation, several at a time; the consumer is this thread's alone, so
        # the offsets are committed (or rewound) here once every invocation of the poll has ended. Topics
        # share no partition: the order within each partition is the poll's.
        with ThreadPoolExecutor(max_workers=min(self._concurrency, len(batches))) as pool:
            delivered = [pool.submit(self._deliver_batch, batch) for batch in batches]
        handled: list[Message] = []
        failed: list[Message] = []
        first_error: BaseException | None = None
        for batch, outcome in zip(batches, delivered, strict=True):
            if (raised := outcome.exception()) is not None:
                failed.extend(batch)
                first_error = first_error or raised
            elif outcome.result():
                handled.extend(batch)
        self._commit(consumer, handled)
        # E.g. the on-failure destination unreachable: that batch is not committed. Rewind it, or the
        # consumer's position would move past its records and a later commit would skip them.
        if first_error is not None:
            _rewind(consumer, failed)
            raise first_error
        # A batch not handled: stopping; it is not committed and comes again after a restart.

    def _deliver_batch(self, batch: list[Message]) -> bool:
        event = msk_event((_record(message) for message in batch), self.bootstrap_servers)
        return self._deliver(event, functools.partial(on_failure_record, event))

    @staticmethod
    def _commit(consumer: Consumer, messages: list[Message]) -> None:
        # Only partitions this member still owns: a commit for a revoked one could rewind its new owner.
        owned = {(tp.topic, tp.partition) for tp in consumer.assignment()}
        last: dict[tuple[str, int], int] = {}
        for message in messages:
            key = (message.topic() or "", message.partition() or 0)
            if key in owned:
                last[key] = max(last.get(key, -1), message.offset() or 0)
        if not last:
            return
        offsets = [TopicPartition(topic, partition, offset + 1) for (topic, partition), offset in last.items()]
        try:
            results = consumer.commit(offsets=offsets, asynchronous=False) or []
        except Exception as error:  # the broker is away: the records come again after a restart
            log.warning("offset commit failed: %s", error)
            return
        for result in results:
            if result.error is not None:
                log.warning("offset commit failed for %s-%d: %s", result.topic, result.partition, result.error)


def _rewind(consumer: Consumer, messages: list[Message]) -> None:
    first: dict[tuple[str, int], int] = {}
    for message in messages:
        key = (message.topic() or "", message.partition() or 0)
        first[key] = min(first.get(key, message.offset() or 0), message.offset() or 0)
    for (topic, partition), offset in first.items():
        consumer.seek(TopicPartition(topic, partition, offset))


def _record(message: Message) -> KafkaRecord:
    kind, timestamp = message.timestamp()
    return KafkaRecord(
        topic=message.topic() or "",
        partition=message.partition() or 0,
        offset=message.offset() or 0,
        timestamp_ms=timestamp,
        timestamp_type="LOG_APPEND_TIME" if kind == TIMESTAMP_LOG_APPEND_TIME else "CREATE_TIME",
        value=_bytes(message.value()),
        key=_bytes(message.key()),
        headers=[(str(name), _bytes(value) or b"") for name, value in list(message.headers() or [])],
    )


def _bytes(value: str | bytes | None) -> bytes | None:
    return value.encode() if isinstance(value, str) else value


def on_failure_record(event: dict[str, Any], attempts: int) -> dict[str, Any]:
    """What Lambda writes to an MSK mapping's S3 OnFailure destination for the batch `event`: the batch's
    metadata, and the whole event as a JSON string in `payload` (Lambda Developer Guide, "Capturing
    discarded batches for Amazon MSK and self-managed Apache Kafka event sources", S3 destination
    example invocation record)."""
    payload = json.dumps(event)
    ranges: dict[str, dict[str, Any]] = {}
    records = [record for group in event["records"].values() for record in group]
    for record in records:
        entry = ranges.setdefault(
            f"{record['topic']}-{record['partition']}",
            {"firstRecordOffset": str(record["offset"]), "firstRecordTimestamp": str(record["timestamp"])},
        )
        entry["lastRecordOffset"] = str(record["offset"])
        entry["lastRecordTimestamp"] = str(record["timestamp"])
    return {
        **invocation_record("InboxRelayFunction", attempts),
        "KafkaBatchInfo": {
            "batchSize": len(records),
            "eventSourceArn": event["eventSourceArn"],
            "bootstrapServers": event["bootstrapServers"],
            "payloadSize": len(payload),
            "recordsInfo": ranges,
        },
        "payload": payload,
    }


def failed_batch_key(record: dict[str, Any], mapping_id: str) -> str:
    """An S3 key for a parked batch, named for its first topic-partition (poimen_tools.local.mapping)."""
    return parked_batch_key(mapping_id, next(iter(record["KafkaBatchInfo"]["recordsInfo"]), "unknown"))
