"""What a tenant costs: the cost model of docs/operations.md#what-a-tenant-costs, computed from template.yaml.

The template gives what is configured (memory sizes, architecture, provisioned pollers, batch sizes, the
event source mappings a tenant adds); `poimen topics ensure` the partitions a tenant adds; the prices are AWS's
(US East, N. Virginia, each with its page); the durations are what `make bench` measured. `python -m
benchmarks.cost_model --tables` prints the section's tables, and tests/unit/test_cost_model.py holds the document to
them, so no figure drifts from the template. After a new `make bench`, pass its figures:
`python -m benchmarks.cost_model --admission-ms 30 --relay-ms 1.2 --outbox-ms 0.8 --tables` (and paste the tables).

As a tool, `python -m benchmarks.cost_model --tenants 300 --aliases 1 --cells 2 --admissions 50000000 --mode
provisioned` prints the monthly bill of that deployment by line, fixed and variable: the event pollers from the
poller groups `make deploy` would assign (poimen_tools.deploy_check, cell after cell on one cluster; each group
billed whole EPUs), the brokers' share, and the admissions' lines scaled from a million. `--spawns-a-post 100`
prints a million spawns relayed on the batch route, a POST /v1/runs of 100 spawns each (1: the per-record path).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
from dataclasses import dataclass
from pathlib import Path

from poimen.wire import MAX_BATCH_SPAWNS
from poimen_tools.deploy_check import GroupLoad, assign_poller_groups, max_tenants
from poimen_tools.local.rie import LOG_EVENT_OVERHEAD_BYTES
from poimen_tools.local.template import Template
from poimen_tools.topics import ensure_topics

REPO = Path(__file__).resolve().parent.parent
HOURS_A_MONTH = 730  # AWS pricing pages' month
MILLION = 1_000_000

LAMBDA_PRICING = "https://aws.amazon.com/lambda/pricing/"
KAFKA_SCALING_MODES = "https://docs.aws.amazon.com/lambda/latest/dg/kafka-scaling-modes.html"
API_GATEWAY_PRICING = "https://aws.amazon.com/api-gateway/pricing/"
DYNAMODB_PRICING = "https://aws.amazon.com/dynamodb/pricing/on-demand/"
MSK_PRICING = "https://aws.amazon.com/msk/pricing/"
MSK_BEST_PRACTICES = "https://docs.aws.amazon.com/msk/latest/developerguide/bestpractices.html"
SQS_PRICING = "https://aws.amazon.com/sqs/pricing/"
S3_PRICING = "https://aws.amazon.com/s3/pricing/"
CLOUDWATCH_PRICING = "https://aws.amazon.com/cloudwatch/pricing/"
XRAY_PRICING = "https://aws.amazon.com/xray/pricing/"
LAMBDA_XRAY = "https://docs.aws.amazon.com/lambda/latest/dg/services-xray.html"
LAMBDA_DDB = "https://docs.aws.amazon.com/lambda/latest/dg/with-ddb.html"
HTTP_API_VS_REST = "https://docs.aws.amazon.com/apigateway/latest/developerguide/http-api-vs-rest.html"


@dataclass(frozen=True)
class Price:
    usd: float  # for `per` of `unit`
    per: int
    unit: str
    source: str

    @property
    def each(self) -> float:
        return self.usd / self.per

    def __str__(self) -> str:
        scale = {1: "", 1000: "1,000 ", MILLION: "million "}[self.per]
        digits = f"{self.usd:.10f}".rstrip("0")
        whole, _, fraction = digits.partition(".")
        return f"${whole}.{fraction.ljust(2, '0')} per {scale}{self.unit}"


# US East (N. Virginia), read 2026-12-01. Which of them the corpus of AWS pages holds as text, and where the
# others come from: docs/operations.md#what-a-tenant-costs.
PRICES = {
    "lambda_gb_second_arm": Price(0.0000133334, 1, "GB-second (Arm, first 7.5 billion a month)", LAMBDA_PRICING),
    "lambda_request": Price(0.20, MILLION, "requests", LAMBDA_PRICING),
    "epu_hour": Price(0.185, 1, "EPU-hour (Kafka: 10 event pollers an EPU)", LAMBDA_PRICING),
    "http_api_request": Price(1.00, MILLION, "requests (first 300 million a month)", API_GATEWAY_PRICING),
    "write_request_unit": Price(0.625, MILLION, "write request units", DYNAMODB_PRICING),
    "msk_broker_hour": Price(0.204, 1, "kafka.m7g.large broker-hour", MSK_PRICING),
    "log_gb": Price(0.50, 1, "GB ingested (Standard log class)", CLOUDWATCH_PRICING),
    "trace": Price(5.00, MILLION, "traces recorded", XRAY_PRICING),
    "sqs_request": Price(0.40, MILLION, "requests (64 KB each)", SQS_PRICING),
    "s3_put": Price(0.005, 1000, "PUT requests (S3 Standard)", S3_PRICING),
}
POLLERS_A_EPU = 10  # Kafka: "EPU-hours price is $0.185/hour and supports 10 event pollers per EPU" (LAMBDA_PRICING)
MODES = ("provisioned", "on-demand")  # the inbox mappings' event pollers
REPLICAS_A_BROKER = 1000  # MSK's recommended most partition replicas on a kafka.m7g.large (MSK_BEST_PRACTICES)
REPLICATION_FACTOR = 3  # MSK's default.replication.factor, which `poimen topics ensure` takes (-1)
TOPICS_A_TENANT = 2  # poimen.<tenant>.dispatch and .events; one more dispatch topic per peer cluster alias


@dataclass(frozen=True)
class Durations:
    """Measured by `make bench` (docs/architecture.md#benchmarks): ms an admission, ms a relayed or published
    record (an invocation's duration over its batch's records)."""

    admission_ms: float
    relay_ms_a_record: float
    outbox_ms_a_record: float
    admission_log_bytes: int  # what CloudWatch Logs ingests of one admission (rie.FunctionBundle.ingested_log_bytes)
    # The batch route (POST /v1/runs, SPAWNS_MEDIA_TYPE) and the relay's batch path: the admission's duration over a
    # full batch's spawns, the relay's over its records, and what CloudWatch Logs ingests of a spawn's audit line
    # and of the batch's one EMF line, counted as admission_log_bytes is.
    batch_admission_ms_a_spawn: float
    batch_relay_ms_a_record: float
    spawn_log_bytes: int
    batch_emf_log_bytes: int
    # What CloudWatch Logs ingests of the relay's own lines an invocation at INFO, its one EMF line (a record's
    # "dispatch relayed" line is DEBUG), counted as admission_log_bytes is; Lambda's START, END and REPORT lines
    # are billed beside it (PLATFORM_LOG_BYTES: the relay's log group is in the text format, no level filtered).
    relay_emf_log_bytes: int
    # The outbox's own lines an invocation at INFO, counted likewise: its "events published" line, and an EMF line a
    # tenant of the batch (text format too: Lambda's lines beside them).
    outbox_log_bytes: int
    outbox_emf_log_bytes: int


# Lambda's own lines of an invocation of a function logging in the text format (the relays'): "three minimal log
# statements generated per invocation (START, END and REPORT)"
# (https://docs.aws.amazon.com/lambda/latest/operatorguide/log-structure.html), in the format
# https://docs.aws.amazon.com/lambda/latest/dg/ruby-logging.html shows: a request id, a published version (the alias
# `live`'s), a warm invocation's figures. Each is a log event: its UTF-8 bytes and LOG_EVENT_OVERHEAD_BYTES.
_REQUEST_ID = "8f5e2b4c-3a1d-4e6f-9b7a-0c2d4e6f8a1b"
PLATFORM_LINES = (
    f"START RequestId: {_REQUEST_ID} Version: 12\n",
    f"END RequestId: {_REQUEST_ID}\n",
    f"REPORT RequestId: {_REQUEST_ID}\tDuration: 519.43 ms\tBilled Duration: 520 ms\tMemory Size: 512 MB\t"
    "Max Memory Used: 98 MB\t\n",
)
# With active tracing the REPORT event goes on with the trace's line.
XRAY_REPORT_BYTES = len("XRAY TraceId: 1-5e34a614-10bd4cf1f1fb44f07bc535a1\tSegmentId: 07f5bd3e2d1f6f85\tSampled: true")
PLATFORM_LOG_BYTES = sum(len(line.encode()) + LOG_EVENT_OVERHEAD_BYTES for line in PLATFORM_LINES)
RELAY_EMF_LOG_BYTES = 555
OUTBOX_LOG_BYTES = 522
OUTBOX_EMF_LOG_BYTES = 355


# `make bench` on the shared 2-core machine (load average 1-3), 2026-12-01: the admission function of the built
# bundle under the RIE (median warm REPORT Duration), the relay and outbox handlers in-process at the template's
# batch sizes (the relay waiting on a local `poimen dev` API, 16 calls in flight). The log bytes, 2026-12-03: one
# warm admission's one EMF line, as CloudWatch Logs counts it (tests/integration/test_rie.py, a 14-character
# tenant and a 6-character dispatch key; 1,101 before, with its JSON line and START/END/REPORT). The batch route's,
# 2026-12-03 (load average 3-7), medians of three `benchmarks.relay_bench` runs: its ms a spawn, POSTs of 100
# spawns one at a time to `poimen dev` (the request's time over its spawns, as Lambda bills the invocation), the
# relay's batch path ms a record at RelayBatchSize; a spawn's audit line and the batch's EMF line as the handler
# writes them (tests/unit/test_admission_log.py, the ids above, the template's namespace). Local
# stand-ins (moto, a local broker, a local API) are not DynamoDB, MSK or API Gateway, and the machine is not
# Lambda's: substitute CloudWatch's Duration of a deployed stack; the model is linear in each.
MEASURED = Durations(
    admission_ms=11.5,
    relay_ms_a_record=11.26,
    outbox_ms_a_record=0.175,
    admission_log_bytes=427,
    batch_admission_ms_a_spawn=4.59,
    batch_relay_ms_a_record=5.19,
    spawn_log_bytes=219,
    batch_emf_log_bytes=279,
    # 2026-12-06: the relay's EMF line for an invocation of MEASURED_IDS' tenant, inbox lag measured
    # (tests/unit/test_cost_model.py).
    relay_emf_log_bytes=RELAY_EMF_LOG_BYTES,
    # 2026-12-06: the outbox's lines for a batch of one tenant of MEASURED_IDS' (tests/unit/test_cost_model.py).
    outbox_log_bytes=OUTBOX_LOG_BYTES,
    outbox_emf_log_bytes=OUTBOX_EMF_LOG_BYTES,
)


@dataclass(frozen=True)
class Ids:
    """A spawn's tenant id and dispatch key, which the admission's log line carries as written: Powertools writes
    the EMF line with json.dumps' ASCII escapes, so an ASCII character takes a byte (`"` and `\\` two), any
    other six (`\\u00e9`), one beyond the BMP twelve (a surrogate pair)."""

    label: str
    tenant_id: str
    dispatch_key: str

    @property
    def line_bytes(self) -> int:
        """What the two take in the line, quotes left out."""
        return sum(len(json.dumps(text)) - 2 for text in (self.tenant_id, self.dispatch_key))


# Issue 35's goal for an admission's logs.
GOAL_LOG_BYTES = 450
# The ids of the line MEASURED counts (tests/integration/test_rie.py: its tenant is named for the test).
MEASURED_IDS = Ids("as measured: a 14-character tenant, a 6-character key", "t" * 14, "k-warm")
# What the line takes with other ids: the README's, a key as long as a UUID, and the longest the API accepts
# (poimen.wire: a tenant of 63 characters, a key of 255 characters that are no control character).
ID_SIZES = [
    Ids("README's `acme` and `k-1`", "acme", "k-1"),
    MEASURED_IDS,
    Ids("a 14-character tenant, a 36-character key (a UUID)", "t" * 14, "0" * 36),
    Ids("the longest: a 63-character tenant, a 255-character ASCII key", "t" * 63, "k" * 255),
    Ids("the longest, the key's characters beyond the BMP (emoji)", "t" * 63, "\U0001f600" * 255),
]


def admission_log_bytes(measured: Durations, ids: Ids) -> int:
    """What CloudWatch Logs ingests of an admission spawned with `ids`: the measured line, the difference in ids."""
    return admission_log_bytes_of(measured.admission_log_bytes, ids)


def admission_log_bytes_of(measured_bytes: int, ids: Ids) -> int:
    """A line measured at `measured_bytes` with MEASURED_IDS, written with `ids` instead."""
    return measured_bytes + ids.line_bytes - MEASURED_IDS.line_bytes


def batch_log_bytes(measured: Durations, ids: Ids, spawns: int) -> int:
    """What CloudWatch Logs ingests of a batch of `spawns` spawned with `ids`: each spawn's audit line (message,
    tenant_id, dispatch_key, run_id, status, correlation_id, latency_ms), the measured line and the difference in
    ids, and the batch's one EMF line (its tenant, not its keys)."""
    tenant = len(json.dumps(ids.tenant_id)) - len(json.dumps(MEASURED_IDS.tenant_id))
    return spawns * admission_log_bytes_of(measured.spawn_log_bytes, ids) + measured.batch_emf_log_bytes + tenant


