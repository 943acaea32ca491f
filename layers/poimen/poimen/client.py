"""A typed Python client of the admission API: SigV4-signed HTTP, retries that never admit a run twice,
failover between the API's regional endpoints (a multi-Region stack), and each tenant's calls sent to its
own cell's endpoints (a cell map, `poimen.cells`), failing over within that cell only.

It knows only the HTTP contract (`poimen.contract`), as the relay does, and shares no path with it to
the store: it never imports the store, admission or the API module (a test enforces it). Nothing in the
Lambda functions imports it. See docs/client.md.

Every spawn carries a dispatch_key. A spawn without one gets a key generated for that call
(`poimen-client/<uuid4>`), reused only by that call's own retries: a retry after a lost answer replays
the run the first attempt admitted, and two calls are still two runs, as two keyless POSTs are. A retry
may go to another Region's endpoint with the same key: the table is one global table (MRSC), whose
conditional write is checked against every Region, so the move cannot admit the run twice either. A retry
never goes to another cell: its table is another table, where the key would admit a second run.
"""

from __future__ import annotations

import functools
import json
import random
import re
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, cast
from urllib.parse import quote, urlsplit, urlunsplit

import botocore.credentials
import botocore.exceptions
import botocore.session
import urllib3
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from pydantic import ValidationError

from poimen.cells import CELLS_DOCUMENT_VARIABLE, CELLS_FILE_VARIABLE, CellMap
from poimen.contract import Problem, Run, json_text, parse_json
from poimen.endpoints import RegionalEndpoint, Rotation, regional_endpoint
from poimen.wire import (
    ENVELOPE_REFUSED_STATUSES,
    MAX_BATCH_BODY_BYTES,
    MAX_BATCH_SPAWNS,
    REPLAYED_HEADER,
    SPAWN_RESULTS_MEDIA_TYPE,
    SPAWNS_MEDIA_TYPE,
    TENANT_HEADER,
    TENANT_PATTERN,
    retry_after_seconds,
)

__all__ = [
    "GENERATED_KEY_PREFIX",
    "AdmissionClient",
    "AdmissionError",
    "CellRoutingError",
    "DispatchKeyReused",
    "Forbidden",
    "InvalidRequest",
    "NotFound",
    "OutcomeUnknown",
    "RegionalEndpoint",
    "SpawnRequest",
    "Spawned",
    "TenantInNoCell",
    "TenantInSeveralCells",
    "Unavailable",
    "UnexpectedAnswer",
    "generated_dispatch_key",
]

# The prefix of the dispatch keys this client generates for keyless spawns; 14 + 36 characters, well
# inside the API's 1-255 and free of control characters. Callers should not choose keys with it.
GENERATED_KEY_PREFIX: Final = "poimen-client/"
RETRYABLE_STATUSES: Final = frozenset({408, 429}) | frozenset(range(500, 600))
SERVICE: Final = "execute-api"
RUN_NOT_FOUND: Final = "urn:poimen:problem:run-not-found"
DISPATCH_KEY_REUSED: Final = "urn:poimen:problem:dispatch-key-reused"
OUTCOME_UNKNOWN: Final = "urn:poimen:problem:outcome-unknown"
STORE_UNAVAILABLE: Final = "urn:poimen:problem:store-unavailable"
# 403: the stack does not serve the tenant (not in its Tenants), whatever the grants: another cell's API, say.
TENANT_NOT_SERVED: Final = "urn:poimen:problem:tenant-not-served"
# Longer than the admission function's own 13 s timeout (template.yaml): a slow invocation ends in the
# gateway's answer rather than in the client giving up first.
DEFAULT_TIMEOUT_SECONDS: Final = 15.0
DEFAULT_MAX_ATTEMPTS: Final = 5
_TENANT = re.compile(TENANT_PATTERN)
# A host name's trailing dots (a fully qualified name), before the port if any: urllib3 sends the Host header
# without them (SSL certificates and servers expect none), so the signature is over the host without them.
_ROOT_DOTS = re.compile(r"\.+(?=(:[0-9]*)?$)")


