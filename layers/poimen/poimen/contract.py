"""The HTTP contract of POST /v1/runs: request and response bodies, limits, header names, and JSON as
the API reads and writes it (strict, numbers exact).

Everything that speaks to the API (the handler, publishers, the client) shares these definitions; the
names and limits themselves are in `poimen.wire`, which the relay imports without pydantic. This module
depends on nothing else in the package.
"""

from __future__ import annotations

import json
import math
import re
from decimal import Decimal, DecimalException
from json.encoder import encode_basestring
from typing import Annotated, Any, Literal, NoReturn

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.json_schema import SkipJsonSchema

from poimen.wire import (
    DISPATCH_KEY_PATTERN,
    IDEMPOTENCY_KEY_HEADER,
    MAX_BATCH_BODY_BYTES,
    MAX_BATCH_SPAWNS,
    MAX_BODY_BYTES,
    MAX_JSON_DEPTH,
    TENANT_PATTERN,
)

TenantId = Annotated[str, Field(pattern=TENANT_PATTERN, description="Tenant id; part of Kafka topic names")]
DispatchKey = Annotated[
    str,
    Field(
        min_length=1,
        max_length=255,
        pattern=DISPATCH_KEY_PATTERN,
        description="Caller-chosen, opaque; repeats of a key admit the first run again",
    ),
]
OrderingKey = Annotated[str, Field(min_length=1, max_length=255)]
WorkflowRef = Annotated[str, Field(min_length=1, max_length=256)]
GoalId = Annotated[str, Field(min_length=1, max_length=256)]


class RunRequest(BaseModel):
    """Body of POST /v1/runs."""

    # defer_build: the validator is built on first use, not at import (cold start); warmed before a
    # SnapStart snapshot (poimen.api.warm). Run and Problem are only ever built for the OpenAPI document.
    model_config = ConfigDict(extra="forbid", strict=True, defer_build=True)

    workflow_ref: WorkflowRef
    input: dict[str, Any]
    goal_id: GoalId | None = None
    dispatch_key: DispatchKey | None = None


class Run(BaseModel):
    """A run as the API returns it; a replayed admission returns the first answer unchanged."""

    model_config = ConfigDict(defer_build=True)

    run_id: str
    tenant_id: str
    workflow_ref: str
    input: dict[str, Any]
    goal_id: str | None
    dispatch_key: str | None
    status: Literal["admitted"]
    created_at: str = Field(description="RFC 3339 UTC timestamp of the first admission")


class SpawnBatch(BaseModel):
    """Body of POST /v1/runs sent as application/vnd.poimen.spawns+json: spawns of the one tenant the request
    names, each admitted as if it were the body of its own POST /v1/runs, answered one result each, in order."""

    model_config = ConfigDict(extra="forbid", strict=True, defer_build=True)

    spawns: list[dict[str, Any]] = Field(
        min_length=1,
        max_length=MAX_BATCH_SPAWNS,
        description=(
            f"1 to {MAX_BATCH_SPAWNS} spawns, the whole body at most {MAX_BATCH_BODY_BYTES} bytes: each a RunRequest "
            "(#/components/schemas/RunRequest), validated on its own: one that is not is its own result's 400 "
            f"(or 413 over {MAX_BODY_BYTES} bytes as compact JSON), never the request's. Its key is its "
            "dispatch_key (no Idempotency-Key header); a key repeated in the batch is its first spawn's run "
            "(200, replayed) or a 422. Spawns of different keys are admitted concurrently, those sharing a key or "
            "an ordering key one after another, in order."
        ),
    )
    traceparents: list[str | None] = Field(
        default_factory=list,
        description=(
            "W3C traceparent of each spawn, by position: none, or one a spawn (null: the request's traceparent "
            "header); a malformed one is not kept, as the header's is not."
        ),
    )
    ordering_keys: list[OrderingKey | None] = Field(
        default_factory=list,
        description=(
            "Ordering key of each spawn, by position: none, or one a spawn (null: none). Spawns sharing an ordering "
            "key (or a dispatch_key) are admitted in the batch's order, and one after such a spawn that was not "
            "admitted (its result a 503, or a 500) is not begun: its result is 503 `store-unavailable`, nothing "
            "written, to send again after that one. The inbox relay gives the records of one Kafka key one, so "
            "that none is admitted ahead of an earlier one. Opaque, scoped to the request."
        ),
    )

    @model_validator(mode="after")
    def _none_or_one_entry_a_spawn(self) -> SpawnBatch:
        for name in ("traceparents", "ordering_keys"):
            entries = getattr(self, name)
            if entries and len(entries) != len(self.spawns):
                raise ValueError(f"{name} must be empty or have one entry for each spawn")
        return self


class SpawnAdmitted(BaseModel):
    """A spawn of the batch admitted: the run, as POST /v1/runs answers it (201 new, 200 replayed)."""

    model_config = ConfigDict(defer_build=True)

    status: Literal[200, 201]
    replayed: bool
    run: Run


