"""The store against in-process moto: one call per admission, bounded retries, template agreement."""

from __future__ import annotations

import dataclasses
import json
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from botocore.awsrequest import AWSResponse, HTTPHeaders
from botocore.credentials import RefreshableCredentials
from botocore.exceptions import ReadTimeoutError

from poimen.admission import Admission
from poimen.config import Settings
from poimen.contract import RunRequest
from poimen.errors import DispatchKeyReused, OutcomeUnknown, RunNotStorable, RunTooLarge, StoreUnavailable
from poimen.retention import expires_at
from poimen.store import FENCE, HASH_KEY, ITEM_TYPE, MAX_ITEM_BYTES, GrantRecord, NewRun, RunRecord, Store, item_size
from poimen_tools.local.template import Template


def _count_calls(store: Store) -> list[str]:
    calls: list[str] = []
    store.client.meta.events.register("before-call.dynamodb", lambda model, **_: calls.append(model.name))
    return calls


def test_admission_is_one_dynamodb_call_fresh_and_replayed(store: Store) -> None:
    # Given a granted principal whose grant is already cached
    store.grant("arn:aws:iam::1:user/a", "t1")
    admission = Admission(store, grants_cache_seconds=60, tenants={"t1"})
    admission.authorize("arn:aws:iam::1:user/a", "t1")
    calls = _count_calls(store)
    request = RunRequest(workflow_ref="wf", input={"x": 1}, dispatch_key="k")
    # When a keyed spawn is admitted, then replayed
    fresh = admission.admit_run("arn:aws:iam::1:user/a", "t1", request)
    replay = admission.admit_run("arn:aws:iam::1:user/a", "t1", request)
    # Then each took exactly one PutItem
    assert (fresh.replayed, replay.replayed) == (False, True)
    assert calls == ["PutItem", "PutItem"]


