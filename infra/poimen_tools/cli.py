"""The `poimen` command line: `poimen dev` runs the whole path locally; `topics ensure` declares a
tenant's topics; `dispatch publish` publishes a spawn request to its dispatch topic; `grants` says which
tenants each principal may act for; `dlq` inspects and redrives dead letters."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import re
import socket
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn, TypeAlias, cast

import botocore.exceptions
import botocore.session
from confluent_kafka import KafkaException
from pydantic import ValidationError
from pynamodb.exceptions import PynamoDBException

from poimen.admission import normalise_principal
from poimen.config import EVENT_POLLER_MODES, ConfigurationError, Settings
from poimen.contract import RunRequest
from poimen.dispatch import DispatchPublisher, InvalidDispatch, KeylessDispatchWarning, PublishFailed
from poimen.errors import StoreUnavailable
from poimen.kafka import dispatch_topic
from poimen.principals import GrantPrincipal, InvalidPrincipal, grant_principal
from poimen.store import Store
from poimen_tools import events, runs
from poimen_tools.arguments import (
    bootstrap_servers,
    endpoint_url,
    json_object,
    kafka_connection_arguments,
    listen_host,
    port,
    principal_arn,
    queue_name,
    region,
    run_retention_days,
    table_name,
    tenant,
    tenant_list,
    tenant_or_all,
    text,
    whole_number,
)
from poimen_tools.credentials import local_credentials
from poimen_tools.local.dev import DevOptions, InvalidTemplate, load_template, run_dev
from poimen_tools.local.kafka_broker import BrokerError
from poimen_tools.local.sigv4 import InvalidPrincipals, load_principals
from poimen_tools.topics import (
    SEVEN_DAYS_MS,
    DispatchRetentionTooLong,
    KafkaUnreachable,
    ensure_topics,
    retention_text,
)

EXIT_OK = 0
EXIT_NOT_FOUND = 1  # the request was refused or names nothing (a table, a grant); dlq: dead letters remain
EXIT_USAGE = 2  # bad arguments or input, refused before anything was sent (argparse's own code)
EXIT_UNAVAILABLE = 3  # a service could not be reached in time, or refused the caller (credentials)
EXIT_PORT_IN_USE = 4  # a port `poimen dev` was told to listen on is taken
EXIT_INTERNAL = 70  # a failure nobody expected (a bug): rerun with --debug and report the traceback
EXIT_INTERRUPTED = 130  # Ctrl-C

EPILOG = f"""\
Errors are one line on stderr, the cause and the fix; --debug (anywhere on the line) shows the
traceback instead. Exit codes:
  {EXIT_OK}   done
  {EXIT_NOT_FOUND}   refused or not found: no such table or topic, no such grant to remove, a broker refusing
      the request; dlq: dead letters of the chosen kinds remain (failing again, not sendable, or older
      than --run-retention-days); events backfill: a run item that is no event, or an event the broker
      can never take
  {EXIT_USAGE}   usage: bad arguments or input (a spawn request the API would refuse, a principal that is no
      ARN, a dispatch retention longer than --run-retention-days); dlq: unknown ID, redrive refused or
      not confirmed
  {EXIT_UNAVAILABLE}   unavailable: DynamoDB, Kafka, SQS, S3 or the admission API not reachable in time, no AWS
      credentials, or a service refusing the caller
  {EXIT_PORT_IN_USE}   port in use: poimen dev cannot listen on --port, --moto-port or --kafka-port
  {EXIT_INTERNAL}  internal error (a bug): rerun with --debug and report the traceback
  {EXIT_INTERRUPTED} interrupted (Ctrl-C)"""

# The bounds of numeric arguments: execution environments of `poimen dev` (worker processes), and what
# Kafka takes for a topic (librdkafka's NewTopic: 1..100000 partitions; an int16 replication factor).
MAX_CONCURRENCY = 256
MAX_PARTITIONS = 100_000
MAX_REPLICATION_FACTOR = 32_767
MAX_RETENTION_MS = 2**63 - 1

Handler = Callable[[argparse.Namespace], int]
Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


class OneLineParser(argparse.ArgumentParser):
    """argparse, with a usage error in one line (its usage block is what `--help` is for)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message}; see {self.prog} --help\n")