class SpawnRefused(BaseModel):
    """A spawn of the batch refused or failed: the problem POST /v1/runs would answer for it alone, with its
    status. A 503 `outcome-unknown` names the run (`problem.run_id`) that may have been admitted; `retry_after`
    is the Retry-After its own answer would carry."""

    model_config = ConfigDict(defer_build=True)

    status: int = Field(ge=400, le=599)
    problem: Problem
    retry_after: int | SkipJsonSchema[None] = Field(default=None, description="Seconds before sending it again")


class SpawnResults(BaseModel):
    """The answer to a batch: one result a spawn, in the order of `spawns`."""

    model_config = ConfigDict(defer_build=True)

    results: list[SpawnAdmitted | SpawnRefused]


class InvalidIdempotencyKey(ValueError):
    """An Idempotency-Key header value that names no dispatch_key; the message says what it must be."""


class IdempotencyKeyMismatch(ValueError):
    """The Idempotency-Key header and the body's dispatch_key name different keys."""


def idempotency_key(value: str) -> str:
    """The dispatch_key an Idempotency-Key header value names, or InvalidIdempotencyKey.

    Quoted, the value is an RFC 8941 sf-string (section 3.3.3): printable ASCII between double quotes,
    `\\"` and `\\\\` its only escapes, nothing after the closing quote (no parameters). Unquoted, it is the
    key itself, as most clients send it, without a comma: API Gateway (payload 2.0) and `poimen dev` join
    repeated header lines with commas, so `k,k` is the line `k` sent twice (or `a,b` two keys), never a
    key; a key with a comma must be quoted, or sent in the body. Whitespace around it is not part of it
    (RFC 9110 OWS). The key keeps the dispatch_key rules (1-255 characters, no control characters) and,
    being a header, is printable ASCII: other keys go in the body, as header bytes beyond ASCII have no
    agreed encoding.
    """
    text = value.strip(" \t")
    if "," in text and not text.startswith('"'):
        raise InvalidIdempotencyKey(
            f"{IDEMPOTENCY_KEY_HEADER} is unquoted and holds a comma: repeated header lines arrive joined with "
            'commas, so it names no one key; send a key with a comma quoted ("a,b"), or as the body\'s '
            "dispatch_key."
        )
    if text.startswith('"'):
        string = _SF_STRING.fullmatch(text)
        if string is None:
            raise InvalidIdempotencyKey(
                f"{IDEMPOTENCY_KEY_HEADER} is quoted but not one RFC 8941 string: printable ASCII between double "
                'quotes, with \\" and \\\\ the only escapes, and nothing after it.'
            )
        text = _SF_ESCAPE.sub(r"\1", string[1])
    if _HEADER_KEY.fullmatch(text) is None:
        raise InvalidIdempotencyKey(
            f"{IDEMPOTENCY_KEY_HEADER} must name a key of 1 to 255 printable ASCII characters; "
            "send other keys as the body's dispatch_key."
        )
    return text


def dispatch_key_of(header: str | None, body_key: str | None) -> str | None:
    """The request's dispatch_key: from its Idempotency-Key header, its body, or both when they are equal.

    InvalidIdempotencyKey for a header that names no key; IdempotencyKeyMismatch when the two differ.
    """
    if header is None:
        return body_key
    key = idempotency_key(header)
    if body_key is not None and body_key != key:
        raise IdempotencyKeyMismatch(
            f"The {IDEMPOTENCY_KEY_HEADER} header and the body's dispatch_key name different keys; "
            "send the key in one of them, or the same key in both."
        )
    return key


# RFC 8941 sf-string: DQUOTE *( unescaped / "\" ( DQUOTE / "\" ) ) DQUOTE, unescaped being %x20-21 / %x23-5B / %x5D-7E.
_SF_STRING = re.compile(r'"((?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\["\\])*)"')
_SF_ESCAPE = re.compile(r'\\(["\\])')
# A dispatch_key (DISPATCH_KEY_PATTERN) of printable ASCII only, which has no control characters.
_HEADER_KEY = re.compile(r"[\x20-\x7e]{1,255}")
# What `idempotency_key` accepts, as one regular expression for the OpenAPI document (ECMA-262 and Python
# read it alike; tests hold it to the function): optional whitespace around an RFC 8941 string of 1-255
# characters, or a bare key of 1-255 printable ASCII characters that neither starts with a quote or a space
# nor holds a comma, nor ends with a space.
IDEMPOTENCY_KEY_HEADER_PATTERN = (
    r'^[ \t]*(?:"(?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\["\\]){1,255}"'
    r"|[\x21\x23-\x2b\x2d-\x7e](?:[\x20-\x2b\x2d-\x7e]{0,253}[\x21-\x2b\x2d-\x7e])?)[ \t]*$"
)


class GatewayMessage(BaseModel):
    """API Gateway's own answer, before the function runs (IAM authorization, throttling, quotas)."""

    model_config = ConfigDict(defer_build=True)

    message: str