# X-Ray under Lambda's tracing (LAMBDA_XRAY). Active: Lambda records the first request each second and 5 % of the
# others, a rate no sampling rule changes. PassThrough: only requests that arrive sampled; an HTTP API does not
# trace (it has no X-Ray, HTTP_API_VS_REST), nor do event source mappings: none.
RESERVOIR_A_SECOND = 1
SAMPLED_BEYOND = 0.05
SECONDS_A_MONTH = HOURS_A_MONTH * 3600
# A DynamoDB stream's records wait for Lambda's next poll of the shard, four a second (LAMBDA_DDB), before their
# batch is invoked: the outbox's batching window of 0 gathers what arrives in that quarter-second.
STREAM_POLL_SECONDS = 0.25


def traced_share(tracing: str, invocations_a_second: float) -> float:
    """The share of a function's invocations X-Ray records, arriving at random (Poisson) at `invocations_a_second`:
    Active, the first of each second that has one, and 5 % of the others; at a million a month (0.38 a second)
    that is 84 %, not 5 %."""
    if tracing != "Active" or invocations_a_second <= 0:
        return 0.0
    firsts = RESERVOIR_A_SECOND * (1 - math.exp(-invocations_a_second / RESERVOIR_A_SECOND))
    return (firsts + SAMPLED_BEYOND * (invocations_a_second - firsts)) / invocations_a_second


