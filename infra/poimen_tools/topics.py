"""`poimen topics ensure`: declare a tenant's topics, idempotently."""

from __future__ import annotations

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from poimen.kafka import dispatch_topic, events_topic
from poimen.kafka_client import client_config

SEVEN_DAYS_MS = 7 * 24 * 3600 * 1000


def ensure_topics(
    bootstrap_servers: str,
    tenant_id: str,
    *,
    partitions: int = 6,
    replication_factor: int = -1,
    retention_ms: int = SEVEN_DAYS_MS,
    iam_region: str | None = None,
) -> dict[str, str]:
    """Create `poimen.<tenant>.events` and `.dispatch` unless they exist; {topic: "created"|"exists"}.

    A replication factor of -1 takes the broker's `default.replication.factor` (3 on MSK, 1 locally).
    An existing topic is reported as it is, not altered.

    `.dispatch` retention must not exceed how long admission remembers a dispatch_key. Run items are
    never deleted, so with run-scoped keys that is forever, and any retention is safe.
    """
    admin = AdminClient(client_config(bootstrap_servers, iam_region))
    admin.poll(0)  # librdkafka serves oauth_cb (MSK IAM) only from poll()
    topics = [dispatch_topic(tenant_id), events_topic(tenant_id)]
    futures = admin.create_topics(
        [
            NewTopic(topic, partitions, replication_factor, config={"retention.ms": str(retention_ms)})
            for topic in topics
        ],
        request_timeout=30,
    )
    outcome: dict[str, str] = {}
    for topic, future in futures.items():
        try:
            future.result()
            outcome[topic] = "created"
        except KafkaException as error:
            if error.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
            outcome[topic] = "exists"
    return outcome
