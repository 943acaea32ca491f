"""The admission table: pynamodb models for runs and grants, and the one conditional write (of a `NewRun`).

One table, one string hash key `pk`:
- a run is the item `RUN#<tenant>#<run_id>`, so keys spread per run (no hot tenant partition) and a
  lookup can never cross tenants;
- a principal's grants are the item `GRANT#<principal ARN>` with a string set of tenant ids;
- a fence is an item at a keyless run's key that is NOT a run: `item_type` = `fence` (runs have no
  `item_type`, and no fence has a `status`). Admission writes one when that run's write may have been
  sent but is not there, so that the write can no longer land late (`Store.fence_run`). Readers of the
  table (`get_run`, the outbox relay's stream filter) treat it as no run.

With run retention (Settings.run_retention_days), runs and fences carry the Number attribute `expires_at`
(epoch seconds), the table's TTL attribute. DynamoDB deletes an expired item lazily (days later, maybe):
until then the store treats it as absent, so it is no run to a read, and its key admits a new run, which
overwrites it (a MODIFY on the stream, that the outbox publishes as the admission it is). Items written
without retention have no `expires_at` and are kept forever; without retention the store ignores it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from types import TracebackType
from typing import Any, TypeVar, cast

from botocore.credentials import RefreshableCredentials
from botocore.exceptions import (
    ClientError,
    ConnectionError,
    ConnectTimeoutError,
    CredentialRetrievalError,
    EndpointConnectionError,
    HTTPClientError,
)
from pynamodb.attributes import UnicodeAttribute, UnicodeSetAttribute
from pynamodb.constants import STREAM_NEW_IMAGE
from pynamodb.exceptions import DoesNotExist, PynamoDBException
from pynamodb.models import Model

from poimen.aws_session import ThreadSessions
from poimen.config import Settings
from poimen.errors import OutcomeUnknown, RunNotStorable, RunTooLarge, StoreUnavailable
from poimen.retention import expires_at
from poimen.wire import rfc3339

HASH_KEY = "pk"
# The marker of an item that is not a run (see the module doc): its name, and a fence's value.
ITEM_TYPE = "item_type"
FENCE = "fence"
# The TTL attribute of runs and fences under run retention (template.yaml: TimeToLiveSpecification).
EXPIRES_AT = "expires_at"
# DynamoDB's item limit is 400 KB of 1,024 bytes (409,600); the run write stops at the decimal reading,
# under every stand-in's limit too (moto refuses past 405,000), so no emulator refuses first.
MAX_ITEM_BYTES = 400_000
# Error codes DynamoDB answers when retrying later can succeed; botocore has already retried them.
# ReplicatedWriteConflictException (a multi-Region strongly consistent table: another Region was writing the
# same item) is a refusal like a throttle: answered, so known not written, never an unknown outcome.
_TRANSIENT_CODES = frozenset(
    {
        "ThrottlingException",
        "ReplicatedWriteConflictException",
        "ProvisionedThroughputExceededException",
        "RequestLimitExceeded",
        "InternalServerError",
        "ServiceUnavailable",
        "TransactionInProgressException",
    }
)
# Of those, DynamoDB asking its caller to slow down (a throttle, or another Region's write of the item in flight),
# rather than failing: the store-unavailable problem says so (poimen.wire.THROTTLED_MEMBER).
_THROTTLING_CODES = frozenset(
    {
        "ThrottlingException",
        "ReplicatedWriteConflictException",
        "ProvisionedThroughputExceededException",
        "RequestLimitExceeded",
    }
)
# What a write attempt can fail with before its request left: nothing was sent, so nothing can commit.
# Any other failure after a request was sent (a read timeout, a dropped connection, a 5xx) leaves the
# write's outcome unknown: DynamoDB may have committed it.
_NOT_SENT = (EndpointConnectionError, ConnectTimeoutError)
# Codes of DynamoDB's 5xx answers, for answers that carry no HTTP status.
_UNKNOWN_OUTCOME_CODES = frozenset({"InternalServerError", "ServiceUnavailable"})
# The credentials could not be fetched (the container endpoint did not answer in time, say): raised before
# sending, and passing. None configured at all (NoCredentialsError) is left as it is: a misconfiguration.
_NO_CREDENTIALS = CredentialRetrievalError


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
    # The admission request's W3C traceparent, when it carried a valid one: the run's event carries it on.
    traceparent = UnicodeAttribute(null=True)


class GrantRecord(Model):
    """The tenants one principal may act for; `*` grants every tenant."""

    class Meta:
        table_name = "poimen-admission"

    pk = UnicodeAttribute(hash_key=True)
    tenants = UnicodeSetAttribute(null=True)


def run_pk(tenant_id: str, run_id: str) -> str:
    return f"RUN#{tenant_id}#{run_id}"


@dataclasses.dataclass(frozen=True, slots=True)
class NewRun:
    """A run admission is about to write: `RunRecord`'s attributes, by the same names, without a pynamodb
    model. Building that record and its `serialize()` cost admission more instructions than the rest of its
    own work on the item; `item()` is the same item, attribute for attribute and in the same order (so the
    request's bytes are the same too: tests/unit/test_store.py holds the two equal)."""

    run_id: str
    tenant_id: str
    workflow_ref: str
    input_json: str
    goal_id: str | None
    dispatch_key: str | None
    fingerprint: str
    attempt_id: str
    status: str
    created_at: str
    traceparent: str | None

    @property
    def pk(self) -> str:
        return run_pk(self.tenant_id, self.run_id)

    def item(self) -> dict[str, dict[str, str]]:
        """The run's DynamoDB item as `RunRecord.serialize()` makes it: its attributes in the model's order
        (sorted by their Python names: `input_json` is stored as `input`), each absent one (None) left out."""
        item = {"attempt_id": {"S": self.attempt_id}, "created_at": {"S": self.created_at}}
        if self.dispatch_key is not None:
            item["dispatch_key"] = {"S": self.dispatch_key}
        item["fingerprint"] = {"S": self.fingerprint}
        if self.goal_id is not None:
            item["goal_id"] = {"S": self.goal_id}
        item["input"] = {"S": self.input_json}
        item[HASH_KEY] = {"S": run_pk(self.tenant_id, self.run_id)}
        item["run_id"] = {"S": self.run_id}
        item["status"] = {"S": self.status}
        item["tenant_id"] = {"S": self.tenant_id}
        if self.traceparent is not None:
            item["traceparent"] = {"S": self.traceparent}
        item["workflow_ref"] = {"S": self.workflow_ref}
        return item


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
            "region": settings.table_region or settings.region,
            # pynamodb hands botocore total_max_attempts = 1 + this, in botocore's "standard" mode
            # (exponential backoff with full jitter, throttling-aware).
            "max_retry_attempts": settings.dynamodb_max_attempts - 1,
            "connect_timeout_seconds": settings.dynamodb_timeout_seconds,
            "read_timeout_seconds": settings.dynamodb_timeout_seconds,
            "max_pool_connections": settings.dynamodb_max_connections,
        },
    )
    return cast(type[M], type(model.__name__, (model,), {"Meta": meta}))


