"""infra/openapi.json says what the API answers: its operations' answers, headers and schemas, checked here and
by openapi-spec-validator; tests/integration/test_fuzz.py holds the running API to it with Schemathesis."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from openapi_spec_validator import validate
from openapi_spec_validator.readers import read_from_filename

from poimen.contract import IDEMPOTENCY_KEY_HEADER_PATTERN
from poimen.wire import MAX_BATCH_BODY_BYTES, MAX_BATCH_SPAWNS, SPAWN_RESULTS_MEDIA_TYPE, SPAWNS_MEDIA_TYPE
from tests.conftest import REPO, count_runs
from tests.unit.conftest import Invoke

DOCUMENT = REPO / "infra" / "openapi.json"
OPERATIONS = [("/v1/runs", "post"), ("/v1/runs", "get"), ("/v1/runs/{run_id}", "get")]
GATEWAY_MESSAGE = {"$ref": "#/components/schemas/GatewayMessage"}


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DOCUMENT.read_text())
    return loaded


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _refs(item)


def test_openapi_spec_validator_finds_the_document_valid() -> None:
    # openapi-spec-validator (pinned in pyproject.toml) against the OpenAPI version the document declares
    spec, _ = read_from_filename(str(DOCUMENT))
    validate(spec)


def test_each_get_answers_its_run_with_the_run_schema(document: dict[str, Any]) -> None:
    for path in ("/v1/runs", "/v1/runs/{run_id}"):
        found = document["paths"][path]["get"]["responses"]["200"]
        assert found["content"] == {"application/json": {"schema": {"$ref": "#/components/schemas/Run"}}}


def test_the_created_runs_location_is_required_and_the_replays_header_declared(document: dict[str, Any]) -> None:
    responses = document["paths"]["/v1/runs"]["post"]["responses"]
    location = responses["201"]["headers"]["Location"]
    assert location["required"] is True
    assert location["schema"]["pattern"].startswith("^/v1/runs/")
    # Not required: a batch's 200 (its own media type) has none, each result says whether it replayed
    replayed = responses["200"]["headers"]["Idempotent-Replayed"]
    assert (replayed.get("required", False), replayed["schema"]) == (False, {"type": "string", "enum": ["true"]})
    assert "absent on a batch" in replayed["description"]


def test_the_batch_form_is_a_media_type_of_post_v1_runs_with_its_limits_and_its_answer(
    document: dict[str, Any],
) -> None:
    create_run = document["paths"]["/v1/runs"]["post"]
    schemas = document["components"]["schemas"]
    # Given the request body: one spawn as application/json, a batch as its own media type
    assert create_run["requestBody"]["content"] == {
        "application/json": {"schema": {"$ref": "#/components/schemas/RunRequest"}},
        SPAWNS_MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/SpawnBatch"}},
    }
    spawns = schemas["SpawnBatch"]["properties"]["spawns"]
    assert (spawns["minItems"], spawns["maxItems"]) == (1, MAX_BATCH_SPAWNS)
    assert spawns["items"]["type"] == "object"  # each spawn validated on its own: a bad one is its result's 400
    assert f"at most {MAX_BATCH_BODY_BYTES} bytes" in spawns["description"]
    assert schemas["SpawnBatch"]["additionalProperties"] is False
    # Then a batch is answered 200 with its results, each a run or a problem with its status
    assert create_run["responses"]["200"]["content"][SPAWN_RESULTS_MEDIA_TYPE] == {
        "schema": {"$ref": "#/components/schemas/SpawnResults"}
    }
    results = schemas["SpawnResults"]["properties"]["results"]["items"]["anyOf"]
    assert results == [{"$ref": "#/components/schemas/SpawnAdmitted"}, {"$ref": "#/components/schemas/SpawnRefused"}]
    assert schemas["SpawnAdmitted"]["properties"]["status"]["enum"] == [200, 201]
    assert schemas["SpawnAdmitted"]["properties"]["run"] == {"$ref": "#/components/schemas/Run"}
    assert schemas["SpawnRefused"]["required"] == ["status", "problem"]


def test_the_idempotency_key_header_has_its_syntax_and_its_400s(document: dict[str, Any]) -> None:
    create_run = document["paths"]["/v1/runs"]["post"]
    header = next(p for p in create_run["parameters"] if p["name"] == "idempotency-key")
    assert header["schema"]["pattern"] == IDEMPOTENCY_KEY_HEADER_PATTERN
    assert "RFC 8941" in header["description"]
    for kind in ("idempotency-key-invalid", "idempotency-key-mismatch"):
        assert f"`{kind}`" in create_run["responses"]["400"]["description"]


# What the document says a batch with an Idempotency-Key header is answered: "<status> `<problem type>`".
_BATCH_KEY_ANSWER = re.compile(r"any Idempotency-Key on a batch, well-formed or not, is answered (\d{3}) `([a-z-]+)`")


def test_a_batch_with_a_well_formed_idempotency_key_gets_what_the_document_says(
    document: dict[str, Any], invoke: Invoke, dynamodb: Any, table_name: str, tenant: str
) -> None:
    # Given what the document says, where a caller of POST /v1/runs looks: the header (declared once for the
    # operation, both media types), the request body and the 400s
    create_run = document["paths"]["/v1/runs"]["post"]
    header = next(p for p in create_run["parameters"] if p["name"] == "idempotency-key")
    said = {
        where: _BATCH_KEY_ANSWER.findall(text)
        for where, text in (
            ("header", header["description"]),
            ("request", create_run["requestBody"]["description"]),
            ("400", create_run["responses"]["400"]["description"]),
        )
    }
    assert said == {where: [("400", "idempotency-key-invalid")] for where in ("header", "request", "400")}
    assert re.fullmatch(IDEMPOTENCY_KEY_HEADER_PATTERN, "k-1")  # well-formed: the single form's key k-1
    # When a batch comes with a well-formed Idempotency-Key
    answer = invoke(
        body={"spawns": [{"workflow_ref": "wf", "input": {}}]},
        headers={
            "content-type": SPAWNS_MEDIA_TYPE,
            "idempotency-key": "k-1",
        },
    )
    # Then it is answered exactly that, and nothing is admitted
    assert [(str(answer.status), answer.body["type"].removeprefix("urn:poimen:problem:"))] == said["400"]
    assert count_runs(dynamodb, table_name, tenant) == []
    # And, as the document says, after the envelope (a bad one is its validation-error) and before the grants (a
    # tenant not granted to the caller is still the key's 400)
    keyed = {"content-type": SPAWNS_MEDIA_TYPE, "idempotency-key": "k-1"}
    assert invoke(body={"spawns": []}, headers=keyed).body["type"] == "urn:poimen:problem:validation-error"
    not_granted = invoke(body={"spawns": [{"workflow_ref": "wf", "input": {}}]}, headers=keyed, tenant=f"{tenant}-b")
    assert not_granted.body["type"] == "urn:poimen:problem:idempotency-key-invalid"


def test_no_answer_the_code_never_gives_and_no_schema_nothing_uses(document: dict[str, Any]) -> None:
    # Powertools declares a FastAPI-style 422 HTTPValidationError on every route; validation failures are 400s here
    for path, method in OPERATIONS:
        responses = document["paths"][path][method]["responses"]
        for status, response in responses.items():
            for media in response.get("content", {}).values():
                assert "HTTPValidationError" not in json.dumps(media), (path, method, status)
    for path in ("/v1/runs", "/v1/runs/{run_id}"):
        assert "422" not in document["paths"][path]["get"]["responses"]
    used = {ref.rsplit("/", 1)[1] for ref in _refs(document["paths"])}
    used |= {ref.rsplit("/", 1)[1] for ref in _refs(document["components"]["schemas"])}
    assert set(document["components"]["schemas"]) == used


def test_every_schema_defines_what_it_requires(document: dict[str, Any]) -> None:
    for name, schema in document["components"]["schemas"].items():
        assert set(schema.get("required", [])) <= set(schema.get("properties", {})), name


def test_api_gateways_own_answers_are_its_json_message(document: dict[str, Any]) -> None:
    gateway = document["components"]["schemas"]["GatewayMessage"]
    assert (gateway["required"], gateway["properties"]["message"]["type"]) == (["message"], "string")
    for path, method in OPERATIONS:
        responses = document["paths"][path][method]["responses"]
        # IAM authorization's 403 beside admission's own problem; throttling's 429 from API Gateway alone
        assert responses["403"]["content"]["application/json"]["schema"] == GATEWAY_MESSAGE
        assert "application/problem+json" in responses["403"]["content"]
        assert responses["429"]["content"] == {"application/json": {"schema": GATEWAY_MESSAGE}}
    # Over API Gateway's 10 MB payload quota the 413 is its own; up to it, admission's problem
    too_large = document["paths"]["/v1/runs"]["post"]["responses"]["413"]["content"]
    assert set(too_large) == {"application/problem+json", "application/json"}


def test_api_gateways_own_500_and_504_are_declared_as_its_message_with_their_outcome(document: dict[str, Any]) -> None:
    # API Gateway answers 500 when the function fails (a crash, its timeout, an invocation Lambda refused) and 504
    # past the HTTP API's integration timeout: its own {"message"}, no problem, and the outcome unknown either way
    for path, method in OPERATIONS:
        responses = document["paths"][path][method]["responses"]
        internal, timed_out = responses["500"], responses["504"]
        assert internal["content"]["application/json"]["schema"] == GATEWAY_MESSAGE
        # admission's own 500 beside it: the `internal-error` problem of its last-resort handler
        assert internal["content"]["application/problem+json"]["schema"] == {"$ref": "#/components/schemas/Problem"}
        assert timed_out["content"] == {"application/json": {"schema": GATEWAY_MESSAGE}}
        for response in (internal, timed_out):
            assert "no problem+json" in response["description"]
            assert "outcome is unknown" in response["description"]
            assert "same dispatch_key" in response["description"]


def test_the_http_apis_own_503_past_its_integration_timeout_is_declared_as_its_message_of_unknown_outcome(
    document: dict[str, Any],
) -> None:
    # An HTTP API that gives up on its integration answers 503 {"message":"Service Unavailable"}, not a problem
    # (seen with its apigw-requestid header: cortexlabs/cortex#1225, serverless/serverless#11222): beside
    # admission's own 503 problems, every operation declares it, and that its outcome is unknown
    for path, method in OPERATIONS:
        unavailable = document["paths"][path][method]["responses"]["503"]
        assert unavailable["content"]["application/json"]["schema"] == GATEWAY_MESSAGE
        assert unavailable["content"]["application/problem+json"]["schema"] == {"$ref": "#/components/schemas/Problem"}
        assert '{"message":"Service Unavailable"}' in unavailable["description"]
        assert "outcome is unknown" in unavailable["description"]
        assert "Retry-After" in unavailable["headers"]
