"""The HTTP API: routes of /v1/runs, request validation, and the one mapping of errors to RFC 9457."""

from __future__ import annotations

import base64
import binascii
import json
import re
import time
from collections.abc import Callable, Mapping
from functools import lru_cache
from http import HTTPStatus
from typing import TYPE_CHECKING, Annotated, Any, cast

# Submodules, not `aws_lambda_powertools.event_handler`'s re-exports: what this module uses is named
# where it is defined. (Python still runs that package's __init__, which imports every resolver.)
from aws_lambda_powertools.event_handler.api_gateway import APIGatewayHttpResolver, Response, ResponseBuilder
from aws_lambda_powertools.event_handler.exceptions import NotFoundError
from aws_lambda_powertools.event_handler.openapi.exceptions import (
    RequestUnsupportedContentType,
    RequestValidationError,
)
from aws_lambda_powertools.event_handler.openapi.params import Header, Path, Query
from aws_lambda_powertools.utilities.data_classes import APIGatewayProxyEventV2
from aws_lambda_powertools.utilities.typing import LambdaContext
from pydantic import BaseModel, Field, TypeAdapter
from pydantic import ValidationError as ModelValidationError
from pydantic.json_schema import SkipJsonSchema

from poimen.admission import Admission, Admitted, RunView
from poimen.batch import Refusal, SpawnDeferred, SpawnTooLarge, admit_spawns
from poimen.config import ConfigurationError, Settings
from poimen.contract import (
    IDEMPOTENCY_KEY_HEADER_PATTERN,
    DispatchKey,
    GatewayMessage,
    IdempotencyKeyMismatch,
    InvalidIdempotencyKey,
    JSONTooDeep,
    Problem,
    Run,
    RunRequest,
    SpawnBatch,
    SpawnResults,
    TenantId,
    dispatch_key_of,
    json_text,
    parse_json,
)
from poimen.errors import (
    DispatchKeyReused,
    IdentityMissing,
    OutcomeUnknown,
    RunNotFound,
    RunNotStorable,
    RunTooLarge,
    StoreUnavailable,
    TenantNotGranted,
    TenantNotServed,
)
from poimen.observability import add_count, logger, metrics, print_count
from poimen.store import Store
from poimen.wire import (
    IDEMPOTENCY_KEY_HEADER,
    MAX_BATCH_BODY_BYTES,
    MAX_BATCH_SPAWNS,
    MAX_BODY_BYTES,
    MAX_JSON_DEPTH,
    REPLAYED_HEADER,
    RUN_ID_PATTERN,
    SPAWN_RESULTS_MEDIA_TYPE,
    SPAWNS_MEDIA_TYPE,
    TENANT_HEADER,
    THROTTLED_MEMBER,
    TRACEPARENT_PATTERN,
)

if TYPE_CHECKING:
    from aws_lambda_powertools.event_handler.openapi.types import OpenAPIResponse, OpenAPIResponseHeader

PROBLEM_JSON = "application/problem+json"
PROBLEM_TYPE_PREFIX = "urn:poimen:problem:"
# RFC 9110's reason phrases, fixed here: Python's HTTPStatus renamed 413 and 422 in 3.13, and the
# problem titles must not change with the interpreter (3.11 locally, 3.13 on Lambda).
_REASON_PHRASES = {413: "Content Too Large", 422: "Unprocessable Content"}
# A 256 KiB body can fail validation in tens of thousands of places (one per unknown field): a problem
# names the first MAX_PROBLEM_ERRORS, each text cut to MAX_PROBLEM_TEXT_CHARS, and counts them all, so it
# stays a few kilobytes (Lambda answers at most 6 MB, and the relay dead-letters the answer with the record).
MAX_PROBLEM_ERRORS = 20
MAX_PROBLEM_TEXT_CHARS = 200
_TRACEPARENT = re.compile(TRACEPARENT_PATTERN)


def _title(status: HTTPStatus) -> str:
    return _REASON_PHRASES.get(int(status), status.phrase)


class AdmissionResolver(APIGatewayHttpResolver):
    """Screens bodies before Powertools parses them, so no input can end in a 5xx.

    - flagged isBase64Encoded but not base64 as API Gateway writes it: 400 (the resolver gets the body the screen
      decoded, as text: Powertools' own base64 decoding never runs);
    - over MAX_BODY_BYTES: 413 (API Gateway itself allows 10 MB);
    - a media type other than application/json: 415;
    - not strict JSON (not UTF-8, NaN/Infinity, out-of-range numbers, lone surrogates, nesting deeper
      than MAX_JSON_DEPTH): 400;
    - JSON that is not an object: 400. Powertools' validation unwraps a JSON array to its first
      element for a non-sequence body (meant for form fields), which would admit `[{...}]`.

    The screen's parse, numbers exact (`poimen.contract.parse_json`), is the one Powertools validates.
    A POST /v1/runs sent as SPAWNS_MEDIA_TYPE, the batch form, is screened to its own limits and answered by
    `_spawn_batch`: the same route, authorization and rule, its envelope checked here. A POST /v1/runs of one
    spawn that its models validate is answered by `_create_run_validated`, before the resolver too (the
    resolver's routing and validation cost more than the rest of our work); one they refuse goes on to the
    resolver, whose validation answers it as the route's models and OpenAPI document say.
    """

    def __init__(self) -> None:
        # json_text: Powertools' own JSON answers (the OpenAPI document) are written as every other answer is.
        super().__init__(enable_validation=True, json_body_deserializer=self._screened_body, serializer=json_text)
        self._body: dict[str, Any] = {}
        self.started = 0.0  # perf_counter() when the request in hand arrived: its admission's latency_ms
        # The tenant and dispatch_key a POST /v1/runs in hand spawns for, once read: what its audit line names.
        self.spawning: dict[str, str | None] = {}
        # Whether the request in hand is a batch: its spawns' audit fields are a line each, not the EMF line's.
        self.in_batch = False
        self.request_id = ""  # API Gateway's id of the request in hand (requestContext.requestId)

    def resolve(self, event: Mapping[str, Any], context: LambdaContext) -> dict[str, Any]:
        self.started = time.perf_counter()
        self.spawning = {}
        self.in_batch = False
        self.request_id = str((event.get("requestContext") or {}).get("requestId") or "")
        try:
            event, self._body = _screened(event)
        except _Refused as refusal:
            return refusal.answer
        if _is_spawn_batch(event):
            try:
                return _spawn_batch(event, self._body, context.get_remaining_time_in_millis)
            finally:
                self._body = {}
        try:
            if _is_create_run(event) and (spawn := _validated_spawn(event, self._body)) is not None:
                return _create_run_validated(event, *spawn)
            return super().resolve(event, context)
        finally:
            self._body = {}

    def _screened_body(self, _: str) -> dict[str, Any]:
        """The body `resolve` parsed: Powertools asks for it only when there is one."""
        return self._body


