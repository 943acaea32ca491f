"""Every error of the API leaves as RFC 9457 problem+json with a stable type."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from aws_lambda_powertools.utilities.data_classes.common import BaseProxyEvent

from poimen.errors import StoreUnavailable
from poimen.ids import keyed_run_id
from poimen.store import Store
from tests.conftest import count_runs
from tests.unit.conftest import Invoke

GOOD = {"workflow_ref": "wf/hello", "input": {}}
PROBLEM = "urn:poimen:problem:"


def _fields(body: dict[str, Any]) -> set[str]:
    return {error["field"] for error in body["errors"]}


def test_malformed_json_is_400(invoke: Invoke) -> None:
    answer = invoke(raw_body='{"workflow_ref": "wf", "input": {')

    assert answer.status == 400
    assert answer.headers["Content-Type"] == "application/problem+json"
    assert answer.body["type"] == PROBLEM + "malformed-json"
    assert answer.body["status"] == 400


def test_deeply_nested_json_is_400(invoke: Invoke) -> None:
    answer = invoke(raw_body='{"workflow_ref": "wf", "input": ' + "[" * 100_000 + "]" * 100_000 + "}")

    assert answer.status == 400
    assert answer.body["type"] == PROBLEM + "malformed-json"


@pytest.mark.parametrize(
    ("body", "fields"),
    [
        ({"input": {}}, {"body.workflow_ref"}),
        ({"workflow_ref": "wf"}, {"body.input"}),
        ({"workflow_ref": 7, "input": []}, {"body.workflow_ref", "body.input"}),
        ({**GOOD, "priority": 1}, {"body.priority"}),
        ({**GOOD, "goal_id": 5}, {"body.goal_id"}),
        ({**GOOD, "workflow_ref": ""}, {"body.workflow_ref"}),
        ({**GOOD, "workflow_ref": "w" * 257}, {"body.workflow_ref"}),
        ({**GOOD, "dispatch_key": ""}, {"body.dispatch_key"}),
        ({**GOOD, "dispatch_key": "k" * 256}, {"body.dispatch_key"}),
        ({**GOOD, "dispatch_key": "line\nbreak"}, {"body.dispatch_key"}),
        ({**GOOD, "dispatch_key": "nul\x00"}, {"body.dispatch_key"}),
        ({**GOOD, "dispatch_key": "c1\x85"}, {"body.dispatch_key"}),
        ([GOOD], {"body"}),
    ],
    ids=[
        "no-workflow_ref",
        "no-input",
        "wrong-types",
        "unknown-field",
        "goal_id-type",
        "empty-workflow_ref",
        "long-workflow_ref",
        "empty-key",
        "long-key",
        "newline-key",
        "nul-key",
        "c1-key",
        "array-body",
    ],
)
def test_schema_violations_are_400_naming_each_field(
    invoke: Invoke, dynamodb: Any, table_name: str, tenant: str, body: Any, fields: set[str]
) -> None:
    answer = invoke(body=body)

    assert answer.status == 400
    assert answer.body["type"] == PROBLEM + "validation-error"
    assert _fields(answer.body) == fields
    assert count_runs(dynamodb, table_name, tenant) == []


@pytest.mark.parametrize(
    "raw",
    [
        '{"workflow_ref": "wf", "input": {"n": NaN}}',
        '{"workflow_ref": "wf", "input": {"n": -Infinity}}',
        '{"workflow_ref": "wf", "input": {"n": 1e400}}',
        '{"workflow_ref": "wf", "input": {"n": ' + "9" * 5000 + "}}",
        '{"workflow_ref": "wf", "input": {"s": "\\ud800"}}',
    ],
    ids=["nan", "infinity", "overflow", "huge-int", "lone-surrogate"],
)
def test_json_that_is_not_strict_is_400(invoke: Invoke, raw: str) -> None:
    answer = invoke(raw_body=raw)

    assert answer.status == 400
    assert answer.body["type"] == PROBLEM + "malformed-json"


def test_a_body_that_is_not_utf8_is_400(invoke: Invoke) -> None:
    answer = invoke(raw_bytes=b'{"workflow_ref": "\xff\xfe", "input": {}}')

    assert answer.status == 400
    assert answer.body["type"] == PROBLEM + "malformed-json"


SPAWNS = "application/vnd.poimen.spawns+json"


def _flagged_base64_cases() -> list[tuple[str, dict[str, str], str]]:
    """Bodies flagged isBase64Encoded that are not base64 as API Gateway writes it (standard alphabet, padded, no
    whitespace): the JSON text itself, of a valid spawn, an invalid one and a batch; and base64 flavours of a
    valid spawn that lenient decoders (Powertools', base64.b64decode without validate) would read all the same."""
    spawn = {**GOOD, "input": {"s": "ab???>>>"}}  # encodes with "+", "/" and padding, alone and in a batch
    text = json.dumps(spawn)
    encoded = base64.b64encode(text.encode()).decode()
    batch = base64.b64encode(json.dumps({"spawns": [spawn]}).encode()).decode()
    assert {"+", "/", "="} <= set(encoded)
    assert batch.endswith("=")
    plain = {"content-type": "application/json"}
    return [
        (text, plain, "valid-spawn-as-text"),
        (json.dumps({"input": {}}), plain, "invalid-spawn-as-text"),
        (json.dumps({"spawns": [spawn]}), {"content-type": SPAWNS}, "batch-as-text"),
        (encoded.rstrip("="), plain, "unpadded"),
        (encoded + "=", plain, "padded-twice"),
        ("\n".join(encoded[i : i + 76] for i in range(0, len(encoded), 76)) + "\n", plain, "mime-lines"),
        (" " + encoded, plain, "leading-space"),
        (base64.urlsafe_b64encode(text.encode()).decode(), plain, "urlsafe-alphabet"),
        ("中" + encoded, plain, "non-ascii"),
        # The last character's unused bits set: base64.b64decode(validate=True) reads it, but no encoder writes it
        (encoded[:-2] + chr(ord(encoded[-2]) + 1) + "=", plain, "non-canonical-bits"),
        (batch.rstrip("="), {"content-type": SPAWNS}, "batch-unpadded"),
    ]


@pytest.mark.parametrize(
    ("raw", "headers"),
    [case[:2] for case in _flagged_base64_cases()],
    ids=[case[2] for case in _flagged_base64_cases()],
)
def test_a_body_flagged_base64_that_is_not_base64_is_400_and_nothing_is_written(
    invoke: Invoke, dynamodb: Any, table_name: str, tenant: str, raw: str, headers: dict[str, str]
) -> None:
    # When API Gateway's event says the body is base64 and it is not (as API Gateway writes it)
    answer = invoke(raw_body=raw, headers=headers, flagged_base64=True)
    # Then it is the request's 400, never read as text nor handed to Powertools' own decoding (a 500)
    assert (answer.status, answer.body.get("type")) == (400, PROBLEM + "malformed-json")
    assert answer.body["detail"] == "The body is flagged base64-encoded (isBase64Encoded) but is not base64."
    assert count_runs(dynamodb, table_name, tenant) == []


@pytest.mark.parametrize("path", ["/v1/runs/00000000-0000-8000-8000-000000000000", "/v1/runs"])
def test_a_get_whose_body_is_flagged_base64_but_is_not_is_400(invoke: Invoke, path: str) -> None:
    query = "dispatch_key=k-1" if path == "/v1/runs" else ""
    answer = invoke("GET", path, query=query, raw_body="{}", flagged_base64=True)

    assert (answer.status, answer.body.get("type")) == (400, PROBLEM + "malformed-json")
    # and a GET with a base64 body, or an empty one flagged, is answered as without it
    assert invoke("GET", path, query=query, raw_body="{}", base64_body=True).status == 404
    assert invoke("GET", path, query=query, raw_body="", flagged_base64=True).status == 404
    assert invoke("GET", path, query=query, flagged_base64=True).status == 404  # no body at all


def test_an_empty_body_flagged_base64_is_answered_as_an_empty_body(
    invoke: Invoke, dynamodb: Any, table_name: str, tenant: str
) -> None:
    flagged = invoke(raw_body="", flagged_base64=True)
    plain = invoke(raw_body="")
    assert (flagged.status, flagged.text) == (plain.status, plain.text)
    assert flagged.body["type"] == PROBLEM + "validation-error"
    assert count_runs(dynamodb, table_name, tenant) == []


@pytest.mark.parametrize(
    ("body", "status"), [(GOOD, 201), ({"input": {}}, 400), ({**GOOD, "dispatch_key": "b-1"}, 201)]
)
def test_a_base64_body_is_answered_as_its_text(
    invoke: Invoke, monkeypatch: pytest.MonkeyPatch, body: dict[str, Any], status: int
) -> None:
    # Given Powertools' event, whose own base64 decoding (lenient: it skips what is not base64) must never run
    def decoded_body(event: BaseProxyEvent) -> str | None:
        assert not event.is_base64_encoded, "Powertools decoded a base64 body itself"
        return event.body

    monkeypatch.setattr(BaseProxyEvent, "decoded_body", property(decoded_body))
    # Valid or not, through the screen's fast path or Powertools' validation: the same answer as the text
    encoded = invoke(body=body, base64_body=True)
    assert encoded.status == status
    if status == 400:
        assert encoded.text == invoke(body=body).text


def test_non_ascii_input_up_to_the_limit_is_stored(invoke: Invoke, dynamodb: Any, table_name: str, tenant: str) -> None:
    # 80,000 three-byte characters: 240 KB as UTF-8, twice DynamoDB's item limit if \u-escaped
    body = {**GOOD, "input": {"text": "中" * 80_000, "emoji": "🔑" * 100}}
    answer = invoke(raw_body=json.dumps(body, ensure_ascii=False))

    assert answer.status == 201
    assert answer.body["input"]["text"] == "中" * 80_000
    assert len(count_runs(dynamodb, table_name, tenant)) == 1


@pytest.mark.parametrize(
    "content_type",
    ["text/csv", "application/x-www-form-urlencoded", "multipart/form-data", "application/jsonx"],
)
def test_bodies_of_other_media_types_are_415(invoke: Invoke, content_type: str) -> None:
    answer = invoke(body=GOOD, headers={"content-type": content_type})

    assert answer.status == 415
    assert answer.body["type"] == PROBLEM + "unsupported-media-type"


def test_json_media_type_is_case_insensitive_with_parameters(invoke: Invoke) -> None:
    assert invoke(body=GOOD, headers={"content-type": "Application/JSON; charset=utf-8"}).status == 201


def test_key_limits_accept_255_characters_unicode_and_hash(invoke: Invoke) -> None:
    for key in ("k" * 255, "schlüssel#1", "🔑"):
        assert invoke(body={**GOOD, "dispatch_key": key}).status == 201


def test_body_over_256_kib_is_413(invoke: Invoke, dynamodb: Any, table_name: str, tenant: str) -> None:
    oversize = {**GOOD, "input": {"blob": "x" * (256 * 1024)}}

    plain = invoke(body=oversize)
    encoded = invoke(body=oversize, base64_body=True)

    for answer in (plain, encoded):
        assert answer.status == 413
        assert answer.body["type"] == PROBLEM + "payload-too-large"
        assert answer.body["title"] == "Content Too Large"  # RFC 9110, on every Python version
    assert count_runs(dynamodb, table_name, tenant) == []


def test_body_just_under_the_limit_is_admitted(invoke: Invoke) -> None:
    envelope = len(json.dumps({**GOOD, "input": {"blob": ""}}))
    assert invoke(body={**GOOD, "input": {"blob": "x" * (256 * 1024 - envelope)}}).status == 201


def test_no_identity_is_403(invoke: Invoke) -> None:
    answer = invoke(body=GOOD, principal=None)

    assert answer.status == 403
    assert answer.body["type"] == PROBLEM + "forbidden"


def test_tenant_not_granted_is_403_for_every_route(invoke: Invoke, dynamodb: Any, table_name: str, tenant: str) -> None:
    not_granted = f"{tenant}-b"  # served by the stack (tests/unit/conftest.py), not granted to the caller
    for method, path, query in (
        ("POST", "/v1/runs", ""),
        ("GET", f"/v1/runs/{keyed_run_id(not_granted, 'k')}", ""),
        ("GET", "/v1/runs", "dispatch_key=k"),
    ):
        answer = invoke(method, path, body=GOOD if method == "POST" else None, tenant=not_granted, query=query)
        assert answer.status == 403
        assert answer.body["type"] == PROBLEM + "forbidden"
    assert count_runs(dynamodb, table_name, not_granted) == []


@pytest.mark.parametrize("header", ["Acme", "a#b", "a.b", "a" * 64, "ünï", "-lead", ""])
def test_invalid_tenant_header_is_400(invoke: Invoke, header: str) -> None:
    answer = invoke(body=GOOD, tenant=header)

    assert answer.status == 400
    assert _fields(answer.body) == {"header.x-poimen-tenant"}


def test_missing_tenant_header_is_400(invoke: Invoke) -> None:
    answer = invoke(body=GOOD, tenant=None)

    assert answer.status == 400
    assert _fields(answer.body) == {"header.x-poimen-tenant"}


def test_a_run_id_that_is_no_uuid_is_400(invoke: Invoke) -> None:
    answer = invoke("GET", "/v1/runs/not-a-run-id")

    assert answer.status == 400
    assert _fields(answer.body) == {"path.run_id"}


def test_lookup_without_dispatch_key_is_400(invoke: Invoke) -> None:
    answer = invoke("GET", "/v1/runs")

    assert answer.status == 400
    assert _fields(answer.body) == {"query.dispatch_key"}


def test_unknown_route_is_404(invoke: Invoke) -> None:
    answer = invoke("DELETE", "/v1/runs")

    assert answer.status == 404
    assert answer.body["type"] == PROBLEM + "not-found"


def test_store_unavailable_is_503_with_retry_after(invoke: Invoke, monkeypatch: pytest.MonkeyPatch) -> None:
    def throttled(self: Store, record: object) -> None:
        raise StoreUnavailable("DynamoDB answered ThrottlingException after retries", retry_after_seconds=2)

    monkeypatch.setattr(Store, "put_run_if_absent", throttled)

    answer = invoke(body=GOOD)

    assert answer.status == 503
    assert answer.headers["Retry-After"] == "2"
    assert answer.body["type"] == PROBLEM + "store-unavailable"


def test_unexpected_error_is_a_500_problem(invoke: Invoke, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: Store, record: object) -> None:
        raise KeyError("boom")

    monkeypatch.setattr(Store, "put_run_if_absent", broken)

    answer = invoke(body=GOOD)

    assert answer.status == 500
    assert answer.body["type"] == PROBLEM + "internal-error"
    assert "boom" not in json.dumps(answer.body)


def test_unicode_and_hash_keys_are_valid_and_never_collide(
    invoke: Invoke, dynamodb: Any, table_name: str, tenant: str
) -> None:
    keys = ["k", "k#", "#k", "k#1", "ключ", "ключ#", "🔑", "k\u00e9", "ke\u0301"]  # é composed and decomposed

    answers = [invoke(body={**GOOD, "dispatch_key": key}) for key in keys]

    assert [answer.status for answer in answers] == [201] * len(keys)
    assert len({answer.body["run_id"] for answer in answers}) == len(keys)
    assert len(count_runs(dynamodb, table_name, tenant)) == len(keys)


def _nested(levels: int, opener: str = '{"a":', closer: str = "}") -> str:
    """JSON text `levels` deep: each object (or array) inside the one before."""
    return opener * (levels - 1) + "{}" + closer * (levels - 1)


def test_an_input_nested_255_levels_is_400_and_nothing_is_written(
    invoke: Invoke, dynamodb: Any, table_name: str, tenant: str
) -> None:
    answer = invoke(raw_body='{"workflow_ref": "wf", "input": ' + _nested(255) + "}")

    assert answer.status == 400
    assert answer.body["type"] == PROBLEM + "malformed-json"
    assert "64 levels" in answer.body["detail"]
    assert count_runs(dynamodb, table_name, tenant) == []


@pytest.mark.parametrize(("opener", "closer"), [('{"a":', "}"), ("[", "]")], ids=["objects", "arrays"])
def test_bodies_nest_up_to_64_levels_the_body_counting_as_one(invoke: Invoke, opener: str, closer: str) -> None:
    at_limit = invoke(raw_body='{"workflow_ref": "wf", "input": {"a": ' + _nested(62, opener, closer) + "}}")
    over = invoke(raw_body='{"workflow_ref": "wf", "input": {"a": ' + _nested(63, opener, closer) + "}}")

    assert (at_limit.status, over.status) == (201, 400)
    assert over.body["type"] == PROBLEM + "malformed-json"


def test_numbers_are_stored_as_sent_so_a_body_under_256_kib_fits_one_item(
    invoke: Invoke, dynamodb: Any, table_name: str, tenant: str
) -> None:
    # 50,000 times `1e15,`: 250 KB sent; written back as 1000000000000000.0 it was 950 KB, past DynamoDB's 400 KB
    numbers = ",".join(["1e15"] * 50_000)

    answer = invoke(raw_body='{"workflow_ref": "wf", "input": {"n": [' + numbers + "]}}")

    assert answer.status == 201
    [item] = count_runs(dynamodb, table_name, tenant)
    assert item["input"]["S"] == '{"n":[' + numbers + "]}"


def test_a_run_over_dynamodbs_item_limit_is_413_before_the_write(
    invoke: Invoke, monkeypatch: pytest.MonkeyPatch, dynamodb: Any, table_name: str, tenant: str
) -> None:
    # Given a body limit raised past what one DynamoDB item holds
    monkeypatch.setattr("poimen.api.MAX_BODY_BYTES", 1024 * 1024)
    # When a run's item would be just over 400,000 bytes (moto itself refuses only past 405,000)
    answer = invoke(body={**GOOD, "input": {"blob": "x" * 400_000}})
    # Then it is refused before the write, saying why
    assert answer.status == 413
    assert answer.body["type"] == PROBLEM + "payload-too-large"
    assert "DynamoDB" in answer.body["detail"]
    assert count_runs(dynamodb, table_name, tenant) == []


@pytest.mark.parametrize(
    "header",
    ['"k-1', '"k-1";a=1', r'"bad \n escape"', '""', "k" * 256, "nul\x00", '"a", "b"'],
    ids=["unterminated", "parameters", "unknown-escape", "empty", "too-long", "control", "two-values"],
)
def test_an_idempotency_key_that_names_no_key_is_400(
    invoke: Invoke, dynamodb: Any, table_name: str, tenant: str, header: str
) -> None:
    answer = invoke(body=GOOD, headers={"idempotency-key": header})

    assert answer.status == 400
    assert answer.headers["Content-Type"] == "application/problem+json"
    assert answer.body["type"] == PROBLEM + "idempotency-key-invalid"
    assert "Idempotency-Key" in answer.body["detail"]
    assert count_runs(dynamodb, table_name, tenant) == []


def test_a_repeated_bare_idempotency_key_line_admits_nothing(
    invoke: Invoke, dynamodb: Any, table_name: str, tenant: str
) -> None:
    # Given a run admitted under key k-1 from its Idempotency-Key header
    first = invoke(body=GOOD, headers={"idempotency-key": "k-1"})
    # When the same spawn comes with the header line twice, which API Gateway joins with a comma, and
    # with two different keys
    repeated = invoke(body=GOOD, headers={"idempotency-key": "k-1,k-1"})
    two = invoke(body=GOOD, headers={"idempotency-key": "k-2,k-3"})
    # Then neither is a key: both are refused, and the table holds the first run only
    assert first.status == 201
    assert [(answer.status, answer.body["type"]) for answer in (repeated, two)] == [
        (400, PROBLEM + "idempotency-key-invalid")
    ] * 2
    assert "quoted" in repeated.body["detail"]
    assert [item["run_id"]["S"] for item in count_runs(dynamodb, table_name, tenant)] == [first.body["run_id"]]


def test_a_quoted_idempotency_key_may_hold_a_comma(invoke: Invoke, tenant: str) -> None:
    answer = invoke(body=GOOD, headers={"idempotency-key": '"a,b"'})

    assert (answer.status, answer.body["dispatch_key"]) == (201, "a,b")
    assert answer.body["run_id"] == keyed_run_id(tenant, "a,b")


@pytest.mark.parametrize("header", ['"k-2"', "k-2"], ids=["quoted", "unquoted"])
def test_an_idempotency_key_other_than_the_body_key_is_400(
    invoke: Invoke, dynamodb: Any, table_name: str, tenant: str, header: str
) -> None:
    answer = invoke(body={**GOOD, "dispatch_key": "k-1"}, headers={"idempotency-key": header})

    assert answer.status == 400
    assert answer.body["type"] == PROBLEM + "idempotency-key-mismatch"
    assert "dispatch_key" in answer.body["detail"]
    assert count_runs(dynamodb, table_name, tenant) == []