def test_throttling_is_retried_a_bounded_number_of_times_then_unavailable(
    dynamodb: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DYNAMODB_MAX_ATTEMPTS", "2")
    store = Store(Settings.from_env())
    attempts: list[int] = []

    def throttle(**_: Any) -> AWSResponse:
        attempts.append(1)
        return _dynamodb_error("ThrottlingException")

    store.client.meta.events.register_first("before-send.dynamodb.PutItem", throttle)
    with pytest.raises(StoreUnavailable):
        store.put_run_if_absent(_record(store))
    assert len(attempts) == 2


@pytest.mark.parametrize("read", ["run", "grants"])
def test_throttled_reads_are_unavailable_too(dynamodb: Any, monkeypatch: pytest.MonkeyPatch, read: str) -> None:
    monkeypatch.setenv("DYNAMODB_MAX_ATTEMPTS", "1")
    store = Store(Settings.from_env())
    model = store.runs if read == "run" else store.grants
    client: Any = model._get_connection().connection.client

    def throttle(**_: Any) -> AWSResponse:
        return _dynamodb_error("ProvisionedThroughputExceededException")

    client.meta.events.register_first("before-send.dynamodb.GetItem", throttle)

    call = (lambda: store.get_run("t", "r")) if read == "run" else (lambda: store.granted_tenants("arn:x"))

    with pytest.raises(StoreUnavailable):
        call()


def _dynamodb_error(code: str) -> AWSResponse:
    """The HTTP answer DynamoDB gives for `code`, handed to botocore in place of sending the request."""
    body = f'{{"__type":"com.amazonaws.dynamodb.v20120810#{code}","message":"injected"}}'.encode()
    return AWSResponse("https://local", 400, HTTPHeaders.from_dict({"x-amzn-requestid": "r"}), _Raw(body))


class _Raw:
    def __init__(self, body: bytes) -> None:
        self._body = body

    def stream(self, **_: Any) -> Any:
        yield self._body


def test_table_in_template_matches_the_model(template: Template) -> None:
    props = template.properties("AdmissionTable")
    for model in (RunRecord, GrantRecord):
        keys = {name: attr for name, attr in model.get_attributes().items() if attr.is_hash_key or attr.is_range_key}
        assert list(keys) == [HASH_KEY]
        assert keys[HASH_KEY].is_hash_key
        assert keys[HASH_KEY].attr_type == "S"
    assert props["KeySchema"] == [{"AttributeName": HASH_KEY, "KeyType": "HASH"}]
    assert props["AttributeDefinitions"] == [{"AttributeName": HASH_KEY, "AttributeType": "S"}]
    assert props["BillingMode"] == "PAY_PER_REQUEST"
    assert props["StreamSpecification"] == {"StreamViewType": "NEW_IMAGE"}


def _record(store: Store, run_input: str = "{}", attempt_id: str = "a") -> NewRun:
    return NewRun(
        run_id="1",
        tenant_id="t",
        workflow_ref="w",
        input_json=run_input,
        goal_id=None,
        dispatch_key=None,
        fingerprint="f",
        attempt_id=attempt_id,
        status="admitted",
        created_at="now",
        traceparent=None,
    )


def _without_the_item_on_conflict(store: Store) -> None:
    """Answer ConditionalCheckFailed as dynalite and older emulators do: without the stored item."""

    def drop_item(parsed: dict[str, Any], **_: Any) -> None:
        parsed.pop("Item", None)

    store.client.meta.events.register("after-call.dynamodb.PutItem", drop_item)


def test_a_conflict_answered_without_the_item_reads_it_once_consistently(store: Store) -> None:
    # Given a store that leaves the item out of ConditionalCheckFailed, and a granted principal
    _without_the_item_on_conflict(store)
    store.grant("arn:aws:iam::1:user/a", "t1")
    admission = Admission(store, grants_cache_seconds=60, tenants={"t1"})
    admission.authorize("arn:aws:iam::1:user/a", "t1")
    calls = _count_calls(store)
    reads: list[bool] = []
    store.client.meta.events.register(
        "provide-client-params.dynamodb.GetItem", lambda params, **_: reads.append(params.get("ConsistentRead"))
    )
    request = RunRequest(workflow_ref="wf", input={"x": 1}, dispatch_key="k")
    # When a keyed spawn is admitted, replayed, and its key reused for something else
    fresh = admission.admit_run("arn:aws:iam::1:user/a", "t1", request)
    replay = admission.admit_run("arn:aws:iam::1:user/a", "t1", request)
    with pytest.raises(DispatchKeyReused):
        admission.admit_run("arn:aws:iam::1:user/a", "t1", request.model_copy(update={"input": {"x": 2}}))
    # Then the replay answers the first run, each conflict took one strongly consistent GetItem
    assert (fresh.replayed, replay.replayed) == (False, True)
    assert replay.run == fresh.run
    assert calls == ["PutItem", "PutItem", "GetItem", "PutItem", "GetItem"]
    assert reads == [True, True]


def test_a_conflict_whose_item_is_gone_when_read_is_outcome_unknown(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a conditional write that fails on an item deleted before it can be read back
    _without_the_item_on_conflict(store)
    store.put_run_if_absent(_record(store))
    monkeypatch.setattr(store, "get_run", lambda tenant_id, run_id: None)
    # When the write is made again
    # Then its outcome is unknown (an item was there), naming the run
    with pytest.raises(OutcomeUnknown) as unknown:
        store.put_run_if_absent(_record(store, attempt_id="b"))
    assert (unknown.value.run_id, unknown.value.keyed) == ("1", False)


def test_a_fence_is_no_run_and_keeps_a_late_write_out(store: Store, dynamodb: Any) -> None:
    # Given a run id whose write never landed, fenced
    record = _record(store)
    assert store.fence_run(record) is None
    # When the write, still inside DynamoDB, lands late
    with pytest.raises(dynamodb.exceptions.ConditionalCheckFailedException):
        dynamodb.put_item(
            TableName=store.table_name,
            Item=record.item(),
            ConditionExpression="attribute_not_exists(#pk)",
            ExpressionAttributeNames={"#pk": HASH_KEY},
        )
    # Then it fails its condition on the fence; the item stays a fence, and no reader sees a run
    stored = dynamodb.get_item(TableName=store.table_name, Key={HASH_KEY: {"S": "RUN#t#1"}})["Item"]
    assert stored[ITEM_TYPE] == {"S": FENCE}
    assert "status" not in stored  # the outbox relay lets only items with status `admitted` through
    assert store.get_run("t", "1") is None


def test_fencing_a_written_run_answers_that_run(store: Store) -> None:
    record = _record(store, attempt_id="mine")
    store.put_run_if_absent(record)

    found = store.fence_run(_record(store, attempt_id="mine"))

    assert found is not None
    assert found.attempt_id == "mine"
    assert store.get_run("t", "1") is not None


def test_resolution_makes_one_attempt_and_a_failure_is_outcome_unknown(dynamodb: Any) -> None:
    # Given a store whose reads and writes all time out, retried up to 3 attempts
    store = Store(dataclasses.replace(Settings.from_env(), dynamodb_max_attempts=3))
    attempts: list[str] = []

    def timed_out(request: Any, **_: Any) -> None:
        attempts.append(request.url)
        raise ReadTimeoutError(endpoint_url=request.url)

    store.resolution_client.meta.events.register_first("before-send.dynamodb", timed_out)
    # When the write is fenced, and read back
    for resolve in (store.fence_run, store.read_run_once):
        with pytest.raises(OutcomeUnknown):
            resolve(_record(store))
    # Then each took one attempt
    assert len(attempts) == 2


def test_item_size_counts_utf8_bytes_of_names_and_string_values() -> None:
    assert item_size({"pk": {"S": "RUN#a"}}) == 2 + 5
    assert item_size({"é": {"S": "中"}, "k": {"S": "🔑"}}) == (2 + 3) + (1 + 4)
    assert item_size({"input": {"S": ""}}) == 5


def test_an_item_over_the_limit_is_refused_without_a_call(store: Store) -> None:
    calls = _count_calls(store)
    envelope = item_size(_record(store).item()) - 2  # without the 2 bytes of "{}"
    at_limit = _record(store, '"' + "x" * (MAX_ITEM_BYTES - envelope - 2) + '"')
    over = _record(store, '"' + "x" * (MAX_ITEM_BYTES - envelope - 1) + '"')

    assert item_size(at_limit.item()) == MAX_ITEM_BYTES
    assert store.put_run_if_absent(at_limit) is None
    with pytest.raises(RunTooLarge) as refused:
        store.put_run_if_absent(over)
    assert (refused.value.size, refused.value.limit) == (MAX_ITEM_BYTES + 1, MAX_ITEM_BYTES)
    assert calls == ["PutItem"]


def test_a_validation_exception_on_the_write_is_not_storable(dynamodb: Any) -> None:
    store = Store(Settings.from_env())
    store.client.meta.events.register_first(
        "before-send.dynamodb.PutItem", lambda **_: _dynamodb_error("ValidationException")
    )

    with pytest.raises(RunNotStorable, match="injected"):
        store.put_run_if_absent(_record(store))


TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.mark.parametrize("retention_days", [None, 3], ids=["kept", "retained"])
@pytest.mark.parametrize(
    ("request_fields", "traceparent"),
    [
        ({"workflow_ref": "wf", "input": {}}, None),
        ({"workflow_ref": "wf/ünï", "input": {"n": 1.50, "s": "中🔑"}, "dispatch_key": "k"}, TRACEPARENT),
        ({"workflow_ref": "wf", "input": {"a": [1, None, True]}, "goal_id": "g-1", "dispatch_key": "k"}, None),
    ],
    ids=["keyless", "keyed-traced", "keyed-goal"],
)
def test_admissions_write_is_the_run_records_item_and_condition(
    dynamodb: Any, request_fields: dict[str, Any], traceparent: str | None, retention_days: int | None
) -> None:
    # Given a store (with or without run retention) whose PutItem requests are recorded as sent
    store = Store(dataclasses.replace(Settings.from_env(), run_retention_days=retention_days))
    store.grant("arn:aws:iam::1:user/a", "t1")
    admission = Admission(store, grants_cache_seconds=60, tenants={"t1"})
    sent: list[dict[str, Any]] = []
    store.client.meta.events.register("provide-client-params.dynamodb.PutItem", lambda params, **_: sent.append(params))
    bodies: list[bytes] = []
    store.client.meta.events.register("before-send.dynamodb.PutItem", lambda request, **_: bodies.append(request.body))
    # When a spawn is admitted
    admission.admit_run(
        "arn:aws:iam::1:user/a", "t1", RunRequest.model_validate(request_fields), traceparent=traceparent
    )
    # Then its item is the one the pynamodb record of the same run serialises, in the same order, with the same
    # TTL attribute and condition, and so the same request bytes
    (params,) = sent
    item = params["Item"]
    stored = {name: value["S"] for name, value in item.items() if "S" in value}
    record = store.runs(
        stored["pk"],
        run_id=stored["run_id"],
        tenant_id=stored["tenant_id"],
        workflow_ref=stored["workflow_ref"],
        input_json=stored["input"],
        goal_id=stored.get("goal_id"),
        dispatch_key=stored.get("dispatch_key"),
        fingerprint=stored["fingerprint"],
        attempt_id=stored["attempt_id"],
        status="admitted",
        created_at=stored["created_at"],
        traceparent=traceparent,
    )
    expected_item = record.serialize()
    expected_condition: dict[str, Any] = {
        "ConditionExpression": "attribute_not_exists(#pk)",
        "ExpressionAttributeNames": {"#pk": "pk"},
    }
    if retention_days is not None:
        created_ms = datetime.fromisoformat(record.created_at).timestamp() * 1000
        expected_item["expires_at"] = {"N": str(expires_at(created_ms, retention_days))}
        now = params["ExpressionAttributeValues"][":now"]["N"]
        assert abs(int(now) - time.time()) < 60
        expected_condition = {
            "ConditionExpression": "attribute_not_exists(#pk) OR #expires_at < :now",
            "ExpressionAttributeNames": {"#pk": "pk", "#expires_at": "expires_at"},
            "ExpressionAttributeValues": {":now": {"N": now}},
        }
    expected = {
        "TableName": store.table_name,
        "Item": expected_item,
        "ReturnValuesOnConditionCheckFailure": "ALL_OLD",
        **expected_condition,
    }
    assert list(params.items()) == list(expected.items())
    assert list(item) == list(expected_item)
    (body,) = bodies
    assert body == json.dumps(expected).encode()
    assert item_size(item) == item_size(expected_item)


def test_a_new_run_has_the_run_records_attributes_and_their_nullability() -> None:
    attributes = RunRecord.get_attributes()
    fields = {field.name: str(field.type) for field in dataclasses.fields(NewRun)}

    assert set(fields) | {HASH_KEY} == set(attributes)
    assert {name for name, kind in fields.items() if "None" in kind} == {
        name for name, attribute in attributes.items() if attribute.null
    }


def test_a_connected_block_refreshes_credentials_only_once_expired_and_restores_botocores_windows(
    store: Store,
) -> None:
    # Given the store's clients signing with refreshable credentials 12 minutes from their expiry (botocore's
    # advisory window), whose refresh counts its calls
    calls: list[int] = []
    expiry = (datetime.now(UTC) + timedelta(minutes=12)).isoformat()

    def refresh() -> dict[str, str]:
        calls.append(1)
        return {"access_key": "a", "secret_key": "s", "token": "t", "expiry_time": expiry}

    credentials = RefreshableCredentials.create_from_metadata(refresh(), refresh, "test")
    calls.clear()
    for client in (store.client, store.resolution_client):
        client._request_signer._credentials = credentials
    # When a block is connected and the credentials used many times in it
    with store.connected():
        for _ in range(20):
            credentials.get_frozen_credentials()
        inside = len(calls)
    # Then they were refreshed once, by the block's start, and not again in it; after it botocore refreshes them
    # early again, its windows as they were
    assert inside == 1
    assert "_advisory_refresh_timeout" not in vars(credentials)
    credentials.get_frozen_credentials()
    assert len(calls) == 2
