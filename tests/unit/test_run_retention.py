"""Optional run retention (RunRetentionDays): the setting, the TTL attribute, expired runs, the template."""

from __future__ import annotations

import argparse
import math
import re
import time
from datetime import datetime
from typing import Any

import boto3
import pytest
from moto import mock_aws

from poimen.api import admission_service
from poimen.config import ConfigurationError, RelaySettings, Settings
from poimen.ids import keyed_run_id
from poimen.outbox import events_of_batch
from poimen.retention import (
    RUN_RETENTION_ENV,
    InvalidRetention,
    expired,
    expires_at,
    run_retention_days,
)
from poimen.store import EXPIRES_AT, FENCE, ITEM_TYPE, Store, run_pk
from poimen_tools import arguments
from poimen_tools.cli import _dev_options, build_parser
from poimen_tools.local import dev
from poimen_tools.local.stream_source import passes
from poimen_tools.local.template import Template
from tests.conftest import count_runs, load_event
from tests.unit.conftest import Invoke
from tests.unit.test_outbox import _stream_event

DAY = 86_400
RELAY_ENV = {"ADMISSION_API_URL": "https://api.example", "DLQ_URL": "https://sqs.example/q", "AWS_REGION": "x"}


# --- the setting ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "days"), [({}, None), ({RUN_RETENTION_ENV: ""}, None), ({RUN_RETENTION_ENV: " 3 "}, 3)]
)
def test_retention_is_off_when_absent_or_empty_and_else_whole_days(env: dict[str, str], days: int | None) -> None:
    assert run_retention_days(env) == days
    assert Settings.from_env({"TABLE_NAME": "t", "AWS_REGION": "x", **env}).run_retention_days == days
    assert RelaySettings.from_env({**RELAY_ENV, **env}).run_retention_days == days


@pytest.mark.parametrize("value", ["0", "-1", "3651", "1.5", "3d", "٣"])
def test_a_retention_that_is_no_whole_number_of_days_from_1_to_3650_is_refused(value: str) -> None:
    with pytest.raises(InvalidRetention, match=RUN_RETENTION_ENV):
        run_retention_days({RUN_RETENTION_ENV: value})
    with pytest.raises(ConfigurationError, match=RUN_RETENTION_ENV):
        Settings.from_env({"TABLE_NAME": "t", "AWS_REGION": "x", RUN_RETENTION_ENV: value})
    with pytest.raises(argparse.ArgumentTypeError, match="1 to 3650"):
        arguments.run_retention_days(value)


def test_the_argument_type_reads_empty_as_forever() -> None:
    assert (arguments.run_retention_days(""), arguments.run_retention_days("3650")) == (None, 3650)


def test_expiry_is_after_the_whole_retention() -> None:
    created_ms = 1_796_115_600_000.5

    assert expires_at(created_ms, 3) == 1_796_115_601 + 3 * DAY
    assert not expired(created_ms, created_ms + 3 * DAY * 1000, 3)
    assert expired(created_ms, created_ms + 3 * DAY * 1000 + 1, 3)
    assert not expired(0, 10**15, None)


# --- the store ---------------------------------------------------------------------------------------------


def _item(dynamodb: Any, table_name: str, tenant: str, run_id: str) -> dict[str, Any]:
    item: dict[str, Any] = dynamodb.get_item(
        TableName=table_name, Key={"pk": {"S": run_pk(tenant, run_id)}}, ConsistentRead=True
    )["Item"]
    return item


def _epoch(created_at: str) -> float:
    return datetime.fromisoformat(created_at).timestamp()


def _expire(dynamodb: Any, table_name: str, tenant: str, run_id: str) -> None:
    """Make the run past its TTL, as DynamoDB leaves it until it deletes it (lazily, maybe days later)."""
    dynamodb.update_item(
        TableName=table_name,
        Key={"pk": {"S": run_pk(tenant, run_id)}},
        UpdateExpression="SET #e = :past",
        ExpressionAttributeNames={"#e": EXPIRES_AT},
        ExpressionAttributeValues={":past": {"N": str(int(time.time()) - 60)}},
    )


@pytest.fixture
def retention(monkeypatch: pytest.MonkeyPatch, dynamodb: Any) -> int:
    """Admission (the handler's, and Store(Settings.from_env())) keeps runs 3 days."""
    monkeypatch.setenv(RUN_RETENTION_ENV, "3")
    admission_service.cache_clear()
    return 3