class AdmissionError(Exception):
    """Any failure of a call. `status` is the HTTP status (None: no answer, or refused before sending);
    `problem` the RFC 9457 problem the API answered (None for API Gateway's own `{"message": ...}`
    refusals and for failures without an answer); `body` the answer's body as parsed JSON (or text);
    `endpoint` the endpoint whose answer it is, for a refusal (None otherwise).

    `attempts`: the attempts the call made, the failing one included (0: refused before any). `dispatch_key`:
    for a spawn, its key, yours or the one generated for the call (None for get and find).
    `outcome_unknown`: some attempt may have reached the API and written, its answer lost or not telling
    (a timeout, a dropped connection, a 5xx other than `store-unavailable`); False when every attempt
    either never connected, was throttled (429), was answered `store-unavailable` (nothing written), or
    was answered by this refusal itself. A spawn failing with an unknown outcome may have admitted a run
    under `dispatch_key`: a spawn with the same key admits it at most once, `find(tenant,
    error.dispatch_key)` says whether it did, and a spawn without it may admit a second run."""

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        problem: Problem | None = None,
        body: Any = None,
        attempts: int = 0,
        outcome_unknown: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.problem = problem
        self.body = body
        self.attempts = attempts
        self.outcome_unknown = outcome_unknown
        self.dispatch_key: str | None = None
        self.endpoint: RegionalEndpoint | None = None  # the endpoint that answered a refusal


class InvalidRequest(AdmissionError):
    """400, 413 or 415: the request itself is wrong (or it could not be built: status None)."""


class Forbidden(AdmissionError):
    """403: the caller is not granted the tenant, or its signature was refused (API Gateway's IAM check)."""


class NotFound(AdmissionError):
    """404: no such run for this tenant (problem type run-not-found), or no such route (a wrong base URL)."""


class DispatchKeyReused(AdmissionError):
    """422: the dispatch_key already admitted `run_id`, for a different workflow_ref, input or goal_id."""

    def __init__(self, message: str, *, run_id: str, **answer: Any) -> None:
        super().__init__(message, **answer)
        self.run_id = run_id


class Unavailable(AdmissionError):
    """No answer, or only 408, 429 and 5xx, after every attempt; or every endpoint asked to wait longer than
    `max_retry_after`. `retry_after` is how long, in seconds, the endpoint the next call goes to asked to
    be left alone from now (None if it asked nothing, or that has passed); `endpoints` the endpoints the
    attempts went to, in the order first tried."""

    def __init__(
        self,
        message: str,
        *,
        attempts: int,
        endpoints: tuple[RegionalEndpoint, ...] = (),
        retry_after: float | None = None,
        status: int | None = None,
        problem: Problem | None = None,
        body: Any = None,
        outcome_unknown: bool = False,
    ) -> None:
        super().__init__(
            message, status=status, problem=problem, body=body, attempts=attempts, outcome_unknown=outcome_unknown
        )
        self.endpoints = endpoints
        self.retry_after = retry_after


class OutcomeUnknown(Unavailable):
    """The API could not tell, on the last attempt, whether the spawn admitted `run_id` (503 outcome-unknown).

    Every spawn of this client carries a dispatch_key (`dispatch_key`, generated or the caller's), so each
    retry could only admit or replay that run; after the last one it may or may not exist. Find out with
    `get(tenant, run_id)` or `find(tenant, dispatch_key)`, or spawn again with the same dispatch_key:
    never without it, which could admit a second run."""

    def __init__(self, message: str, *, run_id: str, attempts: int, **answer: Any) -> None:
        super().__init__(message, attempts=attempts, outcome_unknown=True, **answer)
        self.run_id = run_id


class UnexpectedAnswer(AdmissionError):
    """An answer the contract does not define (a redirect, 401, 405, a success that is not a run):
    usually a base URL that is not the admission API."""


class CellRoutingError(AdmissionError):
    """The client's cell map does not route `tenant` to one cell: nothing was sent (`status` None, `attempts`
    0). `cells` names the cells that list it (none, or several)."""

    def __init__(self, message: str, *, tenant: str, cells: tuple[str, ...]) -> None:
        super().__init__(message)
        self.tenant = tenant
        self.cells = cells


class TenantInNoCell(CellRoutingError):
    """No cell of the map lists the tenant: add it to the cell that serves it."""


class TenantInSeveralCells(CellRoutingError):
    """Several cells of the map list the tenant: each would admit its keys in its own table, so a key could be
    admitted twice. A cell map lists a tenant in one cell only (the one `make deploy` serves it in)."""


@dataclass(frozen=True)
class Spawned:
    """The answer to a spawn.

    `replayed`: the API answered 200 `Idempotent-Replayed: true`, the dispatch_key had admitted this run
    before. With a key of the caller's, that may have been an earlier spawn or an earlier attempt of this
    same call whose answer was lost (`attempts` > 1); with a generated key it can only be the latter, so
    it is always False: the call admitted the run. `run.dispatch_key` is the key sent, generated or not.
    `endpoint` is the endpoint that answered (after a failover, not the first one tried).
    """

    run: Run
    replayed: bool
    attempts: int
    endpoint: RegionalEndpoint

    @property
    def run_id(self) -> str:
        return self.run.run_id


