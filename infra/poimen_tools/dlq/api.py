"""`POST /v1/runs` for redrive, through `poimen.client`: one record's dispatch, signed as the caller,
and what each answer means for the redrive (confirmed, the record at fault, or stop)."""

from __future__ import annotations

from typing import Any

import botocore.credentials
import botocore.exceptions
import urllib3

from poimen.cells import CellMap
from poimen.client import (
    DISPATCH_KEY_REUSED,
    RUN_NOT_FOUND,
    AdmissionClient,
    AdmissionError,
    CellRoutingError,
    Forbidden,
    InvalidRequest,
    NotFound,
    OutcomeUnknown,
)
from poimen.dead_letter import DeadLetterReason
from poimen.ids import keyed_run_id
from poimen.inbox_rule import RECORD_FAULT_STATUSES, RETRYABLE_STATUSES, rejected
from poimen_tools.dlq.errors import ApiRefused, ApiUnavailable, AwsUnavailable, UsageError
from poimen_tools.dlq.model import Dispatch
from poimen_tools.dlq.render import problem_summary

# Longer than API Gateway holds a request (30 s): redrive always gets the answer (or its 503).
HTTP_TIMEOUT_SECONDS = 35.0


class TraceHeader(urllib3.PoolManager):
    """The client's HTTP pool, adding the record's traceparent as the relay forwards it (the client's
    spawn takes no headers). Added after signing, as SigV4 allows: the signature covers what it names."""

    def __init__(self, inner: urllib3.PoolManager) -> None:
        super().__init__()
        self._inner = inner
        self.traceparent: str | None = None

    # PoolManager's own signature, which narrows RequestMethods' as urllib3 itself declares it.
    def urlopen(self, method: str, url: str, redirect: bool = True, **kw: Any) -> urllib3.BaseHTTPResponse:  # type: ignore[override]
        if self.traceparent:
            kw["headers"] = {**kw.get("headers", {}), "traceparent": self.traceparent}
        return self._inner.urlopen(method, url, redirect, **kw)


class AdmissionApi:
    """The admission API at `base_url`, signed (SigV4, execute-api) with `credentials`, one attempt per
    record: what is not confirmed stays, and the next redrive sends it again under the same key."""

    def __init__(
        self,
        base_url: str | CellMap,
        credentials: botocore.credentials.Credentials,
        region: str,
        http: urllib3.PoolManager | None = None,
    ) -> None:
        """`base_url`: the API's (--api-url), or a cell map (--cells), each record's call going to its
        tenant's cell."""
        self._credentials = credentials
        self._http = TraceHeader(http or urllib3.PoolManager(retries=False))
        cells = base_url if isinstance(base_url, CellMap) else None
        try:
            self._client = AdmissionClient(
                base_url if isinstance(base_url, str) else None,
                cells=cells,
                region=region,
                credentials=credentials,
                timeout=HTTP_TIMEOUT_SECONDS,
                max_attempts=1,
                http=self._http,
            )
        except ValueError as error:
            given = f"--cells {cells.source}" if cells is not None else f"--api-url {base_url!r}"
            raise UsageError(f"{given}: {error}") from error
        if cells is None:
            self.runs_url = f"{self._client.base_url}/v1/runs"
        else:
            self.runs_url = f"/v1/runs of each tenant's cell in {cells.source}"

    @property
    def access_key(self) -> str:
        """Whom the calls are signed as."""
        try:
            return str(self._credentials.get_frozen_credentials().access_key)
        except botocore.exceptions.BotoCoreError as error:
            raise AwsUnavailable(f"cannot sign admission API calls ({error}): refresh your AWS credentials") from error

    def spawn(self, dispatch: Dispatch) -> str | DeadLetterReason:
        """`admitted` (201) or `replayed` (200), or why the record is at fault (the API's 400, 413, 415 or
        422 and its problem); raises ApiUnavailable, ApiRefused or AwsUnavailable for anything else.

        A keyless record's run under its legacy key (the one redrive derived before it held the value's
        digest) is looked up first (GET /v1/runs/{run_id}: a keyed run's id is derived from its key), so that
        a redrive of an earlier version, interrupted once it had admitted the record, is not followed by a
        second run under the new key: if that key admitted a run, the record is sent under it, and a replay
        (200: the same request) is its run; a 422 (another record at the same position holds that key) sends
        it under its own key."""
        legacy = dispatch.legacy_key
        if legacy is not None and self.exists(dispatch.tenant, keyed_run_id(dispatch.tenant, legacy)):
            sent = self._spawn(dispatch, legacy)
            reused = isinstance(sent, DeadLetterReason) and _problem_type(sent.problem) == DISPATCH_KEY_REUSED
            if not reused:
                return sent
        return self._spawn(dispatch, dispatch.record_key)

    def _spawn(self, dispatch: Dispatch, key: str) -> str | DeadLetterReason:
        request = dispatch.request
        self._http.traceparent = dispatch.traceparent
        try:
            spawned = self._client.spawn(
                dispatch.tenant, request.workflow_ref, request.input, goal_id=request.goal_id, dispatch_key=key
            )
        except AdmissionError as error:
            return self._refused(error)
        return "replayed" if spawned.replayed else "admitted"

    def exists(self, tenant: str, run_id: str) -> bool:
        """Whether the run is admitted (GET /v1/runs/{run_id}); raises as `spawn` does when the API cannot
        say."""
        try:
            self._client.get(tenant, run_id)
        except AdmissionError as error:
            if isinstance(error, NotFound) and error.problem is not None and error.problem.type == RUN_NOT_FOUND:
                return False
            self._refused(error)  # raises unless the id is at fault (400): then it names no run
            return False
        return True

    def _refused(self, error: AdmissionError) -> DeadLetterReason:
        status = error.status
        if status in RECORD_FAULT_STATUSES:
            return rejected(status, error.body)
        if isinstance(error, InvalidRequest) and status is None:  # the client would not send it
            return DeadLetterReason("rejected", f"not sent: {error}")
        if isinstance(error, Forbidden) and status is None:
            raise AwsUnavailable(f"cannot sign admission API calls ({error}): refresh your AWS credentials") from error
        if isinstance(error, CellRoutingError):  # nothing was sent: the cell map, not the API, is to fix
            raise ApiRefused(f"{error}; then run redrive again") from error
        if isinstance(error, OutcomeUnknown):
            raise ApiUnavailable(
                f"the admission API could not tell whether it admitted run {error.run_id} ({error}): "
                "run redrive again once it is healthy (the record is sent again under the same dispatch_key)"
            ) from error
        if status is None:
            raise ApiUnavailable(
                f"cannot reach the admission API at {self.runs_url} ({error}): "
                "check --api-url and that the API is up, then run redrive again"
            ) from error
        if status in RETRYABLE_STATUSES:
            raise ApiUnavailable(
                f"the admission API answered {status} ({problem_summary(error.body)}): "
                "it is unavailable; run redrive again once it is healthy"
            ) from error
        raise ApiRefused(
            f"the admission API refused the caller with {status} ({problem_summary(error.body)}): "
            "grant your principal the tenant (poimen grants add), check your credentials (--dev-key for "
            "poimen dev) and --api-url"
        ) from error


def _problem_type(problem: Any) -> Any:
    return problem.get("type") if isinstance(problem, dict) else None