class PortInUse(Exception):
    """A port `poimen dev` was told to listen on is taken; `option` is the one that names it."""

    def __init__(self, option: str, host: str, port: int) -> None:
        super().__init__(f"port {port} on {host} is in use")
        self.option = option


class CannotListen(Exception):
    """`poimen dev` cannot listen where it was told to (an address not of this machine, a port it may
    not take); `option` is the one to change."""

    def __init__(self, option: str, host: str, port: int, reason: str) -> None:
        super().__init__(f"cannot listen on {host} port {port} ({reason})")
        self.option = option


class GrantNotFound(Exception):
    """`grants remove` of a grant the table does not hold."""

    def __init__(self, principal: str, tenant_id: str) -> None:
        super().__init__(f"{principal} holds no grant of tenant {tenant_id}")
        self.principal = principal
        self.tenant_id = tenant_id


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    # --debug is global and may come anywhere: a failure deep in a subcommand is where one adds it.
    debug = "--debug" in arguments
    arguments = [argument for argument in arguments if argument != "--debug"]
    if arguments[:1] == ["dlq"]:
        # Imported only for `poimen dlq`: it loads the relay's modules, whose Powertools logger and
        # metrics read their settings when imported; `poimen dev` must import them only after it has
        # set the functions' environment (else its relay has no metrics namespace and fails every batch).
        # `poimen --help` still lists it (the stub below); poimen_tools.dlq parses its arguments.
        args = argparse.Namespace(debug=debug, prog="poimen dlq", run=lambda _args: _dlq(arguments[1:], debug))
    else:
        args = build_parser().parse_args(arguments)
        args.debug = debug
    _configure_logging(debug)
    try:
        run: Handler = args.run
        return run(args)
    except (Exception, KeyboardInterrupt) as error:
        if debug:
            raise
        line, code = explain(error, args)
        print(f"{getattr(args, 'prog', 'poimen')}: {line}", file=sys.stderr)
        return code


