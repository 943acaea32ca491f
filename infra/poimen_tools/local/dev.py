"""`poimen dev`: the admission API of template.yaml on loopback, against an embedded moto server, and
a local Kafka broker whose dispatch topics feed the relay handler through a local MSK event source; it
serves the tenants it is given (the template's Tenants), as a deployed stack does."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import boto3
import yaml

from poimen.config import Settings
from poimen.kafka import dispatch_topics_pattern
from poimen.store import Store
from poimen_tools.local.devserver import ExecutionEnvironments, LineWriter, LocalApiServer, Route
from poimen_tools.local.event_source import (
    LocalMskEventSource,
    failed_batch_key,
    local_relay_group,
    relay_mapping_attempts,
)
from poimen_tools.local.kafka_broker import BrokerError, KafkaBroker
from poimen_tools.local.mapping import park_in_s3
from poimen_tools.local.moto import EmbeddedMoto
from poimen_tools.local.sigv4 import (
    DEV_ACCESS_KEY,
    DEV_SECRET_KEY,
    InvalidPrincipals,
    Principal,
    dev_principal,
    load_principals,
    verify,
)
from poimen_tools.local.stream_source import start_local_outbox
from poimen_tools.local.template import Template, default_template_path
from poimen_tools.topics import dispatch_retention_ms, ensure_topics

DEFAULT_PRINCIPAL = "arn:aws:iam::000000000000:user/poimen-dev"
ADMISSION_FUNCTION = "AdmissionFunction"
ADMISSION_TABLE = "AdmissionTable"
RELAY_DLQ = "RelayDeadLetterQueue"
RELAY_FUNCTION = "InboxRelayFunction"
RUN_RETENTION_PARAMETER = "RunRetentionDays"
EVENT_POLLERS_PARAMETER = "RelayEventPollers"
TENANTS_PARAMETER = "Tenants"
# The tenants `poimen dev` serves unless told otherwise: the README's session uses acme.
DEFAULT_TENANTS = ("acme",)
# What `poimen dev` serves from a template: these resources, of these types.
SERVED_RESOURCES = (
    (ADMISSION_FUNCTION, "AWS::Serverless::Function"),
    (ADMISSION_TABLE, "AWS::DynamoDB::Table"),
    (RELAY_DLQ, "AWS::SQS::Queue"),
    (RELAY_FUNCTION, "AWS::Serverless::Function"),
)


class InvalidTemplate(ValueError):
    """A file `poimen dev` cannot serve: not YAML, or not a template declaring SERVED_RESOURCES."""


@dataclass(frozen=True)
class DevOptions:
    host: str = "127.0.0.1"
    port: int = 8080
    # One endpoint per service, as the SDK's AWS_ENDPOINT_URL_<SERVICE>: a service given none is served
    # by an embedded moto server (started only if one is needed).
    dynamodb_endpoint: str | None = None
    sqs_endpoint: str | None = None
    s3_endpoint: str | None = None
    moto_port: int = 0
    table_name: str = "poimen-admission-local"
    principal: str = DEFAULT_PRINCIPAL
    # More principals (access key → secret, ARN, tenants); the dev key of `principal` is always there.
    principals_file: Path | None = None
    region: str = "us-east-1"
    # The Region of the table's replica the functions use (TABLE_REGION); None: `region`. Another Region
    # stands a shared table of a local AWS in for a global table that two `poimen dev`s replicate.
    table_region: str | None = None
    template_path: Path | None = None
    concurrency: int = 4
    dlq_name: str = "poimen-relay-dlq-local"
    # The event source's on-failure destination, as FailedBatchesBucket in template.yaml.
    failed_batches_bucket: str = "poimen-relay-failed-batches-local"
    # The outbox's event source's on-failure destination, as OutboxFailedBatchesBucket in template.yaml.
    outbox_failed_batches_bucket: str = "poimen-outbox-failed-batches-local"
    kafka: bool = True
    kafka_port: int = 9092
    kafka_bootstrap: str | None = None
    # The template's RunRetentionDays: the table's TTL, the functions' RUN_RETENTION_DAYS, the DLQ's
    # retention. None keeps runs forever (the template's default).
    run_retention_days: int | None = None
    # The template's Tenants: the tenants admission serves (any other is refused, as the deployed stack
    # refuses it), whose topics are created at start and whose dispatch topics the relay consumes.
    tenants: tuple[str, ...] = DEFAULT_TENANTS
    # The template's RelayEventPollers (provisioned, on-demand): how the local MSK mapping retries a failing batch
    # and whether it parks it, and the relay's RELAY_EVENT_POLLERS. None: the template's default.
    event_pollers: str | None = None

    @property
    def template_parameters(self) -> dict[str, str]:
        """The template parameters these options stand for, as a deploy would pass them."""
        days = self.run_retention_days
        given = {RUN_RETENTION_PARAMETER: "" if days is None else str(days), TENANTS_PARAMETER: ",".join(self.tenants)}
        return given if self.event_pollers is None else {**given, EVENT_POLLERS_PARAMETER: self.event_pollers}

    @property
    def table_home(self) -> str:
        """The Region whose table the functions use."""
        return self.table_region or self.region


@dataclass(frozen=True)
class Endpoints:
    dynamodb: str
    sqs: str
    s3: str

    def describe(self) -> str:
        """One line: the shared endpoint once, or each service's."""
        if self.dynamodb == self.sqs == self.s3:
            return f"Local AWS (DynamoDB, SQS, S3): {self.dynamodb}"
        return f"Local AWS: DynamoDB {self.dynamodb}  SQS {self.sqs}  S3 {self.s3}"