app = AdmissionResolver()


@lru_cache(maxsize=1)
def admission_service() -> Admission:
    """Admission built once per process from the validated environment, on first use."""
    settings = Settings.from_env()
    if not settings.tenants:
        raise ConfigurationError("TENANTS must name the tenants this stack serves (template.yaml: its Tenants)")
    # The stack's relay is trusted for exactly the tenants the stack serves.
    trusted = {settings.relay_principal: settings.tenants} if settings.relay_principal else {}
    return Admission(
        Store(settings),
        settings.grants_cache_seconds,
        tenants=settings.tenants,
        refusal_cache_seconds=settings.refusal_cache_seconds,
        trusted=trusted,
    )


class FieldError(BaseModel):
    field: str = Field(description=f"Where, e.g. body.workflow_ref; at most {MAX_PROBLEM_TEXT_CHARS} characters")
    type: str
    message: str


class ValidationProblem(Problem):
    """A 400 problem; a `validation-error` lists its first failures and counts them all."""

    # Absent, never null, from other problems: SkipJsonSchema keeps None out of the document.
    errors: list[FieldError] | SkipJsonSchema[None] = Field(
        default=None, description=f"validation-error: the first {MAX_PROBLEM_ERRORS} failures"
    )
    errors_total: int | SkipJsonSchema[None] = Field(
        default=None, description="validation-error: how many failures there were"
    )


# API Gateway's own answers, given before the function runs, as `application/json` `{"message": ...}`: IAM
# authorization's refusals ("Control access to HTTP APIs with IAM authorization in API Gateway",
# apigateway/latest/developerguide/http-api-access-control-iam.html), throttling ("Throttling requests to your
# HTTP API", http-api-throttling.html) and the payload quota ("Quotas for configuring and running an HTTP API",
# http-api-quotas.html), a function that failed ("Troubleshooting issues with HTTP API Lambda integrations",
# http-api-troubleshooting-lambda.html: `{"message":"Internal Server Error"}`; also when Lambda rejects the
# invocation, https://docs.aws.amazon.com/lambda/latest/dg/services-apigateway-errors.html) and the integration timeout:
# an HTTP API answers it 503 `{"message":"Service Unavailable"}` (its `apigw-requestid` answer, quoted in
# https://github.com/cortexlabs/cortex/issues/1225 and https://github.com/serverless/serverless/issues/11222),
# and AWS's knowledge center names 504 (https://repost.aws/knowledge-center/api-gateway-504-errors, for REST,
# HTTP and WebSocket APIs alike): both declared. Its 404 for a route it does not have is not an answer of any
# operation listed here.
_UNKNOWN_OUTCOME = (
    "it carries no problem+json, and the outcome is unknown: a POST /v1/runs may have admitted its run. Send it "
    "again with the same dispatch_key, which answers that run (201 or 200 Idempotent-Replayed) and admits no "
    "other; without one there is no run_id to GET, and sending it again could admit a second run. A GET may be "
    "sent again."
)
_GATEWAY_ANSWERS = {
    HTTPStatus.FORBIDDEN: (
        'API Gateway\'s IAM authorization (`{"message"}`): unsigned, badly signed, stale, or a principal '
        "without execute-api permission."
    ),
    HTTPStatus.TOO_MANY_REQUESTS: (
        'API Gateway throttled the request (`{"message":"Too Many Requests"}`); it never reached admission: '
        "send it again later."
    ),
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: 'Over API Gateway\'s 10 MB payload quota, its own `{"message"}`.',
    HTTPStatus.INTERNAL_SERVER_ERROR: (
        'API Gateway\'s own `{"message":"Internal Server Error"}` (application/json) when the function failed: it '
        f"crashed, ran out of time, or Lambda refused to invoke it; {_UNKNOWN_OUTCOME}"
    ),
    HTTPStatus.SERVICE_UNAVAILABLE: (
        'API Gateway\'s own `{"message":"Service Unavailable"}` (application/json) when the function did not answer '
        f"within the HTTP API's 30 s integration timeout, though it may still run; {_UNKNOWN_OUTCOME}"
    ),
    HTTPStatus.GATEWAY_TIMEOUT: (
        "API Gateway's own `{\"message\"}` (application/json) past its integration timeout, as AWS's knowledge center "
        f"names it (an HTTP API answers it 503, above); {_UNKNOWN_OUTCOME}"
    ),
}
# What API Gateway alone answers: no problem of admission's.
_GATEWAY_ONLY = frozenset({HTTPStatus.TOO_MANY_REQUESTS, HTTPStatus.GATEWAY_TIMEOUT})
_PROBLEM_DESCRIPTIONS = {
    HTTPStatus.FORBIDDEN: (
        "`forbidden`: no authenticated principal, or the tenant is not granted to it. `tenant-not-served`: this "
        "stack does not serve the tenant (it is not in the stack's Tenants), whatever the caller's grants; "
        "nothing was read or written, and only a deploy serving the tenant changes the answer."
    ),
    HTTPStatus.NOT_FOUND: "`run-not-found`: no such run for this tenant.",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: (
        f"`payload-too-large`: the body is over {MAX_BODY_BYTES} bytes (a batch's over {MAX_BATCH_BODY_BYTES}), or "
        "the run would be over DynamoDB's item limit."
    ),
    HTTPStatus.UNSUPPORTED_MEDIA_TYPE: (
        f"`unsupported-media-type`: a body that is not application/json (nor, to POST /v1/runs, {SPAWNS_MEDIA_TYPE})."
    ),
    HTTPStatus.UNPROCESSABLE_ENTITY: (
        "`dispatch-key-reused`: the dispatch_key already admitted a run with a different workflow_ref, input or "
        "goal_id; `run_id` names it. Nothing was written."
    ),
    HTTPStatus.SERVICE_UNAVAILABLE: (
        "`store-unavailable`: the store did not answer; send it again after Retry-After (`throttled: true` when "
        "the API asks to slow down: DynamoDB throttled it)."
    ),
    HTTPStatus.INTERNAL_SERVER_ERROR: (
        "`internal-error`: the request failed unexpectedly, maybe after the write: for a POST /v1/runs the outcome "
        "is unknown, as below."
    ),
}
_RETRY_AFTER: OpenAPIResponseHeader = {
    "description": "Seconds to wait before sending again",
    "schema": {"type": "integer"},
}


