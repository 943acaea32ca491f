"""The `poimen` command line: `poimen dev` runs the whole path locally; `topics ensure` declares a
tenant's topics; `dispatch publish` publishes a spawn request to its dispatch topic."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from poimen.admission import normalise_principal
from poimen.config import Settings
from poimen.contract import TENANT_PATTERN, RunRequest, parse_json
from poimen.dispatch import DispatchPublisher
from poimen.kafka import dispatch_topic
from poimen.principals import GrantPrincipal, InvalidPrincipal, grant_principal
from poimen.store import Store
from poimen_tools.local.dev import DevOptions, run_dev
from poimen_tools.topics import SEVEN_DAYS_MS, ensure_topics


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["dlq"]:
        # Imported only for `poimen dlq`: it loads the relay's modules, whose Powertools logger and
        # metrics read their settings when imported; `poimen dev` must import them only after it has
        # set the functions' environment (else its relay has no metrics namespace and fails every batch).
        from poimen_tools.dlq import main as dlq_main

        return dlq_main(arguments[1:])
    parser = argparse.ArgumentParser(prog="poimen", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    defaults = DevOptions()
    dev = commands.add_parser("dev", help="serve the admission API on loopback, with an embedded moto server")
    dev.add_argument("--host", default=defaults.host, help="address to listen on (default: %(default)s)")
    dev.add_argument(
        "--port", type=int, default=defaults.port, help="API port, 0 for any free one (default: %(default)s)"
    )
    dev.add_argument(
        "--dynamodb-endpoint",
        metavar="URL",
        help="DynamoDB only: use this endpoint (a running moto server, dynalite, DynamoDB Local) instead of an "
        "embedded moto server",
    )
    dev.add_argument(
        "--sqs-endpoint", metavar="URL", help="SQS only: use this endpoint (the relay's dead-letter queue)"
    )
    dev.add_argument("--s3-endpoint", metavar="URL", help="S3 only: use this endpoint (the failed-batches bucket)")
    dev.add_argument(
        "--moto-port", type=int, default=defaults.moto_port, help="port of the embedded moto server (default: any)"
    )
    dev.add_argument("--table-name", default=defaults.table_name, help="(default: %(default)s)")
    dev.add_argument(
        "--principal",
        default=defaults.principal,
        help="principal ARN of the default dev key (see README); granted every tenant (default: %(default)s)",
    )
    dev.add_argument(
        "--principals",
        type=Path,
        help="JSON: access key id -> {secret, arn, tenants}; also POIMEN_LOCAL_PRINCIPALS (default: the dev key)",
    )
    dev.add_argument("--dlq-name", default=defaults.dlq_name, help="(default: %(default)s)")
    dev.add_argument("--region", default=defaults.region, help="(default: %(default)s)")
    dev.add_argument(
        "--concurrency",
        type=int,
        default=defaults.concurrency,
        help="execution environments (worker processes), each running one request at a time (default: %(default)s)",
    )
    dev.add_argument("--template", type=Path, help="SAM template to serve (default: the checkout's)")
    dev.add_argument("--no-kafka", action="store_true", help="serve the API only: no broker, no relay")
    dev.add_argument(
        "--kafka-port", type=int, default=defaults.kafka_port, help="local broker port (default: %(default)s)"
    )
    dev.add_argument("--kafka-bootstrap", metavar="HOST:PORT", help="use this broker instead of a local one")

    topics = commands.add_parser("topics", help="Kafka topics").add_subparsers(dest="action", required=True)
    ensure = topics.add_parser("ensure", help="create poimen.<tenant>.events and .dispatch if missing")
    ensure.add_argument("--tenant", required=True, type=_tenant)
    ensure.add_argument("--partitions", type=int, default=6, help="(default: %(default)s)")
    ensure.add_argument(
        "--replication-factor", type=int, default=-1, help="(default: -1, the broker's default.replication.factor)"
    )
    ensure.add_argument("--retention-ms", type=int, default=SEVEN_DAYS_MS, help="(default: 7 days)")
    _connection_arguments(ensure)

    dispatch = commands.add_parser("dispatch", help="dispatch topic").add_subparsers(dest="action", required=True)
    publish = dispatch.add_parser("publish", help="publish one spawn request to poimen.<tenant>.dispatch")
    publish.add_argument("--tenant", required=True, type=_tenant)
    publish.add_argument("--workflow-ref", required=True)
    publish.add_argument("--input", required=True, type=_json_object, help="a JSON object (numbers kept exactly)")
    publish.add_argument("--goal-id")
    publish.add_argument("--dispatch-key")
    _connection_arguments(publish)

    grants = commands.add_parser("grants", help="which tenants each principal may act for")
    grant_actions = grants.add_subparsers(dest="action", required=True)
    for action in ("add", "remove"):
        change = grant_actions.add_parser(action, help=f"{action} one grant")
        change.add_argument(
            "--principal",
            required=True,
            help="IAM or STS principal ARN; assumed-role sessions count as their role, roles are named without path"
            + ("" if action == "add" else " (any other string is removed as given)"),
        )
        change.add_argument("--tenant", required=True, type=_tenant_or_all, help="a tenant id, or * for every tenant")
        _table_arguments(change)
    _table_arguments(grant_actions.add_parser("list", help="every principal and its tenants"))

    # Listed here, parsed by poimen_tools/dlq.py (see the top of main).
    commands.add_parser("dlq", help="inspect and redrive dead letters: poimen dlq {list,show,redrive} --help")

    args = parser.parse_args(arguments)
    if args.command == "grants":
        return _grants(args)
    if args.command == "topics":
        result = ensure_topics(
            args.bootstrap_servers,
            args.tenant,
            partitions=args.partitions,
            replication_factor=args.replication_factor,
            retention_ms=args.retention_ms,
            iam_region=args.region if args.iam else None,
        )
        for topic, state in result.items():
            print(f"{topic}: {state}")
        return 0
    if args.command == "dispatch":
        request = RunRequest(
            workflow_ref=args.workflow_ref, input=args.input, goal_id=args.goal_id, dispatch_key=args.dispatch_key
        )
        publisher = DispatchPublisher(args.bootstrap_servers, args.region if args.iam else None)
        run_id = publisher.publish(args.tenant, request)
        publisher.flush()
        print(f"published to {dispatch_topic(args.tenant)}" + (f"; run_id {run_id}" if run_id else ""))
        return 0
    return run_dev(
        DevOptions(
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
            template_path=args.template,
            concurrency=args.concurrency,
            dlq_name=args.dlq_name,
            kafka=not args.no_kafka,
            kafka_port=args.kafka_port,
            kafka_bootstrap=args.kafka_bootstrap,
        )
    )


def _grants(args: argparse.Namespace) -> int:
    if args.action == "list":
        for principal, tenants in sorted(_store(args).all_grants().items()):
            print(f"{principal}\t{','.join(sorted(tenants))}")
        return 0
    try:
        granted = grant_principal(args.principal)
    except InvalidPrincipal as error:
        if args.action == "add":
            print(f"poimen grants add: {error}", file=sys.stderr)
            return 2
        # Remove takes what `grants list` shows, even a grant added before principals were checked.
        granted = GrantPrincipal(args.principal)
    if granted.note:
        print(f"note: {granted.note}", file=sys.stderr)
    principal = normalise_principal(granted.arn)
    store = _store(args)
    (store.grant if args.action == "add" else store.revoke)(principal, args.tenant)
    print(f"{args.action}: {principal} {args.tenant}")
    return 0


def _store(args: argparse.Namespace) -> Store:
    if args.dynamodb_endpoint:
        os.environ["AWS_ENDPOINT_URL_DYNAMODB"] = args.dynamodb_endpoint
    return Store(Settings.from_env({"TABLE_NAME": args.table_name, "AWS_REGION": args.region}))


def _table_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--table-name", default=os.environ.get("TABLE_NAME", "poimen-admission-local"))
    parser.add_argument("--dynamodb-endpoint", metavar="URL", help="a local endpoint, e.g. that of `poimen dev`")
    parser.add_argument("--region", default=os.environ.get("AWS_REGION", "us-east-1"))


def _tenant_or_all(value: str) -> str:
    return value if value == "*" else _tenant(value)


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = parse_json(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from error
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, like '{\"key\": 1}'")
    return value


def _tenant(value: str) -> str:
    if not re.fullmatch(TENANT_PATTERN, value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a tenant id ({TENANT_PATTERN})")
    return value


def _connection_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--bootstrap-servers",
        default="127.0.0.1:9092",
        help="(default: %(default)s, the broker of `poimen dev`)",
    )
    parser.add_argument("--iam", action="store_true", help="authenticate to MSK with IAM (SASL_SSL/OAUTHBEARER)")
    parser.add_argument("--region", default="us-east-1", help="MSK region with --iam (default: %(default)s)")


if __name__ == "__main__":
    sys.exit(main())
