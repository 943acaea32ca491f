"""Optional run retention (RunRetentionDays): the setting, the TTL attribute, expired runs, the template."""

from __future__ import annotations

import argparse
import base64
import io
import json
import math
import re
import subprocess
import time
from collections.abc import Callable
from datetime import datetime
from email.utils import formatdate
from pathlib import Path
from typing import Any
from unittest import mock

import boto3
import pytest
from moto import mock_aws

from poimen.api import admission_service
from poimen.config import ConfigurationError, RelaySettings, Settings
from poimen.ids import keyed_run_id
from poimen.inbox_rule import HeldBack, judge
from poimen.outbox import events_of_batch
from poimen.retention import (
    CHANGED_AT_PATTERN,
    PENDING,
    PREVIOUS_RUN_RETENTION_ENV,
    RUN_RETENTION_CHANGED_ENV,
    RUN_RETENTION_ENV,
    InvalidRetention,
    RunRetention,
    after_change,
    expired,
    expires_at,
    hold_first,
    run_retention,
    run_retention_days,
)
from poimen.store import EXPIRES_AT, FENCE, ITEM_TYPE, NewRun, Store, run_pk
from poimen_tools import arguments, retention_change
from poimen_tools.cli import _dev_options, build_parser
from poimen_tools.local import dev
from poimen_tools.local.stream_source import passes
from poimen_tools.local.template import Template
from tests.conftest import count_runs, load_event
from tests.unit.conftest import Invoke
from tests.unit.relay_harness import RelayHarness
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
    assert RelaySettings.from_env({**RELAY_ENV, **env}).run_retention.days == days


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
    record = NewRun(
        run_id="r-1",
        tenant_id=tenant,
        workflow_ref="wf",
        input_json="{}",
        goal_id=None,
        dispatch_key=None,
        fingerprint="f",
        attempt_id="a",
        status="admitted",
        created_at="2026-12-01T09:00:00.000Z",
        traceparent=None,
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
    admission_store_run = NewRun(
        run_id="r-1",
        tenant_id=tenant,
        workflow_ref="wf",
        input_json="{}",
        goal_id=None,
        dispatch_key="k",
        fingerprint="f",
        attempt_id="a",
        status="admitted",
        created_at="2026-12-01T09:00:00.000Z",
        traceparent=None,
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


def test_the_last_change_of_the_retention_is_a_pair_of_parameters_the_relay_is_given(template: Template) -> None:
    parameters = template.document["Parameters"]
    changed_at = re.compile(parameters["RunRetentionChangedAt"]["AllowedPattern"])
    variables = template.properties("InboxRelayFunction")["Environment"]["Variables"]

    assert parameters["PreviousRunRetentionDays"]["AllowedPattern"] == parameters["RunRetentionDays"]["AllowedPattern"]
    assert parameters["RunRetentionChangedAt"]["AllowedPattern"] == f"^$|^{PENDING}$|{CHANGED_AT_PATTERN}"
    assert all(changed_at.fullmatch(v) for v in ["", PENDING, "2026-11-29T12:00:00Z", "2026-11-29T12:00:00.482Z"])
    assert not any(changed_at.fullmatch(v) for v in ["2026-11-29", "2026-11-29T12:00:00+01:00", "yesterday"])
    assert variables[PREVIOUS_RUN_RETENTION_ENV] == {"Ref": "PreviousRunRetentionDays"}
    assert variables[RUN_RETENTION_CHANGED_ENV] == {"Ref": "RunRetentionChangedAt"}


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


@pytest.mark.parametrize(("days", "kept_days"), [("", 7), ("1", 1), ("3", 1), ("365", 1)])
def test_a_parked_objects_replaced_versions_outlive_it_one_day_at_most_under_run_retention(
    template: Template, days: str, kept_days: int
) -> None:
    # Given both parked-batch buckets, versioned (AWS recommends it of an S3 on-failure destination), so that an
    # object expired, deleted after a backfill, or written again by a retried set-aside (poimen.outbox) stays a
    # noncurrent version, its stream record and the run's input with it, for NoncurrentDays more
    parameters = {"RunRetentionDays": days}
    for bucket in ("FailedBatchesBucket", "OutboxFailedBatchesBucket"):
        properties = template.properties(bucket)
        (rule,) = template.evaluate(properties["LifecycleConfiguration"], parameters)["Rules"]
        # Then under run retention the record outlives its run's RunRetentionDays by one day at most (the
        # shortest S3 keeps a noncurrent version), not by a week
        assert properties["VersioningConfiguration"] == {"Status": "Enabled"}
        assert int(rule["NoncurrentVersionExpiration"]["NoncurrentDays"]) == kept_days


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


# --- a change of the retention -----------------------------------------------------------------------------

DAY_MS = DAY * 1000
NOW_MS = 1_796_000_000_000


def test_a_record_from_before_a_change_is_held_to_the_shorter_of_the_two_retentions() -> None:
    raised = RunRetention(7, 1, NOW_MS - DAY_MS)
    lowered = RunRetention(1, 7, NOW_MS - DAY_MS)
    switched_on = RunRetention(3, None, NOW_MS - DAY_MS)
    switched_off = RunRetention(None, 3, NOW_MS - DAY_MS)

    assert [raised.days_for(NOW_MS - 2 * DAY_MS), raised.days_for(NOW_MS - DAY_MS + 1)] == [1, 7]
    assert [lowered.days_for(NOW_MS - 2 * DAY_MS), lowered.days_for(NOW_MS)] == [1, 1]
    assert [switched_on.days_for(NOW_MS - 9 * DAY_MS), switched_off.days_for(NOW_MS - 2 * DAY_MS)] == [3, 3]
    assert switched_off.days_for(NOW_MS) is None
    assert RunRetention(7).days_for(0) == 7
    assert raised.expired(NOW_MS - 2 * DAY_MS, NOW_MS)
    assert not RunRetention(7).expired(NOW_MS - 2 * DAY_MS, NOW_MS)


def test_the_relay_reads_the_last_change_from_its_environment() -> None:
    changed = {
        RUN_RETENTION_ENV: "7",
        PREVIOUS_RUN_RETENTION_ENV: "1",
        RUN_RETENTION_CHANGED_ENV: "2026-11-29T12:00:00Z",
    }
    forever_before = {**changed, PREVIOUS_RUN_RETENTION_ENV: ""}

    assert run_retention(changed) == RunRetention(7, 1, 1_795_953_600_000)
    assert run_retention(forever_before) == RunRetention(7, None, 1_795_953_600_000)
    assert run_retention({RUN_RETENTION_ENV: "7"}) == RunRetention(7)
    assert RelaySettings.from_env({**RELAY_ENV, **changed}).run_retention == RunRetention(7, 1, 1_795_953_600_000)
    for broken in ({**changed, RUN_RETENTION_CHANGED_ENV: "yesterday"}, {PREVIOUS_RUN_RETENTION_ENV: "1"}):
        with pytest.raises(ConfigurationError):
            RelaySettings.from_env({**RELAY_ENV, **broken})


@pytest.mark.parametrize(
    ("deployed", "days", "expected"),
    [
        (None, 7, RunRetention(7)),  # a new stack: nothing was written under another retention
        (RunRetention(1), 1, RunRetention(1)),  # unchanged
        (RunRetention(7, 1, NOW_MS - DAY_MS), 7, RunRetention(7, 1, NOW_MS - DAY_MS)),  # unchanged: kept
        (RunRetention(1), 7, RunRetention(7, 1, pending=True)),  # a raise, pending until the deploy completed
        (RunRetention(None), 3, RunRetention(3, None, pending=True)),  # switched on: runs were kept forever
        # a second raise while the first still matters: held to the shortest retention of both changes
        (RunRetention(7, 1, NOW_MS - 2 * DAY_MS), 14, RunRetention(14, 1, pending=True)),
        # a second raise once records from before the first are older than both of its retentions
        (RunRetention(7, 1, NOW_MS - 8 * DAY_MS), 14, RunRetention(14, 7, pending=True)),
        (RunRetention(7, None, NOW_MS - 800 * DAY_MS), 14, RunRetention(14, 7, pending=True)),
        # a pending change deployed again unchanged: it took effect by now, its update having completed
        (RunRetention(7, 1, pending=True), 7, RunRetention(7, 1, NOW_MS)),
        # a change while another is pending: the pending one took effect by now, so it still matters
        (RunRetention(7, 1, pending=True), 14, RunRetention(14, 1, pending=True)),
    ],
)
def test_a_deploy_records_a_change_of_the_retention_and_remembers_one_that_still_matters(
    deployed: RunRetention | None, days: int | None, expected: RunRetention
) -> None:
    assert after_change(deployed, days, NOW_MS) == expected


def test_a_second_change_never_holds_a_record_to_more_than_the_retentions_its_run_was_written_under() -> None:
    # Given a raise from 1 to 7 days, then 2 days later one to 14
    first = after_change(RunRetention(1), 7, NOW_MS).settled(NOW_MS)
    second = after_change(first, 14, NOW_MS + 2 * DAY_MS).settled(NOW_MS + 2 * DAY_MS)
    # Then a record from before the first raise, 3 days old after the second, is held to 1 day, as its run was
    assert second.days_for(NOW_MS - DAY_MS // 2) == 1
    assert second.expired(NOW_MS - DAY_MS // 2, NOW_MS + 2 * DAY_MS + DAY_MS // 2)


STACK_TEMPLATE = json.dumps(
    {
        "Parameters": {
            name: {"Type": "String", "Default": ""}
            for name in ("RunRetentionDays", "PreviousRunRetentionDays", "RunRetentionChangedAt")
        },
        "Resources": {"Queue": {"Type": "AWS::SQS::Queue"}},
    }
)
SAMCONFIG = """version = 0.1
[staging.global.parameters]
stack_name = "poimen-admission-staging"
[staging.deploy.parameters]
parameter_overrides = "Stage=staging TableDeletionProtection=true"
"""


def _deploy_parameters(tmp_path: Path, *argv: str, now_ms: int = NOW_MS) -> tuple[int, str, str]:
    """retention_change as make deploy runs it, the operator's clock reading `now_ms`."""
    config = tmp_path / "samconfig.toml"
    if not config.exists():
        config.write_text(SAMCONFIG)
    out, err = io.StringIO(), io.StringIO()
    code = retention_change.main(
        ["--config-env", "staging", "--config-file", str(config), *argv],
        cloudformation=boto3.client("cloudformation"),
        now_ms=now_ms,
        stdout=out,
        stderr=err,
    )
    return code, out.getvalue(), err.getvalue()


def _update_stack(words: str, stack_name: str = "poimen-admission-staging") -> dict[str, str]:
    """The stack updated (the change set executed) with these `Key=Value` overrides; they, as a dict."""
    parameters = _as_sam_reads(words)
    boto3.client("cloudformation").update_stack(
        StackName=stack_name,
        TemplateBody=STACK_TEMPLATE,
        Parameters=[{"ParameterKey": name, "ParameterValue": value} for name, value in parameters.items()],
    )
    return parameters


def _deploy_stack(days: str, stack_name: str = "poimen-admission-staging") -> None:
    boto3.client("cloudformation").create_stack(
        StackName=stack_name,
        TemplateBody=STACK_TEMPLATE,
        Parameters=[{"ParameterKey": "RunRetentionDays", "ParameterValue": days}],
    )


def test_make_deploy_reads_the_deployed_retention_and_records_a_raise(tmp_path: Path) -> None:
    with mock_aws():
        # Given no stack yet: nothing to record
        first = _deploy_parameters(tmp_path, "--run-retention-days", "1")
        # Given the stack deployed with runs kept 1 day
        _deploy_stack("1")
        # When make deploy raises it to 7 days, or deploys it again unchanged, or is given nothing
        raised = _deploy_parameters(tmp_path, "--run-retention-days", "7")
        unchanged = _deploy_parameters(tmp_path, "--run-retention-days", "1")
        kept = _deploy_parameters(tmp_path)
        nothing_pending = _deploy_parameters(tmp_path, "--settle")
        # When the raise is deployed, and make deploy's second step runs
        _update_stack(raised[1])
        settled = _deploy_parameters(tmp_path, "--settle")
        _update_stack(settled[1])
        again = _deploy_parameters(tmp_path, "--settle")
    # Then the raise is passed pending with the previous value, and says so; the others record nothing
    assert first == (0, "RunRetentionDays=1 PreviousRunRetentionDays='' RunRetentionChangedAt=''\n", "")
    assert raised[:2] == (0, "RunRetentionDays=7 PreviousRunRetentionDays=1 RunRetentionChangedAt=pending\n")
    assert raised[2].startswith(
        "make deploy: RunRetentionDays of poimen-admission-staging changes from 1 day to 7 days: until the update"
    )
    assert unchanged == kept == (0, "RunRetentionDays=1 PreviousRunRetentionDays='' RunRetentionChangedAt=''\n", "")
    # And once it is deployed, the second step records when it took effect (AWS's time: the operator's clock,
    # NOW_MS, is behind it), and then has nothing left to record
    assert nothing_pending == again == (0, "", "")
    changed_at = run_retention(_relay_env(_as_sam_reads(settled[1]))).changed_at_ms
    assert changed_at is not None
    assert changed_at > NOW_MS
    assert settled[2].startswith(
        "make deploy: the change of RunRetentionDays of poimen-admission-staging to 7 days took effect by 20"
    )


def test_make_deploy_reads_the_retention_of_the_cell_it_deploys(tmp_path: Path) -> None:
    with mock_aws():
        # Given the environment's stack keeping runs 7 days, and its cell c2 keeping them 1 day
        _deploy_stack("7")
        _deploy_stack("1", "poimen-admission-staging-c2")
        # When make deploy CELL=c2 raises the cell's to 7 days
        raised = _deploy_parameters(
            tmp_path, "--run-retention-days", "7", "--stack-name", "poimen-admission-staging-c2"
        )
    # Then the raise of the cell's own retention is recorded, not the other stack's value
    assert raised[1] == "RunRetentionDays=7 PreviousRunRetentionDays=1 RunRetentionChangedAt=pending\n"
    assert "RunRetentionDays of poimen-admission-staging-c2 changes from 1 day to 7 days" in raised[2]


def test_make_deploy_refuses_to_guess_the_deployed_retention(tmp_path: Path) -> None:
    (tmp_path / "samconfig.toml").write_text(SAMCONFIG.replace("TableDeletionProtection=true", "RunRetentionDays=3"))
    with mock_aws():
        disagreeing = _deploy_parameters(tmp_path, "--run-retention-days", "7")
        staged = _deploy_parameters(tmp_path)
    with mock_aws(), mock.patch.dict("os.environ", {"AWS_ENDPOINT_URL": "http://127.0.0.1:9"}):
        unreachable = retention_change.main(
            ["--config-env", "staging", "--config-file", str(tmp_path / "samconfig.toml")]
        )

    assert disagreeing[0] == 1
    assert "RUN_RETENTION_DAYS=7 and RunRetentionDays=3 of" in disagreeing[2]
    assert staged[:2] == (0, "RunRetentionDays=3 PreviousRunRetentionDays='' RunRetentionChangedAt=''\n")
    assert unreachable == 1


def test_a_record_redelivered_after_a_deployed_raise_admits_no_second_run(
    tmp_path: Path, template: Template, handler: Callable[[dict[str, Any], Any], dict[str, Any]], store: Store
) -> None:
    harness = RelayHarness.start(template, handler, store)
    # Given a spawn relayed 2 days ago under a run retention of 1 day: its run has expired (deleted by TTL)
    two_days_ago = int(time.time() * 1000) - 2 * DAY_MS
    record = harness.record({"workflow_ref": "wf", "input": {}, "dispatch_key": "k-1"}, 0, timestamp_ms=two_days_ago)
    # When RunRetentionDays is raised to 7 by make deploy, and the record is delivered again (a reset group)
    with mock_aws():
        _deploy_stack("1")
        code, words, _ = _deploy_parameters(tmp_path, "--run-retention-days", "7")
    parameters = _as_sam_reads(words)
    raised = harness.with_environment(template.function_environment("InboxRelayFunction", parameters))
    raised.run([record])
    # Then it is dead-lettered as expired, held to the 1 day its run was written under, and no run is admitted
    assert code == 0
    assert count_runs(boto3.client("dynamodb"), Settings.from_env().table_name, harness.tenant) == []
    ((_, letter),) = harness.dead_letters()
    assert letter["reason"]["kind"] == "expired"
    assert (
        "older than the run retention of 1 day (it was 1 day, and is 7 days by a deploy not yet settled"
        in (letter["reason"]["detail"])
    )
    assert letter["runRetention"] == {"days": 7, "previousDays": 1, "changedAt": "pending"}


# A raise still pending: make deploy ran at `DEPLOYED_AT`, its change set waited for confirmation and ran
# 30 min later, and meanwhile the stack's admission, still under 1 day, admitted a spawn 20 min in.
HOUR_MS = 3_600_000


def _a_raise_confirmed_later(tmp_path: Path, deployed_at: int) -> tuple[dict[str, str], dict[str, str]]:
    """Inside mock_aws: the stack deployed with runs kept 1 day, raised to 7 by make deploy at `deployed_at`
    (the operator's clock), its change set executed 30 min later, then make deploy's second step. The
    relay's parameters once the change set ran, and once the second step's (if any) ran."""
    _deploy_stack("1")
    code, words, _ = _deploy_parameters(tmp_path, "--run-retention-days", "7", now_ms=deployed_at)
    assert code == 0
    executed = _update_stack(words)
    code, settling, _ = _deploy_parameters(tmp_path, "--settle", now_ms=deployed_at + HOUR_MS // 2)
    assert code == 0
    return executed, _update_stack(settling) if settling.strip() else executed


def test_a_raise_still_waiting_for_its_change_set_admits_no_record_of_its_wait_twice(tmp_path: Path) -> None:
    # Given a raise from 1 to 7 days deployed 2 days 1 h ago and confirmed 30 min later, and a spawn
    # admitted under 1 day while it waited
    now = int(time.time() * 1000)
    deployed_at = now - 2 * DAY_MS - HOUR_MS
    admitted_at = deployed_at + HOUR_MS // 3
    record = {"topic": "poimen.acme.dispatch", "timestamp": admitted_at, "value": base64_json({"dispatch_key": "k"})}
    with mock_aws():
        executed, settled = _a_raise_confirmed_later(tmp_path, deployed_at)
    # When its record is delivered again 48.5 h later, once the change set ran and once make deploy settled
    verdicts = [
        judge(record, admitted_at + 48 * HOUR_MS + HOUR_MS // 2, run_retention(_relay_env(p)))
        for p in (executed, settled)
    ]
    # Then neither relay admits it: its run was written under 1 day
    assert [type(verdict).__name__ for verdict in verdicts] == ["HeldBack", "HeldBack"]
    assert all(isinstance(v, HeldBack) and v.reason.kind == "expired" for v in verdicts)


def test_a_raise_is_recorded_by_aws_clock_not_the_operators(tmp_path: Path) -> None:
    # Given an operator whose clock is 3 days behind AWS's, raising the retention from 1 to 7 days
    before = int(time.time() * 1000) // 1000 * 1000
    with mock_aws():
        _, settled = _a_raise_confirmed_later(tmp_path, before - 3 * DAY_MS)
    # Then the change is recorded no earlier than AWS's time once its change set ran: a spawn admitted under
    # 1 day a minute before that is still held to 1 day
    retention = run_retention(_relay_env(settled))
    assert retention.changed_at_ms is not None
    assert retention.changed_at_ms >= before
    assert retention.days_for(before - 60_000) == 1


def test_a_record_admitted_while_a_raise_waited_is_dead_lettered_not_admitted_again(
    tmp_path: Path, template: Template, handler: Callable[[dict[str, Any], Any], dict[str, Any]], store: Store
) -> None:
    harness = RelayHarness.start(template, handler, store)
    # Given a raise from 1 to 7 days by make deploy 2 days 1 h ago, confirmed 30 min later, and a spawn relayed
    # 20 min in, under 1 day: its run has expired (deleted by TTL)
    deployed_at = int(time.time() * 1000) - 2 * DAY_MS - HOUR_MS
    record = harness.record(
        {"workflow_ref": "wf", "input": {}, "dispatch_key": "k-1"}, 0, timestamp_ms=deployed_at + HOUR_MS // 3
    )
    with mock_aws():
        executed, settled = _a_raise_confirmed_later(tmp_path, deployed_at)
    # When the record is delivered again now (a reset group), to the relay as the change set left it and as
    # make deploy's second step left it
    for parameters in (executed, settled):
        relay = harness.with_environment(template.function_environment("InboxRelayFunction", parameters))
        relay.run([record])
    # Then it is dead-lettered as expired both times, and no run is admitted
    assert count_runs(boto3.client("dynamodb"), Settings.from_env().table_name, harness.tenant) == []
    letters = harness.dead_letters()
    assert [letter["reason"]["kind"] for _, letter in letters] == ["expired", "expired"]


def _relay_env(parameters: dict[str, str]) -> dict[str, str]:
    return {
        RUN_RETENTION_ENV: parameters["RunRetentionDays"],
        PREVIOUS_RUN_RETENTION_ENV: parameters["PreviousRunRetentionDays"],
        RUN_RETENTION_CHANGED_ENV: parameters["RunRetentionChangedAt"],
    }


def base64_json(value: Any) -> str:
    return base64.b64encode(json.dumps({"workflow_ref": "wf", "input": {}, **value}).encode()).decode()


# --- a lowering, whatever becomes of its update --------------------------------------------------------------

# What DescribeStacks shows once the change's update ends so: its parameters if it went forward, else those
# it was rolled back to (a failed update, a cancelled one); UPDATE_ROLLBACK_FAILED leaves functions of both
# versions running. `interrupted`: make deploy killed once the update completed, before its last step.
OUTCOMES = {
    "complete": "UPDATE_COMPLETE",
    "rolled-back": "UPDATE_ROLLBACK_COMPLETE",
    "cancelled": "UPDATE_ROLLBACK_COMPLETE",
    "rollback-failed": "UPDATE_ROLLBACK_FAILED",
    "interrupted": "UPDATE_COMPLETE",
}


class StubStack:
    """A stubbed CloudFormation holding one stack: DescribeStacks answers its parameters and status (with a
    Date header), and an update ends in one of OUTCOMES."""

    def __init__(self, days: str) -> None:
        self.parameters = {"RunRetentionDays": days, "PreviousRunRetentionDays": "", "RunRetentionChangedAt": ""}
        self.status = "CREATE_COMPLETE"
        self.ran: list[dict[str, str]] = [dict(self.parameters)]  # every parameter set a function ran with

    def describe_stacks(self, StackName: str) -> dict[str, Any]:
        return {
            "Stacks": [
                {
                    "StackName": StackName,
                    "StackStatus": self.status,
                    "Parameters": [{"ParameterKey": k, "ParameterValue": v} for k, v in self.parameters.items()],
                }
            ],
            "ResponseMetadata": {"HTTPHeaders": {"date": formatdate(time.time(), usegmt=True)}},
        }

    def update(self, words: str, outcome: str = "complete") -> dict[str, str]:
        """The update's parameters, which functions run with while it is under way, whatever its outcome."""
        parameters = _as_sam_reads(words)
        assert set(parameters) == set(self.parameters)
        self.ran.append(parameters)
        if OUTCOMES[outcome] == "UPDATE_COMPLETE":
            self.parameters = parameters
        self.status = OUTCOMES[outcome]
        return parameters


def _make_deploy(tmp_path: Path, stack: StubStack, *days: str, outcome: str = "complete") -> int:
    """make deploy's retention steps (Makefile `deploy`) against `stack`, each deploy a stack update, the
    change's ending in `outcome`; make's exit status."""

    def step(*argv: str) -> tuple[int, str]:
        config = tmp_path / "samconfig.toml"
        config.write_text(SAMCONFIG)
        out = io.StringIO()
        code = retention_change.main(
            ["--config-env", "staging", "--config-file", str(config), *argv],
            cloudformation=stack,
            stdout=out,
            stderr=io.StringIO(),
        )
        return code, out.getvalue()

    option = ("--run-retention-days", *days) if days else ()
    code, hold = step("--hold", *option)
    if code:
        return code
    if hold.strip():
        stack.update(hold)
    code, change = step(*option)
    if code:
        return code
    stack.update(change, outcome)
    if OUTCOMES[outcome] != "UPDATE_COMPLETE":
        return 1  # sam deploy failed
    if outcome == "interrupted":
        return 130
    code, settling = step("--settle")
    if code == 0 and settling.strip():
        stack.update(settling)
    return code


@pytest.mark.parametrize("outcome", list(OUTCOMES))
def test_a_lowering_holds_every_record_to_it_whatever_becomes_of_its_update(
    outcome: str,
    tmp_path: Path,
    template: Template,
    handler: Callable[[dict[str, Any], Any], dict[str, Any]],
    store: Store,
    invoke: Invoke,
    dynamodb: Any,
    table_name: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    harness = RelayHarness.start(template, handler, store)
    spawn = {"workflow_ref": "wf", "input": {}, "dispatch_key": "k-1"}
    # Given a stack keeping runs 7 days, lowered to 1 by make deploy, the change's update ending in `outcome`
    stack = StubStack("7")
    _make_deploy(tmp_path, stack, "1", outcome=outcome)
    # And a spawn admitted while that update was under way, by admission under 1 day
    written_under = [p for p in stack.ran if p["RunRetentionDays"] == "1"]
    assert written_under, "the change's update ran admission under 1 day"
    monkeypatch.setenv(RUN_RETENTION_ENV, "1")
    admission_service.cache_clear()
    first = invoke(body=spawn)
    assert first.status == 201
    (stored,) = count_runs(dynamodb, table_name, harness.tenant)
    # When 2 days later its run has expired (DynamoDB not yet having deleted it), the operator runs make deploy
    # again, and the record is delivered again, to every relay that ran during or since the update
    _expire(dynamodb, table_name, harness.tenant, first.body["run_id"])
    next_deploy = _make_deploy(tmp_path, stack)
    record = harness.record(spawn, 0, timestamp_ms=int(time.time() * 1000) - 2 * DAY_MS)
    relays = stack.ran[stack.ran.index(written_under[0]) :]
    for parameters in relays:
        harness.with_environment(template.function_environment("InboxRelayFunction", parameters)).run([record])
    # Then every one of them dead-letters it as expired, and the table holds the first admission only
    (after,) = count_runs(dynamodb, table_name, harness.tenant)
    assert (after["created_at"], after["attempt_id"]) == (stored["created_at"], stored["attempt_id"])
    assert [letter["reason"]["kind"] for _, letter in harness.dead_letters()] == ["expired"] * len(relays)
    # And a stack whose rollback failed is deployed to by nobody until it is complete
    assert (next_deploy != 0) == (outcome == "rollback-failed")


@pytest.mark.parametrize(
    ("deployed", "days", "hold"),
    [
        (RunRetention(1), 7, None),  # a raise: records are held to 1 day already
        (RunRetention(7), 7, None),  # unchanged
        (RunRetention(7), 1, RunRetention(7, 1, pending=True)),  # a lowering: held to 1 day, runs still 7
        (RunRetention(None), 3, RunRetention(None, 3, pending=True)),  # switched on: runs were kept forever
        (RunRetention(7), None, None),  # switched off: records are held to 7 days already
        (RunRetention(7, 1, pending=True), 1, None),  # the hold deployed (or rolled back to): held already
        # a lowering while a raise from 1 still matters: held to the shortest
        (RunRetention(7, 1, NOW_MS - 2 * DAY_MS), 3, RunRetention(7, 1, pending=True)),
    ],
)
def test_a_lowering_is_held_first_while_admission_writes_runs_under_the_deployed_retention(
    deployed: RunRetention, days: int | None, hold: RunRetention | None
) -> None:
    assert hold_first(deployed, days, NOW_MS) == hold
    if hold is not None:
        # And the hold, then the change once the hold is deployed, hold every record to no more than the
        # lowered retention
        assert days is not None
        change = after_change(hold, days, NOW_MS + 60_000)
        held = [hold.days_for(NOW_MS), change.days_for(NOW_MS - 10 * DAY_MS), change.days_for(NOW_MS + 60_000)]
        assert all(day is not None and day <= days for day in held)


def test_a_change_rolled_back_stays_pending_and_a_stack_not_complete_is_deployed_to_by_nobody(tmp_path: Path) -> None:
    config = tmp_path / "samconfig.toml"
    config.write_text(SAMCONFIG)

    def step(stack: StubStack, *argv: str) -> tuple[int, str]:
        out = io.StringIO()
        argv = ("--config-env", "staging", "--config-file", str(config), *argv)
        return retention_change.main(list(argv), cloudformation=stack, stdout=out, stderr=io.StringIO()), out.getvalue()

    # Given a stack keeping runs 7 days
    stack = StubStack("7")
    # When make deploy is asked to lower it to 1 day without deploying its hold first
    unheld = step(stack, "--run-retention-days", "1")
    # When the hold is deployed, and the change's update is rolled back
    stack.update(step(stack, "--hold", "--run-retention-days", "1")[1])
    held = dict(stack.parameters)
    stack.update(step(stack, "--run-retention-days", "1")[1], "rolled-back")
    # Then the change is refused unheld, and after the rollback nothing is settled: the hold stays pending
    assert unheld == (1, "")
    assert step(stack, "--settle") == (0, "")
    assert stack.parameters == held
    assert run_retention(_relay_env(held)).days_for(NOW_MS) == 1
    # And the operator giving up the lowering deploys the hold as it is, still pending, settled once it completes
    unchanged = step(stack, "--run-retention-days", "7")[1]
    assert _as_sam_reads(unchanged) == held
    # And a stack whose update or rollback is under way, or whose rollback failed, is deployed to by nobody
    for status in ("UPDATE_IN_PROGRESS", "UPDATE_ROLLBACK_FAILED", "UPDATE_ROLLBACK_IN_PROGRESS"):
        stack.status = status
        assert [step(stack, *argv)[0] for argv in ((), ("--hold",), ("--settle",))] == [1, 1, 1]


# --- what sam deploy makes of the overrides -----------------------------------------------------------------

SAM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-sam" / "bin" / "python"


def _as_sam_reads(words: str) -> dict[str, str]:
    """retention_change's output as `sam deploy` reads it once make's shell has split it (unquoted): `Key=''`
    is the empty value (test_sam_reads_every_retention_override_make_deploy_passes checks SAM CLI's parser)."""
    parameters = dict(word.split("=", 1) for word in words.split())
    return {name: "" if value == "''" else value for name, value in parameters.items()}


def test_sam_reads_every_retention_override_make_deploy_passes(tmp_path: Path) -> None:
    # Given a first deploy with the default retention (forever), a stack deployed so, and one whose
    # retention is switched on (held first) and off
    with mock_aws():
        outputs = [_deploy_parameters(tmp_path)[1], _deploy_parameters(tmp_path, "--run-retention-days", "")[1]]
        _deploy_stack("")
        outputs += [
            _deploy_parameters(tmp_path)[1],
            _deploy_parameters(tmp_path, "--hold", "--run-retention-days", "3")[1],
        ]
        _update_stack(outputs[-1])
        outputs += [_deploy_parameters(tmp_path, "--run-retention-days", "3")[1]]
    # When make's shell splits each (unquoted $$RETENTION_PARAMETERS) and SAM CLI's own parser reads the words
    words = [output.split() for output in outputs]
    script = (
        "import json, sys; from samcli.cli.types import CfnParameterOverridesType;"
        "read = [CfnParameterOverridesType().convert(tuple(w), None, None) for w in json.loads(sys.argv[1])];"
        "print(json.dumps(read))"
    )
    result = subprocess.run([str(SAM_PYTHON), "-c", script, json.dumps(words)], capture_output=True, text=True)
    # Then SAM takes every one, each empty value as the empty value
    assert result.returncode == 0, result.stderr[-500:]
    read = json.loads(result.stdout)
    assert read == [_as_sam_reads(output) for output in outputs]
    assert read[0] == {"RunRetentionDays": "", "PreviousRunRetentionDays": "", "RunRetentionChangedAt": ""}
    assert read[3] == {"RunRetentionDays": "", "PreviousRunRetentionDays": "3", "RunRetentionChangedAt": "pending"}