def _required_header(description: str, schema: dict[str, Any]) -> OpenAPIResponseHeader:
    """A header every such answer carries (OpenAPI's `required`, which Powertools' TypedDict does not name)."""
    return cast("OpenAPIResponseHeader", {"description": description, "required": True, "schema": schema})


def _problems(*statuses: HTTPStatus) -> dict[int, OpenAPIResponse]:
    """Each status as the API answers it: admission's problem+json, and API Gateway's own message where it
    answers that status itself (a status admission never answers has only that)."""
    answers: dict[int, OpenAPIResponse] = {}
    for status in statuses:
        content: dict[str, Any] = {}
        descriptions = []
        if status not in _GATEWAY_ONLY:
            model = ValidationProblem if status == HTTPStatus.BAD_REQUEST else Problem
            content[PROBLEM_JSON] = {"model": model}
            descriptions.append(_PROBLEM_DESCRIPTIONS.get(status, ""))
        if status in _GATEWAY_ANSWERS:
            content["application/json"] = {"model": GatewayMessage}
            descriptions.append(_GATEWAY_ANSWERS[status])
        described = " ".join(description for description in descriptions if description)
        answers[int(status)] = {"description": described or _title(status), "content": content}
        if status == HTTPStatus.SERVICE_UNAVAILABLE:
            answers[int(status)]["headers"] = {"Retry-After": _RETRY_AFTER}
    return answers


# What every route answers.
_COMMON_PROBLEMS = (
    HTTPStatus.BAD_REQUEST,
    HTTPStatus.FORBIDDEN,
    HTTPStatus.TOO_MANY_REQUESTS,
    HTTPStatus.INTERNAL_SERVER_ERROR,
    HTTPStatus.SERVICE_UNAVAILABLE,
    HTTPStatus.GATEWAY_TIMEOUT,
)

# Each 503 of POST /v1/runs says what a retry can do: store-unavailable, nothing was written; outcome-unknown,
# the run named may exist (see the _outcome_unknown handler).
_CREATE_RUN_UNAVAILABLE: OpenAPIResponse = {
    "description": (
        "`store-unavailable`: nothing was written; send the request again after Retry-After (the problem's "
        "`throttled` is `true` when the API asks to slow down: DynamoDB throttled it, or, in a batch, the batch had "
        "no time or answer room left for the spawn; absent when the store failed). "
        "`outcome-unknown`: the write may have committed; the problem's `run_id` and the Location header "
        "name the run: GET it. With a dispatch_key the request may also be sent again (after Retry-After): "
        "it answers that run (201 if this request wrote it, else 200 Idempotent-Replayed). Without one, "
        "never send it again before the GET: it could admit a second run (no Retry-After is given). "
        + _GATEWAY_ANSWERS[HTTPStatus.SERVICE_UNAVAILABLE]
    ),
    "headers": {
        "Retry-After": _RETRY_AFTER,
        "Location": {"description": "outcome-unknown: the run to GET, /v1/runs/{run_id}", "schema": {"type": "string"}},
    },
    "content": {PROBLEM_JSON: {"model": Problem}, "application/json": {"model": GatewayMessage}},
}

TenantHeader = Annotated[TenantId, Header(alias=TENANT_HEADER, description="Tenant the call acts for")]
# A batch has no single key: each spawn's is its own dispatch_key, so a key header would name none of its runs (taken
# for every spawn, it would make them one run; ignored, the caller would believe the request keyed). Said once,
# here, where the header, the request body and the 400s of the document say it, and `_spawn_batch` answers it.
_BATCH_TAKES_NO_KEY = (
    f"A batch ({SPAWNS_MEDIA_TYPE}) has no single key, each spawn's key is its own dispatch_key: any "
    f"{IDEMPOTENCY_KEY_HEADER} on a batch, well-formed or not, is answered 400 `idempotency-key-invalid`, nothing "
    "admitted (after its tenant header and envelope are found valid, before its caller is authorized)."
)
# Validated by create_run, not by the schema: a malformed key has its own problem type. The pattern is only
# documented (json_schema_extra), for the same reason. OpenAPI declares a header for the operation, not for one
# media type of its body: its description says what the batch form answers.
IdempotencyKeyHeader = Annotated[
    str | SkipJsonSchema[None],
    Header(
        alias=IDEMPOTENCY_KEY_HEADER,
        description=(
            'For one spawn (application/json), the dispatch_key as a header: an RFC 8941 string (`"k-1"`, with '
            '`\\"` and `\\\\` its only escapes) or the key itself unquoted (`k-1`); 1-255 printable ASCII characters '
            "(the pattern). Unquoted, it holds no comma: API Gateway joins repeated header lines with commas, so "
            '`k-1,k-1` is one line sent twice, not a key; quote a key with a comma (`"a,b"`) or send it as the '
            "body's dispatch_key. With a dispatch_key in the body too, both must name the same key. It need not be "
            f"signed. {_BATCH_TAKES_NO_KEY}"
        ),
        # Documented, not enforced by the schema: a value outside it is answered idempotency-key-invalid.
        json_schema_extra={"pattern": IDEMPOTENCY_KEY_HEADER_PATTERN},
    ),
]

# POST /v1/runs's 400s, by problem type.
_CREATE_RUN_BAD_REQUEST: OpenAPIResponse = {
    "description": (
        "`validation-error`: the body or a header breaks the schema; `errors` names each field. "
        "`malformed-json`: the body is not strict JSON, or its Lambda event flags it base64-encoded and it is not "
        "base64. `run-not-storable`: DynamoDB refused the item. "
        "`idempotency-key-invalid`: the Idempotency-Key header names no key of this request: with one spawn, it "
        "is neither an RFC 8941 string nor a key of 1-255 printable ASCII characters without a comma; "
        f"{_BATCH_TAKES_NO_KEY} `idempotency-key-mismatch`: the Idempotency-Key header and the body's dispatch_key "
        "name different keys. Nothing was written."
    ),
    "content": {PROBLEM_JSON: {"model": ValidationProblem}},
}


_RUN_PATH_PATTERN = "^/v1/runs/" + RUN_ID_PATTERN.removeprefix("^")