def build_parser() -> argparse.ArgumentParser:
    """Every command. A command module adds its own with `module.add_parser(commands)`, each leaf
    parser naming its handler: `parser.set_defaults(run=handler)` (see `_leaf`)."""
    parser = OneLineParser(
        prog="poimen", description=__doc__, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--debug", action="store_true", help="a failure's traceback instead of its one line")
    # Its parsers are OneLineParsers; typed as plain ones, what every add_parser(commands) takes.
    commands = cast(Commands, parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    _add_dev(commands)
    _add_topics(commands)
    _add_dispatch(commands)
    _add_grants(commands)
    runs.add_parser(commands)
    events.add_parser(commands)
    # Listed here, parsed by poimen_tools.dlq (see main).
    commands.add_parser("dlq", help="inspect and redrive dead letters: poimen dlq {list,show,redrive} --help")
    return parser


def _leaf(parser: argparse.ArgumentParser, run: Handler) -> None:
    parser.set_defaults(run=run, prog=parser.prog)


def _add_dev(commands: Commands) -> None:
    defaults = DevOptions()
    dev = commands.add_parser("dev", help="serve the admission API on loopback, with an embedded moto server")
    _leaf(dev, _dev)
    dev.add_argument(
        "--host", type=listen_host, default=defaults.host, help="address to listen on (default: %(default)s)"
    )
    dev.add_argument(
        "--port", type=port, default=defaults.port, help="API port, 0 for any free one (default: %(default)s)"
    )
    dev.add_argument(
        "--dynamodb-endpoint",
        type=endpoint_url,
        metavar="URL",
        help="DynamoDB only: use this endpoint (a running moto server, dynalite, DynamoDB Local) instead of an "
        "embedded moto server",
    )
    dev.add_argument(
        "--sqs-endpoint",
        type=endpoint_url,
        metavar="URL",
        help="SQS only: use this endpoint (the relay's dead-letter queue)",
    )
    dev.add_argument(
        "--s3-endpoint",
        type=endpoint_url,
        metavar="URL",
        help="S3 only: use this endpoint (the failed-batches bucket)",
    )
    dev.add_argument(
        "--moto-port", type=port, default=defaults.moto_port, help="port of the embedded moto server (default: any)"
    )
    dev.add_argument("--table-name", type=table_name, default=defaults.table_name, help="(default: %(default)s)")
    dev.add_argument(
        "--principal",
        type=principal_arn,
        default=defaults.principal,
        help="principal ARN of the default dev key (see README); granted every tenant (default: %(default)s)",
    )
    dev.add_argument(
        "--principals",
        type=_principals_file,
        help="JSON: access key id -> {secret, arn, tenants}; also POIMEN_LOCAL_PRINCIPALS (default: the dev key)",
    )
    dev.add_argument("--dlq-name", type=queue_name, default=defaults.dlq_name, help="(default: %(default)s)")
    dev.add_argument("--region", type=region, default=defaults.region, help="(default: %(default)s)")
    dev.add_argument(
        "--table-region",
        type=region,
        metavar="REGION",
        help="the Region whose table the functions use (TABLE_REGION), created there if absent: with another "
        "poimen dev's --dynamodb-endpoint, one table shared by two Regions, as a global table's replicas "
        "(default: --region)",
    )
    dev.add_argument(
        "--concurrency",
        type=whole_number(1, MAX_CONCURRENCY),
        default=defaults.concurrency,
        help="execution environments (worker processes) of the API, and of the relay as many, at most one a tenant; "
        "each runs one invocation at a time (default: %(default)s)",
    )
    dev.add_argument("--template", type=_template_file, help="SAM template to serve (default: the checkout's)")
    dev.add_argument("--no-kafka", action="store_true", help="serve the API only: no broker, no relay")
    dev.add_argument(
        "--kafka-port", type=port, default=defaults.kafka_port, help="local broker port (default: %(default)s)"
    )
    dev.add_argument(
        "--kafka-bootstrap",
        type=bootstrap_servers,
        metavar="HOST:PORT",
        help="use this broker instead of a local one",
    )
    dev.add_argument(
        "--run-retention-days",
        type=run_retention_days,
        metavar="DAYS",
        help="keep runs this many days, as the template's RunRetentionDays: the table's TTL, the DLQ's "
        "retention (default: forever)",
    )
    dev.add_argument(
        "--event-pollers",
        choices=EVENT_POLLER_MODES,
        help="the template's RelayEventPollers, also POIMEN_EVENT_POLLERS: provisioned, a failing batch tried 3 times "
        "then parked in the failed-batches bucket; on-demand, retried until handled, nothing parked, the relay "
        "dead-lettering a batch past RelayOnDemandMaxRecordAgeSeconds (default: the template's, provisioned)",
    )
    dev.add_argument(
        "--tenants",
        type=tenant_list,
        metavar="LIST",
        default=defaults.tenants,
        help="the tenants served, comma-separated, as the template's Tenants: their topics are created at start, "
        "the relay consumes their dispatch topics, and admission refuses any other tenant, 403 tenant-not-served "
        f"(default: {','.join(defaults.tenants)})",
    )


def _add_topics(commands: Commands) -> None:
    topics = commands.add_parser("topics", help="Kafka topics").add_subparsers(dest="action", required=True)
    ensure = topics.add_parser("ensure", help="create poimen.<tenant>.events and .dispatch if missing")
    _leaf(ensure, _topics_ensure)
    ensure.add_argument("--tenant", required=True, type=tenant)
    ensure.add_argument("--partitions", type=whole_number(1, MAX_PARTITIONS), default=6, help="(default: %(default)s)")
    ensure.add_argument(
        "--replication-factor",
        type=_replication_factor,
        default=-1,
        help="(default: -1, the broker's default.replication.factor)",
    )
    ensure.add_argument(
        "--retention-ms",
        type=whole_number(-1, MAX_RETENTION_MS),
        default=SEVEN_DAYS_MS,
        help="(default: 7 days; -1: forever)",
    )
    ensure.add_argument(
        "--run-retention-days",
        type=run_retention_days,
        metavar="DAYS",
        help="the stack's RunRetentionDays: refuse a --retention-ms longer than it (or -1), as a dispatch record "
        "older than its run could be admitted again (default: runs kept forever, any retention)",
    )
    kafka_connection_arguments(ensure, "seconds to wait for the broker's answer", timeout_seconds=10.0)


def _add_dispatch(commands: Commands) -> None:
    dispatch = commands.add_parser("dispatch", help="dispatch topic").add_subparsers(dest="action", required=True)
    publish = dispatch.add_parser("publish", help="publish one spawn request to poimen.<tenant>.dispatch")
    _leaf(publish, _dispatch_publish)
    publish.add_argument("--tenant", required=True, type=tenant)
    publish.add_argument("--workflow-ref", required=True, type=text)
    publish.add_argument("--input", required=True, type=json_object, help="a JSON object (numbers kept exactly)")
    publish.add_argument("--goal-id", type=text)
    key = publish.add_mutually_exclusive_group()
    key.add_argument(
        "--dispatch-key",
        type=text,
        help="repeats of a key admit one run (default: one generated for this record, poimen-dispatch/<UUIDv7>, "
        "printed with its run id)",
    )
    key.add_argument(
        "--no-dispatch-key",
        action="store_true",
        help="publish the record without a key, warning: the relay delivers it at least once, so a redelivery "
        "admits it again as another run",
    )
    kafka_connection_arguments(
        publish, "seconds to wait for the broker to acknowledge the record", timeout_seconds=10.0
    )


def _add_grants(commands: Commands) -> None:
    grants = commands.add_parser("grants", help="which tenants each principal may act for")
    grant_actions = grants.add_subparsers(dest="action", required=True)
    for action, run in (("add", _grants_add), ("remove", _grants_remove)):
        change = grant_actions.add_parser(action, help=f"{action} one grant")
        _leaf(change, run)
        change.add_argument(
            "--principal",
            required=True,
            type=text,
            help="IAM or STS principal ARN; assumed-role sessions count as their role, roles are named without path"
            + ("" if action == "add" else " (any other string is removed as given)"),
        )
        change.add_argument("--tenant", required=True, type=tenant_or_all, help="a tenant id, or * for every tenant")
        _table_arguments(change)
    listing = grant_actions.add_parser("list", help="every principal and its tenants")
    _leaf(listing, _grants_list)
    _table_arguments(listing)


# -- the commands -------------------------------------------------------------------------------------


def _dev(args: argparse.Namespace) -> int:
    if args.run_retention_days is not None and args.table_region not in (None, args.region):
        # As the template's Rule MultiRegionHasNoRunRetention refuses it: the local stack refuses what AWS does.
        raise ConfigurationError(
            "--run-retention-days needs the table in poimen dev's own --region: a table shared by Regions stands "
            "in for a multi-Region strongly consistent (MRSC) global table, which has no TTL "
            "(docs/operations.md#multi-region)"
        )
    # Checked first, so a taken port is said at once rather than after moto and the broker have started;
    # a port taken in between still ends as PortInUse (see explain).
    busy = _busy_port(args)
    if busy is not None:
        raise busy
    return run_dev(_dev_options(args))


def _dev_options(args: argparse.Namespace) -> DevOptions:
    return DevOptions(
        host=args.host,
        port=args.port,
        dynamodb_endpoint=args.dynamodb_endpoint,
        sqs_endpoint=args.sqs_endpoint,
        s3_endpoint=args.s3_endpoint,
        moto_port=args.moto_port,
        table_name=args.table_name,
        principal=args.principal,
        principals_file=args.principals,
        region=args.region,
        table_region=args.table_region,
        template_path=args.template,
        concurrency=args.concurrency,
        dlq_name=args.dlq_name,
        kafka=not args.no_kafka,
        kafka_port=args.kafka_port,
        kafka_bootstrap=args.kafka_bootstrap,
        run_retention_days=args.run_retention_days,
        tenants=args.tenants,
        event_pollers=args.event_pollers or _event_pollers_from_environment(),
    )


def _event_pollers_from_environment() -> str | None:
    """POIMEN_EVENT_POLLERS, as --event-pollers takes it; None when unset."""
    mode = os.environ.get("POIMEN_EVENT_POLLERS", "").strip()
    if mode and mode not in EVENT_POLLER_MODES:
        raise ConfigurationError(f"POIMEN_EVENT_POLLERS must be one of {', '.join(EVENT_POLLER_MODES)}, got {mode!r}")
    return mode or None


def _topics_ensure(args: argparse.Namespace) -> int:
    result = ensure_topics(
        args.bootstrap_servers,
        args.tenant,
        partitions=args.partitions,
        replication_factor=args.replication_factor,
        retention_ms=args.retention_ms,
        run_retention_days=args.run_retention_days,
        iam_region=args.region if args.iam else None,
        timeout_seconds=args.timeout,
    )
    for topic, state in result.items():
        print(f"{topic}: {state}")
    return EXIT_OK


def _dispatch_publish(args: argparse.Namespace) -> int:
    request = RunRequest(
        workflow_ref=args.workflow_ref, input=args.input, goal_id=args.goal_id, dispatch_key=args.dispatch_key
    )
    publisher = DispatchPublisher(
        args.bootstrap_servers, args.region if args.iam else None, delivery_timeout_seconds=args.timeout
    )
    topic = dispatch_topic(args.tenant)
    if args.no_dispatch_key:

        def warn(message: Warning | str, *_: object, **__: object) -> None:
            print(f"{args.prog}: warning: {message}", file=sys.stderr)

        with warnings.catch_warnings():
            # The publisher's warning as one line on stderr, said once the record is checked, before it is queued.
            # The warnings filters are the caller's: one that makes it an error (PYTHONWARNINGS=error::UserWarning)
            # refuses the record before it is queued (explain), one that ignores it silences it.
            warnings.showwarning = warn
            publisher.publish_without_dispatch_key(args.tenant, request)
        publisher.flush()
        print(f"published to {topic}")
        return EXIT_OK
    published = publisher.publish(args.tenant, request)
    # Known only to this command: a failure from here on names it (explain), for a retry that admits one run.
    args.generated_dispatch_key = published.dispatch_key if published.generated else None
    publisher.flush()
    generated = f"; dispatch_key {published.dispatch_key} (generated)" if published.generated else ""
    print(f"published to {topic}; run_id {published.run_id}{generated}")
    return EXIT_OK


def _grants_list(args: argparse.Namespace) -> int:
    for principal, tenants in sorted(_store(args).all_grants().items()):
        print(f"{principal}\t{','.join(sorted(tenants))}")
    return EXIT_OK


def _grants_add(args: argparse.Namespace) -> int:
    principal = _granted(grant_principal(args.principal))
    _store(args).grant(principal, args.tenant)
    print(f"add: {principal} {args.tenant}")
    return EXIT_OK


def _grants_remove(args: argparse.Namespace) -> int:
    try:
        granted = grant_principal(args.principal)
    except InvalidPrincipal:
        # Remove takes what `grants list` shows, even a grant added before principals were checked.
        granted = GrantPrincipal(args.principal)
    principal = _granted(granted)
    store = _store(args)
    # Read, then remove: an operator's command, so a grant removed in between by someone else is the
    # only race, and it ends as that grant removed (pynamodb's update does not say what it removed).
    if args.tenant not in store.granted_tenants(principal):
        raise GrantNotFound(principal, args.tenant)
    store.revoke(principal, args.tenant)
    print(f"remove: {principal} {args.tenant}")
    return EXIT_OK


def _granted(granted: GrantPrincipal) -> str:
    if granted.note:
        print(f"note: {granted.note}", file=sys.stderr)
    return normalise_principal(granted.arn)


def _dlq(arguments: list[str], debug: bool) -> int:
    from poimen_tools.dlq import main as dlq_main

    return dlq_main([*arguments, "--debug"] if debug else arguments, parser_class=OneLineParser)


def _store(args: argparse.Namespace) -> Store:
    if args.dynamodb_endpoint:
        os.environ["AWS_ENDPOINT_URL_DYNAMODB"] = args.dynamodb_endpoint
    dev_key = local_credentials(_dynamodb_endpoint(args))
    if dev_key is not None:
        # pynamodb takes its credentials from botocore's chain only: this process's environment.
        os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"] = dev_key
        os.environ.pop("AWS_SESSION_TOKEN", None)
    return Store(Settings.from_env({"TABLE_NAME": args.table_name, "AWS_REGION": args.region}))


def _dynamodb_endpoint(args: argparse.Namespace) -> str | None:
    """The endpoint the SDK will call for DynamoDB; None: AWS's own for the region."""
    return (
        getattr(args, "dynamodb_endpoint", None)
        or os.environ.get("AWS_ENDPOINT_URL_DYNAMODB")
        or os.environ.get("AWS_ENDPOINT_URL")
    )


def _configure_logging(debug: bool) -> None:
    # librdkafka's lines (poimen.kafka.librdkafka) and every other library's reach stderr only with
    # --debug; a failure otherwise ends as the one line `explain` gives it.
    if debug:
        logging.basicConfig(level=logging.DEBUG, format="%(levelname)s %(name)s: %(message)s")


# -- the one place failures become lines -------------------------------------------------------------


def explain(error: BaseException, args: argparse.Namespace) -> tuple[str, int]:
    """A failure as (one line naming the cause and the fix, exit code)."""
    line, code = _explain(error, args)
    # A dispatch record queued under a generated key (set by _dispatch_publish once queued) may have been written
    # whatever stopped the command then (a failed flush, Ctrl-C): published again under another generated key, it
    # would be a second spawn; under this one, a replay.
    key = getattr(args, "generated_dispatch_key", None)
    if key is not None:
        line += f"; publish it again with --dispatch-key {key}, which admits at most one run"
    return " ".join(line.split()), code


def _explain(error: BaseException, args: argparse.Namespace) -> tuple[str, int]:
    if isinstance(error, KeyboardInterrupt):
        return "interrupted", EXIT_INTERRUPTED
    if isinstance(error, KeylessDispatchWarning):
        return (
            f"refused, as a warnings filter makes KeylessDispatchWarning an error: {error}; nothing was published",
            EXIT_USAGE,
        )
    if isinstance(error, InvalidPrincipal | ConfigurationError | InvalidDispatch | InvalidTemplate | InvalidPrincipals):
        return str(error), EXIT_USAGE
    if isinstance(error, ValidationError):
        problems = "; ".join(
            f"{'.'.join(str(part) for part in problem['loc']) or 'request'}: {problem['msg']}"
            for problem in error.errors()
        )
        return f"not a valid spawn request: {problems}", EXIT_USAGE
    if isinstance(error, GrantNotFound):
        return f"{error}: nothing removed (see poimen grants list)", EXIT_NOT_FOUND
    if isinstance(error, PublishFailed):
        return _publish_failed(error, args)
    if isinstance(error, DispatchRetentionTooLong):
        return (
            f"--retention-ms {error.retention_ms} ({retention_text(error.retention_ms)}) keeps dispatch records "
            f"longer than --run-retention-days {error.run_retention_days}: a record older than its run could be "
            "admitted again; nothing was created",
            EXIT_USAGE,
        )
    if isinstance(error, KafkaUnreachable):
        return (
            f"cannot reach Kafka at {error.bootstrap_servers} ({error.reason}) within {error.timeout_seconds:g} s; "
            "start it (poimen dev) or pass --bootstrap-servers",
            EXIT_UNAVAILABLE,
        )
    if isinstance(error, events.EventsTopicMissing):
        iam = f" --iam --region {args.region}" if args.iam else ""
        return (
            f"{error}: check --tenant, or create the tenant's topics with poimen topics ensure --tenant "
            f"{args.tenant} --bootstrap-servers {error.bootstrap_servers}{iam}",
            EXIT_NOT_FOUND,
        )
    if isinstance(error, KafkaException):
        broker = getattr(args, "bootstrap_servers", "the broker")
        return f"Kafka at {broker} refused: {error.args[0].str()}", EXIT_NOT_FOUND
    if getattr(args, "command", None) == "dev" and isinstance(error, OSError | BrokerError):
        error = _busy_port(args) or error
    if isinstance(error, PortInUse):
        kafka = ", --kafka-bootstrap HOST:PORT to use a broker already there, or --no-kafka"
        return (
            f"{error}; stop what listens there, or pass {error.option} with another port (0 for any free one)"
            + (kafka if error.option == "--kafka-port" else ""),
            EXIT_PORT_IN_USE,
        )
    if isinstance(error, CannotListen):
        what = "an address of this machine" if error.option == "--host" else "another port (0 for any free one)"
        return f"{error}; pass {error.option} with {what}", EXIT_USAGE
    if isinstance(error, BrokerError):
        return (
            f"the local Kafka broker did not start: {error}; pass --kafka-bootstrap HOST:PORT to use a running "
            "broker, or --no-kafka",
            EXIT_UNAVAILABLE,
        )
    if isinstance(error, FileNotFoundError | PermissionError) and error.filename:
        return f"cannot read {error.filename} ({(error.strerror or str(error)).lower()}); check the path", EXIT_USAGE
    # DynamoDB's failures as the commands that call it meet them (grants, dev), not `poimen dlq`'s.
    dynamodb = None if getattr(args, "prog", "") == "poimen dlq" else _dynamodb_failure(error, args)
    if dynamodb is not None:
        return dynamodb
    return (
        f"unexpected {type(error).__name__}: {str(error).strip() or repr(error)}; rerun with --debug for the "
        "traceback, and report it",
        EXIT_INTERNAL,
    )


def _publish_failed(error: PublishFailed, args: argparse.Namespace) -> tuple[str, int]:
    if any("Unknown topic" in failure for failure in error.failures):
        return (
            f"Kafka at {error.bootstrap_servers} has no topic {dispatch_topic(args.tenant)}: create it with "
            f"poimen topics ensure --tenant {args.tenant} --bootstrap-servers {error.bootstrap_servers}",
            EXIT_NOT_FOUND,
        )
    return (
        f"cannot publish to Kafka at {error.bootstrap_servers} ({error.reason}): {error.records} record(s) not "
        f"acknowledged within {error.timeout_seconds:g} s; start the broker (poimen dev) or pass "
        "--bootstrap-servers (--timeout to wait longer)",
        EXIT_UNAVAILABLE,
    )


def _dynamodb_failure(error: BaseException, args: argparse.Namespace) -> tuple[str, int] | None:
    """DynamoDB's failures as the grants commands meet them: unreachable, no credentials, no table."""
    endpoint = _dynamodb_endpoint(args)
    where = f"at {endpoint}" if endpoint else f"in {getattr(args, 'region', 'its region')}"
    cause = error.cause if isinstance(error, PynamoDBException) and error.cause is not None else error
    if isinstance(cause, StoreUnavailable):
        fix = "start it (poimen dev) or pass --dynamodb-endpoint" if endpoint else "check the network and --region"
        return f"cannot reach DynamoDB {where} ({_reason(cause)}); {fix}", EXIT_UNAVAILABLE
    if isinstance(cause, botocore.exceptions.NoCredentialsError):
        return (
            f"no AWS credentials for DynamoDB {where}: configure them (AWS_PROFILE, aws sso login), or pass "
            "--dynamodb-endpoint for a local table",
            EXIT_UNAVAILABLE,
        )
    if isinstance(cause, botocore.exceptions.ClientError):
        details = cause.response.get("Error", {})
        if details.get("Code") == "ResourceNotFoundException":
            return (
                f"no table {args.table_name} in DynamoDB {where}: pass --table-name (poimen dev prints its table) "
                "or --dynamodb-endpoint",
                EXIT_NOT_FOUND,
            )
        return (
            f"DynamoDB {where} refused the call ({details.get('Code', '?')}: {details.get('Message', '')}); "
            "check your AWS credentials and --region",
            EXIT_UNAVAILABLE,
        )
    if isinstance(cause, botocore.exceptions.BotoCoreError):
        return f"cannot reach DynamoDB {where} ({_reason(cause)}); check --dynamodb-endpoint", EXIT_UNAVAILABLE
    return None


def _reason(error: BaseException) -> str:
    """The operating system's words for a failed connection ('connection refused'), from the chain of
    causes; else the error's own."""
    seen: BaseException | None = error
    for _ in range(10):
        if seen is None:
            break
        if isinstance(seen, OSError) and seen.strerror:
            return seen.strerror.lower()
        if isinstance(seen, TimeoutError | socket.timeout):
            return "timed out"
        seen = seen.__cause__ or seen.__context__
    text = str(error)
    return text.removeprefix("DynamoDB unreachable: ")


def _busy_port(args: argparse.Namespace) -> PortInUse | CannotListen | None:
    """Which of `poimen dev`'s ports is taken (or cannot be listened on at all), found by binding each as
    its server does."""
    candidates = [("--port", args.host, args.port), ("--moto-port", "127.0.0.1", args.moto_port)]
    if not args.no_kafka and not args.kafka_bootstrap:
        candidates.append(("--kafka-port", "127.0.0.1", args.kafka_port))
    for option, host, number in candidates:
        refusal = _bind_refusal(host, number)
        if refusal is None:
            continue
        if refusal.errno == errno.EADDRINUSE:
            if number:  # port 0 is any free one: never taken
                return PortInUse(option, host, number)
            continue
        reason = (refusal.strerror or str(refusal)).lower()
        return CannotListen("--host" if refusal.errno == errno.EADDRNOTAVAIL else option, host, number, reason)
    return None


def _bind_refusal(host: str, number: int) -> OSError | None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as http.server and the broker do
        try:
            probe.bind((host, number))
        except OSError as error:
            return error
    return None


# -- argument types -----------------------------------------------------------------------------------


def _table_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--table-name", type=table_name, default=os.environ.get("TABLE_NAME", "poimen-admission-local"))
    parser.add_argument(
        "--dynamodb-endpoint",
        type=endpoint_url,
        metavar="URL",
        help="a local endpoint, e.g. that of `poimen dev` (loopback endpoints need no AWS credentials)",
    )
    parser.add_argument("--region", type=region, default=os.environ.get("AWS_REGION") or "us-east-1")


def _template_file(value: str) -> Path:
    """A SAM template `poimen dev` can serve (see `load_template`)."""
    path = Path(text(value))
    try:
        load_template(path)
    except InvalidTemplate as error:
        raise argparse.ArgumentTypeError(str(error)) from error
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot read {path} ({(error.strerror or str(error)).lower()})") from error
    return path


def _principals_file(value: str) -> Path:
    """A principals file `poimen dev` can load (see `load_principals`)."""
    path = Path(text(value))
    try:
        load_principals(path)
    except InvalidPrincipals as error:
        raise argparse.ArgumentTypeError(str(error)) from error
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot read {path} ({(error.strerror or str(error)).lower()})") from error
    return path


def _replication_factor(value: str) -> int:
    if value != "-1" and not (re.fullmatch(r"[0-9]{1,5}", value) and 1 <= int(value) <= MAX_REPLICATION_FACTOR):
        raise argparse.ArgumentTypeError(
            f"{value!r} is not -1 (the broker's default) or a whole number from 1 to {MAX_REPLICATION_FACTOR}"
        )
    return int(value)


if __name__ == "__main__":
    sys.exit(main())