@dataclass(frozen=True)
class SpawnRequest:
    """One spawn of `AdmissionClient.spawn_many`: what `spawn` takes."""

    workflow_ref: str
    input: Mapping[str, Any]
    goal_id: str | None = None
    dispatch_key: str | None = None


# The batch envelope's bytes besides its spawns (`{"spawns":[`, `]}`), and each spawn's comma.
_ENVELOPE_BYTES = 16


def generated_dispatch_key() -> str:
    """A fresh key for one keyless spawn: `poimen-client/` and a random UUID."""
    return f"{GENERATED_KEY_PREFIX}{uuid.uuid4()}"


@dataclass(frozen=True)
class _Answer:
    status: int
    headers: Mapping[str, str]
    data: bytes
    attempts: int
    endpoint: RegionalEndpoint
    reached_before: bool = False  # an earlier attempt of the call may have reached the API and written


class AdmissionClient:
    """The admission API at `base_url` (the stack output AdmissionApiUrl, or `poimen dev`'s URL), or at
    several regional endpoints of one multi-Region stack, in order of preference; or, with `cells`, at the
    endpoints of each tenant's cell.

    `base_url` is a URL, a RegionalEndpoint, or a sequence of them. A URL's Region is `region` if given,
    else the one in an execute-api host name, else the SDK's configured region; a RegionalEndpoint names
    its own. `cells` (a `poimen.cells.CellMap`) instead sends each call to the endpoints of the one cell
    that lists its tenant, whose URLs get their Regions the same way; a tenant listed in no cell, or in
    several, raises TenantInNoCell or TenantInSeveralCells before anything is sent. With neither, the map
    is the environment's (`POIMEN_CELLS_FILE`, or `POIMEN_CELLS`). Calls are signed with SigV4 for
    execute-api and the Region of the endpoint they go to, as IAM authorization requires: with
    `credentials`, else the standard botocore chain (environment, profile, SSO, container or instance
    role), resolved once and refreshed by botocore as they expire.

    Each attempt is re-signed and bounded by `timeout` seconds (connect, and each read). Connection
    errors, timeouts, 408, 429 and 5xx are retried up to `max_attempts` attempts in all, after a
    full-jitter exponential backoff (uniform in [0, min(backoff_cap, backoff_base * 2^n)]). Each of those
    failures also moves the client to the next endpoint (round robin) of the same stack or cell, where the
    next attempt goes, and every later call: it stays there until that one fails in turn. Each cell keeps
    its own place, and a call never leaves its tenant's cell. A `Retry-After` holds back every
    attempt to the endpoint that sent it, of this call and of later ones, until it has passed: the move
    skips an endpoint held back longer than the backoff when another is ready by then, and waits for the
    first to accept when none is; one that would wait more than `max_retry_after` seconds ends the call
    with Unavailable at once, and so does every call that would wait for it in the next `max_retry_after`
    seconds, after which the endpoint is called again: a Retry-After holds an endpoint back
    `max_retry_after` at most. Other answers (4xx) are final, wherever they come from. `sleep`, `clock`
    (monotonic seconds) and `rng` are there for tests. Safe to share between threads.
    """

    def __init__(
        self,
        base_url: str | RegionalEndpoint | Sequence[str | RegionalEndpoint] | None = None,
        *,
        cells: CellMap | None = None,
        region: str | None = None,
        credentials: botocore.credentials.Credentials | None = None,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        backoff_base: float = 0.25,
        backoff_cap: float = 8.0,
        max_retry_after: float = 60.0,
        http: urllib3.PoolManager | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        if base_url is not None and cells is not None:
            raise ValueError("give base_url or cells, not both")
        if base_url is None and cells is None:
            cells = CellMap.from_environment()
            if cells is None:
                variables = f"{CELLS_FILE_VARIABLE} (or {CELLS_DOCUMENT_VARIABLE})"
                raise ValueError(f"no endpoint: give base_url or cells, or set {variables} to a cell map")
        if max_attempts < 1 or timeout <= 0:
            raise ValueError("max_attempts must be at least 1 and timeout positive")
        # The SDK's configuration is read only when something is left to it: a URL's region, the credentials.
        session = functools.cache(botocore.session.get_session)

        def rotation(entries: Sequence[str | RegionalEndpoint], label: str = "") -> Rotation:
            return Rotation(
                tuple(regional_endpoint(entry, region, session) for entry in entries), max_retry_after, label
            )

        self._cells = cells
        # One rotation per set of endpoints that share a table: the only one (key None), or one per cell.
        self._rotations: dict[str | None, Rotation]
        if cells is None:
            given = [base_url] if isinstance(base_url, str | RegionalEndpoint) else list(base_url or [])
            self._rotations = {None: rotation(given)}
        else:
            self._rotations = {cell.name: rotation(cell.endpoints, f"cell {cell.name}") for cell in cells.cells}
        if credentials is None:
            credentials = session().get_credentials()
            if credentials is None:
                raise ValueError("no AWS credentials found to sign admission API calls with")
        self._credentials = credentials
        self._timeout = urllib3.Timeout(connect=timeout, read=timeout)
        self._max_attempts = max_attempts
        self._backoff_base = backoff_base
        self._backoff_cap = backoff_cap
        self._max_retry_after = max_retry_after
        self._http = http or urllib3.PoolManager(retries=False)
        self._sleep = sleep
        self._clock = clock
        # Backoff jitter spreads retries; it is not security-relevant randomness.
        self._rng = rng or random.Random()  # noqa: S311

    @property
    def endpoints(self) -> tuple[RegionalEndpoint, ...]:
        """Every endpoint, in order of preference (with cells: each cell's, in the map's order)."""
        return tuple(endpoint for rotation in self._rotations.values() for endpoint in rotation.endpoints)

    @property
    def endpoint(self) -> RegionalEndpoint:
        """The endpoint the next call goes to: the first, until a failure moved the client on. A client of
        cells has one per cell: see endpoint_for."""
        if self._cells is not None:
            raise ValueError("a client of cells routes by tenant: endpoint_for(tenant) is where its calls go")
        return self._rotations[None].endpoint

    @property
    def base_url(self) -> str:
        return self.endpoint.url

    @property
    def region(self) -> str:
        return self.endpoint.region

    def endpoint_for(self, tenant: str) -> RegionalEndpoint:
        """The endpoint the next call for `tenant` goes to (its cell's, with cells); raises as a call would
        for a tenant that is not one, or that the cell map does not route to one cell."""
        return self._rotation(tenant).endpoint

    def __enter__(self) -> AdmissionClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.clear()

    def spawn(
        self,
        tenant: str,
        workflow_ref: str,
        input: Mapping[str, Any],
        *,
        goal_id: str | None = None,
        dispatch_key: str | None = None,
    ) -> Spawned:
        """POST /v1/runs. Without `dispatch_key`, a key is generated for this call (see the module doc):
        however often it retries, it admits at most one run. Raises DispatchKeyReused, Forbidden,
        InvalidRequest, Unavailable (OutcomeUnknown if the last answer could not tell whether the run was
        admitted: it names the run), or another AdmissionError; each sent carries the key in `dispatch_key`,
        which is the only way to retry a keyless spawn safely once its outcome is unknown."""
        key = generated_dispatch_key() if dispatch_key is None else dispatch_key
        body = _spawn_body(SpawnRequest(workflow_ref, input, goal_id), key)
        return self._spawn_alone(tenant, body, key, generated=dispatch_key is None)

    def _spawn_alone(
        self, tenant: str, body: bytes, key: str, *, generated: bool, carried: int = 0, reached: bool = False
    ) -> Spawned:
        """One spawn's POST /v1/runs of `body` (its dispatch_key `key`), as `spawn` sends it; `carried`: the attempts
        of calls that carried it before (a batch refused whole), and `reached` whether one may have admitted it."""
        try:
            answer = self._call("POST", "/v1/runs", tenant, body=body)
            if answer.status not in (200, 201):
                raise _refusal(answer)
            run = _run(answer)
        except AdmissionError as error:
            error.dispatch_key = key  # the only way back to a run it may have admitted (a generated key)
            error.attempts += carried
            error.outcome_unknown = error.outcome_unknown or reached
            raise
        replayed = answer.status == 200 and answer.headers.get(REPLAYED_HEADER, "").lower() == "true"
        attempts = carried + answer.attempts
        return Spawned(run, replayed=replayed and not generated, attempts=attempts, endpoint=answer.endpoint)

    def spawn_many(self, tenant: str, spawns: Sequence[SpawnRequest]) -> list[Spawned | AdmissionError]:
        """POST /v1/runs in the batch form: the spawns in as few calls as the API's limits allow (MAX_BATCH_SPAWNS
        a call, MAX_BATCH_BODY_BYTES a body), in order. One result a spawn, in order: its Spawned, or the
        AdmissionError `spawn` would raise for it alone, its `dispatch_key` set. Every spawn carries a key
        (generated as `spawn` does when it has none), so a call, or a spawn of it answered 408/429/5xx, is
        sent again (up to `max_attempts` in all, as `spawn`'s retries), and can only admit or replay its run.
        A failure of a whole call (Forbidden, Unavailable, ...) is the result of each spawn it carried; only
        a tenant that is not one (or no cell's) raises, before anything is sent."""
        self._rotation(tenant)
        results: list[Spawned | AdmissionError | None] = [None] * len(spawns)
        keys: list[str] = []
        bodies: list[tuple[int, bytes]] = []
        for index, spawn in enumerate(spawns):
            key = generated_dispatch_key() if spawn.dispatch_key is None else spawn.dispatch_key
            keys.append(key)
            try:
                bodies.append((index, _spawn_body(spawn, key)))
            except InvalidRequest as refused:
                results[index] = _named(refused, key)
        generated = [spawn.dispatch_key is None for spawn in spawns]
        for chunk in _batches(bodies):
            self._spawn_chunk(tenant, chunk, keys, generated, results)
        return cast("list[Spawned | AdmissionError]", results)  # each set: by its encoding, or by its chunk

    def _spawn_chunk(
        self,
        tenant: str,
        chunk: list[tuple[int, bytes]],
        keys: list[str],
        generated: list[bool],
        results: list[Spawned | AdmissionError | None],
    ) -> None:
        """One batch call of `chunk` (index, body), its spawns answered 408/429/5xx sent again in the next; when a
        call's answer refuses the batch whole (ENVELOPE_REFUSED_STATUSES: a body the API reads in none, whichever spawn
        made it so), each of its spawns sent again alone, as `spawn` sends it, for its own answer."""
        pending = chunk
        # Per spawn, as `_call`'s `reached` for one: whether a call so far may have admitted it (an earlier call's
        # outcome unknown is not undone by a later answer that wrote nothing).
        reached = dict.fromkeys((index for index, _ in chunk), False)
        for attempt in range(1, self._max_attempts + 1):
            body = b'{"spawns":[' + b",".join(spawn for _, spawn in pending) + b"]}"
            try:
                answer = self._call("POST", "/v1/runs", tenant, body=body, media=SPAWNS_MEDIA_TYPE)
                found = _batch_results(answer, len(pending))
            except AdmissionError as error:
                if error.status in ENVELOPE_REFUSED_STATUSES:
                    for index, spawn_body in pending:
                        try:
                            results[index] = self._spawn_alone(
                                tenant,
                                spawn_body,
                                keys[index],
                                generated=generated[index],
                                carried=error.attempts + attempt - 1,
                                # an earlier attempt of the call refused whole may have admitted it (its answer lost)
                                reached=reached[index] or error.outcome_unknown,
                            )
                        except AdmissionError as alone:
                            results[index] = alone
                    return
                for index, _ in pending:
                    failed = _for_key(error, keys[index])
                    failed.outcome_unknown = failed.outcome_unknown or reached[index]
                    results[index] = failed
                return
            again: list[tuple[int, bytes]] = []
            retry_after = 0.0
            for (index, spawn_body), result in zip(pending, found, strict=True):
                status = result["status"]
                data = json_text(result.get("run", result.get("problem"))).encode("utf-8")
                headers = {} if result.get("retry_after") is None else {"Retry-After": str(result["retry_after"])}
                before = reached[index] or answer.reached_before
                item = _Answer(status, headers, data, answer.attempts + attempt - 1, answer.endpoint, before)
                reached[index] = before or (status in RETRYABLE_STATUSES and not _nothing_written(item))
                if status in (200, 201):
                    try:
                        run = _run(item)
                    except UnexpectedAnswer as garbled:  # that spawn's answer alone: the others' stand
                        results[index] = _named(garbled, keys[index])
                        continue
                    replayed = status == 200 and not generated[index]
                    results[index] = Spawned(run, replayed=replayed, attempts=item.attempts, endpoint=item.endpoint)
                elif status in RETRYABLE_STATUSES and attempt < self._max_attempts:
                    again.append((index, spawn_body))
                    retry_after = max(retry_after, retry_after_seconds(headers.get("Retry-After")) or 0.0)
                else:
                    failed = (
                        _refusal(item)
                        if status not in RETRYABLE_STATUSES
                        else _unavailable(
                            f"unavailable after {attempt} calls",
                            item.attempts,
                            (item.endpoint,),
                            None,
                            item,
                            reached[index],
                        )
                    )
                    results[index] = _named(failed, keys[index])
            if not again:
                return
            pending = again
            self._sleep(max(retry_after, self._backoff(attempt - 1)))

    def get(self, tenant: str, run_id: str) -> Run:
        """GET /v1/runs/{run_id}. Raises NotFound (no such run for this tenant), Forbidden, ..."""
        answer = self._call("GET", f"/v1/runs/{_quoted(run_id, '', 'run_id')}", tenant)
        if answer.status != 200:
            raise _refusal(answer)
        return _run(answer)

    def find(self, tenant: str, dispatch_key: str) -> Run | None:
        """GET /v1/runs?dispatch_key=: the run the key admitted, or None. A 404 that is not the API's
        run-not-found (a route the API does not have: a wrong base URL) raises NotFound."""
        answer = self._call(
            "GET", "/v1/runs", tenant, query=f"dispatch_key={_quoted(dispatch_key, '-_.~', 'dispatch_key')}"
        )
        if answer.status == 200:
            return _run(answer)
        refusal = _refusal(answer)
        if isinstance(refusal, NotFound) and refusal.problem is not None and refusal.problem.type == RUN_NOT_FOUND:
            return None
        raise refusal

    # --- one call: sign, send, retry, fail over ---------------------------------------------------------

    def _rotation(self, tenant: str) -> Rotation:
        """The endpoints `tenant`'s calls go to: the client's, or those of the one cell that lists it."""
        if not _TENANT.fullmatch(tenant):
            raise InvalidRequest(f"tenant {tenant!r} does not match {TENANT_PATTERN}")
        if self._cells is None:
            return self._rotations[None]
        found = self._cells.cells_of(tenant)
        if len(found) == 1:
            return self._rotations[found[0].name]
        names = tuple(cell.name for cell in found)
        source = self._cells.source
        if not names:
            message = (
                f"tenant {tenant} is in no cell of {source} (cells {self._cells.names()}): nothing was sent; add it "
                "to the tenants of the cell that serves it (the one make deploy serves it in)"
            )
            raise TenantInNoCell(message, tenant=tenant, cells=names)
        listed = ", ".join(names[:-1]) + f" and {names[-1]}"
        message = (
            f"tenant {tenant} is in cells {listed} of {source}: nothing was sent, as each cell would admit its "
            "dispatch keys in its own table (a key admitted twice); list it in the one cell that serves it"
        )
        raise TenantInSeveralCells(message, tenant=tenant, cells=names)

    def _call(
        self,
        method: str,
        path: str,
        tenant: str,
        *,
        body: bytes = b"",
        query: str = "",
        media: str = "application/json",
    ) -> _Answer:
        rotation = self._rotation(tenant)
        # Encoded here as SigV4 canonicalises a query (unreserved characters bare, upper-case hex), so the
        # URL sent is the one signed: botocore signs a query as it finds it.
        target = path + (f"?{query}" if query else "")
        headers = {TENANT_HEADER: tenant}
        if method == "POST":
            headers["Content-Type"] = media
        attempt = 0
        tried: list[RegionalEndpoint] = []
        reached = False  # whether an attempt so far may have reached the API and written (see AdmissionError)
        # An endpoint may still be holding back an earlier call's retries: the first attempt waits for it too.
        index, hold = rotation.next(None, self._clock(), 0.0)
        if hold > self._max_retry_after:
            raise _unavailable(rotation.held_back(index, hold), 0, (), hold, None)
        if hold > 0:
            self._sleep(hold)
        while True:
            attempt += 1
            endpoint = rotation.endpoints[index]
            if endpoint not in tried:
                tried.append(endpoint)
            url = f"{endpoint.url}{target}"
            retry_after: float | None = None
            last: _Answer | None = None
            try:
                signed = self._signed(method, url, headers, body, endpoint.region)
            except AdmissionError as error:
                error.attempts, error.outcome_unknown = attempt, reached
                raise
            try:
                response = self._http.request(
                    method,
                    url,
                    body=body if method == "POST" else None,
                    headers=signed,
                    timeout=self._timeout,
                    redirect=False,
                )
            except urllib3.exceptions.HTTPError as error:  # refused, reset, dropped, timed out
                failure = f"{type(error).__name__}: {error}"
                # A connection never made carried nothing; anything later may have reached the API.
                reached = reached or not isinstance(error, urllib3.exceptions.ConnectTimeoutError)
            else:
                answer = _Answer(response.status, response.headers, response.data, attempt, endpoint, reached)
                if response.status not in RETRYABLE_STATUSES:
                    return answer
                last = answer
                failure = f"HTTP {response.status}"
                retry_after = retry_after_seconds(response.headers.get("Retry-After"))
                reached = reached or not _nothing_written(answer)
            # A Retry-After speaks for the endpoint that sent it, not for another Region's: it holds back that
            # endpoint only, however the rotation comes back to it.
            now = self._clock()
            backoff = self._backoff(attempt - 1)
            index, hold = rotation.next(index, now, backoff, retry_after)
            held = hold if hold > 0 else None
            if hold > self._max_retry_after:
                raise _unavailable(rotation.held_back(index, hold), attempt, tuple(tried), held, last, reached)
            if attempt >= self._max_attempts:
                tries = f"{attempt} attempt" + ("s" if attempt > 1 else "")
                where = ", ".join(str(each) for each in tried) + (f" in {rotation.label}" if rotation.label else "")
                message = f"unavailable after {tries} at {where}: {failure}"
                raise _unavailable(message, attempt, tuple(tried), held, last, reached)
            self._sleep(max(hold, backoff))

    def _backoff(self, retry: int) -> float:
        ceiling = min(self._backoff_cap, self._backoff_base * 2 ** min(retry, 30))
        return self._rng.uniform(0, ceiling)

    def _signed(self, method: str, url: str, headers: dict[str, str], body: bytes, region: str) -> dict[str, str]:
        """SigV4 (execute-api, `region`): a new signature, and date, for every attempt, over the Host header
        urllib3 sends (a host name's trailing dot left out: `_ROOT_DOTS`)."""
        parts = urlsplit(url)
        sent = urlunsplit(parts._replace(netloc=_ROOT_DOTS.sub("", parts.netloc)))
        request = AWSRequest(method=method, url=sent, data=body, headers=headers)
        try:
            credentials = self._credentials.get_frozen_credentials()
        except botocore.exceptions.BotoCoreError as error:
            raise Forbidden(f"cannot sign the call: no usable AWS credentials ({error})") from error
        SigV4Auth(credentials, SERVICE, region).add_auth(request)
        return dict(request.headers.items())


def _run(answer: _Answer) -> Run:
    """The run in a success answer, its input's numbers exact (integers int, others JSONNumber)."""
    try:
        return Run.model_validate(parse_json(answer.data.decode("utf-8")))
    except (ValueError, ValidationError) as error:
        raise _carried_no(answer, "run") from error


def _spawn_body(spawn: SpawnRequest, key: str) -> bytes:
    """The single route's body of `spawn` under `key` (its `dispatch_key` ignored); InvalidRequest if it cannot be
    sent as JSON."""
    request: dict[str, Any] = {"workflow_ref": spawn.workflow_ref, "input": dict(spawn.input)}
    if spawn.goal_id is not None:
        request["goal_id"] = spawn.goal_id
    request["dispatch_key"] = key
    try:
        return json_text(request).encode("utf-8")
    except (TypeError, ValueError) as error:  # a non-JSON value, NaN, a lone surrogate
        raise InvalidRequest(f"the spawn request cannot be sent as JSON: {error}") from error


def _batches(bodies: list[tuple[int, bytes]]) -> list[list[tuple[int, bytes]]]:
    """The spawns' bodies in order, in runs of at most MAX_BATCH_SPAWNS whose envelope fits MAX_BATCH_BODY_BYTES
    (a spawn too large for any goes in a batch of its own: the API refuses it 413, and it is sent again alone)."""
    chunks: list[list[tuple[int, bytes]]] = []
    size = _ENVELOPE_BYTES
    for item in bodies:
        cost = len(item[1]) + 1
        if chunks and chunks[-1] and (len(chunks[-1]) < MAX_BATCH_SPAWNS) and size + cost <= MAX_BATCH_BODY_BYTES:
            chunks[-1].append(item)
            size += cost
        else:
            chunks.append([item])
            size = _ENVELOPE_BYTES + cost
    return chunks


def _batch_results(answer: _Answer, count: int) -> list[dict[str, Any]]:
    """The results of a batch's answer, numbers exact; its refusal (as `spawn`'s) or UnexpectedAnswer."""
    if answer.status != 200:
        raise _refusal(answer)
    try:
        results = parse_json(answer.data.decode("utf-8"))["results"]
        if answer.headers.get("Content-Type") != SPAWN_RESULTS_MEDIA_TYPE or len(results) != count:
            raise ValueError("not the results of this batch")
        if not all(isinstance(result, dict) and isinstance(result.get("status"), int) for result in results):
            raise ValueError("a result without its status")
    except (ValueError, TypeError, KeyError) as error:
        raise _carried_no(answer, f"results of {count} spawns") from error
    return list(results)


def _carried_no(answer: _Answer, what: str) -> UnexpectedAnswer:
    """A success answer without the `what` it must carry: a success of something, so it may have admitted what
    was sent (its outcome is unknown)."""
    return UnexpectedAnswer(
        f"HTTP {answer.status} carried no {what}: is the base URL the admission API?",
        status=answer.status,
        body=_json_or_text(answer.data),
        attempts=answer.attempts,
        outcome_unknown=True,
    )


def _named(error: AdmissionError, key: str) -> AdmissionError:
    """`error` as one spawn's result, naming its key."""
    error.dispatch_key = key
    return error


def _for_key(error: AdmissionError, key: str) -> AdmissionError:
    """A failure of a whole call as one of its spawns' results: a copy of its own, naming its key (copied
    field by field: the errors' constructors take keyword-only arguments that copy.copy cannot pass)."""
    mine = type(error).__new__(type(error))
    mine.__dict__.update(error.__dict__)
    mine.args = error.args
    return _named(mine, key)


def _refusal(answer: _Answer) -> AdmissionError:
    """The typed error for a non-success answer, naming the endpoint that gave it."""
    error = _typed_refusal(answer)
    error.endpoint = answer.endpoint
    return error


def _typed_refusal(answer: _Answer) -> AdmissionError:
    body = _json_or_text(answer.data)
    problem = _problem(body)
    message = f"HTTP {answer.status}: {_summary(problem, body)}"
    if answer.status == 422 and problem is not None and problem.type == DISPATCH_KEY_REUSED:
        run_id = str((problem.model_extra or {}).get("run_id", ""))
        return DispatchKeyReused(
            f"{message} (run {run_id})",
            run_id=run_id,
            status=answer.status,
            problem=problem,
            body=body,
            attempts=answer.attempts,
            outcome_unknown=answer.reached_before,
        )
    kind: type[AdmissionError] = {
        400: InvalidRequest,
        413: InvalidRequest,
        415: InvalidRequest,
        403: Forbidden,
        404: NotFound,
    }.get(answer.status, UnexpectedAnswer)
    return kind(
        message,
        status=answer.status,
        problem=problem,
        body=body,
        attempts=answer.attempts,
        outcome_unknown=answer.reached_before,
    )


def _nothing_written(answer: _Answer) -> bool:
    """Whether a retryable answer says nothing was written: API Gateway's throttling (429, the function never
    ran) or admission's 503 store-unavailable."""
    if answer.status == 429:
        return True
    problem = _problem(_json_or_text(answer.data))
    return answer.status == 503 and problem is not None and problem.type == STORE_UNAVAILABLE


def _unavailable(
    message: str,
    attempts: int,
    endpoints: tuple[RegionalEndpoint, ...],
    retry_after: float | None,
    last: _Answer | None,
    reached: bool = False,
) -> Unavailable:
    if last is None:
        return Unavailable(
            message, attempts=attempts, endpoints=endpoints, retry_after=retry_after, outcome_unknown=reached
        )
    body = _json_or_text(last.data)
    problem = _problem(body)
    message = f"{message} ({_summary(problem, body)})"
    answer: dict[str, Any] = {
        "endpoints": endpoints,
        "retry_after": retry_after,
        "status": last.status,
        "problem": problem,
        "body": body,
    }
    if problem is not None and problem.type == OUTCOME_UNKNOWN:  # OutcomeUnknown: outcome_unknown, always
        run_id = str((problem.model_extra or {}).get("run_id", ""))
        return OutcomeUnknown(f"{message} (run {run_id})", run_id=run_id, attempts=attempts, **answer)
    return Unavailable(message, attempts=attempts, outcome_unknown=reached, **answer)


def _quoted(value: str, safe: str, name: str) -> str:
    """`value` percent-encoded as UTF-8; InvalidRequest if it is not text UTF-8 can carry (a lone surrogate)."""
    try:
        return quote(value, safe=safe)
    except UnicodeEncodeError as error:
        raise InvalidRequest(f"{name} {value!r} cannot be sent: it is not UTF-8 text ({error.reason})") from error


def _problem(body: Any) -> Problem | None:
    if not isinstance(body, dict):
        return None
    try:
        return Problem.model_validate(body)
    except ValidationError:
        return None


def _summary(problem: Problem | None, body: Any) -> str:
    if problem is not None:
        return f"{problem.detail} [{problem.type}]"
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        return str(body["message"])  # API Gateway's own refusals
    return (str(body) or "no body")[:200]


def _json_or_text(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return data.decode("utf-8", "replace")
