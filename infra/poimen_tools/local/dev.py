"""`poimen dev`: the admission API of template.yaml on loopback, against an embedded moto server."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import boto3

from poimen.config import Settings
from poimen.store import Store
from poimen_tools.local.devserver import ExecutionEnvironments, LocalApiServer, Route
from poimen_tools.local.moto import EmbeddedMoto
from poimen_tools.local.template import Template, default_template_path

DEFAULT_PRINCIPAL = "arn:aws:iam::000000000000:user/poimen-dev"
ADMISSION_FUNCTION = "AdmissionFunction"
ADMISSION_TABLE = "AdmissionTable"
RELAY_DLQ = "RelayDeadLetterQueue"


def run_dev(
    *,
    host: str,
    port: int,
    dynamodb_endpoint: str | None,
    moto_port: int,
    table_name: str,
    principal: str,
    region: str,
    template_path: Path | None,
    concurrency: int,
    dlq_name: str,
) -> int:
    template = Template(template_path or default_template_path())
    # The same defaults a developer shell would give boto: fake credentials only if none are set.
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "local")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "local")
    os.environ["AWS_REGION"] = os.environ["AWS_DEFAULT_REGION"] = region
    signal.signal(signal.SIGTERM, _interrupt)
    with _local_aws(dynamodb_endpoint, moto_port) as endpoint:
        os.environ["AWS_ENDPOINT_URL_DYNAMODB"] = endpoint
        os.environ["AWS_ENDPOINT_URL_SQS"] = endpoint
        _prepare_table(template, table_name, principal)
        dlq_url = boto3.client("sqs").create_queue(**template.create_queue_request(RELAY_DLQ, dlq_name))["QueueUrl"]
        os.environ.update(template.function_environment(ADMISSION_FUNCTION, {ADMISSION_TABLE: table_name}))
        environments = ExecutionEnvironments(str(template.path), ADMISSION_FUNCTION, concurrency)
        routes = [Route(method, path) for method, path in template.http_routes(ADMISSION_FUNCTION)]
        server = LocalApiServer((host, port), environments, routes, principal_arn=principal)
        print(f"Admission API: {server.url}", flush=True)
        print(f"Local AWS (DynamoDB, SQS): {endpoint}  table: {table_name}", flush=True)
        print(f"Relay dead-letter queue: {dlq_url}", flush=True)
        print(
            "Try: curl -si -X POST "
            f"{server.url}/v1/runs -H 'Content-Type: application/json' -H 'X-Poimen-Tenant: acme' "
            '-d \'{"workflow_ref": "wf/hello", "input": {}, "dispatch_key": "k-1"}\'',
            flush=True,
        )
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            print("Stopping.", file=sys.stderr, flush=True)
        finally:
            server.server_close()
            environments.close()
    return 0


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def _local_aws(endpoint: str | None, moto_port: int) -> Iterator[str]:
    if endpoint:
        yield endpoint
        return
    with EmbeddedMoto(moto_port) as moto:
        yield moto.endpoint


def _prepare_table(template: Template, table_name: str, principal: str) -> None:
    """Create the table as template.yaml declares it (if absent) and grant the local principal `*`."""
    client = boto3.client("dynamodb")
    if table_name not in client.list_tables()["TableNames"]:
        client.create_table(**template.create_table_request(ADMISSION_TABLE, table_name))
        client.get_waiter("table_exists").wait(TableName=table_name)
    settings = Settings.from_env({"TABLE_NAME": table_name, "AWS_REGION": client.meta.region_name})
    Store(settings).grant(principal, "*")