def records_a_batch(batch_size: int, records_a_second: float, gathering_seconds: float) -> float:
    """The records an invocation carries when they arrive at `records_a_second`: the first opens the batch, and
    those that arrive while it gathers (the batching window) join it, up to the batch size."""
    return min(float(batch_size), 1 + records_a_second * gathering_seconds)


@dataclass(frozen=True)
class Load:
    """The traffic a million admissions are priced at: how many a month, spread evenly over the tenants (each with
    its one mapping). Batches fill, and X-Ray samples, by the rate."""

    admissions: int = MILLION
    tenants: int = 100

    @property
    def a_second(self) -> float:
        return self.admissions / SECONDS_A_MONTH


# The per-million table's traffic: a million admissions a month over a full poller group's tenants.
REFERENCE_LOAD = Load()


LAMBDA_DEFAULT_TRACING = "PassThrough"


@dataclass(frozen=True)
class Settings:
    """What template.yaml configures that the cost depends on (its defaults)."""

    memory_mb: dict[str, int]
    architecture: dict[str, str]
    minimum_pollers: int
    maximum_pollers: int
    relay_batch_size: int
    outbox_batch_size: int
    partitions: int
    relay_batching_window_seconds: float
    outbox_batching_window_seconds: float
    tracing: dict[str, str]  # each function's, PassThrough or Active

    @classmethod
    def of(cls, template: Template) -> Settings:
        functions = ("AdmissionFunction", "InboxRelayFunction", "OutboxRelayFunction")
        globals_ = template.document.get("Globals", {}).get("Function", {})
        parameters = template.document["Parameters"]
        global_tracing = globals_.get("Tracing", LAMBDA_DEFAULT_TRACING)
        return cls(
            memory_mb={
                name: int(template.properties(name).get("MemorySize", globals_["MemorySize"])) for name in functions
            },
            architecture={
                name: template.properties(name).get("Architectures", globals_["Architectures"])[0] for name in functions
            },
            minimum_pollers=int(parameters["RelayMinimumPollers"]["Default"]),
            maximum_pollers=int(parameters["RelayMaximumPollers"]["Default"]),
            relay_batch_size=int(parameters["RelayBatchSize"]["Default"]),
            outbox_batch_size=int(template.properties("OutboxRelaySource")["BatchSize"]),
            partitions=int(inspect.signature(ensure_topics).parameters["partitions"].default),
            relay_batching_window_seconds=float(parameters["RelayBatchingWindowSeconds"]["Default"]),
            outbox_batching_window_seconds=float(
                template.properties("OutboxRelaySource").get("MaximumBatchingWindowInSeconds", 0)
            ),
            tracing={
                # Lambda's default, PassThrough, where neither the function nor Globals sets it
                name: str(template.evaluate(template.properties(name).get("Tracing", global_tracing)))
                for name in functions
            },
        )


@dataclass(frozen=True)
class Line:
    item: str
    quantity: float
    unit: str
    price: str  # a key of PRICES
    note: str = ""

    @property
    def usd(self) -> float:
        return self.quantity * PRICES[self.price].each


