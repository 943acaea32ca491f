"""`poimen dev --table-region`: the table (and the grants) in another Region than the functions', and two
`poimen dev`s of two Regions preparing one shared table at the same moment."""

from __future__ import annotations

from typing import Any

import boto3
import pytest
from moto import mock_aws

from poimen_tools.cli import _dev_options, build_parser
from poimen_tools.local import dev
from poimen_tools.local.sigv4 import dev_principal
from poimen_tools.local.template import Template


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