@dataclass(frozen=True)
class DevStack:
    server: LocalApiServer
    endpoints: Endpoints
    table_name: str
    table_region: str
    dlq_url: str
    kafka_bootstrap: str | None
    failed_batches_bucket: str | None
    outbox_failed_batches_bucket: str | None = None


@contextlib.contextmanager
def dev_stack(options: DevOptions) -> Iterator[DevStack]:
    """Local AWS, the table and DLQ as template.yaml declares them, and the API server, listening.

    The server listens only once every execution environment has imported the handler (and the local
    broker answers), so a connection is answered as soon as the caller runs `serve_forever`: nothing
    connects earlier to a server that cannot answer yet. Its port is bound first, so a taken port fails
    at once (PortInUse). It sets this process's AWS environment (region, endpoints, the function's
    variables), as the execution environments it starts inherit it.
    """
    template = load_template(options.template_path or default_template_path())
    principals = _principals(options)  # read before anything starts: a bad file ends it at once
    # This process's AWS identity is the documented dev key: moto takes any key, and the relay that
    # runs here signs its calls to the API with it, the one principal `poimen dev` always knows.
    os.environ["AWS_ACCESS_KEY_ID"] = DEV_ACCESS_KEY
    os.environ["AWS_SECRET_ACCESS_KEY"] = DEV_SECRET_KEY
    os.environ.pop("AWS_SESSION_TOKEN", None)
    os.environ["AWS_REGION"] = os.environ["AWS_DEFAULT_REGION"] = options.region
    with _local_aws(options) as endpoints:
        os.environ["AWS_ENDPOINT_URL_DYNAMODB"] = endpoints.dynamodb
        os.environ["AWS_ENDPOINT_URL_SQS"] = endpoints.sqs
        os.environ["AWS_ENDPOINT_URL_S3"] = endpoints.s3
        parameters = options.template_parameters
        table_region = options.table_home
        _prepare_table(template, options.table_name, principals.values(), parameters, region=table_region)
        queue = template.create_queue_request(RELAY_DLQ, options.dlq_name, parameters)
        dlq_url = boto3.client("sqs").create_queue(**queue)["QueueUrl"]
        # Admission's variables, in this process too (the outbox relay runs in it, beside them; its own are named
        # for it). Each function's execution environments get the function's own from the template, as Lambda
        # sets them, over this process's.
        admission_refs = {ADMISSION_TABLE: options.table_name, **parameters}
        os.environ.update(template.function_environment(ADMISSION_FUNCTION, admission_refs))
        os.environ["TABLE_REGION"] = table_region
        environments = ExecutionEnvironments(
            str(template.path), ADMISSION_FUNCTION, options.concurrency, refs=admission_refs
        )
        routes = [Route(method, path) for method, path in template.http_routes(ADMISSION_FUNCTION)]
        server = LocalApiServer(
            (options.host, options.port),
            environments,
            routes,
            lambda method, target, headers, body: (
                verify(principals, method, target, headers, body, region=options.region).arn
            ),
        )
        with contextlib.ExitStack() as cleanup:
            cleanup.callback(environments.close)
            cleanup.callback(server.server_close)
            environments.start()  # they import the handler while the broker starts
            bootstrap = bucket = None
            if options.kafka:
                bucket = _failed_batches_bucket(options.failed_batches_bucket)
                bootstrap = options.kafka_bootstrap or _start_broker(options.kafka_port, cleanup)
            if bootstrap is not None:
                create_tenant_topics(bootstrap, options.tenants, options.run_retention_days)
            environments.wait_ready()
            server.listen()
            outbox_bucket = None
            if bootstrap is not None and bucket is not None:
                _start_event_source(
                    template,
                    bootstrap,
                    server.url,
                    dlq_url,
                    bucket,
                    cleanup,
                    options.tenants,
                    options.table_name,
                    options.concurrency,
                    parameters,
                )
                outbox_bucket = _failed_batches_bucket(options.outbox_failed_batches_bucket)
                start_local_outbox(
                    template,
                    bootstrap,
                    endpoints.dynamodb,
                    options.table_name,
                    outbox_bucket,
                    cleanup,
                    table_region=table_region,
                    region=options.region,
                    keep_positions=options.dynamodb_endpoint is not None,  # the table outlives poimen dev
                )
            yield DevStack(
                server, endpoints, options.table_name, table_region, dlq_url, bootstrap, bucket, outbox_bucket
            )