@app.post(
    "/v1/runs",
    summary="Admit a run; with a dispatch_key, repeats answer the first run",
    responses={
        201: {
            "description": "A new run was admitted",
            "headers": {
                "Location": _required_header(
                    "The run, /v1/runs/{run_id}", {"type": "string", "pattern": _RUN_PATH_PATTERN}
                )
            },
            "content": {"application/json": {"model": Run}},
        },
        200: {
            "description": (
                "application/json: the dispatch_key already admitted this run (Idempotent-Replayed: true). "
                f"{SPAWN_RESULTS_MEDIA_TYPE}: the answer to a batch ({SPAWNS_MEDIA_TYPE}), whatever became of its "
                "spawns: one result a spawn, in order, each the run and its status (201 admitted, 200 replayed) or "
                "the problem this route would answer for that spawn alone, with its status (a 503 "
                "`outcome-unknown` names the run that may have been admitted). The request's own 4xx (its "
                "envelope, tenant, Idempotency-Key, authorization) and 5xx are its problems below."
            ),
            "headers": {
                REPLAYED_HEADER: {
                    "description": "Always `true` on a replay of one spawn: the answer is the first run's; absent "
                    "on a batch's answer, whose results say it",
                    "schema": {"type": "string", "enum": ["true"]},
                }
            },
            "content": {"application/json": {"model": Run}, SPAWN_RESULTS_MEDIA_TYPE: {"model": SpawnResults}},
        },
        **_problems(
            *_COMMON_PROBLEMS,
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
            HTTPStatus.UNPROCESSABLE_ENTITY,
        ),
        400: _CREATE_RUN_BAD_REQUEST,
        503: _CREATE_RUN_UNAVAILABLE,
    },
)
def create_run(
    body: RunRequest,
    tenant_id: TenantHeader,
    idempotency_key: IdempotencyKeyHeader = None,
) -> Response[str]:
    # What the resolver routes here is what `_validated_spawn` leaves to it (AdmissionResolver.resolve).
    return _admit_spawn(body, tenant_id, idempotency_key, _caller(), _traceparent())


def _admit_spawn(
    body: RunRequest, tenant_id: str, idempotency_key: str | None, principal: str | None, traceparent: str | None
) -> Response[str]:
    """POST /v1/runs of one spawn, validated: `body` admitted for `tenant_id` under the key however it came."""
    # The key however it came: a header key and a body key are one key, so one run (same run_id).
    key = dispatch_key_of(idempotency_key, body.dispatch_key)
    # Every line of this request from here on names the spawn, so that the runbook's query finds its outcome,
    # whatever it is, by tenant and dispatch key (docs/operations.md#finding-an-admission). The Logger's keys are
    # cleared at each invocation (functions/admission/app.py: clear_state).
    _spawning(tenant_id, key)
    request = body if key == body.dispatch_key else body.model_copy(update={"dispatch_key": key})
    admitted = admission_service().admit_run(principal, tenant_id, request, traceparent=traceparent)
    # Written: from here on only the answer admission built before the write, and its metric and log line.
    run = admitted.run
    if admitted.replayed:
        _record(admitted, HTTPStatus.OK)
        return _run_answer(run, HTTPStatus.OK, {REPLAYED_HEADER: "true"})
    _record(admitted, HTTPStatus.CREATED)
    return _run_answer(run, HTTPStatus.CREATED, {"Location": f"/v1/runs/{run.run_id}"})


_RUN_FOUND: OpenAPIResponse = {"description": "The run", "content": {"application/json": {"model": Run}}}


@app.get(
    "/v1/runs/<run_id>",
    summary="One run of the tenant",
    responses={200: _RUN_FOUND, **_problems(*_COMMON_PROBLEMS, HTTPStatus.NOT_FOUND)},
)
def get_run(run_id: Annotated[str, Path(pattern=RUN_ID_PATTERN)], tenant_id: TenantHeader) -> Response[str]:
    return _run_answer(admission_service().get_run(_caller(), tenant_id, run_id))


@app.get(
    "/v1/runs",
    summary="The run a dispatch_key admitted (reconciliation look-up)",
    responses={200: _RUN_FOUND, **_problems(*_COMMON_PROBLEMS, HTTPStatus.NOT_FOUND)},
)
def find_run(dispatch_key: Annotated[DispatchKey, Query()], tenant_id: TenantHeader) -> Response[str]:
    return _run_answer(admission_service().find_run_by_dispatch_key(_caller(), tenant_id, dispatch_key))


def _run_answer(
    run: RunView, status: HTTPStatus = HTTPStatus.OK, headers: dict[str, str] | None = None
) -> Response[str]:
    # The body is JSON text already, the input in it as sent: Powertools would read its numbers as floats.
    return Response(status_code=status, content_type="application/json", body=run.body, headers=headers)


# The link is relative to infra/openapi.json, the document as committed.
_API_DESCRIPTION = (
    "Admits workflow runs exactly once: a repeated POST /v1/runs with the same dispatch_key (in the body, or "
    "as the Idempotency-Key header) answers the first run. What a key is scoped to, what counts as the same "
    "request, each answer and how long a key is remembered: the "
    "[idempotency specification](../docs/architecture.md#idempotency-specification)."
)


@app.get("/openapi.json", include_in_schema=False)
def openapi_document() -> dict[str, Any]:
    schema: dict[str, Any] = json.loads(
        app.get_openapi_json_schema(title="Poimen admission", version="1", description=_API_DESCRIPTION)
    )
    return _without_leftovers(_with_spawn_batch(schema))


def _with_spawn_batch(schema: dict[str, Any]) -> dict[str, Any]:
    """The document with POST /v1/runs's second request media type, the batch, from its model: Powertools
    declares one body model a route."""
    components = schema["components"]["schemas"]
    batch = SpawnBatch.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(batch.pop("$defs", {}))
    components["SpawnBatch"] = batch
    request = schema["paths"]["/v1/runs"]["post"]["requestBody"]
    request["content"][SPAWNS_MEDIA_TYPE] = {"schema": {"$ref": "#/components/schemas/SpawnBatch"}}
    request["description"] = (
        f"One spawn (application/json, a RunRequest), or up to {MAX_BATCH_SPAWNS} of the tenant in one request "
        f"({SPAWNS_MEDIA_TYPE}, a SpawnBatch of at most {MAX_BATCH_BODY_BYTES} bytes), answered 200 "
        f"{SPAWN_RESULTS_MEDIA_TYPE}. {_BATCH_TAKES_NO_KEY}"
    )
    return schema