class _WriteAttempts(threading.local):
    """Whether an attempt of this thread's current write may have reached DynamoDB unanswered."""

    unanswered = False


class Store:
    """Data access for one admission table. Build it once per process (see `poimen.api`) and use it from any
    thread: the clients a thread builds share that thread's botocore session (`poimen.aws_session.ThreadSessions`),
    so a first request resolves the credentials once, within a bound, and loads the service model once."""

    def __init__(self, settings: Settings) -> None:
        self.table_name = settings.table_name
        self.runs = _bind(RunRecord, settings)
        self.grants = _bind(GrantRecord, settings)
        # One attempt per call, for telling a write's unknown outcome: with the grant read and the write's
        # own retries it must still end before the function's timeout.
        self._once = _bind(RunRecord, dataclasses.replace(settings, dynamodb_max_attempts=1))
        # pynamodb keeps a session per connection and thread, made (botocore's default, its fetch unbounded) when
        # that thread first builds the connection's client: its holder of them is replaced (pynamodb keeps no
        # other way to pass one), so that every thread's is bounded, and one for the store's three connections.
        sessions = ThreadSessions()
        for model in (self.runs, self.grants, self._once):
            model._get_connection().connection._local = sessions
        self._attempts = _WriteAttempts()
        self._watched_client: Any = None
        self.run_retention_days = settings.run_retention_days

    @contextlib.contextmanager
    def connected(self) -> Iterator[None]:
        """Build the clients a write and its resolution use, in this thread, now, and refresh their credentials if
        botocore would before signing (StoreUnavailable if no valid credentials can be had: nothing is sent); then,
        until the block ends, refresh them only once expired. Threads that write inside it share the clients
        (pynamodb keeps one client a connection), so none fetches the credentials or reads the service model for
        itself; and none refreshes them again: botocore refreshes before every use (each signing, each endpoint
        resolution's account id) in the 15 minutes before they expire while a refresh fails or the endpoint hands
        out credentials that close to their expiry, which a batch's threads would do one after another on the
        credentials' lock. A batch lasts seconds; the credentials it has are good for minutes. For one request at a
        time, as a function's execution environment serves them
        (https://docs.aws.amazon.com/lambda/latest/dg/lambda-runtime-environment.html)."""
        with _translated_errors:  # the second is built without a fetch: they share this thread's session
            clients = [self._watched(self.client), self.resolution_client]
            held = {id(found): found for found in (client._get_credentials() for client in clients)}  # botocore's
            refreshing = [found for found in held.values() if isinstance(found, RefreshableCredentials)]
            for credentials in refreshing:
                _refresh_if_due(credentials)
        windows = [(credentials, vars(credentials).copy()) for credentials in refreshing]
        for credentials in refreshing:
            for name in _REFRESH_WINDOWS:
                setattr(credentials, name, 0)  # refreshed once expired, not before
        try:
            yield
        finally:
            for credentials, before in windows:
                for name in _REFRESH_WINDOWS:
                    if name in before:
                        setattr(credentials, name, before[name])
                    else:
                        delattr(credentials, name)  # the class's default again

    @property
    def client(self) -> Any:
        """The botocore DynamoDB client pynamodb uses for runs (one pool for every run call)."""
        return self.runs._get_connection().connection.client

    @property
    def resolution_client(self) -> Any:
        """A DynamoDB client making one attempt per call: what resolves a write of unknown outcome."""
        return self._once._get_connection().connection.client

    def put_run_if_absent(self, record: NewRun) -> RunRecord | None:
        """Write `record` unless its item exists; return None if written, else the stored run.

        One PutItem, one round trip: pynamodb's save() drops the item that
        ReturnValuesOnConditionCheckFailure=ALL_OLD puts into the ConditionalCheckFailed error, so
        the call goes through the same botocore client, with the item the model would serialise. DynamoDB
        always returns that item; a stand-in that does not (dynalite, older emulators) costs one
        strongly consistent GetItem more.

        botocore retries the PutItem; every attempt after a lost answer fails its condition on our own
        write, which the caller tells by `attempt_id`. If any attempt was sent and not answered (a read
        timeout, a dropped connection, a 5xx), the write may have committed whatever the last attempt
        said: OutcomeUnknown, for the caller to resolve. Only when no attempt left (connect refused or
        timed out) or DynamoDB refused each (throttled, or in conflict with another Region's write of the
        item: ReplicatedWriteConflictException) is it StoreUnavailable: nothing was written. An attempt
        after such a conflict is evaluated against the other Region's write: its run is the stored one.

        Refused before the call: an item over MAX_ITEM_BYTES (RunTooLarge). DynamoDB's
        ValidationException is RunNotStorable: the request, not the service, is at fault.
        """
        item = record.item()
        if self.run_retention_days is not None:
            created_ms = datetime.fromisoformat(record.created_at).timestamp() * 1000
            item[EXPIRES_AT] = {"N": str(expires_at(created_ms, self.run_retention_days))}
        size = item_size(item)
        if size > MAX_ITEM_BYTES:
            raise RunTooLarge(size, MAX_ITEM_BYTES)
        with _translated_errors:  # building the client resolves the credentials
            client = self._watched(self.client)
        self._attempts.unanswered = False
        try:
            client.put_item(
                TableName=self.table_name,
                Item=item,
                ReturnValuesOnConditionCheckFailure="ALL_OLD",
                **self._absent_condition(),
            )
        except ClientError as error:
            details = error.response.get("Error", {})
            code = details.get("Code", "")
            if code == "ConditionalCheckFailedException":
                stored: dict[str, Any] | None = cast(dict[str, Any], error.response).get("Item")
                if stored is not None and _is_fence(stored):  # only keyless ids, never reused, are fenced
                    raise RuntimeError(f"run id {record.run_id} is fenced") from error
                return self.runs.from_raw_data(stored) if stored is not None else self._read_back(record)
            if self._attempts.unanswered or _unanswered(error):
                raise _unknown(record, f"DynamoDB answered {code}, and an attempt may have committed") from error
            if code == "ValidationException":
                raise RunNotStorable(details.get("Message", code)) from error
            raise _unavailable_or_original(error) from error
        except (ConnectionError, HTTPClientError) as error:
            if self._attempts.unanswered or not isinstance(error, _NOT_SENT):
                raise _unknown(record, f"{type(error).__name__}: {error}") from error
            raise StoreUnavailable(f"DynamoDB unreachable: {error}") from error
        except _NO_CREDENTIALS as error:  # refreshing them before an attempt failed: that attempt was not sent
            if self._attempts.unanswered:
                raise _unknown(record, f"{type(error).__name__}: {error}") from error
            raise StoreUnavailable(f"no credentials for DynamoDB: {error}") from error
        except Exception as error:
            if self._attempts.unanswered:
                raise _unknown(record, f"{type(error).__name__}: {error}") from error
            raise
        return None

    def _watched(self, client: Any) -> Any:
        """`client`, with `_note_attempt` hooked to its PutItem attempts. Hooked once per client: botocore's
        register inspects the handler's signature on every call, however often it was registered before."""
        if client is not self._watched_client:
            client.meta.events.register(
                "response-received.dynamodb.PutItem", self._note_attempt, unique_id="poimen.store.write-attempts"
            )
            self._watched_client = client
        return client

    def _absent_condition(self) -> dict[str, Any]:
        """The condition of a run's write: no item at its key, or (with retention) only an expired one.

        An item without `expires_at` (a run admitted before retention was set) never counts as expired.
        """
        if self.run_retention_days is None:
            return {"ConditionExpression": "attribute_not_exists(#pk)", "ExpressionAttributeNames": {"#pk": HASH_KEY}}
        return {
            "ConditionExpression": "attribute_not_exists(#pk) OR #expires_at < :now",
            "ExpressionAttributeNames": {"#pk": HASH_KEY, "#expires_at": EXPIRES_AT},
            "ExpressionAttributeValues": {":now": {"N": str(_now_seconds())}},
        }

    def _note_attempt(self, exception: Exception | None = None, response_dict: Any = None, **_: Any) -> None:
        """botocore's hook after each PutItem attempt: note one that may have committed unanswered."""
        sent_unanswered = exception is not None and not isinstance(exception, _NOT_SENT)
        if sent_unanswered or (response_dict is not None and response_dict.get("status_code", 0) >= 500):
            self._attempts.unanswered = True

    def _read_back(self, record: NewRun) -> RunRecord:
        """The run that failed `record`'s condition, read strongly consistently."""
        try:
            existing = self.get_run(record.tenant_id, record.run_id)
        except Exception as error:  # it exists: for a keyless record, that can only be our own write
            raise _unknown(record, f"reading it back failed: {type(error).__name__}: {error}") from error
        if existing is None:  # deleted (or a fence) between the write and the read
            raise _unknown(record, "its item existed, then was no run when read back")
        return existing

    def fence_run(self, record: NewRun) -> RunRecord | None:
        """After a keyless `record`'s write of unknown outcome: its run if the write committed, else None
        once a fence holds its key, so that the write (delayed, or retried inside DynamoDB) can never land.

        One conditional PutItem of the fence, one attempt: the condition reads the key strongly
        consistently and atomically with the fence. Keyed records are never fenced: a fence would block
        their key forever. OutcomeUnknown if the store cannot tell.
        """
        fence = {
            HASH_KEY: {"S": record.pk},
            ITEM_TYPE: {"S": FENCE},
            "attempt_id": {"S": record.attempt_id},
            "fenced_at": {"S": rfc3339()},
        }
        if self.run_retention_days is not None:  # a fence outlives its run's write by far, not forever
            fence[EXPIRES_AT] = {"N": str(expires_at(time.time() * 1000, self.run_retention_days))}
        try:
            self.resolution_client.put_item(
                TableName=self.table_name,
                Item=fence,
                ConditionExpression="attribute_not_exists(#pk)",
                ExpressionAttributeNames={"#pk": HASH_KEY},
                ReturnValuesOnConditionCheckFailure="ALL_OLD",
            )
        except ClientError as error:
            if error.response.get("Error", {}).get("Code") != "ConditionalCheckFailedException":
                raise _unknown(record, f"fencing it failed: {error}") from error
            stored = cast(dict[str, Any], error.response).get("Item")
            return self._run_or_fenced(record, stored)
        except Exception as error:
            raise _unknown(record, f"fencing it failed: {type(error).__name__}: {error}") from error
        return None

    def read_run_once(self, record: NewRun) -> RunRecord | None:
        """After a keyed `record`'s write of unknown outcome: the stored run, or None (not there now), read
        strongly consistently in one attempt. OutcomeUnknown if the store cannot be read."""
        return self._run_or_none(self._item_once(record))

    def _run_or_fenced(self, record: NewRun, stored: dict[str, Any] | None) -> RunRecord | None:
        if stored is None:  # a stand-in without ALL_OLD: read what failed the condition
            stored = self._item_once(record)
            if stored is None:
                raise _unknown(record, "its key was taken, then empty when read")
        # Never an expired run: keyless run ids are never reused, so nothing older is at this key.
        return None if _is_fence(stored) else self.runs.from_raw_data(stored)

    def _item_once(self, record: NewRun) -> dict[str, Any] | None:
        try:
            found = self.resolution_client.get_item(
                TableName=self.table_name, Key={HASH_KEY: {"S": record.pk}}, ConsistentRead=True
            )
        except Exception as error:
            raise _unknown(record, f"reading it back failed: {type(error).__name__}: {error}") from error
        item: dict[str, Any] | None = found.get("Item")
        return item

    def get_run(self, tenant_id: str, run_id: str) -> RunRecord | None:
        """The run, read strongly consistently; None if absent, fenced or expired (not yet deleted)."""
        with _translated_errors:
            found = self.client.get_item(
                TableName=self.table_name, Key={HASH_KEY: {"S": run_pk(tenant_id, run_id)}}, ConsistentRead=True
            )
        return self._run_or_none(found.get("Item"))

    def _run_or_none(self, item: dict[str, Any] | None) -> RunRecord | None:
        return None if item is None or _is_fence(item) or self._expired(item) else self.runs.from_raw_data(item)

    def _expired(self, item: dict[str, Any]) -> bool:
        """Whether, under retention, `item` is past its `expires_at` (as the write's condition tells it)."""
        if self.run_retention_days is None:
            return False
        stamp: dict[str, str] = item.get(EXPIRES_AT, {})
        return "N" in stamp and float(stamp["N"]) < _now_seconds()

    def granted_tenants(self, principal: str) -> frozenset[str]:
        with _translated_errors:
            try:
                record = self.grants.get(grant_pk(principal), consistent_read=True)
            except DoesNotExist:
                return frozenset()
        return frozenset(record.tenants or ())

    def grant(self, principal: str, tenant_id: str) -> None:
        with _translated_errors:
            self.grants(grant_pk(principal)).update(actions=[GrantRecord.tenants.add({tenant_id})])

    def revoke(self, principal: str, tenant_id: str) -> None:
        with _translated_errors:
            self.grants(grant_pk(principal)).update(actions=[GrantRecord.tenants.delete({tenant_id})])

    def all_grants(self) -> dict[str, frozenset[str]]:
        """Every principal with its tenants. A scan: for operators, never on a request path."""
        with _translated_errors:
            records = self.grants.scan(self.grants.pk.startswith(GRANT_PREFIX), consistent_read=True)
            return {
                record.pk.removeprefix(GRANT_PREFIX): frozenset(record.tenants) for record in records if record.tenants
            }