def test_without_retention_a_run_has_no_ttl_attribute(
    invoke: Invoke, dynamodb: Any, table_name: str, granted: str
) -> None:
    created = invoke(body={"workflow_ref": "wf", "input": {}, "dispatch_key": "k-1"})

    assert created.status == 201
    assert EXPIRES_AT not in _item(dynamodb, table_name, granted, created.body["run_id"])


def test_with_retention_a_run_expires_its_retention_after_it_was_created(
    retention: int, invoke: Invoke, dynamodb: Any, table_name: str, granted: str
) -> None:
    created = invoke(body={"workflow_ref": "wf", "input": {}, "dispatch_key": "k-1"})

    stored = _item(dynamodb, table_name, granted, created.body["run_id"])
    assert created.status == 201
    assert int(stored[EXPIRES_AT]["N"]) == math.ceil(_epoch(created.body["created_at"])) + 3 * DAY
    assert invoke("GET", f"/v1/runs/{created.body['run_id']}").status == 200


def test_with_retention_a_fence_expires_too(retention: int, dynamodb: Any, table_name: str, tenant: str) -> None:
    # Given a keyless run's record whose write's outcome was unknown
    store = Store(Settings.from_env())
    record = store.runs(
        run_pk(tenant, "r-1"),
        run_id="r-1",
        tenant_id=tenant,
        workflow_ref="wf",
        input_json="{}",
        fingerprint="f",
        attempt_id="a",
        status="admitted",
        created_at="2026-12-01T09:00:00.000Z",
    )
    # When its key is fenced
    assert store.fence_run(record) is None
    # Then the fence carries the TTL attribute, about the retention from now
    fence = _item(dynamodb, table_name, tenant, "r-1")
    assert fence[ITEM_TYPE] == {"S": FENCE}
    assert abs(int(fence[EXPIRES_AT]["N"]) - (time.time() + 3 * DAY)) < 60


def test_an_expired_run_not_yet_deleted_is_gone_and_its_key_admits_one_new_run(
    retention: int, invoke: Invoke, dynamodb: Any, table_name: str, granted: str
) -> None:
    # Given a keyed run past its TTL that DynamoDB has not deleted yet
    first = invoke(body={"workflow_ref": "wf", "input": {"n": 1}, "dispatch_key": "k-1"})
    run_id = first.body["run_id"]
    _expire(dynamodb, table_name, granted, run_id)
    # When it is read, by id and by key
    by_id = invoke("GET", f"/v1/runs/{run_id}")
    by_key = invoke("GET", "/v1/runs", query="dispatch_key=k-1")
    # Then it is not found
    assert (by_id.status, by_key.status) == (404, 404)
    # When its key is admitted again (another input: nothing of the expired run is compared)
    time.sleep(0.002)  # a later created_at than the first run's millisecond, not synchronisation
    again = invoke(body={"workflow_ref": "wf", "input": {"n": 2}, "dispatch_key": "k-1"})
    # Then it is a new admission, the one run of the key, alive until its own expiry
    assert again.status == 201
    assert again.body["run_id"] == run_id == keyed_run_id(granted, "k-1")
    assert again.body["created_at"] > first.body["created_at"]
    (stored,) = count_runs(dynamodb, table_name, granted)
    assert stored["created_at"] == {"S": again.body["created_at"]}
    assert stored["input"] == {"S": '{"n":2}'}
    assert int(stored[EXPIRES_AT]["N"]) > time.time() + 3 * DAY - 60
    assert invoke("GET", f"/v1/runs/{run_id}").body["input"] == {"n": 2}
    # And a replay of the new request is a replay of it
    replay = invoke(body={"workflow_ref": "wf", "input": {"n": 2}, "dispatch_key": "k-1"})
    assert (replay.status, replay.body["created_at"]) == (200, again.body["created_at"])