def _without_leftovers(schema: dict[str, Any]) -> dict[str, Any]:
    """The document without what Powertools adds that this API never answers: a FastAPI-style 422
    `HTTPValidationError` on every route that declares no 422 (validation failures are 400 problems here),
    and the component schemas nothing refers to any more (`HTTPValidationError`, `ValidationError`, ...)."""
    for operations in schema["paths"].values():
        for operation in operations.values():
            unprocessable = operation["responses"].get("422", {})
            if "HTTPValidationError" in json.dumps(unprocessable):
                del operation["responses"]["422"]
    components = schema["components"]["schemas"]
    used: set[str] = set()
    pending = _schema_refs(schema["paths"])
    while pending:
        name = pending.pop()
        if name not in used:
            used.add(name)
            pending |= _schema_refs(components[name])
    schema["components"]["schemas"] = {name: definition for name, definition in components.items() if name in used}
    return schema


def _schema_refs(node: Any) -> set[str]:
    """The component schemas `node` refers to, directly."""
    if isinstance(node, dict):
        found = {node["$ref"].rsplit("/", 1)[1]} if isinstance(node.get("$ref"), str) else set()
        return found.union(*(_schema_refs(value) for value in node.values()))
    if isinstance(node, list):
        return set().union(*(_schema_refs(item) for item in node))
    return set()


def warm() -> None:
    """Build each route's request validation now rather than on its first request: run before a
    SnapStart snapshot (functions/admission/app.py). One request per route, each refused by validation
    (no tenant header; a batch without spawns) before it reaches admission: no AWS call, nothing stored,
    nothing logged.
    """
    batch = {"content-type": SPAWNS_MEDIA_TYPE, TENANT_HEADER.lower(): "warm"}
    requests: tuple[tuple[str, str, dict[str, str], str | None, dict[str, str]], ...] = (
        ("POST", "/v1/runs", {}, '{"workflow_ref": "wf/warm", "input": {}}', {"content-type": "application/json"}),
        ("POST", "/v1/runs", {}, '{"spawns": []}', batch),
        ("GET", "/v1/runs/00000000-0000-8000-8000-000000000000", {}, None, {"content-type": "application/json"}),
        ("GET", "/v1/runs", {"dispatch_key": "warm"}, None, {"content-type": "application/json"}),
    )
    for method, path, query, body, headers in requests:
        event = {
            "version": "2.0",
            "routeKey": "$default",
            "rawPath": path,
            "rawQueryString": "&".join(f"{name}={value}" for name, value in query.items()),
            "queryStringParameters": query or None,
            "headers": headers,
            "requestContext": {"http": {"method": method, "path": path}, "stage": "$default"},
            "body": body,
            "isBase64Encoded": False,
        }
        answer = app.resolve(event, LambdaContext())
        if answer["statusCode"] != HTTPStatus.BAD_REQUEST:
            raise RuntimeError(f"warming {method} {path} answered {answer['statusCode']}, not 400")


def _traceparent() -> str | None:
    """The request's W3C traceparent if well-formed, stored with the run for its event; else none."""
    return _well_formed_traceparent(app.current_event.headers.get("traceparent"))


def _well_formed_traceparent(value: str | None) -> str | None:
    return value if value is not None and _TRACEPARENT.fullmatch(value) else None


def _caller() -> str | None:
    """The IAM principal API Gateway authenticated; absent when the route has no IAM authorization."""
    return app.current_event.request_context.authorizer.iam.user_arn or None


def correlation_id(event: Mapping[str, Any]) -> str | None:
    """API Gateway's id of the request, `requestContext.requestId` (correlation_paths.API_GATEWAY_HTTP)."""
    context = event.get("requestContext")
    return context.get("requestId") if isinstance(context, Mapping) else None


def _principal(event: Mapping[str, Any]) -> str | None:
    """`_caller()` of an event the resolver has not routed."""
    authorizer = (event.get("requestContext") or {}).get("authorizer") or {}
    return (authorizer.get("iam") or {}).get("userArn") or None


def _record(admitted: Admitted, status: HTTPStatus) -> None:
    """The admission's one log line: the EMF line of its metric, the audit fields in it as metadata (not
    dimensions, each of which would make a metric of its own). docs/operations.md#finding-an-admission
    queries them. Printed directly (poimen.observability.print_count): the request has added no metric."""
    message = "run replayed" if admitted.replayed else "run admitted"
    print_count(
        "RunsReplayed" if admitted.replayed else "RunsAdmitted", _audit_fields(message, status, admitted.run.run_id)
    )


def _audit(message: str, status: HTTPStatus, run_id: str) -> None:
    """The audit fields of the spawn in hand, as metadata of the EMF line of the metric just added; a batch's
    spawn, as a line of its own with the same fields (the batch's one EMF line carries its metrics summed)."""
    audit = _audit_fields(message, status, run_id)
    if app.in_batch:
        print(json.dumps(audit, separators=(",", ":")))  # the line Lambda sends to the log group
        return
    for key, value in audit.items():
        metrics.add_metadata(key=key, value=value)


def _audit_fields(message: str, status: HTTPStatus, run_id: str) -> dict[str, Any]:
    """What the runbook's query finds a spawn by: its tenant and dispatch key, run, answer and latency."""
    return {
        "message": message,
        **app.spawning,
        "run_id": run_id,
        "status": int(status),
        # API Gateway's request id, the correlation_id of the Logger's lines (a refusal's, an error's).
        "correlation_id": app.request_id,
        "latency_ms": round((time.perf_counter() - app.started) * 1000, 1),
    }


def _spawning(tenant_id: str, dispatch_key: str | None) -> None:
    """Name the spawn in hand in every line written about it from here on (the runbook's query finds it)."""
    app.spawning = {"tenant_id": tenant_id, "dispatch_key": dispatch_key}
    logger.append_keys(**app.spawning)


# --- errors: every failure leaves as application/problem+json, mapped here and nowhere else ---


def _problem_body(status: HTTPStatus, kind: str, detail: str, **extensions: Any) -> dict[str, Any]:
    return {
        "type": PROBLEM_TYPE_PREFIX + kind,
        "title": _title(status),
        "status": int(status),
        "detail": detail,
        **extensions,
    }


def problem(
    status: HTTPStatus,
    kind: str,
    detail: str,
    headers: dict[str, str] | None = None,
    **extensions: Any,
) -> Response[str]:
    return Response(
        status_code=status,
        content_type=PROBLEM_JSON,
        # Powertools serialises dict bodies only for application/json, so the problem is sent as text.
        body=json_text(_problem_body(status, kind, detail, **extensions)),
        headers=headers,
    )