class Problem(BaseModel):
    """RFC 9457 problem details; extension members (`errors`, `run_id`) ride along."""

    model_config = ConfigDict(extra="allow", defer_build=True)

    type: str
    title: str
    status: int
    detail: str
    # Absent, never null, from other problems (SkipJsonSchema keeps None out of the document).
    throttled: Literal[True] | SkipJsonSchema[None] = Field(
        default=None,
        description=(
            "store-unavailable: `true` when the API asks to slow down, nothing written (as API Gateway's 429 does): "
            "DynamoDB throttled the request, or a batch's spawn found the batch without the time or answer room "
            "left for it, or waits for an earlier spawn of its keys that was throttled; absent when the store failed"
        ),
    )


# --- JSON as the API reads and writes it: strict, numbers exact --------------------------------------


class JSONNumber(Decimal):
    """A JSON number with a fraction or an exponent, read exactly: a Decimal that keeps its text as sent."""

    __slots__ = ("text",)
    text: str

    def __new__(cls, text: str) -> JSONNumber:
        number = super().__new__(cls, text)
        number.text = text
        return number


class JSONTooDeep(ValueError):
    """The JSON nests deeper than MAX_JSON_DEPTH."""


def parse_json(text: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Strict JSON with exact numbers, or ValueError.

    Integers are Python ints; numbers with a fraction or an exponent are JSONNumbers. Refused: NaN and
    Infinity, numbers a double would overflow (1e400), integers of more digits than Python converts
    (4300), lone surrogates, and nesting deeper than `max_depth` (JSONTooDeep; so is RecursionError
    from nesting too deep to parse at all).
    """
    value = _DECODER.decode(text)
    if exceeds_depth(value, max_depth):
        raise JSONTooDeep(f"nested deeper than {max_depth} levels")
    if _SURROGATE_ESCAPE.search(text):
        json_text(value).encode("utf-8")  # a lone surrogate cannot be encoded: UnicodeEncodeError
    return value


class JSONText(str):
    """JSON text written already, by `json_text` (or `run_json`, which writes as it does): `json_text` embeds it as it
    is, so that an answer built of parts (a batch's runs and problems) is one serializer's text without its parts
    parsed and written again."""

    __slots__ = ()


def json_text(value: Any) -> str:
    """Compact JSON text of a parsed value, each JSONNumber written as it was sent, each JSONText as it is.

    The one serializer of the API's answers: problems, a batch's results, the OpenAPI document, and runs (by
    `run_json`, which writes as it does, without the parse). Keys keep their order and strings are not \\u-escaped
    (a 256 KiB body stays under DynamoDB's item limit); a Python float (from a caller in-process) is written as
    json.dumps writes it.
    """
    if isinstance(value, str):
        return value if isinstance(value, JSONText) else encode_basestring(value)
    if isinstance(value, dict):
        return "{" + ",".join(encode_basestring(key) + ":" + json_text(item) for key, item in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(json_text(item) for item in value) + "]"
    if isinstance(value, JSONNumber):
        return value.text
    if value is None or isinstance(value, bool):
        return _LITERALS[value]
    if isinstance(value, int):
        return int.__repr__(value)
    return json.dumps(value, allow_nan=False)  # a float, from a caller in-process


def run_json(
    *,
    run_id: str,
    tenant_id: str,
    workflow_ref: str,
    input_json: str,
    goal_id: str | None,
    dispatch_key: str | None,
    created_at: str,
) -> str:
    """A Run as the API answers it, `input_json` (the input's JSON text) embedded verbatim; the rest as
    json.dumps(ensure_ascii=False, separators=(",", ":")) writes it, each string by the function that call
    uses (`encode_basestring`), without an encoder built and run for each answer."""
    return (
        f'{{"run_id":{encode_basestring(run_id)},"tenant_id":{encode_basestring(tenant_id)},'
        f'"workflow_ref":{encode_basestring(workflow_ref)},"input":{input_json},'
        f'"goal_id":{_string_or_null(goal_id)},"dispatch_key":{_string_or_null(dispatch_key)},'
        f'"status":"admitted","created_at":{encode_basestring(created_at)}}}'
    )


def _string_or_null(value: str | None) -> str:
    return "null" if value is None else encode_basestring(value)


def _json_number(text: str) -> JSONNumber:
    if not math.isfinite(float(text)):
        raise ValueError(f"{text} overflows a double")
    try:
        return JSONNumber(text)
    except DecimalException as error:  # an exponent beyond Decimal's: 1e-99999999999999999999
        raise ValueError(f"{text} is out of range") from error


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_float=_json_number, parse_constant=_reject_constant)
_LITERALS = {None: "null", True: "true", False: "false"}
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def exceeds_depth(value: Any, max_depth: int = MAX_JSON_DEPTH) -> bool:
    """Whether `value` nests deeper than `max_depth`, found level by level (no recursion)."""
    level = [value] if isinstance(value, dict | list) else []
    for _ in range(max_depth):
        if not level:
            return False
        level = [
            child
            for node in level
            for child in (node.values() if isinstance(node, dict) else node)
            if isinstance(child, dict | list)
        ]
    return bool(level)