def run_dev(options: DevOptions) -> int:
    """`poimen dev`: serve until Ctrl-C or SIGTERM, which stop it cleanly with one line, "Stopping."
    (a second one ends it at once). The banner prints once a request would be answered.

    Raises PortInUse if the API's port is taken, BrokerError if the local broker cannot start.
    """
    _stop_on_signals()
    # Whole lines only: the relay logs from this process into the stdout the environments share.
    sys.stdout = LineWriter(sys.stdout.fileno())
    try:
        with dev_stack(options) as stack:
            _announce(stack, options)
            stack.server.serve_forever()
    except KeyboardInterrupt:
        pass  # "Stopping." is printed when the signal comes, and the stack stopped on the way out
    return 0


def _stop_on_signals() -> None:
    """The first SIGINT or SIGTERM stops `poimen dev` (KeyboardInterrupt); a second, while it stops, ends
    it at once: its execution environments and broker die with it (see ExecutionEnvironments)."""
    stopping = False

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        if stopping:
            os._exit(128 + signum)
        stopping = True
        os.write(2, b"Stopping.\n")  # not print(): the signal may have interrupted a write to stderr
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)


def _announce(stack: DevStack, options: DevOptions) -> None:
    url = stack.server.url
    tenant = options.tenants[0]  # the one the examples below name
    print(f"Admission API: {url}", flush=True)
    table = stack.table_name if stack.table_region == options.region else f"{stack.table_name} ({stack.table_region})"
    print(f"{stack.endpoints.describe()}  table: {table}", flush=True)
    print(f"Relay dead-letter queue: {stack.dlq_url}", flush=True)
    print(
        f"Tenants: {','.join(options.tenants)}  (the template's Tenants, --tenants; any other is refused: 403 "
        "tenant-not-served)",
        flush=True,
    )
    if stack.kafka_bootstrap:
        print(f"Kafka bootstrap: {stack.kafka_bootstrap}  (relay consuming poimen.<tenant>.dispatch)", flush=True)
        print(
            f"Publish: poimen dispatch publish --bootstrap-servers {stack.kafka_bootstrap} --tenant {tenant} "
            "--workflow-ref wf/hello --input '{}' --dispatch-key k-2",
            flush=True,
        )
    if stack.outbox_failed_batches_bucket:
        print(
            f"Outbox relay: table stream -> poimen.<tenant>.events  (failed batches, S3: "
            f"{stack.outbox_failed_batches_bucket}; watch: poimen events tail --bootstrap-servers "
            f"{stack.kafka_bootstrap} --tenant {tenant})",
            flush=True,
        )
    if stack.failed_batches_bucket:
        print(f"Failed batches (S3): {stack.failed_batches_bucket}", flush=True)
        endpoints = stack.endpoints
        # One --aws-endpoint serves SQS and S3 alike; split, the SDK's variables name each.
        where = (
            f"--aws-endpoint {endpoints.sqs}"
            if endpoints.sqs == endpoints.s3
            else f"(with AWS_ENDPOINT_URL_SQS={endpoints.sqs} AWS_ENDPOINT_URL_S3={endpoints.s3})"
        )
        print(
            f"Dead letters: poimen dlq list --api-url {url} --queue-url {stack.dlq_url} "
            f"--bucket {stack.failed_batches_bucket} {where} --dev-key",
            flush=True,
        )
    print(f"Credentials (SigV4, execute-api): {DEV_ACCESS_KEY}:{DEV_SECRET_KEY}", flush=True)
    print(
        f"Try: curl -si --aws-sigv4 aws:amz:{options.region}:execute-api --user {DEV_ACCESS_KEY}:{DEV_SECRET_KEY} "
        f"-X POST {url}/v1/runs -H 'Content-Type: application/json' -H 'X-Poimen-Tenant: {tenant}' "
        '-d \'{"workflow_ref": "wf/hello", "input": {}, "dispatch_key": "k-1"}\'',
        flush=True,
    )