@app.exception_handler(RequestValidationError)
def _invalid_request(error: RequestValidationError) -> Response[str]:
    failures = error.errors()
    errors = [
        {
            "field": _clipped(".".join(str(part) for part in failure["loc"])),
            "type": _clipped(str(failure["type"])),
            "message": _clipped(str(failure.get("msg", ""))),
        }
        for failure in failures[:MAX_PROBLEM_ERRORS]
    ]
    fields = sorted({_clipped(".".join(str(part) for part in failure["loc"])) for failure in failures})
    named = ", ".join(fields[:MAX_PROBLEM_ERRORS])
    more = f", and {len(fields) - MAX_PROBLEM_ERRORS} more" if len(fields) > MAX_PROBLEM_ERRORS else ""
    return problem(
        HTTPStatus.BAD_REQUEST,
        "validation-error",
        f"Invalid fields: {named}{more}.",
        errors=errors,
        errors_total=len(failures),
    )


def _clipped(text: str) -> str:
    return text if len(text) <= MAX_PROBLEM_TEXT_CHARS else text[: MAX_PROBLEM_TEXT_CHARS - 1] + "…"


@app.exception_handler(RequestUnsupportedContentType)
def _unsupported_media(_: RequestUnsupportedContentType) -> Response[str]:
    return problem(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, "unsupported-media-type", "Send the body as application/json.")


@app.exception_handler(IdentityMissing)
def _no_identity(_: IdentityMissing) -> Response[str]:
    return problem(HTTPStatus.FORBIDDEN, "forbidden", "The request carries no authenticated principal.")


@app.exception_handler(TenantNotGranted)
def _not_granted(error: TenantNotGranted) -> Response[str]:
    logger.warning(
        "tenant not granted", principal=error.principal, tenant_id=error.tenant_id, status=HTTPStatus.FORBIDDEN
    )
    return problem(HTTPStatus.FORBIDDEN, "forbidden", "The caller is not granted this tenant.")


@app.exception_handler(TenantNotServed)
def _not_served(error: TenantNotServed) -> Response[str]:
    # 403 and not a 400/422: the request is not at fault, this stack is not the one to ask (the relay, which
    # dead-letters what blames the record, fails the batch instead and retries it until a deploy serves the
    # tenant), and no grant changes the answer.
    logger.warning("tenant not served", tenant_id=error.tenant_id, status=HTTPStatus.FORBIDDEN)
    return problem(
        HTTPStatus.FORBIDDEN,
        "tenant-not-served",
        f"This stack does not serve tenant {error.tenant_id}: it admits runs only for the tenants it is "
        "deployed with (its Tenants), whatever the caller's grants.",
    )


@app.exception_handler(RunNotFound)
def _run_not_found(_: RunNotFound) -> Response[str]:
    return problem(HTTPStatus.NOT_FOUND, "run-not-found", "No such run for this tenant.")


@app.not_found
def _route_not_found(_: NotFoundError) -> Response[str]:
    return problem(HTTPStatus.NOT_FOUND, "not-found", "No such resource.")


@app.exception_handler(DispatchKeyReused)
def _key_reused(error: DispatchKeyReused) -> Response[str]:
    add_count("DispatchKeyConflicts")
    _audit("dispatch key reused", HTTPStatus.UNPROCESSABLE_ENTITY, error.run_id)
    return problem(
        HTTPStatus.UNPROCESSABLE_ENTITY,
        "dispatch-key-reused",
        "This dispatch_key already admitted a run with a different workflow_ref, input or goal_id.",
        run_id=error.run_id,
    )


@app.exception_handler(InvalidIdempotencyKey)
def _idempotency_key_invalid(error: InvalidIdempotencyKey) -> Response[str]:
    return problem(HTTPStatus.BAD_REQUEST, "idempotency-key-invalid", str(error))


@app.exception_handler(IdempotencyKeyMismatch)
def _idempotency_key_mismatch(error: IdempotencyKeyMismatch) -> Response[str]:
    return problem(HTTPStatus.BAD_REQUEST, "idempotency-key-mismatch", str(error))


@app.exception_handler(RunTooLarge)
def _run_too_large(error: RunTooLarge) -> Response[str]:
    return problem(
        HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
        "payload-too-large",
        f"Stored, the run would take {error.size} bytes; one DynamoDB item holds at most {error.limit}. "
        "Send a smaller input.",
    )


@app.exception_handler(SpawnTooLarge)
def _spawn_too_large(error: SpawnTooLarge) -> Response[str]:
    return problem(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "payload-too-large", str(error))


def _invalid_model(error: ModelValidationError) -> Response[str]:
    """A batch's envelope or one of its spawns, validated by its model: the same problem as the route's own."""
    errors = [{**failure, "loc": ("body", *failure["loc"])} for failure in error.errors()]
    answer: Response[str] = _invalid_request(RequestValidationError(errors))
    return answer


@app.exception_handler(RunNotStorable)
def _run_not_storable(error: RunNotStorable) -> Response[str]:
    logger.warning("run not storable", reason=str(error), status=HTTPStatus.BAD_REQUEST)
    return problem(HTTPStatus.BAD_REQUEST, "run-not-storable", f"DynamoDB refused to store this run: {error}")


@app.exception_handler(StoreUnavailable)
def _store_unavailable(error: StoreUnavailable) -> Response[str]:
    logger.warning("store unavailable", reason=str(error), status=HTTPStatus.SERVICE_UNAVAILABLE)
    add_count("StoreUnavailable")
    return problem(
        HTTPStatus.SERVICE_UNAVAILABLE,
        "store-unavailable",
        "Admission storage is busy; retry after the given delay.",
        headers={"Retry-After": str(error.retry_after_seconds)},
        **_throttled(error),
    )


def _throttled(error: StoreUnavailable) -> dict[str, bool]:
    """The problem's THROTTLED_MEMBER, only when the API asks to slow down (poimen.wire.asks_to_slow_down)."""
    return {THROTTLED_MEMBER: True} if error.throttled else {}


@app.exception_handler(SpawnDeferred)
def _spawn_deferred(error: SpawnDeferred) -> Response[str]:
    logger.warning("spawn deferred", reason=str(error), status=HTTPStatus.SERVICE_UNAVAILABLE)
    return problem(
        HTTPStatus.SERVICE_UNAVAILABLE,
        "store-unavailable",
        str(error),
        headers={"Retry-After": str(error.retry_after_seconds)},
        **_throttled(error),
    )


