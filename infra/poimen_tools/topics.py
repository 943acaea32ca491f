"""`poimen topics ensure`: declare a tenant's topics, idempotently."""

from __future__ import annotations

from collections.abc import Iterable

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from poimen.kafka import dispatch_topic, events_topic
from poimen.kafka_client import broker_error_reason, client_config, quiet_client_settings

DAY_MS = 24 * 3600 * 1000
SEVEN_DAYS_MS = 7 * DAY_MS
DEFAULT_TIMEOUT_SECONDS = 30.0
# A dispatch record's timestamp is the broker's, when it appended the record, not the publisher's clock: the
# relay's age check (run retention) trusts it (Kafka's topic configuration message.timestamp.type).
DISPATCH_TOPIC_CONFIG = {"message.timestamp.type": "LogAppendTime"}
# The admin client's errors when no broker answered in time, as opposed to a broker refusing the request.
_UNREACHABLE = frozenset({KafkaError._TIMED_OUT, KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN})


class DispatchRetentionTooLong(ValueError):
    """The dispatch topic would keep records longer than runs are kept: a record older than its run, read
    again (a redelivery, a reset group), would admit a second run."""

    def __init__(self, retention_ms: int, run_retention_days: int) -> None:
        super().__init__(
            f"retention.ms {retention_ms} ({retention_text(retention_ms)}) keeps dispatch records longer than "
            f"the run retention of {run_retention_days} days"
        )
        self.retention_ms = retention_ms
        self.run_retention_days = run_retention_days


def retention_text(retention_ms: int) -> str:
    """`forever` for -1, else the retention in days (`7 days`, `0.5 days`)."""
    if retention_ms < 0:
        return "forever"
    days = retention_ms / DAY_MS
    return f"{days:g} day" if days == 1 else f"{days:g} days"


def dispatch_retention_ms(run_retention_days: int | None) -> int:
    """The `.dispatch` retention to create under a run retention: 7 days, or the run retention when shorter."""
    return SEVEN_DAYS_MS if run_retention_days is None else min(SEVEN_DAYS_MS, run_retention_days * DAY_MS)


def check_dispatch_retention(retention_ms: int, run_retention_days: int | None) -> None:
    """Raise DispatchRetentionTooLong if `.dispatch` records would outlive the runs they admit (infinite
    retention, -1, does); any retention is safe when runs are kept forever (None)."""
    if run_retention_days is not None and (retention_ms < 0 or retention_ms > run_retention_days * DAY_MS):
        raise DispatchRetentionTooLong(retention_ms, run_retention_days)


class KafkaUnreachable(Exception):
    """No broker of `bootstrap_servers` answered within the timeout."""

    def __init__(self, bootstrap_servers: str, reason: str, timeout_seconds: float) -> None:
        super().__init__(f"no answer from {bootstrap_servers} within {timeout_seconds:g} s ({reason})")
        self.bootstrap_servers = bootstrap_servers
        self.reason = reason
        self.timeout_seconds = timeout_seconds


def ensure_topics(
    bootstrap_servers: str,
    tenants: str | Iterable[str],
    *,
    partitions: int = 6,
    replication_factor: int = -1,
    retention_ms: int = SEVEN_DAYS_MS,
    run_retention_days: int | None = None,
    iam_region: str | None = None,
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
) -> dict[str, str]:
    """Create `poimen.<tenant>.events` and `.dispatch` of the tenant (or each of several) unless they exist, in one
    CreateTopics request (a request a tenant, 100 tenants took 24 s of `poimen dev`'s start, one request 2 s);
    {topic: "created"|"exists"}. The dispatch topic is declared with `message.timestamp.type=LogAppendTime`
    (DISPATCH_TOPIC_CONFIG).

    A replication factor of -1 takes the broker's `default.replication.factor` (3 on MSK, 1 locally).
    An existing topic is reported as it is, not altered. KafkaUnreachable when no broker answers within
    `timeout_seconds`; a broker's refusal (say, too few brokers for the replication factor) is raised
    as confluent-kafka's KafkaException.

    `.dispatch` retention must not exceed how long admission remembers a dispatch_key: its runs'. Without a
    run retention (`run_retention_days` None, RunRetentionDays empty) runs are kept forever, and any
    retention is safe; with one, a longer retention (or -1, forever) raises DispatchRetentionTooLong before
    anything is created. (After a change of RunRetentionDays the new value is the one to give: a topic
    created now holds records from after the change only.)
    """
    check_dispatch_retention(retention_ms, run_retention_days)
    broker_errors: list[str] = []
    admin = AdminClient(
        client_config(
            bootstrap_servers,
            iam_region,
            error_cb=lambda error: broker_errors.append(str(error.str())),
            **quiet_client_settings(timeout_seconds),
        )
    )
    admin.poll(0)  # librdkafka serves oauth_cb (MSK IAM) only from poll()
    retention = {"retention.ms": str(retention_ms)}
    configs = {}
    for tenant in [tenants] if isinstance(tenants, str) else tenants:
        configs[dispatch_topic(tenant)] = {**retention, **DISPATCH_TOPIC_CONFIG}
        configs[events_topic(tenant)] = retention
    futures = admin.create_topics(
        [NewTopic(topic, partitions, replication_factor, config=config) for topic, config in configs.items()],
        request_timeout=timeout_seconds,
    )
    outcome: dict[str, str] = {}
    for topic, future in futures.items():
        try:
            future.result()
            outcome[topic] = "created"
        except KafkaException as error:
            code = error.args[0].code()
            if code in _UNREACHABLE:
                admin.poll(0)  # serves error_cb: the transport error that says why
                transport = [text for text in broker_errors if "failed:" in text]
                reason = broker_error_reason(transport[-1]) if transport else str(error.args[0].str())
                raise KafkaUnreachable(bootstrap_servers, reason, timeout_seconds) from error
            if code != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
            outcome[topic] = "exists"
    return outcome
