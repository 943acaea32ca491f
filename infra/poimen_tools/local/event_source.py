"""The local stand-in for Lambda's MSK event source mapping: consume, build the MSK event, invoke.

It consumes `poimen.<tenant>.dispatch` topics and their replicas from other Regions
(`<alias>.poimen.<tenant>.dispatch`) with a consumer group, builds events in the `aws:kafka`
shape (poimen_tools.local.msk), one topic per event, and invokes the *same* relay handler. Each topic
progresses on its own, as the mapping per tenant topic the template declares does: one batch of a topic at a
time (its order kept), several topics' batches at once (`concurrency`, each in an execution environment of its
own), a busy topic's partitions paused while the consumer goes on polling the others. A batch's offsets are
committed as soon as it is handled: the handler returned, or, after `max_attempts` failures (an invocation past
the function's timeout is one: its execution environment ends it), it went to the on-failure destination in the
record Lambda writes to an S3 destination (metadata plus the whole event). With `max_attempts` None, as the
template's mappings under on-demand event pollers (`relay_mapping_attempts`), a failing batch is retried until
handled and nothing is parked. Nothing is committed past a record not handled; stopping while a batch is still
failing, or before it was invoked, commits nothing of it: it comes again.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import TIMESTAMP_LOG_APPEND_TIME, Consumer, KafkaError, Message, TopicPartition

from poimen.kafka import DISPATCH_TOPIC_PATTERN
from poimen_tools.local.devserver import LambdaHandler
from poimen_tools.local.mapping import LocalMapping, OnFailure, invocation_record, parked_batch_key
from poimen_tools.local.msk import KafkaRecord, msk_event
from poimen_tools.local.template import Template

log = logging.getLogger(__name__)
SESSION_TIMEOUT_MS = 6000
# librdkafka's default: the consumer is polled at least every batching window whatever its batches do (a busy
# topic is paused, not waited for), so only a polling thread that hangs is evicted from the group.
MAX_POLL_INTERVAL_MS = 300_000
# Not errors: the end of a partition, and no dispatch topic yet (no tenant has published), which the
# subscription picks up once one is created.
_NOT_YET = (KafkaError._PARTITION_EOF, KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC)
# The attempts a failing batch gets locally before it is parked, where the template's mappings bound retries and
# park (provisioned pollers): not their RelayMaxRetryAttempts, whose 100 retries of up to 120 s would hold a local
# batch for hours.
LOCAL_MAX_ATTEMPTS = 3


def relay_mapping_attempts(template: Template, parameters: Mapping[str, str]) -> int | None:
    """The attempts the local MSK mapping gives a failing batch, as the template's relay mappings handle failures
    with `parameters` (its Tenants, RelayEventPollers): LOCAL_MAX_ATTEMPTS, then the batch parked, where they
    declare bounded retries and an on-failure destination (provisioned pollers); None, retried until handled,
    where they declare neither (on-demand pollers: AWS retries a failed batch "until processing succeeds or the
    messages expire", https://docs.aws.amazon.com/lambda/latest/dg/with-msk-process.html)."""
    tenants = parameters.get("Tenants", "").split(",") if parameters.get("Tenants") else []
    resources = template.expanded_resources({"Tenants": tenants} if tenants else {})
    properties = next(
        (
            body["Properties"]
            for name, body in resources.items()
            if body.get("Type") == "AWS::Lambda::EventSourceMapping" and name.startswith("RelaySource")
        ),
        None,
    )
    if properties is None:  # a template (`poimen dev --template`) declaring no relay mapping: the local default
        return LOCAL_MAX_ATTEMPTS
    declared = [template.declares(properties, key, parameters) for key in ("MaximumRetryAttempts", "DestinationConfig")]
    if all(declared):
        return LOCAL_MAX_ATTEMPTS
    if any(declared):
        raise ValueError("the relay mappings bound retries without an on-failure destination, or the reverse")
    return None


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
        max_attempts: int | None = LOCAL_MAX_ATTEMPTS,
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
        # Topic batches invoked at once: more than 1 only for a handler whose invocations do not share a
        # process (poimen_tools.local.devserver.ExecutionEnvironments); Powertools' logger and metrics are one
        # per process and were never meant for two invocations at a time.
        self._concurrency = concurrency

    def _run(self) -> None:
        consumer = Consumer(
            {
                "bootstrap.servers": self.bootstrap_servers,
                "group.id": self.group_id,
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
                "max.poll.interval.ms": MAX_POLL_INTERVAL_MS,
                # New tenant topics are picked up within a second, as a new mapping would start them.
                "topic.metadata.refresh.interval.ms": 1000,
                # A member that died without leaving (`poimen dev` killed) keeps its partitions until its
                # session times out: 45 s by default, 6 s here (the broker's least, group.min.session.
                # timeout.ms), so a restart resumes within seconds. Not static membership
                # (group.instance.id): a static member never leaves, so even a clean stop would hold the
                # partitions for the timeout unless restarted under the same id, and two `poimen dev`s
                # sharing one broker with one id would fence each other. Heartbeats come from
                # librdkafka's own thread, so a slow relay cannot miss them (max.poll.interval.ms bounds
                # the time between polls).
                "session.timeout.ms": SESSION_TIMEOUT_MS,
                "heartbeat.interval.ms": SESSION_TIMEOUT_MS // 3,
            }
        )
        try:
            consumer.subscribe(self._topics)
            with ThreadPoolExecutor(max_workers=self._concurrency, thread_name_prefix="local-msk-batch") as pool:
                topics = _TopicMappings(consumer, lambda batch: pool.submit(self._deliver_batch, batch))
                try:
                    while not self._stop.is_set():
                        try:
                            topics.poll(self._batch_size, self._window)
                        except Exception:  # keep the relay alive: log, back off, go on (uncommitted records return)
                            log.exception("local MSK event source failed a cycle")
                            self._stop.wait(1.0)
                finally:
                    # The batches in flight end (one still failing gives up at its next backoff, one still waiting
                    # for an execution environment is not invoked, committing nothing); those handled are committed.
                    topics.settle(wait=True)
        finally:
            consumer.close()

    def _deliver_batch(self, batch: list[Message]) -> bool:
        event = msk_event((_record(message) for message in batch), self.bootstrap_servers)
        return self._deliver(event, functools.partial(on_failure_record, event))


@dataclass
class _TopicMapping:
    """One topic's share of the consumer, as the mapping of that topic: the records read and not yet invoked, and
    the batch being invoked, at most one (the order of each partition is kept)."""

    pending: list[Message] = field(default_factory=list)
    batch: list[Message] = field(default_factory=list)
    invocation: Future[bool] | None = None


class _TopicMappings:
    """The topics of one consumer, each progressing on its own; every call on the consumer is from its thread."""

    def __init__(self, consumer: Consumer, invoke: Callable[[list[Message]], Future[bool]]) -> None:
        self._consumer = consumer
        self._invoke = invoke
        self._topics: dict[str, _TopicMapping] = {}
        # The offset after the last record taken into a batch, by partition: a rebalance resumes a partition at
        # its committed offset, and the records of a batch in flight or handled since are not taken twice.
        self._next: dict[tuple[str, int], int] = {}
        # The offset after the records handled of each partition a rebalance had taken away when they were to be
        # committed: committed once the partition is back with this member (a clean restart would read them
        # again), unless its group committed as far meanwhile (another member had it).
        self._deferred: dict[tuple[str, int], int] = {}
        # The offset after the records handled of each partition this member owns whose commit failed (the broker
        # away, a restart): committed at the next settle that reaches it, so a handled record that no other
        # follows on its partition does not stay uncommitted (to come again after a restart).
        self._owed: dict[tuple[str, int], int] = {}

    def poll(self, batch_size: int, window: float) -> None:
        """Read what the consumer has (waiting up to `window`), settle the batches that have ended, and invoke
        the next batch of each topic that has none in flight."""
        arrived: set[str] = set()
        for message in self._consumer.consume(batch_size, window):
            error = message.error()
            if error is not None:
                if error.code() in _NOT_YET:
                    log.debug("consumer: %s", error)
                else:
                    log.warning("consumer: %s", error)
                continue
            key = _partition_of(message)
            offset = message.offset() or 0
            if offset < self._next.get(key, 0):
                continue
            self._next[key] = offset + 1
            self._topics.setdefault(key[0], _TopicMapping()).pending.append(message)
            arrived.add(key[0])
        self.settle(wait=False)
        for topic, mapping in self._topics.items():
            if mapping.invocation is None and mapping.pending:
                mapping.batch, mapping.pending = mapping.pending[:batch_size], mapping.pending[batch_size:]
                mapping.invocation = self._invoke(mapping.batch)
                self._pause(topic)
            elif mapping.invocation is not None and topic in arrived:
                self._pause(topic)  # a rebalance assigned its partitions anew, unpaused

    def settle(self, *, wait: bool) -> None:
        """Commit each batch handled, rewind each that failed (it is read again), resume each topic left idle.
        With `wait`, first wait for every batch in flight."""
        handled: list[Message] = []
        failed: dict[str, list[Message]] = {}
        for topic, mapping in self._topics.items():
            invocation = mapping.invocation
            if invocation is None or not (wait or invocation.done()):
                continue
            batch, mapping.invocation, mapping.batch = mapping.batch, None, []
            raised = invocation.exception()
            if raised is not None:
                # E.g. the on-failure destination unreachable: the batch is not committed. Read it again from its
                # first record, and what followed it, or the consumer's position would move past its records and
                # a later commit would skip them.
                log.error("%s: a batch was neither handled nor parked: %s", topic, raised)
                failed[topic], mapping.pending = batch + mapping.pending, []
            elif invocation.result():
                handled.extend(batch)
            # (Else stopping before it began or while it still failed: not committed, it comes again after a restart.)
            if not mapping.pending:
                self._resume(topic)  # before a rewind's seek: a paused partition resumes where consume() left it
        self._commit(handled)
        for messages in failed.values():
            self._rewind(messages)

    def _commit(self, handled: list[Message]) -> None:
        owned = {(tp.topic, tp.partition) for tp in self._consumer.assignment()}
        for message in handled:
            key, after = _partition_of(message), (message.offset() or 0) + 1
            if key in owned:
                self._deferred.pop(key, None)  # this commit goes further
                self._owed[key] = max(self._owed.get(key, 0), after)
            else:
                self._deferred[key] = max(self._deferred.get(key, 0), after)
        for key in [key for key in self._owed if key not in owned]:  # revoked since its commit failed
            self._deferred[key] = max(self._deferred.get(key, 0), self._owed.pop(key))
        if self._owed:
            failed = _commit_offsets(self._consumer, self._owed)
            self._owed = {key: offset for key, offset in self._owed.items() if key in failed}
        back = [TopicPartition(topic, partition) for topic, partition in self._deferred if (topic, partition) in owned]
        if not back:
            return
        try:
            committed = self._consumer.committed(back, timeout=10)
        except Exception as error:  # the broker is away: tried again at the next settle
            log.warning("committed offsets not read: %s", error)
            return
        offsets: dict[tuple[str, int], int] = {}
        for tp in committed:
            offset = self._deferred.pop((tp.topic, tp.partition))
            if tp.error is None and offset > tp.offset:  # no commit (a negative offset) or one short of it
                offsets[(tp.topic, tp.partition)] = offset
        for key in _commit_offsets(self._consumer, offsets):  # the broker away again: checked again next time
            self._deferred[key] = max(self._deferred.get(key, 0), offsets[key])

    def _partitions(self, topic: str) -> list[TopicPartition]:
        return [tp for tp in self._consumer.assignment() if tp.topic == topic]

    def _pause(self, topic: str) -> None:
        # librdkafka drops what it fetched of them, and resumes each after the last record consume() returned.
        if partitions := self._partitions(topic):
            self._consumer.pause(partitions)

    def _resume(self, topic: str) -> None:
        if partitions := self._partitions(topic):
            self._consumer.resume(partitions)

    def _rewind(self, messages: list[Message]) -> None:
        first: dict[tuple[str, int], int] = {}
        for message in messages:
            key = _partition_of(message)
            first[key] = min(first.get(key, message.offset() or 0), message.offset() or 0)
        owned = {(tp.topic, tp.partition) for tp in self._consumer.assignment()}
        for (topic, partition), offset in first.items():
            self._next[(topic, partition)] = offset
            # A partition a rebalance revoked cannot be sought (librdkafka refuses it: one refusal must not leave
            # the others unwound). Whoever owns it next reads it from its committed offset, never past this
            # batch's first record (nothing of it was committed), and so does this member if it comes back.
            if (topic, partition) in owned:
                self._consumer.seek(TopicPartition(topic, partition, offset))


def _commit_offsets(consumer: Consumer, next_offsets: dict[tuple[str, int], int]) -> set[tuple[str, int]]:
    """Commit `next_offsets`; the partitions whose commit failed (every one when the broker is away)."""
    if not next_offsets:
        return set()
    offsets = [TopicPartition(topic, partition, offset) for (topic, partition), offset in next_offsets.items()]
    try:
        results = consumer.commit(offsets=offsets, asynchronous=False) or []
    except Exception as error:  # the broker is away
        log.warning("offset commit failed: %s", error)
        return set(next_offsets)
    failed = set()
    for result in results:
        if result.error is not None:
            log.warning("offset commit failed for %s-%d: %s", result.topic, result.partition, result.error)
            failed.add((result.topic, result.partition))
    return failed


def _partition_of(message: Message) -> tuple[str, int]:
    return (message.topic() or "", message.partition() or 0)


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
