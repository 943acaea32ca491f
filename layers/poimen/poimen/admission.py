"""The admission rule: admit a run, or hand back the run its dispatch_key already admitted.

Exactly-once lives here and nowhere else: one conditional write per admission, no read before it
(check-then-insert races under redelivery), and no deduplication of requests without a key. Admission
answers for everything it writes: the item and the answer are both built before the write, so a
request that could fail does so with nothing stored.

A write whose outcome is unknown (sent, then its answer lost or a 5xx) is resolved before answering,
so that every 5xx is safe to retry as it says: a keyless run's key is fenced unless the run is there
(found: 201; fenced: nothing written, 503 store-unavailable); a keyed run is read back (found: as any
write; absent: 503 outcome-unknown, as a retry with the key can only admit that run). If the store
cannot be asked, 503 outcome-unknown names the run, for the caller to GET rather than send again.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Protocol

from poimen.contract import RunRequest, json_text, parse_json, run_json
from poimen.errors import (
    DispatchKeyReused,
    IdentityMissing,
    OutcomeUnknown,
    RunNotFound,
    StoreUnavailable,
    TenantNotGranted,
    TenantNotServed,
)
from poimen.ids import keyed_run_id, new_attempt_id, request_fingerprint, unkeyed_run_id
from poimen.store import NewRun, RunRecord, Store
from poimen.wire import rfc3339

ALL_TENANTS = "*"
_ASSUMED_ROLE = re.compile(r"^arn:(?P<partition>[^:]+):sts::(?P<account>\d+):assumed-role/(?P<role>[^/]+)/.+$")


def normalise_principal(arn: str) -> str:
    """The principal grants are kept for: an assumed-role session counts as its role.

    STS session ARNs carry no role path, so grants name roles as `arn:<partition>:iam::<acct>:role/<name>`.
    """
    match = _ASSUMED_ROLE.match(arn)
    if match is None:
        return arn
    return f"arn:{match['partition']}:iam::{match['account']}:role/{match['role']}"


@dataclass(frozen=True, slots=True)
class RunView:
    """A stored run and `body`, the JSON the API answers for it (its input as the caller sent it)."""

    run_id: str
    tenant_id: str
    dispatch_key: str | None
    created_at: str
    body: str


@dataclass(frozen=True, slots=True)
class Admitted:
    run: RunView
    replayed: bool


class Admission:
    """Admission for one table. Grants are cached per principal to keep admission at one call."""

    def __init__(
        self,
        store: Store,
        grants_cache_seconds: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        tenants: Collection[str],
        refusal_cache_seconds: float = 5.0,
        trusted: Mapping[str, frozenset[str]] | None = None,
    ) -> None:
        self._store = store
        # The tenants the stack serves: any other is refused before its grants are read.
        self._tenants = frozenset(tenants)
        self._grants_ttl = grants_cache_seconds
        self._refusal_ttl = min(refusal_cache_seconds, grants_cache_seconds)
        self._clock = clock
        # Principals the deploy trusts for some tenants (the stack's relay), by their normalised ARN.
        self._trusted = {normalise_principal(arn): tenants for arn, tenants in (trusted or {}).items()}
        # Plain dict: a single assignment is atomic under the GIL, and a lost race only costs a read.
        # Each entry: when its tenants were read, and the tenants.
        self._grants: dict[str, tuple[float, frozenset[str]]] = {}

    def connected(self) -> contextlib.AbstractContextManager[None]:
        """The store's clients built in this thread, signing with the credentials they have now until the block ends
        (`Store.connected`): a batch's, for its admitting threads to share. StoreUnavailable if no valid credentials
        can be had."""
        return self._store.connected()

    def admit_run(
        self,
        principal: str | None,
        tenant_id: str,
        request: RunRequest,
        *,
        traceparent: str | None = None,
        authorized: bool = False,
    ) -> Admitted:
        """`authorized`: the caller checked `authorize(principal, tenant_id)` for this request already (a batch,
        once for its spawns), so no spawn of it reads the grants again."""
        if not authorized:
            self.authorize(principal, tenant_id)
        key = request.dispatch_key
        run_id = keyed_run_id(tenant_id, key) if key is not None else unkeyed_run_id()
        fingerprint = request_fingerprint(request.workflow_ref, request.input, request.goal_id)
        attempt_id = new_attempt_id()
        created_at = _now()
        input_json = json_text(request.input)
        # The answer is built from the record before the write (so that no run is stored that could not be
        # answered), by the same `_as_run` as a stored run's, not read back.
        record = NewRun(
            run_id=run_id,
            tenant_id=tenant_id,
            workflow_ref=request.workflow_ref,
            input_json=input_json,
            goal_id=request.goal_id,
            dispatch_key=key,
            fingerprint=fingerprint,
            attempt_id=attempt_id,
            status="admitted",
            created_at=created_at,
            traceparent=traceparent,
        )
        answer = _as_run(record)
        try:
            existing = self._store.put_run_if_absent(record)
        except OutcomeUnknown as unknown:
            existing = self._resolve(record, unknown)
        if existing is None or existing.attempt_id == attempt_id:
            # None: written now. Same attempt: a retried PutItem found the item its lost first try wrote.
            return Admitted(answer, replayed=False)
        if key is None:
            # Only a UUIDv7 collision (74 random bits within one millisecond) gets here; never overwrite.
            raise RuntimeError(f"run id {run_id} already exists")
        if existing.fingerprint != fingerprint and not _asks_for(existing, fingerprint):
            raise DispatchKeyReused(existing.run_id)
        return Admitted(_as_run(existing), replayed=True)

    def _resolve(self, record: NewRun, unknown: OutcomeUnknown) -> RunRecord:
        """The stored run after `record`'s write of unknown outcome; else StoreUnavailable once nothing can
        have been written, or `unknown` again while a write may still land or the store cannot tell."""
        if record.dispatch_key is None:
            # Nobody else ever writes this run id, so a fence on it ends the write's chances for good.
            existing = self._store.fence_run(record)
            if existing is None:
                raise StoreUnavailable(f"run {record.run_id} was not written, and its id is fenced") from unknown
            return existing
        # A key is never fenced (that would refuse it forever): absent now, the write may still land, and
        # a retry with the key can only admit, or replay, this same run.
        existing = self._store.read_run_once(record)
        if existing is None:
            raise unknown
        return existing

    def get_run(self, principal: str | None, tenant_id: str, run_id: str) -> RunView:
        self.authorize(principal, tenant_id)
        record = self._store.get_run(tenant_id, run_id)
        if record is None:
            raise RunNotFound(run_id)
        return _as_run(record)

    def find_run_by_dispatch_key(self, principal: str | None, tenant_id: str, dispatch_key: str) -> RunView:
        """The reconciliation look-up: the run id is derived from the key, so this is one GetItem."""
        return self.get_run(principal, tenant_id, keyed_run_id(tenant_id, dispatch_key))

    def authorize(self, principal: str | None, tenant_id: str) -> None:
        """Whether `principal` may act for `tenant_id`: IdentityMissing, TenantNotServed (whatever its grants:
        the stack cannot serve that tenant), TenantNotGranted; else it may."""
        if not principal:
            raise IdentityMissing("the request carries no authenticated principal")
        if tenant_id not in self._tenants:
            raise TenantNotServed(tenant_id)
        normalised = normalise_principal(principal)
        if tenant_id in self._trusted.get(normalised, frozenset()):
            return
        now = self._clock()
        cached = self._grants.get(normalised)
        # A cached grant is used for the full cache time, a cached refusal only briefly.
        if cached is not None and _grants(cached[1], tenant_id):
            fresh = now - cached[0] < self._grants_ttl
        else:
            fresh = cached is not None and now - cached[0] < self._refusal_ttl
        tenants = cached[1] if cached is not None and fresh else self._read_grants(normalised, now)
        if not _grants(tenants, tenant_id):
            raise TenantNotGranted(normalised, tenant_id)

    def _read_grants(self, principal: str, now: float) -> frozenset[str]:
        tenants = self._store.granted_tenants(principal)
        if self._grants_ttl > 0:
            self._grants[principal] = (now, tenants)
        return tenants


def _grants(tenants: frozenset[str], tenant_id: str) -> bool:
    return tenant_id in tenants or ALL_TENANTS in tenants


def _now() -> str:
    return rfc3339()


class _Run(Protocol):
    """What a run's answer is made of: a stored `RunRecord`, or the `NewRun` about to be written."""

    @property
    def run_id(self) -> str: ...
    @property
    def tenant_id(self) -> str: ...
    @property
    def workflow_ref(self) -> str: ...
    @property
    def input_json(self) -> str: ...
    @property
    def goal_id(self) -> str | None: ...
    @property
    def dispatch_key(self) -> str | None: ...
    @property
    def created_at(self) -> str: ...


def _as_run(record: _Run) -> RunView:
    body = run_json(
        run_id=record.run_id,
        tenant_id=record.tenant_id,
        workflow_ref=record.workflow_ref,
        input_json=record.input_json,
        goal_id=record.goal_id,
        dispatch_key=record.dispatch_key,
        created_at=record.created_at,
    )
    return RunView(record.run_id, record.tenant_id, record.dispatch_key, record.created_at, body)


def _asks_for(record: RunRecord, fingerprint: str) -> bool:
    """Whether the stored run's request has `fingerprint` under today's rule, so that a run fingerprinted
    under an earlier one (numbers compared as doubles) still replays the same request."""
    try:
        stored_input = parse_json(record.input_json)
    except ValueError:  # stored before today's limits (nesting): no request admitted today is the same
        return False
    return request_fingerprint(record.workflow_ref, stored_input, record.goal_id) == fingerprint
