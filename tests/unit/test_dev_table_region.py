"""`poimen dev --table-region`: the table (and the grants) in another Region than the functions', two
`poimen dev`s of two Regions preparing one shared table at the same moment, and a local DynamoDB slower than
a function's timeout while the table is prepared."""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import urlsplit

import boto3
import pytest
from moto import mock_aws

from poimen.config import Settings
from poimen.store import grant_pk
from poimen_tools.cli import _dev_options, build_parser
from poimen_tools.local import dev
from poimen_tools.local.moto import EmbeddedMoto
from poimen_tools.local.sigv4 import Principal, dev_principal
from poimen_tools.local.template import Template
from tests.conftest import serve_on_loopback


def test_the_table_region_defaults_to_the_region_and_is_passed_on() -> None:
    parser = build_parser()
    assert _dev_options(parser.parse_args(["dev", "--region", "us-west-2"])).table_home == "us-west-2"
    given = _dev_options(parser.parse_args(["dev", "--region", "us-west-2", "--table-region", "us-east-1"]))
    assert (given.region, given.table_region, given.table_home) == ("us-west-2", "us-east-1", "us-east-1")


def test_the_table_and_its_grants_are_prepared_in_the_table_region(template: Template) -> None:
    with mock_aws():
        # When `poimen dev` in us-west-2 prepares the table of us-east-1
        principal = dev_principal("arn:aws:iam::000000000000:user/poimen-dev")
        dev._prepare_table(template, "shared", [principal], {}, region="us-east-1")
        # Then the table and the grant are in us-east-1, and us-west-2 has no table
        east = boto3.client("dynamodb", region_name="us-east-1")
        assert east.list_tables()["TableNames"] == ["shared"]
        assert east.scan(TableName="shared")["Count"] == 1
        assert boto3.client("dynamodb", region_name="us-west-2").list_tables()["TableNames"] == []


def test_a_table_created_meanwhile_by_another_region_is_used(
    template: Template, monkeypatch: pytest.MonkeyPatch
) -> None:
    with mock_aws():
        # Given the table created by another `poimen dev` after this one listed the tables
        client = boto3.client("dynamodb", region_name="us-east-1")
        client.create_table(**template.create_table_request("AdmissionTable", "shared"))
        real_client: Any = boto3.client

        def listing_nothing(service: str, *args: Any, **kwargs: Any) -> Any:
            made = real_client(service, *args, **kwargs)
            if service == "dynamodb":
                monkeypatch.setattr(made, "list_tables", lambda: {"TableNames": []})
            return made

        monkeypatch.setattr("boto3.client", listing_nothing)
        # When this one prepares it
        dev._prepare_table(template, "shared", [], {}, region="us-east-1")
        # Then it uses the table (no ResourceInUseException)
        assert client.describe_table(TableName="shared")["Table"]["TableStatus"] == "ACTIVE"


def test_the_grants_are_written_when_the_local_dynamodb_answers_slower_than_a_functions_timeout(
    template: Template, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a local DynamoDB whose every UpdateItem (a grant's write) answers later than the functions'
    # DynamoDB timeout (as moto does on a loaded machine while `poimen dev`'s environments load their handlers)
    late = Settings.dynamodb_timeout_seconds + 0.5
    released = threading.Event()  # set at the end, so no answer outlives the test

    with EmbeddedMoto() as moto:
        upstream = urlsplit(moto.endpoint)

        class Late(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("X-Amz-Target", "").endswith(".UpdateItem"):
                    released.wait(late)  # the answer comes late: a slow server, not a synchronisation
                connection = http.client.HTTPConnection(upstream.hostname or "", upstream.port, timeout=30)
                connection.request("POST", self.path, body, dict(self.headers.items()))
                answer = connection.getresponse()
                data = answer.read()
                self.send_response(answer.status)
                for name, value in answer.getheaders():
                    if name.lower() not in ("content-length", "connection", "transfer-encoding", "date", "server"):
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                connection.close()

            def log_message(self, format: str, *args: Any) -> None:
                return

        with serve_on_loopback(Late) as url:
            monkeypatch.setenv("AWS_ENDPOINT_URL_DYNAMODB", url)
            try:
                # When `poimen dev` prepares its table and grants two principals their tenants through it
                principals = [
                    dev_principal("arn:aws:iam::000000000000:user/poimen-dev"),
                    Principal("AKIDTESTING", "secret", "arn:aws:iam::000000000000:role/relay", ("acme", "globex")),
                ]
                dev._prepare_table(template, "slow", principals, {}, region="us-east-1")
            finally:
                released.set()
        # Then each principal's grant is in the table, with its tenants
        items = boto3.client("dynamodb", endpoint_url=moto.endpoint).scan(TableName="slow", ConsistentRead=True)
        granted = {item["pk"]["S"]: set(item["tenants"]["SS"]) for item in items["Items"]}
        assert granted == {grant_pk(principal.arn): set(principal.tenants) for principal in principals}