def _failed_batches_bucket(name: str) -> str:
    """The bucket `name` in this process's Region, created unless it exists (S3 outside us-east-1 wants the
    Region named); another `poimen dev` on the same local AWS, in another Region, may have created it."""
    s3 = boto3.client("s3")
    region = s3.meta.region_name
    where = {} if region == "us-east-1" else {"CreateBucketConfiguration": {"LocationConstraint": region}}
    # A restart against the same local AWS keeps what earlier runs parked.
    with contextlib.suppress(s3.exceptions.BucketAlreadyOwnedByYou):
        s3.create_bucket(Bucket=name, **where)
    return name


def _start_broker(port: int, cleanup: contextlib.ExitStack) -> str:
    """A local broker in a fresh folder, removed when it stops; kept, with its logs, if it cannot start."""
    data = Path(tempfile.mkdtemp(prefix="poimen-kafka-"))
    broker = KafkaBroker(data, port=port)
    try:
        broker.start()
    except BrokerError as error:
        if str(broker.log_file) in str(error):  # the error sends the reader to the logs: keep them
            raise BrokerError(f"{error} (both kept)") from None
        shutil.rmtree(data, ignore_errors=True)
        raise
    except BaseException:
        shutil.rmtree(data, ignore_errors=True)
        raise
    cleanup.callback(shutil.rmtree, data, ignore_errors=True)
    cleanup.callback(broker.stop)
    return broker.bootstrap_servers


def create_tenant_topics(bootstrap: str, tenants: Iterable[str], run_retention_days: int | None) -> None:
    """What a deploy needs first (docs/operations.md, adding a tenant): each tenant's topics, the .dispatch one
    keeping records no longer than the runs (what topics ensure accepts)."""
    days = run_retention_days
    ensure_topics(bootstrap, tenants, retention_ms=dispatch_retention_ms(days), run_retention_days=days)


def _start_event_source(
    template: Template,
    bootstrap: str,
    api_url: str,
    dlq_url: str,
    bucket: str,
    cleanup: contextlib.ExitStack,
    tenants: tuple[str, ...],
    table_name: str,
    concurrency: int,
    parameters: Mapping[str, str],
) -> None:
    """The local MSK event source feeding the relay handler, which posts to the (listening) API: from the
    dispatch topics of `tenants` only, local or replicated, as the template's one mapping per tenant topic.
    The relay runs in `concurrency` execution environments of its own, at most one a tenant, so the batches of
    that many tenant topics are relayed at once, as their mappings would be (one at a time, 100 tenants'
    records one or two to a batch would each wait for the batches before them). Not more than one a tenant: a
    topic has one batch in flight at a time, so more would seldom run (a replica topic's batch waits for a free
    one), and each
    is a process holding the relay handler (45 MiB): `--concurrency 256` for one tenant would start 256.
    Each tenant topic progresses on its own (LocalMskEventSource), and an invocation past the relay's Timeout
    is ended and fails, as on AWS. A failing batch is retried and parked as the template's mappings do with these
    parameters (RelayEventPollers: relay_mapping_attempts)."""
    s3 = boto3.client("s3")
    mapping_id = str(uuid.uuid4())
    concurrency = min(concurrency, len(tenants))
    # The relay's own variables (its POWERTOOLS_SERVICE_NAME, not admission's): the DLQ's URL for its Ref, and
    # the API's, which only a deploy would resolve.
    environments = ExecutionEnvironments(
        str(template.path),
        RELAY_FUNCTION,
        concurrency,
        refs={RELAY_DLQ: dlq_url, **parameters},
        variables={"ADMISSION_API_URL": api_url},
    )
    cleanup.callback(environments.close)
    environments.start()
    environments.wait_ready()
    source = LocalMskEventSource(
        bootstrap,
        environments.handler,
        park_in_s3(s3, bucket, lambda record: failed_batch_key(record, mapping_id)),
        group_id=local_relay_group(table_name),
        max_attempts=relay_mapping_attempts(template, parameters),
        topics=[dispatch_topics_pattern(tenants)],
        function_timeout_seconds=environments.timeout_seconds,
        concurrency=concurrency,
    )
    source.start()
    cleanup.callback(source.stop)


