"""The `poimen` command line: `poimen dev` runs the admission API locally against moto server."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from poimen_tools.local.dev import DEFAULT_PRINCIPAL, run_dev


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="poimen", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    dev = commands.add_parser("dev", help="serve the admission API on loopback, with an embedded moto server")
    dev.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    dev.add_argument("--port", type=int, default=8080, help="API port, 0 for any free one (default: %(default)s)")
    dev.add_argument(
        "--dynamodb-endpoint",
        metavar="URL",
        help="use this DynamoDB endpoint (an already-running moto server) instead of an embedded one",
    )
    dev.add_argument("--moto-port", type=int, default=0, help="port of the embedded moto server (default: any)")
    dev.add_argument("--table-name", default="poimen-admission-local", help="(default: %(default)s)")
    dev.add_argument(
        "--principal",
        default=DEFAULT_PRINCIPAL,
        help="IAM principal put in the authorizer context of every request; granted every tenant "
        "(default: %(default)s)",
    )
    dev.add_argument("--dlq-name", default="poimen-relay-dlq-local", help="(default: %(default)s)")
    dev.add_argument("--region", default="us-east-1", help="(default: %(default)s)")
    dev.add_argument(
        "--concurrency",
        type=int,
        default=4,
        help="execution environments (worker processes), each running one request at a time (default: %(default)s)",
    )
    dev.add_argument("--template", type=Path, help="SAM template to serve (default: the checkout's)")
    args = parser.parse_args(argv)
    return run_dev(
        host=args.host,
        port=args.port,
        dynamodb_endpoint=args.dynamodb_endpoint,
        moto_port=args.moto_port,
        table_name=args.table_name,
        principal=args.principal,
        region=args.region,
        template_path=args.template,
        concurrency=args.concurrency,
        dlq_name=args.dlq_name,
    )


if __name__ == "__main__":
    sys.exit(main())
