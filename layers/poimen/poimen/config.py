"""Settings read once from the environment, validated, and passed down to the code that needs them."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from poimen.kafka import is_tenant_id
from poimen.principals import InvalidPrincipal, grant_principal
from poimen.retention import InvalidRetention, RunRetention, run_retention, run_retention_days
from poimen.wire import MAX_BATCH_SPAWNS, TENANT_PATTERN

N = TypeVar("N", int, float)

# An AWS Region name as SDKs accept one, botocore's own rule (botocore.utils.validate_region_name): a host
# label of letters, digits and inner hyphens, not all digits.
_REGION_NAME = re.compile(r"(?![0-9]+$)(?!-)[a-zA-Z0-9-]{1,63}(?<!-)")

# API Gateway HTTP APIs give up on an integration after at most 30 s (and answer 503, poimen.api).
API_GATEWAY_MAX_INTEGRATION_SECONDS = 30.0

# The event pollers of the relay's MSK mappings (template RelayEventPollers, RELAY_EVENT_POLLERS).
PROVISIONED_POLLERS = "provisioned"
ON_DEMAND_POLLERS = "on-demand"
EVENT_POLLER_MODES = (PROVISIONED_POLLERS, ON_DEMAND_POLLERS)
# RELAY_MAX_RECORD_AGE_SECONDS' bounds, the template's RelayOnDemandMaxRecordAgeSeconds': at most 23 h, an hour short of
# the shortest `.dispatch` retention (RunRetentionDays 1: a day), so that a batch is given up before the topic can drop
# its records: by the first failing invocation to start past the limit, and Kafka deletes a segment at its first
# retention check once its newest record is retention.ms old (tests/unit/test_template_pollers.py).
MIN_RECORD_AGE_SECONDS = 60
MAX_RECORD_AGE_SECONDS = 82800


class ConfigurationError(ValueError):
    """The environment does not describe a usable configuration."""


@dataclass(frozen=True)
class Settings:
    table_name: str
    region: str
    # Grants are cached per principal so that an admission stays one DynamoDB call; a revoked grant
    # stops working at most this many seconds later.
    grants_cache_seconds: float = 60.0
    # A refusal is cached for less: a grant just written takes effect within this many seconds.
    refusal_cache_seconds: float = 5.0
    # The tenants this stack serves (TENANTS: the template's Tenants, which have topics, event sources and the
    # outbox's permission): admission refuses any other, whatever the caller's grants. Empty (unset) only
    # for the tools that use the store alone; admission refuses to start without it.
    tenants: frozenset[str] = frozenset()
    # The relay of this stack, trusted for the stack's tenants by the deploy itself (template.yaml:
    # RELAY_PRINCIPAL), so it needs no grant and is never refused after a deploy.
    relay_principal: str | None = None
    # Total attempts (first try included) for one DynamoDB call before the API answers 503, and the
    # connect and read timeout of each. An admission makes up to two calls (the grant on a cache miss,
    # then the write), and after a write of unknown outcome one more of a single attempt (the fence or
    # the read back); with botocore's backoff they must end before the function's timeout, so the
    # function answers (503) rather than being cut off by it (tests/unit/test_config_and_grants.py).
    dynamodb_max_attempts: int = 2
    dynamodb_timeout_seconds: float = 0.75
    # Pool size of the DynamoDB client: one Lambda serves one request at a time, the dev server many.
    dynamodb_max_connections: int = 10
    # Days a run is kept (RUN_RETENTION_DAYS, template RunRetentionDays): its items carry the TTL attribute
    # `expires_at`, and past it the run is gone (404) and its key admits anew. None: runs are kept forever.
    run_retention_days: int | None = None
    # The Region of the table's replica the store calls (TABLE_REGION); None: the function's own `region`.
    # On AWS a global table has a replica in every Region of its stacks, so only `poimen dev
    # --table-region` sets it, to stand one table in for a global table's replicas.
    table_region: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        table_name = env.get("TABLE_NAME", "").strip()
        if not table_name:
            raise ConfigurationError("TABLE_NAME must name the admission table")
        settings = cls(
            table_name=table_name,
            region=_region(env),
            grants_cache_seconds=_number(env, "GRANTS_CACHE_SECONDS", cls.grants_cache_seconds, float),
            refusal_cache_seconds=_number(env, "REFUSAL_CACHE_SECONDS", cls.refusal_cache_seconds, float),
            tenants=_tenants(env),
            relay_principal=_relay_principal(env),
            dynamodb_max_attempts=_number(env, "DYNAMODB_MAX_ATTEMPTS", cls.dynamodb_max_attempts, int),
            dynamodb_timeout_seconds=_number(env, "DYNAMODB_TIMEOUT_SECONDS", cls.dynamodb_timeout_seconds, float),
            dynamodb_max_connections=_number(env, "DYNAMODB_MAX_CONNECTIONS", cls.dynamodb_max_connections, int),
            run_retention_days=_retention(env),
            table_region=_table_region(env),
        )
        if settings.grants_cache_seconds < 0 or settings.refusal_cache_seconds < 0:
            raise ConfigurationError("GRANTS_CACHE_SECONDS and REFUSAL_CACHE_SECONDS must not be negative")
        if settings.dynamodb_max_attempts < 1:
            raise ConfigurationError("DYNAMODB_MAX_ATTEMPTS must be at least 1")
        if settings.dynamodb_timeout_seconds <= 0 or settings.dynamodb_max_connections < 1:
            raise ConfigurationError("DynamoDB timeout and pool size must be positive")
        return settings


def _tenants(env: Mapping[str, str]) -> frozenset[str]:
    raw = env.get("TENANTS", "").strip()
    try:
        return frozenset(parse_tenants(raw)) if raw else frozenset()
    except ValueError as error:
        raise ConfigurationError(f"TENANTS: {error}") from error


def parse_tenants(text: str) -> tuple[str, ...]:
    """Tenant ids, comma-separated, as the template's Tenants parameter takes them (TENANTS, `poimen dev
    --tenants`): each a tenant id, named once, and no two equal but for hyphens (`a-b`, `ab`: their event
    sources would share one logical id, which SAM CLI and CloudFormation refuse). ValueError otherwise."""
    tenants = tuple(tenant.strip() for tenant in text.split(","))
    for tenant in tenants:
        if not tenant:
            raise ValueError(f"an empty tenant in {text!r}")
        if not is_tenant_id(tenant):
            raise ValueError(f"{tenant!r} is not a tenant id ({TENANT_PATTERN})")
    repeated = sorted({tenant for tenant in tenants if tenants.count(tenant) > 1})
    if repeated:
        raise ValueError(f"{', '.join(repeated)} named twice")
    by_logical_id: dict[str, list[str]] = {}
    for tenant in tenants:
        by_logical_id.setdefault(tenant.replace("-", ""), []).append(tenant)
    clashing = [" and ".join(names) for names in by_logical_id.values() if len(names) > 1]
    if clashing:
        raise ValueError(f"{'; '.join(clashing)} are equal but for hyphens (one logical id for their event sources)")
    return tenants


def _relay_principal(env: Mapping[str, str]) -> str | None:
    """RELAY_PRINCIPAL as the relay's sessions present it: a role without its path (assumed-role ARNs carry
    none, and admission matches a session as `arn:<partition>:iam::<account>:role/<name>`)."""
    arn = env.get("RELAY_PRINCIPAL", "").strip()
    if not arn:
        return None
    try:
        return grant_principal(arn).arn
    except InvalidPrincipal as error:
        raise ConfigurationError(f"RELAY_PRINCIPAL: {error}") from error


def _retention(env: Mapping[str, str]) -> int | None:
    try:
        return run_retention_days(env)
    except InvalidRetention as error:
        raise ConfigurationError(str(error)) from error


def _relay_retention(env: Mapping[str, str]) -> RunRetention:
    try:
        return run_retention(env)
    except InvalidRetention as error:
        raise ConfigurationError(str(error)) from error


def _region(env: Mapping[str, str]) -> str:
    region = (env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "").strip()
    if not region:
        raise ConfigurationError("AWS_REGION (or AWS_DEFAULT_REGION) must be set")
    return region


def is_region_name(value: str) -> bool:
    """Whether `value` is a name an SDK accepts as a Region's (TABLE_REGION here, `--region` in the CLI)."""
    return _REGION_NAME.fullmatch(value) is not None


def _table_region(env: Mapping[str, str]) -> str | None:
    region = env.get("TABLE_REGION", "").strip()
    if not region:
        return None
    if not is_region_name(region):
        raise ConfigurationError(f"TABLE_REGION must be an AWS Region name (like us-west-2), got {region!r}")
    return region


def _number(env: Mapping[str, str], name: str, default: N, kind: type[N]) -> N:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return kind(raw)
    except ValueError as error:
        raise ConfigurationError(f"{name} must be a {kind.__name__}, got {raw!r}") from error


@dataclass(frozen=True)
class RelaySettings:
    """Settings of the inbox relay (MSK dispatch records → POST /v1/runs)."""

    admission_api_url: str
    dlq_url: str
    region: str
    # Records with different Kafka keys go out concurrently, at most this many at once.
    max_concurrency: int = 16
    # Longer than API Gateway ever holds a request, so the relay never abandons a call that admission may
    # still commit (a keyless record would be admitted twice): the answer, or API Gateway's 503, comes first.
    http_timeout_seconds: float = API_GATEWAY_MAX_INTEGRATION_SECONDS + 2.0
    # Nothing is sent before the connection is up, so a short connect timeout cannot admit twice.
    http_connect_timeout_seconds: float = 3.0
    # Connect and read timeout of each SendMessage to the dead-letter queue; an attempt starts only if
    # both fit before the deadline.
    dlq_timeout_seconds: float = 1.0
    retry_base_seconds: float = 0.05
    retry_cap_seconds: float = 5.0
    # Give up retrying this long before the function's deadline, so the raise reaches the event source; at
    # least poimen.aws_session.CREDENTIALS_FETCH_SECONDS, a credentials refresh begun just before it.
    time_margin_seconds: float = 2.0
    # RUN_RETENTION_DAYS, as admission reads it (days None: runs kept forever), and its last change
    # (PREVIOUS_RUN_RETENTION_DAYS, RUN_RETENTION_CHANGED_AT), as make deploy records it.
    run_retention: RunRetention = field(default_factory=RunRetention)
    # The event pollers of its mappings (RELAY_EVENT_POLLERS). Provisioned, the mapping bounds a failing batch's
    # retries and parks it in S3; on-demand, AWS retries it until it succeeds or its records leave the topic,
    # so the relay dead-letters a batch's records as `retries-exhausted` rather than fail it again once its
    # oldest record is `max_record_age_seconds` old (RELAY_MAX_RECORD_AGE_SECONDS; docs/operations.md).
    event_pollers: str = PROVISIONED_POLLERS
    max_record_age_seconds: float = 10800.0
    # Spawns a POST /v1/runs carries (RELAY_BATCH_SPAWNS): up to MAX_BATCH_SPAWNS of a partition's records in one
    # batch call (poimen.batch); 1, one call a record, as application/json.
    batch_spawns: int = MAX_BATCH_SPAWNS

    @property
    def bounds_failed_batches(self) -> bool:
        """Whether the relay itself gives up on a failing batch (on-demand pollers: nothing else does)."""
        return self.event_pollers == ON_DEMAND_POLLERS

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RelaySettings:
        env = os.environ if environ is None else environ
        url = env.get("ADMISSION_API_URL", "").strip().rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ConfigurationError("ADMISSION_API_URL must be the http(s) base URL of the admission API")
        dlq_url = env.get("DLQ_URL", "").strip()
        if not dlq_url:
            raise ConfigurationError("DLQ_URL must name the relay's dead-letter queue")
        settings = cls(
            admission_api_url=url,
            dlq_url=dlq_url,
            region=_region(env),
            max_concurrency=_number(env, "RELAY_MAX_CONCURRENCY", cls.max_concurrency, int),
            http_timeout_seconds=_number(env, "RELAY_HTTP_TIMEOUT_SECONDS", cls.http_timeout_seconds, float),
            http_connect_timeout_seconds=_number(
                env, "RELAY_HTTP_CONNECT_TIMEOUT_SECONDS", cls.http_connect_timeout_seconds, float
            ),
            dlq_timeout_seconds=_number(env, "RELAY_DLQ_TIMEOUT_SECONDS", cls.dlq_timeout_seconds, float),
            time_margin_seconds=_number(env, "RELAY_TIME_MARGIN_SECONDS", cls.time_margin_seconds, float),
            retry_base_seconds=_number(env, "RELAY_RETRY_BASE_SECONDS", cls.retry_base_seconds, float),
            retry_cap_seconds=_number(env, "RELAY_RETRY_CAP_SECONDS", cls.retry_cap_seconds, float),
            run_retention=_relay_retention(env),
            event_pollers=_event_pollers(env),
            max_record_age_seconds=_number(env, "RELAY_MAX_RECORD_AGE_SECONDS", cls.max_record_age_seconds, float),
            batch_spawns=_number(env, "RELAY_BATCH_SPAWNS", cls.batch_spawns, int),
        )
        if not MIN_RECORD_AGE_SECONDS <= settings.max_record_age_seconds <= MAX_RECORD_AGE_SECONDS:
            raise ConfigurationError(
                f"RELAY_MAX_RECORD_AGE_SECONDS must be {MIN_RECORD_AGE_SECONDS} to {MAX_RECORD_AGE_SECONDS} "
                "(at most the shortest .dispatch retention, a day)"
            )
        if not 1 <= settings.batch_spawns <= MAX_BATCH_SPAWNS:
            raise ConfigurationError(f"RELAY_BATCH_SPAWNS must be 1 to {MAX_BATCH_SPAWNS}")
        positive = (
            settings.max_concurrency,
            settings.http_timeout_seconds,
            settings.http_connect_timeout_seconds,
            settings.dlq_timeout_seconds,
            settings.retry_base_seconds,
        )
        if min(positive) <= 0 or settings.retry_cap_seconds < settings.retry_base_seconds:
            raise ConfigurationError("relay concurrency, timeouts and backoff must be positive (cap >= base)")
        if settings.time_margin_seconds < 0:
            raise ConfigurationError("RELAY_TIME_MARGIN_SECONDS must not be negative")
        return settings


def _event_pollers(env: Mapping[str, str]) -> str:
    mode = env.get("RELAY_EVENT_POLLERS", "").strip() or PROVISIONED_POLLERS
    if mode not in EVENT_POLLER_MODES:
        raise ConfigurationError(f"RELAY_EVENT_POLLERS must be provisioned or on-demand, got {mode!r}")
    return mode


@dataclass(frozen=True)
class OutboxSettings:
    """Settings of the outbox relay (the table's stream → `poimen.<tenant>.events`)."""

    bootstrap_servers: str
    region: str
    # The stack's name, in each event's CloudEvents source (`urn:poimen:<stack>:<tenant>`).
    stack_name: str
    # Where events no retry can deliver are set aside (OUTBOX_FAILED_BATCHES_BUCKET, OutboxFailedBatchesBucket);
    # None only for tools that publish otherwise (backfill reports them instead).
    failed_batches_bucket: str | None = None
    # The service its EMF metrics are published under (the dashboard's `service`): OUTBOX_SERVICE_NAME, else
    # POWERTOOLS_SERVICE_NAME, which Lambda gives each function alone; `poimen dev`, whose process runs the
    # relays beside admission's variables, sets the former from the template. None: Powertools' own default.
    service_name: str | None = None
    # SASL_SSL/OAUTHBEARER with MSK IAM tokens; plaintext otherwise (the local broker).
    iam_auth: bool = False
    # How long a record may wait for the broker (librdkafka's message.timeout.ms); each batch also waits at
    # most until the invocation's deadline less `time_margin_seconds`, so its failure reaches the event source.
    delivery_timeout_seconds: float = 30.0
    time_margin_seconds: float = 2.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> OutboxSettings:
        env = os.environ if environ is None else environ
        bootstrap = env.get("KAFKA_BOOTSTRAP_SERVERS", "").strip()
        if not bootstrap:
            raise ConfigurationError("KAFKA_BOOTSTRAP_SERVERS must name the brokers of the events topics")
        stack_name = env.get("POIMEN_STACK_NAME", "").strip()
        if not stack_name:
            raise ConfigurationError("POIMEN_STACK_NAME must name the stack (the events' CloudEvents source)")
        bucket = env.get("OUTBOX_FAILED_BATCHES_BUCKET", "").strip()
        if not bucket:
            raise ConfigurationError(
                "OUTBOX_FAILED_BATCHES_BUCKET must name the bucket where undeliverable events are set aside"
            )
        auth = env.get("KAFKA_AUTH", "none").strip().lower()
        if auth not in ("iam", "none"):
            raise ConfigurationError(f"KAFKA_AUTH must be iam or none, got {auth!r}")
        settings = cls(
            bootstrap_servers=bootstrap,
            region=_region(env),
            stack_name=stack_name,
            failed_batches_bucket=bucket,
            service_name=(env.get("OUTBOX_SERVICE_NAME") or env.get("POWERTOOLS_SERVICE_NAME") or "").strip() or None,
            iam_auth=auth == "iam",
            delivery_timeout_seconds=_number(
                env, "OUTBOX_DELIVERY_TIMEOUT_SECONDS", cls.delivery_timeout_seconds, float
            ),
            time_margin_seconds=_number(env, "OUTBOX_TIME_MARGIN_SECONDS", cls.time_margin_seconds, float),
        )
        if settings.delivery_timeout_seconds <= 0 or settings.time_margin_seconds < 0:
            raise ConfigurationError("OUTBOX_DELIVERY_TIMEOUT_SECONDS must be positive, the margin not negative")
        return settings
