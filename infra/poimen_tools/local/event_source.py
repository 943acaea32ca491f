"""The local stand-in for Lambda's MSK event source mapping: consume, build the MSK event, invoke.

It consumes `poimen.<tenant>.dispatch` topics with a consumer group, builds events in the `aws:kafka`
shape (poimen_tools.local.msk), invokes the *same* relay handler in-process, and commits offsets only
after the handler returns. A failed batch is retried with backoff; after `max_attempts` its metadata
goes to the on-failure destination (as Lambda's OnFailure record) and the group moves on.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from confluent_kafka import Consumer, Message, TopicPartition

from poimen.kafka import DISPATCH_TOPIC_PATTERN
from poimen_tools.local.devserver import LambdaHandler, LocalLambdaContext
from poimen_tools.local.msk import KafkaRecord, msk_event

log = logging.getLogger(__name__)
OnFailure = Callable[[dict[str, Any]], None]


class LocalMskEventSource:
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
    ) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.group_id = group_id
        self._handler = handler
        self._on_failure = on_failure
        self._function_name = function_name
        self._batch_size = batch_size
        self._window = batching_window_seconds
        self._max_attempts = max_attempts
        self._retry_base = retry_base_seconds
        self._timeout = function_timeout_seconds
        # Names, or ^patterns (librdkafka): every tenant's dispatch topic unless told otherwise.
        self._topics = topics or [DISPATCH_TOPIC_PATTERN]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.invocations = 0

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="local-msk-event-source", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._timeout + 30)
            self._thread = None

    def _run(self) -> None:
        consumer = Consumer(
            {
                "bootstrap.servers": self.bootstrap_servers,
                "group.id": self.group_id,
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
                # New tenant topics are picked up within a second, as a new mapping would start them.
                "topic.metadata.refresh.interval.ms": 1000,
            }
        )
        consumer.subscribe(self._topics)
        try:
            while not self._stop.is_set():
                messages = [m for m in consumer.consume(self._batch_size, self._window) if m.error() is None]
                if messages:
                    self._deliver(messages)
                    self._commit(consumer, messages)
        finally:
            consumer.close()

    def _deliver(self, messages: list[Message]) -> None:
        event = msk_event((_record(message) for message in messages), self.bootstrap_servers)
        for attempt in range(1, self._max_attempts + 1):
            self.invocations += 1
            try:
                self._handler(event, LocalLambdaContext(self._function_name, timeout_seconds=self._timeout))
            except Exception as error:  # the function failed: retry the same batch, as the mapping does
                log.warning("relay invocation %d/%d failed: %s", attempt, self._max_attempts, error)
                if attempt == self._max_attempts:
                    self._on_failure(on_failure_record(messages, event, attempt, self.bootstrap_servers))
                    return
                if self._stop.wait(self._retry_base * 2 ** (attempt - 1)):
                    return
            else:
                return

    @staticmethod
    def _commit(consumer: Consumer, messages: list[Message]) -> None:
        last: dict[tuple[str, int], int] = {}
        for message in messages:
            key = (message.topic() or "", message.partition() or 0)
            last[key] = max(last.get(key, -1), message.offset() or 0)
        try:
            consumer.commit(
                offsets=[TopicPartition(topic, partition, offset + 1) for (topic, partition), offset in last.items()],
                asynchronous=False,
            )
        except Exception as error:  # broker away: the records come again later, and are replays
            log.warning("offset commit failed: %s", error)


def _record(message: Message) -> KafkaRecord:
    _kind, timestamp = message.timestamp()
    return KafkaRecord(
        topic=message.topic() or "",
        partition=message.partition() or 0,
        offset=message.offset() or 0,
        timestamp_ms=timestamp,
        value=_bytes(message.value()),
        key=_bytes(message.key()),
        headers=_headers(message.headers()),
    )


def _headers(raw: Any) -> list[tuple[str, bytes]]:
    pairs = raw.items() if isinstance(raw, dict) else raw or []
    return [(str(name), _bytes(value) or b"") for name, value in pairs]


def _bytes(value: str | bytes | None) -> bytes | None:
    return value.encode() if isinstance(value, str) else value


def on_failure_record(messages: list[Message], event: dict[str, Any], attempts: int, bootstrap: str) -> dict[str, Any]:
    """What Lambda sends to an MSK mapping's OnFailure destination: the batch's metadata, not its records."""
    ranges: dict[str, dict[str, Any]] = {}
    for message in messages:
        name = f"{message.topic()}-{message.partition()}"
        _kind, timestamp = message.timestamp()
        entry = ranges.setdefault(
            name, {"firstRecordOffset": str(message.offset()), "firstRecordTimestamp": str(timestamp)}
        )
        entry["lastRecordOffset"] = str(message.offset())
        entry["lastRecordTimestamp"] = str(timestamp)
    return {
        "requestContext": {
            "requestId": str(uuid.uuid4()),
            "functionArn": "arn:aws:lambda:local:000000000000:function:InboxRelayFunction",
            "condition": "RetryAttemptsExhausted",
            "approximateInvokeCount": attempts,
        },
        "responseContext": {"statusCode": 200, "executedVersion": "$LATEST", "functionError": "Unhandled"},
        "version": "1.0",
        "timestamp": datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "KafkaBatchInfo": {
            "batchSize": len(messages),
            "bootstrapServers": bootstrap,
            "payloadSize": len(json.dumps(event)),
            "recordsInfo": ranges,
        },
    }