def _gb_seconds(settings: Settings, function: str, ms: float) -> float:
    if settings.architecture[function] != "arm64":
        raise ValueError(f"{function} is {settings.architecture[function]}: the model prices Arm (arm64) only")
    return settings.memory_mb[function] / 1024 * math.ceil(ms) / 1000  # Lambda bills whole milliseconds


@dataclass(frozen=True)
class Deployment:
    """What the bill is for: tenants split evenly into cells (stacks) on one MSK cluster, each tenant with one
    mapping and one more for each peer cluster alias, its mappings grouped (the default) or not."""

    tenants: int
    aliases: int = 0
    cells: int = 1
    grouped: bool = True
    mode: str = "provisioned"

    @property
    def mappings(self) -> int:
        return self.tenants * (1 + self.aliases)

    def cell_tenants(self) -> list[list[str]]:
        """Each cell's tenants (their ids made up), as evenly as they split; a cell over a stack's maximum is a
        ValueError, as make build refuses it."""
        ids = [f"t{n}" for n in range(self.tenants)]
        size = -(-self.tenants // self.cells)
        if size > max_tenants(self.aliases):
            raise ValueError(
                f"{self.tenants} tenants in {self.cells} cell(s) is {size} a cell, and a stack serves at most"
                f" {max_tenants(self.aliases)} with {self.aliases} peer cluster alias(es): give more cells"
            )
        return [ids[n * size : (n + 1) * size] for n in range(self.cells) if ids[n * size : (n + 1) * size]]


@dataclass(frozen=True)
class BilledGroup:
    """A poller group as Lambda bills it before any traffic: its mappings and their MinimumPollers."""

    mappings: int = 0
    pollers: int = 0

    @property
    def epus(self) -> int:
        return math.ceil(self.pollers / POLLERS_A_EPU)  # a group is billed whole EPUs


def poller_groups(settings: Settings, deployment: Deployment) -> dict[str, BilledGroup]:
    """Each poller group of the deployment, as make deploy assigns the groups (poimen_tools.deploy_check: by
    MaximumPollers, which the groups' limits count), one cell after the other on the cluster."""
    mappings_a_tenant = 1 + deployment.aliases
    taken: dict[str, GroupLoad] = {}
    billed: dict[str, BilledGroup] = {}
    for tenants in deployment.cell_tenants():
        groups = assign_poller_groups(tenants, mappings_a_tenant, settings.maximum_pollers, taken, {})
        if len(groups) < len(tenants):
            raise ValueError(
                f"{deployment.tenants} tenants in {deployment.cells} cell(s) on one cluster: make deploy would find no"
                " poller group with room for every tenant (36 groups of 100 mappings a cluster): serve some from"
                " another cluster"
            )
        for group in groups.values():
            taken[group] = taken.get(group, GroupLoad()).plus(
                mappings_a_tenant, mappings_a_tenant * settings.maximum_pollers
            )
            before = billed.get(group, BilledGroup())
            billed[group] = BilledGroup(
                before.mappings + mappings_a_tenant, before.pollers + mappings_a_tenant * settings.minimum_pollers
            )
    return billed


def poller_lines(settings: Settings, deployment: Deployment) -> list[Line]:
    """The event pollers of every mapping of the deployment, a month: grouped, each group billed whole EPUs of 10
    pollers (its MinimumPollers summed, rounded up); ungrouped, each mapping its own EPUs."""
    if deployment.mode == "on-demand":
        # Nothing of their own: Lambda bills EPUs in provisioned mode only ("Using provisioned mode incurs
        # additional costs", KAFKA_SCALING_MODES; LAMBDA_PRICING prices EPU-hours for provisioned mode): an
        # on-demand mapping's records cost the invocations and duration of per_million_lines.
        return []
    each = f"{deployment.mappings:,} mapping{'s' if deployment.mappings > 1 else ''} x {settings.minimum_pollers}"
    if not deployment.grouped:
        epus = deployment.mappings * math.ceil(settings.minimum_pollers / POLLERS_A_EPU)
        item = f"event pollers ({each} RelayMinimumPollers, ungrouped: an EPU a mapping)"
    else:
        loads = poller_groups(settings, deployment)
        epus = sum(group.epus for group in loads.values())
        groups = f"{len(loads)} poller group{'s' if len(loads) > 1 else ''}"
        item = f"event pollers ({each} RelayMinimumPollers in {groups}: {epus} EPUs, whole ones a group)"
    return [Line(item, epus * HOURS_A_MONTH, "EPU-hours", "epu_hour")]


def fixed_lines(settings: Settings, deployment: Deployment) -> list[Line]:
    """The deployment's monthly cost before any admission: its event source mappings' pollers, and the share of
    the brokers its tenants' partition replicas take."""
    replicas = deployment.tenants * (TOPICS_A_TENANT + deployment.aliases) * settings.partitions * REPLICATION_FACTOR
    return [
        *poller_lines(settings, deployment),
        Line(
            f"MSK brokers: {replicas:,} partition replicas of the {REPLICAS_A_BROKER:,} a broker holds",
            replicas / REPLICAS_A_BROKER * HOURS_A_MONTH,
            "broker-hours",
            "msk_broker_hour",
        ),
    ]


def scaled(lines: list[Line], factor: float) -> list[Line]:
    """`lines` for `factor` times their quantity (a tenant's share: 1 / tenants; M admissions: M / a million)."""
    return [Line(line.item, line.quantity * factor, line.unit, line.price, line.note) for line in lines]


def a_tenant(settings: Settings, deployment: Deployment) -> float:
    """The deployment's fixed cost a tenant a month, USD."""
    return sum(line.usd for line in fixed_lines(settings, deployment)) / deployment.tenants


def per_million_lines(settings: Settings, measured: Durations, load: Load = REFERENCE_LOAD) -> list[Line]:
    """A million admissions through the API, each relayed from Kafka and published as its event, at `load`: the
    relay's batches gather a mapping's records for its batching window, the outbox's a stream poll's, so a sparse
    topic invokes each function about once a record; the measured ms a record (at full batches) is kept."""
    relay_records = records_a_batch(
        settings.relay_batch_size, load.a_second / load.tenants, settings.relay_batching_window_seconds
    )
    outbox_records = records_a_batch(
        settings.outbox_batch_size,
        load.a_second,
        max(settings.outbox_batching_window_seconds, STREAM_POLL_SECONDS),
    )
    relay_invocations = MILLION / relay_records
    outbox_invocations = MILLION / outbox_records
    relay_ms = measured.relay_ms_a_record * relay_records
    outbox_ms = measured.outbox_ms_a_record * outbox_records

    def traces(function: str, invocations: float) -> float:
        """A million admissions' traces of `function`, invoked `invocations` times for them."""
        return invocations * traced_share(settings.tracing[function], load.a_second * invocations / MILLION)

    return [
        Line("HTTP API requests", MILLION, "requests", "http_api_request"),
        Line("admission: invocations", MILLION, "requests", "lambda_request"),
        Line(
            f"admission: {math.ceil(measured.admission_ms)} ms at {settings.memory_mb['AdmissionFunction']} MB",
            MILLION * _gb_seconds(settings, "AdmissionFunction", measured.admission_ms),
            "GB-seconds",
            "lambda_gb_second_arm",
        ),
        Line("DynamoDB: one conditional PutItem (an item under 1 KB)", MILLION, "write units", "write_request_unit"),
        Line(
            f"inbox relay: invocations (batches of {relay_records:,.1f} of {settings.relay_batch_size})",
            relay_invocations,
            "requests",
            "lambda_request",
        ),
        Line(
            f"inbox relay: {measured.relay_ms_a_record:g} ms a record at {settings.memory_mb['InboxRelayFunction']} MB",
            relay_invocations * _gb_seconds(settings, "InboxRelayFunction", relay_ms),
            "GB-seconds",
            "lambda_gb_second_arm",
        ),
        Line(
            f"outbox: invocations (batches of {outbox_records:,.1f} of {settings.outbox_batch_size})",
            outbox_invocations,
            "requests",
            "lambda_request",
        ),
        Line(
            f"outbox: {measured.outbox_ms_a_record:g} ms a record at {settings.memory_mb['OutboxRelayFunction']} MB",
            outbox_invocations * _gb_seconds(settings, "OutboxRelayFunction", outbox_ms),
            "GB-seconds",
            "lambda_gb_second_arm",
        ),
        Line(
            f"admission's logs: {measured.admission_log_bytes:,} bytes each",
            MILLION * measured.admission_log_bytes / 1e9,
            "GB",
            "log_gb",
        ),
        _relay_logs(settings, measured, relay_invocations),
        _outbox_logs(settings, measured, outbox_invocations, outbox_records, load.tenants),
        Line(
            f"X-Ray: admissions traced (AdmissionTracing {settings.tracing['AdmissionFunction']})",
            traces("AdmissionFunction", MILLION),
            "traces",
            "trace",
        ),
        Line(
            f"inbox relay: invocations traced (RelayTracing {settings.tracing['InboxRelayFunction']})",
            traces("InboxRelayFunction", relay_invocations),
            "traces",
            "trace",
        ),
        Line(
            f"outbox: invocations traced (RelayTracing {settings.tracing['OutboxRelayFunction']})",
            traces("OutboxRelayFunction", outbox_invocations),
            "traces",
            "trace",
        ),
    ]


# The load a million relayed spawns are priced at on the batch route: one tenant's dispatch topic at RelayBatchSize
# records a second fills the relay's batches (its batching window is a second), each POSTed as full batches.
FULL_BATCH_LOAD = Load(100 * SECONDS_A_MONTH, 1)
# HTTP APIs are metered in 512 KB increments (API_GATEWAY_PRICING): a POST of a batch within 512 KB is one request.
METERED_REQUEST_BYTES = 512 * 1024


def relayed_lines(
    settings: Settings, measured: Durations, spawns_a_post: int = MAX_BATCH_SPAWNS, load: Load = FULL_BATCH_LOAD
) -> list[Line]:
    """A million spawns relayed from Kafka on the batch route, `spawns_a_post` spawns a POST /v1/runs (the relay's
    batch path), each admitted and published as its event, at `load`: an HTTP API request and an admission
    invocation a POST, the admission's measured ms a spawn, a PutItem a spawn, the relay's invocations and its
    measured ms a record on the batch path, the outbox as per_million_lines prices it, and the logs: a spawn's
    audit line each and the batch's one EMF line. `spawns_a_post` 1 is the per-record path: per_million_lines."""
    if spawns_a_post == 1:
        return per_million_lines(settings, measured, load)
    if not 1 < spawns_a_post <= MAX_BATCH_SPAWNS:
        raise ValueError(f"{spawns_a_post} spawns a POST: a batch holds 1 to {MAX_BATCH_SPAWNS}")
    posts = MILLION / spawns_a_post
    single = per_million_lines(settings, measured, load)
    relay_records = records_a_batch(
        settings.relay_batch_size, load.a_second / load.tenants, settings.relay_batching_window_seconds
    )
    relay_invocations = MILLION / relay_records
    admission_ms = measured.batch_admission_ms_a_spawn * spawns_a_post
    log_bytes = batch_log_bytes(measured, MEASURED_IDS, spawns_a_post)
    outbox = [line for line in single if line.item.startswith("outbox")]
    return [
        Line(
            f"HTTP API requests: a POST of {spawns_a_post} spawns (within 512 KB: one metered request)",
            posts,
            "requests",
            "http_api_request",
        ),
        Line("admission: invocations (a POST each)", posts, "requests", "lambda_request"),
        Line(
            f"admission: {measured.batch_admission_ms_a_spawn:g} ms a spawn, {math.ceil(admission_ms)} ms a POST at "
            f"{settings.memory_mb['AdmissionFunction']} MB",
            posts * _gb_seconds(settings, "AdmissionFunction", admission_ms),
            "GB-seconds",
            "lambda_gb_second_arm",
        ),
        Line(
            "DynamoDB: a conditional PutItem a spawn (an item under 1 KB)", MILLION, "write units", "write_request_unit"
        ),
        Line(
            f"inbox relay: invocations (batches of {relay_records:,.1f} of {settings.relay_batch_size})",
            relay_invocations,
            "requests",
            "lambda_request",
        ),
        Line(
            f"inbox relay: {measured.batch_relay_ms_a_record:g} ms a record (batch path) at "
            f"{settings.memory_mb['InboxRelayFunction']} MB",
            relay_invocations
            * _gb_seconds(settings, "InboxRelayFunction", measured.batch_relay_ms_a_record * relay_records),
            "GB-seconds",
            "lambda_gb_second_arm",
        ),
        *[line for line in outbox if line.price != "trace"],
        Line(
            f"admission's logs: {spawns_a_post} audit lines of {measured.spawn_log_bytes} bytes and an EMF line of "
            f"{measured.batch_emf_log_bytes} a POST",
            posts * log_bytes / 1e9,
            "GB",
            "log_gb",
        ),
        _relay_logs(settings, measured, relay_invocations),
        Line(
            f"X-Ray: admissions traced (AdmissionTracing {settings.tracing['AdmissionFunction']})",
            posts * traced_share(settings.tracing["AdmissionFunction"], load.a_second / spawns_a_post),
            "traces",
            "trace",
        ),
        *[line for line in single if line.price == "trace" and not line.item.startswith("X-Ray: admissions")],
    ]


def _relay_logs(settings: Settings, measured: Durations, invocations: float) -> Line:
    """What the relay's log group ingests of `invocations`, whichever path relays their records: its EMF line and
    Lambda's START, END and REPORT lines each (the REPORT line naming the trace under active tracing)."""
    traced = XRAY_REPORT_BYTES if settings.tracing["InboxRelayFunction"] == "Active" else 0
    each = measured.relay_emf_log_bytes + PLATFORM_LOG_BYTES + traced
    return Line(f"inbox relay's logs: {each:,} bytes an invocation", invocations * each / 1e9, "GB", "log_gb")


def _outbox_logs(settings: Settings, measured: Durations, invocations: float, records: float, tenants: int) -> Line:
    """What the outbox's log group ingests of `invocations` of `records` each: its "events published" line, an EMF
    line for each tenant among the records (as many as `tenants` spread them over, expected), and Lambda's START,
    END and REPORT lines (the REPORT line naming the trace under active tracing)."""
    emf_lines = tenants * (1 - (1 - 1 / tenants) ** records)
    traced = XRAY_REPORT_BYTES if settings.tracing["OutboxRelayFunction"] == "Active" else 0
    each = PLATFORM_LOG_BYTES + traced + measured.outbox_log_bytes + emf_lines * measured.outbox_emf_log_bytes
    return Line(
        f"outbox's logs: {each:,.0f} bytes an invocation ({emf_lines:,.1f} EMF lines)",
        invocations * each / 1e9,
        "GB",
        "log_gb",
    )


def failure_lines() -> list[Line]:
    """What failures add: none of it is paid while everything is admitted."""
    return [
        Line("dead letters (one SendMessage each; a retried send is one more)", MILLION, "requests", "sqs_request"),
        Line("parked batches (one PutObject each into FailedBatchesBucket)", MILLION, "requests", "s3_put"),
    ]


def _quantity(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 or value == int(value) else f"{value:,.2f}"


def _table(lines: list[Line], quantity_header: str) -> list[str]:
    rows = [f"| item | {quantity_header} | price | USD |", "| --- | ---: | --- | ---: |"]
    for line in lines:
        rows.append(
            f"| {line.item} | {_quantity(line.quantity)} {line.unit} | {PRICES[line.price]} | {line.usd:,.3f} |"
        )
    rows.append(f"| **total** | | | **{sum(line.usd for line in lines):,.2f}** |")
    return rows


# The sizes docs/operations.md#what-a-tenant-costs prices: one tenant, a full poller group, one mapping into the
# next, each stack's maximum by peer aliases, and two cells at the maximum on one cluster.
SIZES = [
    Deployment(1),
    Deployment(100),
    Deployment(101),
    Deployment(max_tenants(0)),
    Deployment(max_tenants(1), aliases=1),
    Deployment(max_tenants(2), aliases=2),
    Deployment(2 * max_tenants(0), cells=2),
]


def _sizes_table(settings: Settings) -> list[str]:
    rows = [
        "| tenants | peer aliases | cells | poller groups | EPUs | a tenant, grouped | a tenant, ungrouped |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for size in SIZES:
        loads = poller_groups(settings, size)
        epus = sum(group.epus for group in loads.values())
        ungrouped = Deployment(size.tenants, size.aliases, size.cells, grouped=False)
        rows.append(
            f"| {size.tenants:,} | {size.aliases} | {size.cells} | {len(loads)} | {epus} |"
            f" {a_tenant(settings, size):,.2f} | {a_tenant(settings, ungrouped):,.2f} |"
        )
    return rows


def ids_budget(measured: Durations, log_bytes: int) -> int:
    """The most bytes a tenant id and dispatch key may take together in the admission's line for an admission to
    log at most `log_bytes`."""
    return MEASURED_IDS.line_bytes + log_bytes - measured.admission_log_bytes


def _ids_table(measured: Durations) -> list[str]:
    rows = [
        "| tenant id and dispatch key | log bytes an admission | the admission's logs, a million, USD |",
        "| --- | ---: | ---: |",
    ]
    for ids in ID_SIZES:
        log_bytes = admission_log_bytes(measured, ids)
        rows.append(f"| {ids.label} | {log_bytes:,} | {MILLION * log_bytes / 1e9 * PRICES['log_gb'].each:,.3f} |")
    return rows


# The traffic the by-traffic table prices a million admissions at: a month's admissions over the tenants, up to
# the rate at which a mapping fills its relay batches within the window (RelayBatchSize a second).
LOADS = [
    Load(MILLION, 1),
    REFERENCE_LOAD,
    Load(10 * MILLION, 100),
    Load(100 * MILLION, 100),
    Load(1000 * MILLION, 100),
    Load(100 * SECONDS_A_MONTH, 1),
]


def _loads_table(settings: Settings, measured: Durations) -> list[str]:
    rows = [
        "| admissions a month | tenants | a relay invocation's records | an outbox invocation's records "
        "| X-Ray, USD | a million admissions, USD |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for load in LOADS:
        lines = per_million_lines(settings, measured, load)
        relay = records_a_batch(
            settings.relay_batch_size, load.a_second / load.tenants, settings.relay_batching_window_seconds
        )
        outbox = records_a_batch(
            settings.outbox_batch_size, load.a_second, max(settings.outbox_batching_window_seconds, STREAM_POLL_SECONDS)
        )
        traces = sum(line.usd for line in lines if line.price == "trace")
        rows.append(
            f"| {load.admissions:,} | {load.tenants} | {relay:,.1f} | {outbox:,.1f} | {traces:,.2f} |"
            f" {sum(line.usd for line in lines):,.2f} |"
        )
    return rows


def _relayed_comparison(settings: Settings, measured: Durations) -> list[str]:
    """A million relayed spawns by spawns a POST, the per-record path (1) beside the batch route's."""
    rows = ["| spawns a POST /v1/runs | HTTP API requests | admission invocations | a million relayed spawns, USD |"]
    rows.append("| ---: | ---: | ---: | ---: |")
    for spawns in RELAYED_SPAWNS_A_POST:
        lines = relayed_lines(settings, measured, spawns)
        requests = sum(line.quantity for line in lines if line.price == "http_api_request")
        invocations = next(line.quantity for line in lines if line.item.startswith("admission: invocations"))
        rows.append(f"| {spawns} | {requests:,.0f} | {invocations:,.0f} | {sum(line.usd for line in lines):,.2f} |")
    return rows


# The spawns a POST the comparison prices: the per-record path, and batches of 10, 25 (a batch of 100 records over
# four partitions) and the most a batch holds.
RELAYED_SPAWNS_A_POST = (1, 10, 25, MAX_BATCH_SPAWNS)


def render(template: Template, measured: Durations = MEASURED) -> str:
    """The markdown tables of docs/operations.md#what-a-tenant-costs."""
    settings = Settings.of(template)
    full = Deployment(100)
    out = [
        f"Inputs from template.yaml: memory {settings.memory_mb['AdmissionFunction']} / "
        f"{settings.memory_mb['InboxRelayFunction']} / {settings.memory_mb['OutboxRelayFunction']} MB (admission, "
        f"inbox relay, outbox), {settings.architecture['AdmissionFunction']}, RelayMinimumPollers "
        f"{settings.minimum_pollers}, RelayBatchSize {settings.relay_batch_size}, outbox BatchSize "
        f"{settings.outbox_batch_size}; {settings.partitions} partitions a topic (`poimen topics ensure`), "
        f"replication factor {REPLICATION_FACTOR}. Durations measured: admission {measured.admission_ms:g} ms, "
        f"relay {measured.relay_ms_a_record:g} ms a record, outbox {measured.outbox_ms_a_record:g} ms a record, "
        f"{measured.admission_log_bytes:,} log bytes an admission; the batch route "
        f"{measured.batch_admission_ms_a_spawn:g}"
        f" ms a spawn, the relay's batch path {measured.batch_relay_ms_a_record:g} ms a record, "
        f"{measured.spawn_log_bytes} log bytes a spawn and {measured.batch_emf_log_bytes} a batch; the relay's EMF "
        f"line {measured.relay_emf_log_bytes} bytes an invocation, and the outbox's "
        f"{measured.outbox_log_bytes} and {measured.outbox_emf_log_bytes} a tenant of its batch, each beside Lambda's "
        f"START, END and REPORT lines ({PLATFORM_LOG_BYTES} bytes).",
        "",
        f"**Fixed, a tenant a month**, its mappings in [poller groups](#poller-groups) (the default), a tenant's "
        f"share of a full group ({full.tenants} tenants, no peer cluster alias; each alias adds one mapping and one "
        "replicated dispatch topic):",
        "",
        *_table(scaled(fixed_lines(settings, full), 1 / full.tenants), "a month"),
        "",
        "By size (USD a tenant a month; each poller group billed whole EPUs, so a group's last tenants cost most "
        "until it fills; two cells share the cluster's groups):",
        "",
        *_sizes_table(settings),
        "",
        "Ungrouped (`RELAY_POLLER_GROUPS=ungrouped`), each mapping on an EPU of its own:",
        "",
        *_table(fixed_lines(settings, Deployment(1, grouped=False)), "a month"),
        "",
        f"**A million admissions**, each relayed from its dispatch topic and published as its event, at "
        f"{REFERENCE_LOAD.admissions:,} a month over {REFERENCE_LOAD.tenants} tenants:",
        "",
        *_table(per_million_lines(settings, measured), "a million admissions"),
        "",
        "By traffic (a batch gathers what arrives within the relay's batching window, or before the next poll of "
        "the stream; Lambda's active tracing records the first invocation of each second and 5 % of the others):",
        "",
        *_loads_table(settings, measured),
        "",
        "The admission's log line carries its tenant id and dispatch key as written (`\\u` escapes beyond ASCII), "
        f"so its bytes depend on them; the tables above are for a {len(MEASURED_IDS.tenant_id)}-character tenant "
        f"and a {len(MEASURED_IDS.dispatch_key)}-character key. Issue 35's goal of {GOAL_LOG_BYTES} log bytes an "
        f"admission holds while the two take at most {ids_budget(measured, GOAL_LOG_BYTES)} bytes together:",
        "",
        *_ids_table(measured),
        "",
        f"**A million relayed spawns on the batch route**: each record of a dispatch topic POSTed by the relay in a "
        f"batch of {MAX_BATCH_SPAWNS} spawns (the relay's batch path: a call a partition's chunk of its batch), at "
        f"{FULL_BATCH_LOAD.a_second:,.0f} records a second on one tenant's topic, which fills the relay's batches:",
        "",
        *_table(relayed_lines(settings, measured), "a million relayed spawns"),
        "",
        *_relayed_comparison(settings, measured),
        "",
        "**Only on failure**, a million of each:",
        "",
        *_table(failure_lines(), "a million"),
    ]
    return "\n".join(out)


def bill(settings: Settings, deployment: Deployment, admissions: int, measured: Durations = MEASURED) -> str:
    """The deployment's monthly bill by line: fixed, then `admissions` admissions."""
    fixed = fixed_lines(settings, deployment)
    variable = scaled(per_million_lines(settings, measured, Load(admissions, deployment.tenants)), admissions / MILLION)
    total = sum(line.usd for line in fixed + variable)
    grouping = "" if deployment.mode == "on-demand" else (", grouped" if deployment.grouped else ", ungrouped")
    return "\n".join(
        [
            f"{deployment.tenants:,} tenants, {deployment.aliases} peer cluster alias(es), {deployment.cells} cell(s),"
            f" {deployment.mode} event pollers{grouping}, {admissions:,} admissions a month:",
            "",
            "**Fixed**",
            "",
            *_table(fixed, "a month"),
            "",
            f"**Variable**, {admissions:,} admissions",
            "",
            *_table(variable, "a month"),
            "",
            f"**Total**: {total:,.2f} USD a month, {total / deployment.tenants:,.2f} a tenant",
        ]
    )


def _nonsense(options: argparse.Namespace) -> str | None:
    """What no deployment has among the tool's options (one line naming what to give), or None."""
    for option in ("tenants", "cells"):
        if getattr(options, option) < 1:
            return f"--{option} {getattr(options, option)}: give 1 or more"
    if options.cells > options.tenants:
        return f"{options.cells} cells for {options.tenants} tenants: a cell serves at least one tenant (fewer cells)"
    spawns = options.spawns_a_post
    if spawns is not None and not 1 <= spawns <= MAX_BATCH_SPAWNS:
        return f"--spawns-a-post {spawns}: a POST /v1/runs carries 1 to {MAX_BATCH_SPAWNS} spawns"
    for option in (
        "admissions",
        "admission_ms",
        "relay_ms",
        "outbox_ms",
        "log_bytes",
        "batch_admission_ms",
        "batch_relay_ms",
    ):
        if getattr(options, option) < 0:
            return f"--{option.replace('_', '-')} {getattr(options, option):g}: give 0 or more"
    if options.ungrouped and options.mode != MODES[0]:
        return f"--ungrouped is provisioned mode's opt-out (RELAY_POLLER_GROUPS=ungrouped), not --mode {options.mode}'s"
    return None


def main(arguments: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tables", action="store_true", help="print docs/operations.md's tables instead of a bill")
    parser.add_argument("--tenants", type=int, default=1, help="tenants in all (split evenly into the cells)")
    parser.add_argument("--aliases", type=int, choices=(0, 1, 2), default=0, help="peer cluster aliases")
    parser.add_argument("--cells", type=int, default=1, help="stacks on the one MSK cluster")
    parser.add_argument("--admissions", type=int, default=MILLION, help="admissions a month")
    parser.add_argument("--mode", choices=MODES, default=MODES[0], help="the inbox mappings' event pollers")
    parser.add_argument("--ungrouped", action="store_true", help="provisioned, RELAY_POLLER_GROUPS=ungrouped")
    parser.add_argument("--admission-ms", type=float, default=MEASURED.admission_ms)
    parser.add_argument("--relay-ms", type=float, default=MEASURED.relay_ms_a_record, help="ms a relayed record")
    parser.add_argument("--outbox-ms", type=float, default=MEASURED.outbox_ms_a_record, help="ms a published record")
    parser.add_argument("--log-bytes", type=int, default=MEASURED.admission_log_bytes, help="log bytes an admission")
    parser.add_argument(
        "--spawns-a-post",
        type=int,
        help=f"print a million relayed spawns, this many a POST /v1/runs (1: the per-record path; {MAX_BATCH_SPAWNS}: "
        "the batch route's most), instead of a bill",
    )
    parser.add_argument(
        "--batch-admission-ms", type=float, default=MEASURED.batch_admission_ms_a_spawn, help="ms a spawn of a batch"
    )
    parser.add_argument(
        "--batch-relay-ms", type=float, default=MEASURED.batch_relay_ms_a_record, help="ms a record, batch path"
    )
    options = parser.parse_args(arguments)
    nonsense = _nonsense(options)
    if nonsense is not None:
        parser.exit(2, f"{parser.prog}: {nonsense}\n")
    measured = dataclasses.replace(
        MEASURED,
        admission_ms=options.admission_ms,
        relay_ms_a_record=options.relay_ms,
        outbox_ms_a_record=options.outbox_ms,
        admission_log_bytes=options.log_bytes,
        batch_admission_ms_a_spawn=options.batch_admission_ms,
        batch_relay_ms_a_record=options.batch_relay_ms,
    )
    template = Template(REPO / "template.yaml")
    if options.tables:
        print(render(template, measured))
        return
    if options.spawns_a_post is not None:
        lines = relayed_lines(Settings.of(template), measured, options.spawns_a_post)
        print(f"A million relayed spawns, {options.spawns_a_post} a POST /v1/runs:\n")
        print("\n".join(_table(lines, "a million relayed spawns")))
        return
    deployment = Deployment(options.tenants, options.aliases, options.cells, not options.ungrouped, options.mode)
    try:
        print(bill(Settings.of(template), deployment, options.admissions, measured))
    except ValueError as error:
        parser.exit(2, f"{parser.prog}: {error}\n")


if __name__ == "__main__":
    main()
