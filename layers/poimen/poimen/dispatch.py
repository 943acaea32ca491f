"""Publishing spawn decisions to `poimen.<tenant>.dispatch` (the orchestrator's side of the relay)."""

from __future__ import annotations

from typing import Any

from confluent_kafka import KafkaError, Message, Producer

from poimen.contract import RunRequest, json_text
from poimen.ids import keyed_run_id, unkeyed_run_id
from poimen.kafka import dispatch_topic, partition_key
from poimen.kafka_client import client_config


class PublishFailed(RuntimeError):
    """The broker did not acknowledge dispatch records within the producer's delivery timeout."""


class DispatchPublisher:
    """An idempotent producer with acks=all: a retried send never duplicates a record in the log.

    While the broker is down, records wait in the producer's queue (up to `message.timeout.ms`, five
    minutes by default) and go out when it is back.
    """

    def __init__(self, bootstrap_servers: str, iam_region: str | None = None, **extra: Any) -> None:
        # murmur2: the partitioner of Java producers, so every producer puts a partition key in one place.
        settings = {"enable.idempotence": True, "acks": "all", "partitioner": "murmur2_random", **extra}
        self._producer = Producer(client_config(bootstrap_servers, iam_region, **settings))
        self._failures: list[str] = []
        self._producer.poll(0)  # serves oauth_cb before the first request (librdkafka calls it from poll)

    def publish(self, tenant_id: str, request: RunRequest) -> str | None:
        """Queue one dispatch record; the run id it will admit when it has a dispatch_key, else None.

        The value is the body POST /v1/runs takes; the key is the partition key (tenant, run id).
        Without a dispatch_key no run id exists before admission, so the key carries a fresh UUIDv7.
        """
        run_id = keyed_run_id(tenant_id, request.dispatch_key) if request.dispatch_key is not None else None
        self._producer.produce(
            dispatch_topic(tenant_id),
            key=partition_key(tenant_id, run_id or unkeyed_run_id()),
            # json_text: numbers parsed exactly (poimen.contract.parse_json) go out as they came in.
            value=json_text(request.model_dump()).encode(),
            on_delivery=self._delivered,
        )
        self._producer.poll(0)
        return run_id

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every queued record is acknowledged; raise if any failed or is still queued."""
        remaining = self._producer.flush(timeout)
        failures, self._failures = self._failures, []
        if failures or remaining:
            raise PublishFailed(f"{remaining} dispatch record(s) unsent; failures: {failures}")

    def _delivered(self, error: KafkaError | None, _message: Message) -> None:
        if error is not None:
            self._failures.append(str(error))