class _TranslatedErrors:
    """Transient failures of a read or a grant change as StoreUnavailable, from pynamodb or botocore. A class
    rather than a `contextlib.contextmanager` generator, which costs more to enter: every write enters it."""

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if isinstance(error, ClientError):
            translated = _unavailable_or_original(error)
            if translated is not error:
                raise translated from error
        elif isinstance(error, ConnectionError | HTTPClientError):
            raise StoreUnavailable(f"DynamoDB unreachable: {error}") from error
        elif isinstance(error, _NO_CREDENTIALS):
            raise StoreUnavailable(f"no credentials for DynamoDB: {error}") from error
        elif isinstance(error, PynamoDBException):
            cause = error.cause
            if isinstance(cause, ClientError):
                raise _unavailable_or_original(cause) from error
            if isinstance(cause, ConnectionError | HTTPClientError):
                raise StoreUnavailable(f"DynamoDB unreachable: {cause}") from error
            if isinstance(cause, _NO_CREDENTIALS):
                raise StoreUnavailable(f"no credentials for DynamoDB: {cause}") from error


_translated_errors = _TranslatedErrors()  # stateless: one for every thread


def item_size(item: dict[str, dict[str, str]]) -> int:
    """An item's size as DynamoDB counts it against its limit: for each attribute, the UTF-8 bytes of
    its name plus those of its value. Every run attribute is a string (DynamoDB Developer Guide, *Item
    sizes and formats*: a string is its UTF-8 bytes) but `expires_at`, a number: at most 21 bytes, counted
    here as its digits plus one, more than DynamoDB's (digits / 2) + 1."""
    # Joined, then encoded once: the UTF-8 length of a concatenation is the sum of its parts' (fewer steps a write).
    strings = [value["S"] for value in item.values() if "S" in value]
    numbers = [len(value["N"]) + 1 for value in item.values() if "S" not in value]
    return len("".join(item).encode()) + len("".join(strings).encode()) + sum(numbers)