@app.exception_handler(OutcomeUnknown)
def _outcome_unknown(error: OutcomeUnknown) -> Response[str]:
    logger.warning(
        "write outcome unknown",
        run_id=error.run_id,
        keyed=error.keyed,
        reason=str(error),
        status=HTTPStatus.SERVICE_UNAVAILABLE,
    )
    add_count("OutcomeUnknown")
    location = f"/v1/runs/{error.run_id}"
    headers = {"Location": location}
    if error.keyed:
        # Only a request with its dispatch_key is safe to send again: it can admit no other run.
        headers["Retry-After"] = str(error.retry_after_seconds)
        detail = (
            f"Run {error.run_id} may have been admitted. GET {location} to find out; sending the request "
            "again with its dispatch_key is safe, it answers that run."
        )
    else:
        detail = (
            f"Run {error.run_id} may have been admitted. GET {location} to find out before sending "
            "the request again: without a dispatch_key, sending it again could admit a second run."
        )
    return problem(HTTPStatus.SERVICE_UNAVAILABLE, "outcome-unknown", detail, headers=headers, run_id=error.run_id)


@app.exception_handler(Exception)
def _unexpected(error: Exception) -> Response[str]:
    logger.exception("unhandled error", error_type=type(error).__name__, status=HTTPStatus.INTERNAL_SERVER_ERROR)
    return problem(HTTPStatus.INTERNAL_SERVER_ERROR, "internal-error", "The request failed unexpectedly.")


def _decoded_body(event: Mapping[str, Any]) -> bytes:
    """The body's bytes; one flagged isBase64Encoded must be base64 as API Gateway writes it (standard alphabet,
    padded, nothing else: the text `base64.b64encode` gives its bytes back), or it is the request's 400. Read as
    text instead, a valid spawn would be admitted from a body its event says is something else, and lenient decoders
    (Powertools', `b64decode` without `validate`) skip what is not base64 and read another body."""
    body = str(event.get("body") or "")
    if not event.get("isBase64Encoded"):
        return body.encode("utf-8", "surrogatepass")
    try:
        decoded = base64.b64decode(body, validate=True)
        canonical = base64.b64encode(decoded) == body.encode("ascii")
    except (binascii.Error, ValueError):  # a character outside the alphabet, bad padding, or not ASCII at all
        canonical = False
    if not canonical:
        raise _Refused(HTTPStatus.BAD_REQUEST, "malformed-json", _NOT_BASE64)
    return decoded


_NOT_BASE64 = "The body is flagged base64-encoded (isBase64Encoded) but is not base64."


def _as_text(event: Mapping[str, Any], body: bytes) -> Mapping[str, Any]:
    """The screened event with its body as text, `body` decoded (UTF-8: the screen refused any other), so that the
    resolver reads the body the screen read and never decodes base64 itself."""
    if not event.get("isBase64Encoded"):
        return event
    return {**event, "body": body.decode("utf-8"), "isBase64Encoded": False}


def _content_type(event: Mapping[str, Any]) -> str:
    # HTTP API payload 2.0 lower-cases header names.
    return str((event.get("headers") or {}).get("content-type", ""))


class _Refused(Exception):
    """A body refused by the screen, with the answer to send."""

    def __init__(self, status: HTTPStatus, kind: str, detail: str, **extensions: Any) -> None:
        super().__init__(detail)
        self.answer = _early_problem(status, kind, detail, **extensions)


def _screened(event: Mapping[str, Any]) -> tuple[Mapping[str, Any], dict[str, Any]]:
    """The event to route, its content type lower-cased, and its body parsed ({} if none); or _Refused."""
    body = _decoded_body(event)
    content_type = _content_type(event)
    media_type = content_type.split(";", 1)[0].strip().lower()
    batch = media_type == SPAWNS_MEDIA_TYPE and _is_create_run(event)
    # A batch's spawns nest in it two levels down (the envelope, its list): each keeps the body's depth.
    limit, depth = (MAX_BATCH_BODY_BYTES, MAX_JSON_DEPTH + 2) if batch else (MAX_BODY_BYTES, MAX_JSON_DEPTH)
    if len(body) > limit:
        raise _Refused(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "payload-too-large", f"The body exceeds {limit} bytes.")
    if not body and not batch:
        return _as_text(event, body), {}
    if media_type not in ("", "application/json") and not batch:
        raise _Refused(
            HTTPStatus.UNSUPPORTED_MEDIA_TYPE, "unsupported-media-type", "Send the body as application/json."
        )
    try:
        value = parse_json(body.decode("utf-8"), depth) if body else None
    except (JSONTooDeep, RecursionError) as error:
        detail = f"The body nests deeper than {MAX_JSON_DEPTH} levels" + (" in a spawn." if batch else ".")
        raise _Refused(HTTPStatus.BAD_REQUEST, "malformed-json", detail) from error
    except ValueError as error:  # UnicodeError and JSONDecodeError are ValueErrors
        raise _Refused(HTTPStatus.BAD_REQUEST, "malformed-json", "The body is not valid JSON.") from error
    if not isinstance(value, dict):
        raise _Refused(
            HTTPStatus.BAD_REQUEST,
            "validation-error",
            "Invalid fields: body.",
            errors=[{"field": "body", "type": "model_type", "message": "The body must be a JSON object"}],
            errors_total=1,
        )
    if content_type != content_type.lower():
        # Media types are case-insensitive (RFC 9110); Powertools compares them case-sensitively.
        event = {**event, "headers": {**event["headers"], "content-type": content_type.lower()}}
    return _as_text(event, body), value


def _is_create_run(event: Mapping[str, Any]) -> bool:
    http = (event.get("requestContext") or {}).get("http") or {}
    return str(http.get("method", "")).upper() == "POST" and event.get("rawPath") == "/v1/runs"


def _is_spawn_batch(event: Mapping[str, Any]) -> bool:
    """Whether the screened event is a batch: POST /v1/runs as SPAWNS_MEDIA_TYPE."""
    return _content_type(event).split(";", 1)[0].strip() == SPAWNS_MEDIA_TYPE and _is_create_run(event)


@lru_cache(maxsize=1)
def _tenant_id() -> TypeAdapter[str]:
    """The tenant header's validation, built on a batch's first use (cold start)."""
    return TypeAdapter(TenantId)