@contextlib.contextmanager
def _local_aws(options: DevOptions) -> Iterator[Endpoints]:
    given = (options.dynamodb_endpoint, options.sqs_endpoint, options.s3_endpoint)
    if all(given):
        yield Endpoints(*(endpoint or "" for endpoint in given))
        return
    with EmbeddedMoto(options.moto_port) as moto:
        yield Endpoints(*(endpoint or moto.endpoint for endpoint in given))


def load_template(path: Path) -> Template:
    """The template at `path`, if `poimen dev` can serve it; else InvalidTemplate (OSError if unreadable)."""
    try:
        template = Template(path)
    except UnicodeDecodeError as error:
        raise InvalidTemplate(f"{path} is not UTF-8 text ({error.reason} at byte {error.start})") from error
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f", line {mark.line + 1}" if mark is not None else ""
        raise InvalidTemplate(f"{path} is not YAML ({getattr(error, 'problem', None) or error}{where})") from error
    document = template.document
    resources = document.get("Resources") if isinstance(document, dict) else None
    for logical_id, kind in SERVED_RESOURCES:
        declared = resources.get(logical_id) if isinstance(resources, dict) else None
        if not isinstance(declared, dict) or declared.get("Type") != kind:
            raise InvalidTemplate(f"{path} is not poimen's SAM template: it declares no {kind} {logical_id}")
    return template


def _principals(options: DevOptions) -> dict[str, Principal]:
    principals = {DEV_ACCESS_KEY: dev_principal(options.principal)}
    source, path = "--principals", options.principals_file
    if path is None and os.environ.get("POIMEN_LOCAL_PRINCIPALS"):
        source, path = "POIMEN_LOCAL_PRINCIPALS", Path(os.environ["POIMEN_LOCAL_PRINCIPALS"])
    if path is not None:
        try:
            principals |= load_principals(path)
        except InvalidPrincipals as error:
            raise InvalidPrincipals(f"{source}: {error}") from error
    return principals


def _prepare_table(
    template: Template,
    table_name: str,
    principals: Iterable[Principal],
    parameters: Mapping[str, str],
    *,
    region: str | None = None,
) -> None:
    """Create the table in `region` (None: this process's) as template.yaml declares it (if absent), with its
    TTL if `parameters` enable it, and grant each principal its tenants."""
    client = boto3.client("dynamodb", region_name=region)
    region = client.meta.region_name
    if table_name not in client.list_tables()["TableNames"]:
        # Another `poimen dev` sharing the table (another Region's) may be creating it at the same moment.
        with contextlib.suppress(client.exceptions.ResourceInUseException):
            client.create_table(**template.create_table_request(ADMISSION_TABLE, table_name))
        # Emulators other than moto (dynalite, DynamoDB Local) take a moment to make the table ACTIVE.
        client.get_waiter("table_exists").wait(TableName=table_name, WaiterConfig={"Delay": 1, "MaxAttempts": 60})
    time_to_live = template.time_to_live_request(ADMISSION_TABLE, table_name, parameters)
    if time_to_live is not None:
        # A table kept from an earlier run may have it already: DynamoDB refuses to enable it twice. (Without
        # retention a table's TTL is left as it is, so the emulators that lack TTL serve as before.)
        described = client.describe_time_to_live(TableName=table_name)["TimeToLiveDescription"]
        if described.get("TimeToLiveStatus") not in ("ENABLED", "ENABLING"):
            client.update_time_to_live(**time_to_live)
    # The grants are start-up, not a request: written with botocore's own 60 s timeout (as the calls above),
    # not with a function's DynamoDB timeout, which a local DynamoDB on a loaded machine outlasts while the
    # execution environments load their handlers.
    settings = Settings.from_env(
        {"TABLE_NAME": table_name, "AWS_REGION": region, "TABLE_REGION": region, "DYNAMODB_TIMEOUT_SECONDS": "60"}
    )
    store = Store(settings)
    for principal in principals:
        for tenant in principal.tenants:
            store.grant(principal.arn, tenant)
