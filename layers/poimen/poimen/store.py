"""The admission table: pynamodb models for runs and grants, and the one conditional write.

One table, one string hash key `pk`:
- a run is the item `RUN#<tenant>#<run_id>`, so keys spread per run (no hot tenant partition) and a
  lookup can never cross tenants;
- a principal's grants are the item `GRANT#<principal ARN>` with a string set of tenant ids.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, TypeVar, cast

from botocore.exceptions import ClientError, ConnectionError, HTTPClientError
from pynamodb.attributes import UnicodeAttribute, UnicodeSetAttribute
from pynamodb.constants import STREAM_NEW_IMAGE
from pynamodb.exceptions import DoesNotExist, PynamoDBException
from pynamodb.models import Model

from poimen.config import Settings
from poimen.errors import RunNotStorable, RunTooLarge, StoreUnavailable

HASH_KEY = "pk"
# DynamoDB's item limit is 400 KB of 1,024 bytes (409,600); the run write stops at the decimal reading,
# under every stand-in's limit too (moto refuses past 405,000), so no emulator refuses first.
MAX_ITEM_BYTES = 400_000
# Error codes DynamoDB answers when retrying later can succeed; botocore has already retried them.
_TRANSIENT_CODES = frozenset(
    {
        "ThrottlingException",
        "ProvisionedThroughputExceededException",
        "RequestLimitExceeded",
        "InternalServerError",
        "ServiceUnavailable",
        "TransactionInProgressException",
    }
)


class RunRecord(Model):
    """One admitted run. `fingerprint` tells a replay from a reused dispatch_key."""

    class Meta:
        table_name = "poimen-admission"  # rebound per table by Store
        # New images feed the events outbox; template.yaml declares the same (a test holds them equal).
        stream_view_type = STREAM_NEW_IMAGE

    pk = UnicodeAttribute(hash_key=True)
    run_id = UnicodeAttribute()
    tenant_id = UnicodeAttribute()
    workflow_ref = UnicodeAttribute()
    # The input's JSON text, numbers as the caller sent them (`poimen.contract.json_text`): never parsed
    # on the way out, so what was admitted is what every answer returns.
    input_json = UnicodeAttribute(attr_name="input")
    goal_id = UnicodeAttribute(null=True)
    dispatch_key = UnicodeAttribute(null=True)
    fingerprint = UnicodeAttribute()
    # Random per admission attempt: when botocore resends a PutItem whose answer was lost, the
    # condition fails on our own write, and this tells it from a true replay.
    attempt_id = UnicodeAttribute()
    status = UnicodeAttribute()
    created_at = UnicodeAttribute()


class GrantRecord(Model):
    """The tenants one principal may act for; `*` grants every tenant."""

    class Meta:
        table_name = "poimen-admission"

    pk = UnicodeAttribute(hash_key=True)
    tenants = UnicodeSetAttribute(null=True)


def run_pk(tenant_id: str, run_id: str) -> str:
    return f"RUN#{tenant_id}#{run_id}"


GRANT_PREFIX = "GRANT#"


def grant_pk(principal: str) -> str:
    return f"{GRANT_PREFIX}{principal}"


M = TypeVar("M", bound=Model)


def _bind(model: type[M], settings: Settings) -> type[M]:
    """A subclass of `model` bound to the configured table, region and retry policy."""
    meta = type(
        "Meta",
        (),
        {
            "table_name": settings.table_name,
            "region": settings.region,
            # pynamodb hands botocore total_max_attempts = 1 + this, in botocore's "standard" mode
            # (exponential backoff with full jitter, throttling-aware).
            "max_retry_attempts": settings.dynamodb_max_attempts - 1,
            "connect_timeout_seconds": settings.dynamodb_timeout_seconds,
            "read_timeout_seconds": settings.dynamodb_timeout_seconds,
            "max_pool_connections": settings.dynamodb_max_connections,
        },
    )
    return cast(type[M], type(model.__name__, (model,), {"Meta": meta}))


class Store:
    """Data access for one admission table. Build it once per process (see `poimen.api`)."""

    def __init__(self, settings: Settings) -> None:
        self.table_name = settings.table_name
        self.runs = _bind(RunRecord, settings)
        self.grants = _bind(GrantRecord, settings)

    @property
    def client(self) -> Any:
        """The botocore DynamoDB client pynamodb uses for runs (one pool for every run call)."""
        return self.runs._get_connection().connection.client

    def put_run_if_absent(self, record: RunRecord) -> RunRecord | None:
        """Write `record` unless its item exists; return None if written, else the stored run.

        One PutItem, one round trip: pynamodb's save() drops the item that
        ReturnValuesOnConditionCheckFailure=ALL_OLD puts into the ConditionalCheckFailed error, so
        the call goes through the same botocore client with the model's own serialisation. DynamoDB
        always returns that item; a stand-in that does not (dynalite, older emulators) costs one
        strongly consistent GetItem more.

        Refused before the call: an item over MAX_ITEM_BYTES (RunTooLarge). DynamoDB's
        ValidationException is RunNotStorable: the request, not the service, is at fault.
        """
        item = record.serialize()
        size = item_size(item)
        if size > MAX_ITEM_BYTES:
            raise RunTooLarge(size, MAX_ITEM_BYTES)
        try:
            self.client.put_item(
                TableName=self.table_name,
                Item=item,
                ConditionExpression="attribute_not_exists(#pk)",
                ExpressionAttributeNames={"#pk": HASH_KEY},
                ReturnValuesOnConditionCheckFailure="ALL_OLD",
            )
        except ClientError as error:
            details = error.response.get("Error", {})
            code = details.get("Code")
            if code == "ValidationException":
                raise RunNotStorable(details.get("Message", code)) from error
            if code != "ConditionalCheckFailedException":
                raise _unavailable_or_original(error) from error
            stored: dict[str, Any] | None = cast(dict[str, Any], error.response).get("Item")
            return self.runs.from_raw_data(stored) if stored is not None else self._read_back(record)
        except (ConnectionError, HTTPClientError) as error:
            raise StoreUnavailable(f"DynamoDB unreachable: {error}") from error
        return None

    def _read_back(self, record: RunRecord) -> RunRecord:
        """The run that failed `record`'s condition, read strongly consistently."""
        existing = self.get_run(record.tenant_id, record.run_id)
        if existing is None:  # deleted between the write and the read; a retry will write it
            raise StoreUnavailable(f"run {record.run_id} existed, then was gone when read back")
        return existing

    def get_run(self, tenant_id: str, run_id: str) -> RunRecord | None:
        with _translated_errors():
            try:
                return self.runs.get(run_pk(tenant_id, run_id), consistent_read=True)
            except DoesNotExist:
                return None

    def granted_tenants(self, principal: str) -> frozenset[str]:
        with _translated_errors():
            try:
                record = self.grants.get(grant_pk(principal), consistent_read=True)
            except DoesNotExist:
                return frozenset()
        return frozenset(record.tenants or ())

    def grant(self, principal: str, tenant_id: str) -> None:
        with _translated_errors():
            self.grants(grant_pk(principal)).update(actions=[GrantRecord.tenants.add({tenant_id})])

    def revoke(self, principal: str, tenant_id: str) -> None:
        with _translated_errors():
            self.grants(grant_pk(principal)).update(actions=[GrantRecord.tenants.delete({tenant_id})])

    def all_grants(self) -> dict[str, frozenset[str]]:
        """Every principal with its tenants. A scan: for operators, never on a request path."""
        with _translated_errors():
            records = self.grants.scan(self.grants.pk.startswith(GRANT_PREFIX), consistent_read=True)
            return {
                record.pk.removeprefix(GRANT_PREFIX): frozenset(record.tenants) for record in records if record.tenants
            }


@contextlib.contextmanager
def _translated_errors() -> Iterator[None]:
    try:
        yield
    except PynamoDBException as error:
        cause = error.cause
        if isinstance(cause, ClientError):
            raise _unavailable_or_original(cause) from error
        if isinstance(cause, ConnectionError | HTTPClientError):
            raise StoreUnavailable(f"DynamoDB unreachable: {cause}") from error
        raise


def item_size(item: dict[str, dict[str, str]]) -> int:
    """An item's size as DynamoDB counts it against its limit: for each attribute, the UTF-8 bytes of
    its name plus those of its value. Every run attribute is a string (DynamoDB Developer Guide, *Item
    sizes and formats*: a string is its UTF-8 bytes)."""
    return sum(len(name.encode()) + len(value["S"].encode()) for name, value in item.items())


def _unavailable_or_original(error: ClientError) -> Exception:
    code = error.response.get("Error", {}).get("Code", "")
    if code in _TRANSIENT_CODES:
        return StoreUnavailable(f"DynamoDB answered {code} after retries")
    return error