def _spawn_batch(event: Mapping[str, Any], body: dict[str, Any], remaining_ms: Callable[[], int]) -> dict[str, Any]:
    """POST /v1/runs in the batch form: the request checked as the single route checks it (its tenant, no
    Idempotency-Key, its caller authorized once for its tenant) and its envelope, then each spawn admitted by
    poimen.batch. A fault of the request is its own problem; one of a spawn, that spawn's result."""
    headers = event.get("headers") or {}
    try:
        loc = ("header", TENANT_HEADER.lower())
        if TENANT_HEADER.lower() not in headers:  # as Powertools answers the single route: missing, not a None
            raise RequestValidationError([{"type": "missing", "loc": loc, "msg": "Field required"}])
        try:
            tenant_id = _tenant_id().validate_python(headers[TENANT_HEADER.lower()])
        except ModelValidationError as error:
            raise RequestValidationError([{**e, "loc": loc} for e in error.errors()]) from error
        batch = SpawnBatch.model_validate(body)
        if headers.get(IDEMPOTENCY_KEY_HEADER.lower()) is not None:
            raise InvalidIdempotencyKey(
                f"A batch takes no {IDEMPOTENCY_KEY_HEADER} header: each spawn's key is its own dispatch_key."
            )
        principal = _principal(event)
        service = admission_service()
        service.authorize(principal, tenant_id)
        app.in_batch = True
        # Before any spawn: Powertools prints the set at a metric's 100th value, which a batch of 100 refusals
        # reaches midway, and that line too names the batch. Printed only with a metric; either way cleared at
        # the invocation's end (poimen.observability.log_metrics).
        metrics.add_metadata(key="tenant_id", value=tenant_id)
        metrics.add_metadata(key="spawns", value=len(batch.spawns))
        counts = {"RunsAdmitted": 0, "RunsReplayed": 0}

        def admitted(dispatch_key: str | None, outcome: Admitted) -> None:
            _spawning(tenant_id, dispatch_key)
            counts["RunsReplayed" if outcome.replayed else "RunsAdmitted"] += 1
            status = HTTPStatus.OK if outcome.replayed else HTTPStatus.CREATED
            _audit("run replayed" if outcome.replayed else "run admitted", status, outcome.run.run_id)

        def refused(dispatch_key: str | None, error: Exception) -> Refusal:
            _spawning(tenant_id, dispatch_key)
            return _refusal(error)

        results = admit_spawns(
            service,
            principal,
            tenant_id,
            batch,
            headers.get("traceparent"),
            remaining_ms=remaining_ms,
            refusal=refused,
            admitted=admitted,
        )
        if counts["RunsAdmitted"]:
            add_count("RunsAdmitted", counts["RunsAdmitted"])
        if counts["RunsReplayed"]:
            add_count("RunsReplayed", counts["RunsReplayed"])
    except Exception as error:
        answer = _answer_to(error)
        return {
            "statusCode": answer.status_code,
            "headers": {"Content-Type": PROBLEM_JSON, **(answer.headers or {})},
            "body": answer.body,
            "isBase64Encoded": False,
        }
    return {
        "statusCode": int(HTTPStatus.OK),
        "headers": {"Content-Type": SPAWN_RESULTS_MEDIA_TYPE},
        "body": results,
        "isBase64Encoded": False,
    }


def _validated_spawn(event: Mapping[str, Any], body: dict[str, Any]) -> tuple[RunRequest, str, str | None] | None:
    """A screened POST /v1/runs of one spawn validated by the models `create_run` declares: its body, tenant and
    Idempotency-Key header, each as Powertools' validation would give it the route. None when the models refuse it
    (Powertools' validation then answers it, its errors the document's), or when the event is one the resolver
    reads otherwise: a stage other than $default (the resolver's path drops the stage's name), a header name not
    lower-cased (its headers are case-insensitive), or multiValueHeaders (none in payload 2.0)."""
    headers = event.get("headers") or {}
    names = "".join(headers)  # lower-cased as a whole when each name is (str.lower maps character by character)
    if (
        (event.get("requestContext") or {}).get("stage") != "$default"
        or "multiValueHeaders" in event
        or names != names.lower()
    ):
        return None
    idempotency_key = headers.get(IDEMPOTENCY_KEY_HEADER.lower())
    if not isinstance(idempotency_key, str | None):
        return None
    try:
        tenant_id = _tenant_id().validate_python(headers.get(TENANT_HEADER.lower()))
        return RunRequest.model_validate(body), tenant_id, idempotency_key
    except ModelValidationError:
        return None


def _create_run_validated(
    event: Mapping[str, Any], body: RunRequest, tenant_id: str, idempotency_key: str | None
) -> dict[str, Any]:
    """POST /v1/runs of one spawn validated by `_validated_spawn`, answered as the resolver answers `create_run`:
    the route's own answer, or its error's exception handler's."""
    headers = event.get("headers") or {}
    try:
        answer = _admit_spawn(
            body, tenant_id, idempotency_key, _principal(event), _well_formed_traceparent(headers.get("traceparent"))
        )
    except Exception as error:
        # The resolver's builder, without a route: none sets CORS, compression or cache control.
        builder: ResponseBuilder[APIGatewayProxyEventV2] = ResponseBuilder(_answer_to(error))
        return builder.build(APIGatewayProxyEventV2(cast("dict[str, Any]", event)))
    return _run_response(answer)


def _run_response(answer: Response[str]) -> dict[str, Any]:
    """A run's answer (`_run_answer`'s: a JSON text body, headers of one value each, no cookies) as the payload 2.0
    response the resolver's builder makes of it, built without a builder and an event wrapper each admission
    (tests/unit/test_hot_path.py holds the two alike).
    https://docs.aws.amazon.com/apigateway/latest/developerguide/http-api-develop-integrations-lambda.html"""
    return {
        "statusCode": answer.status_code,
        "body": answer.body,
        "isBase64Encoded": False,
        "headers": dict(answer.headers),
        "cookies": [],
    }


def _answer_to(error: Exception) -> Response[str]:
    """The problem this module answers for `error`: its exception handler's, the one mapping."""
    if isinstance(error, ModelValidationError):  # not registered: only a batch validates a model itself
        return _invalid_model(error)
    handler = app.exception_handler_manager.lookup_exception_handler(type(error)) or _unexpected
    answer: Response[str] = handler(error)
    return answer


def _refusal(error: Exception) -> Refusal:
    """A batch's spawn that failed, answered as the single route answers it."""
    answer = _answer_to(error)
    headers = answer.headers or {}
    retry_after = headers.get("Retry-After")
    return Refusal(int(answer.status_code), str(answer.body), retry_after if isinstance(retry_after, str) else None)


def _early_problem(status: HTTPStatus, kind: str, detail: str, **extensions: Any) -> dict[str, Any]:
    """A problem answered before routing, as the Lambda proxy response API Gateway expects."""
    return {
        "statusCode": int(status),
        "headers": {"Content-Type": PROBLEM_JSON},
        "body": json_text(_problem_body(status, kind, detail, **extensions)),
        "isBase64Encoded": False,
    }
