"""The `poimen` command line: `poimen dev` runs the admission API locally against moto server."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from poimen_tools.local.dev import DevOptions, run_dev


def main(argv: Sequence[str] | None = None) -> int:
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
        help="use this DynamoDB endpoint (an already-running moto server) instead of an embedded one",
    )
    dev.add_argument(
        "--moto-port", type=int, default=defaults.moto_port, help="port of the embedded moto server (default: any)"
    )
    dev.add_argument("--table-name", default=defaults.table_name, help="(default: %(default)s)")
    dev.add_argument(
        "--principal",
        default=defaults.principal,
        help="IAM principal put in the authorizer context of every request; granted every tenant "
        "(default: %(default)s)",
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
    args = parser.parse_args(argv)
    return run_dev(
        DevOptions(
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
    )


if __name__ == "__main__":
    sys.exit(main())