# How long before their expiry botocore refreshes credentials, when it may and when it must: its own knobs (the
# attributes its constructor's advisory_timeout and mandatory_timeout set), 15 and 10 minutes by default.
_REFRESH_WINDOWS = ("_advisory_refresh_timeout", "_mandatory_refresh_timeout")


def _refresh_if_due(credentials: RefreshableCredentials) -> None:
    """Refresh `credentials` if botocore would before using them; StoreUnavailable when the endpoint answers
    credentials already expired (botocore's RuntimeError: nothing was sent)."""
    try:
        credentials.get_frozen_credentials()
    except RuntimeError as error:
        raise StoreUnavailable(f"no valid credentials for DynamoDB: {error}") from error


def _now_seconds() -> int:
    return int(time.time())


def _is_fence(item: dict[str, Any]) -> bool:
    marker: dict[str, str] = item.get(ITEM_TYPE, {})
    return marker.get("S") == FENCE


def _unanswered(error: ClientError) -> bool:
    """Whether DynamoDB's error answer leaves open that it performed the write (a 5xx)."""
    status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    return status >= 500 or error.response.get("Error", {}).get("Code") in _UNKNOWN_OUTCOME_CODES


def _unknown(record: NewRun, reason: str) -> OutcomeUnknown:
    return OutcomeUnknown(record.run_id, reason, keyed=record.dispatch_key is not None)


def _unavailable_or_original(error: ClientError) -> Exception:
    code = error.response.get("Error", {}).get("Code", "")
    if code in _TRANSIENT_CODES:
        return StoreUnavailable(f"DynamoDB answered {code} after retries", throttled=code in _THROTTLING_CODES)
    return error