def test_a_run_without_ttl_attribute_never_expires_under_retention(
    invoke: Invoke, dynamodb: Any, table_name: str, granted: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a run admitted before retention was set (no expires_at), then retention set
    first = invoke(body={"workflow_ref": "wf", "input": {}, "dispatch_key": "k-1"})
    monkeypatch.setenv(RUN_RETENTION_ENV, "1")
    admission_service.cache_clear()
    # When it is read and its key admitted again
    read = invoke("GET", f"/v1/runs/{first.body['run_id']}")
    replay = invoke(body={"workflow_ref": "wf", "input": {}, "dispatch_key": "k-1"})
    # Then it is alive: the replay answers it, and it is still the one run without expiry
    assert (read.status, replay.status, replay.body["created_at"]) == (200, 200, first.body["created_at"])
    (stored,) = count_runs(dynamodb, table_name, granted)
    assert EXPIRES_AT not in stored


def test_without_retention_a_past_ttl_attribute_is_ignored(
    retention: int, invoke: Invoke, dynamodb: Any, table_name: str, granted: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a run admitted under retention, past its expires_at, then retention switched off (TTL disabled)
    first = invoke(body={"workflow_ref": "wf", "input": {}, "dispatch_key": "k-1"})
    _expire(dynamodb, table_name, granted, first.body["run_id"])
    monkeypatch.delenv(RUN_RETENTION_ENV)
    admission_service.cache_clear()
    # When it is read and its key admitted again
    read = invoke("GET", f"/v1/runs/{first.body['run_id']}")
    replay = invoke(body={"workflow_ref": "wf", "input": {}, "dispatch_key": "k-1"})
    # Then runs are kept forever again: it is alive, and replayed rather than admitted twice
    assert (read.status, replay.status) == (200, 200)
    assert len(count_runs(dynamodb, table_name, granted)) == 1


def test_the_keyed_resolution_read_treats_an_expired_run_as_absent(
    retention: int, dynamodb: Any, table_name: str, tenant: str
) -> None:
    # Given an expired keyed run not yet deleted
    store = Store(Settings.from_env())
    admission_store_run = store.runs(
        run_pk(tenant, "r-1"),
        run_id="r-1",
        tenant_id=tenant,
        workflow_ref="wf",
        input_json="{}",
        dispatch_key="k",
        fingerprint="f",
        attempt_id="a",
        status="admitted",
        created_at="2026-12-01T09:00:00.000Z",
    )
    assert store.put_run_if_absent(admission_store_run) is None
    _expire(dynamodb, table_name, tenant, "r-1")
    # When a write of unknown outcome at its key is resolved by reading it, Then nothing is there
    assert store.read_run_once(admission_store_run) is None
    assert store.get_run(tenant, "r-1") is None


# --- the outbox: an admission over an expired run is a MODIFY --------------------------------------------


def test_a_modify_of_an_admitted_run_is_let_through_and_published(template: Template) -> None:
    event = load_event("dynamodb_stream_modify.json")
    filters = template.properties("OutboxRelaySource")["FilterCriteria"]["Filters"]

    (published,) = events_of_batch(event, "prod")

    assert passes(filters, event["Records"][0])
    assert published.run_id == "28f956d5-cb15-83b0-bfc9-6c1d99e2e4ae"
    assert published.created_at == "2026-12-01T09:00:00.000Z"
    assert b'"created_at":"2026-12-01T09:00:00.000Z"' in published.value
    assert b"expires_at" not in published.value


def test_an_admission_is_one_event_id_and_a_readmission_of_its_key_another(
    retention: int, invoke: Invoke, dynamodb: Any, table_name: str, granted: str
) -> None:
    # Given a keyed run admitted, expired, and its key admitted again: one run id, two admissions
    spawn = {"workflow_ref": "wf", "input": {"n": 1}, "dispatch_key": "k-1"}
    first = invoke(body=spawn)
    _expire(dynamodb, table_name, granted, first.body["run_id"])
    time.sleep(0.002)  # a later created_at than the first run's millisecond, not synchronisation
    again = invoke(body={**spawn, "input": {"n": 2}})
    assert (first.status, again.status) == (201, 201)
    # When the table's stream is read as the outbox's event source delivers it, and delivered again
    event = _stream_event(dynamodb, table_name)
    admitted, expiry, readmitted = events_of_batch(event, "prod")
    redelivered = events_of_batch(event, "prod")
    # Then each admission's event has one CloudEvents id, the same in every copy (the test's expiry, which
    # rewrote the first item, and a redelivery are identical duplicates), and the re-admission another
    ids = [dict(published.headers)["ce_id"] for published in (admitted, expiry, readmitted)]
    assert ids[0] == ids[1] != ids[2]
    assert expiry == admitted
    assert redelivered == [admitted, expiry, readmitted]
    # And both are the run's (its subject, key and value), the id being the admission's, not the run's
    assert {dict(published.headers)["ce_subject"] for published in (admitted, readmitted)} == {
        first.body["run_id"].encode()
    }
    assert first.body["run_id"].encode() not in ids


def test_a_ttl_deletion_is_neither_let_through_nor_published(template: Template) -> None:
    event = load_event("dynamodb_stream_modify.json")
    event["Records"][0]["eventName"] = "REMOVE"
    filters = template.properties("OutboxRelaySource")["FilterCriteria"]["Filters"]

    assert not passes(filters, event["Records"][0])
    assert events_of_batch(event, "prod") == []


# --- the template ------------------------------------------------------------------------------------------


def test_the_retention_parameter_defaults_to_forever_and_allows_1_to_3650_days(template: Template) -> None:
    parameter = template.document["Parameters"]["RunRetentionDays"]
    pattern = re.compile(parameter["AllowedPattern"])

    assert (parameter["Type"], parameter["Default"]) == ("String", "")
    assert [v for v in ["", *map(str, range(0, 4000))] if pattern.fullmatch(v)] == ["", *map(str, range(1, 3651))]
    assert not any(pattern.fullmatch(v) for v in ["01", " 3", "3 ", "-1", "1e3"])


@pytest.mark.parametrize(("days", "enabled"), [("", False), ("3", True)])
def test_the_table_expires_runs_by_expires_at_only_with_retention(template: Template, days: str, enabled: bool) -> None:
    specification = template.evaluate(
        template.properties("AdmissionTable")["TimeToLiveSpecification"], {"RunRetentionDays": days}
    )

    assert specification == {"AttributeName": EXPIRES_AT, "Enabled": enabled}


def test_admission_and_the_relay_are_given_the_retention(template: Template) -> None:
    for function in ("AdmissionFunction", "InboxRelayFunction"):
        variables = template.properties(function)["Environment"]["Variables"]
        assert variables[RUN_RETENTION_ENV] == {"Ref": "RunRetentionDays"}
        assert template.function_environment(function, {"RunRetentionDays": "3"})[RUN_RETENTION_ENV] == "3"


@pytest.mark.parametrize(
    ("days", "dead_letter_seconds", "parked_days"),
    [
        ("", 14 * DAY, 90),
        ("3", 3 * DAY, 3),
        ("1", DAY, 1),
        ("13", 13 * DAY, 13),
        ("14", 14 * DAY, 14),
        ("365", 14 * DAY, 365),
    ],
)
def test_dead_letters_and_parked_batches_expire_no_later_than_the_runs(
    template: Template, days: str, dead_letter_seconds: int, parked_days: int
) -> None:
    parameters = {"RunRetentionDays": days}
    queue = template.evaluate(template.properties("RelayDeadLetterQueue")["MessageRetentionPeriod"], parameters)
    buckets = [
        template.evaluate(template.properties(bucket)["LifecycleConfiguration"], parameters)["Rules"][0]
        for bucket in ("FailedBatchesBucket", "OutboxFailedBatchesBucket")
    ]

    assert int(queue) == dead_letter_seconds
    assert [int(rule["ExpirationInDays"]) for rule in buckets] == [parked_days, parked_days]
    if days:
        assert int(queue) <= int(days) * DAY
        assert all(int(rule["ExpirationInDays"]) <= int(days) for rule in buckets)
    assert template.create_queue_request("RelayDeadLetterQueue", "q", parameters)["Attributes"][
        "MessageRetentionPeriod"
    ] == str(dead_letter_seconds)


# --- poimen dev --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("days", "status"), [(None, "DISABLED"), (3, "ENABLED")])
def test_poimen_dev_sets_the_tables_ttl_as_the_template_with_its_retention(
    template: Template, days: int | None, status: str
) -> None:
    with mock_aws():
        # Given the options of `poimen dev --run-retention-days` (or none)
        parameters = dev.DevOptions(run_retention_days=days).template_parameters
        # When it prepares the table, twice (a restart against the same local AWS)
        dev._prepare_table(template, "admission-local", [], parameters)
        dev._prepare_table(template, "admission-local", [], parameters)
        # Then the table's TTL is on expires_at exactly when retention is set
        described = boto3.client("dynamodb").describe_time_to_live(TableName="admission-local")
        assert described["TimeToLiveDescription"]["TimeToLiveStatus"] == status
        if days is not None:
            assert described["TimeToLiveDescription"]["AttributeName"] == EXPIRES_AT


def test_poimen_dev_takes_the_retention_argument() -> None:
    args = build_parser().parse_args(["dev", "--run-retention-days", "3"])

    assert _dev_options(args).template_parameters["RunRetentionDays"] == "3"
    assert _dev_options(build_parser().parse_args(["dev"])).run_retention_days is None
