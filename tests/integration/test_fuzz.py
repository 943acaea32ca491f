"""Schemathesis (pinned in pyproject.toml) holds `poimen dev` to infra/openapi.json over HTTP: its stateless
phases (examples, coverage, fuzzing) generate valid and invalid requests from the committed document, each
signed by botocore (SigV4, the schema's auth hook) for one tenant, and six checks judge every answer."""

from __future__ import annotations

import uuid
from http import HTTPStatus
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from schemathesis.core.transport import Response
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from poimen.ids import keyed_run_id
from poimen.wire import SPAWNS_MEDIA_TYPE
from tests.conftest import REPO, count_runs
from tests.integration.conftest import DevServer, SigV4, next_tenant, signed_session

DOCUMENT = REPO / "infra" / "openapi.json"
# Every generated request acts for this tenant (the header is set, not generated). Half of the generated look-ups
# ask for a run `admitted` put there first, by key or by id, and some spawns reuse its keys (a replay or a 422),
# so the answers to real runs are judged too, not only 404s.
TENANT = next_tenant()
KEYS = [f"fuzz-{i}" for i in range(4)]
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
    negative_data_rejection,
]
# Fuzzing cases per operation; the coverage phase adds its own boundary and negative cases. Three operations
# in about a minute on two cores. POST /v1/runs's cases are split between its two media types, a spawn and a
# batch (about 50 each, a batch's valid envelopes answered 200 with their results).
MAX_EXAMPLES = 60
# Nothing is excluded: no check, no generated kind of case (a repeated query parameter included: API Gateway joins
# repeats with commas, and the joined key is looked up and not found, a 4xx as negative_data_rejection expects).
# The two checks that do not fit this API stay out by not being among CHECKS: unsupported_method (API Gateway
# answers an undeclared method with its 404, not 405) and positive_data_acceptance (a valid body can meet a 422
# dispatch-key-reused, a conflict with what its key admitted before, not a refusal of the data).

config = SchemathesisConfig.from_dict(
    {
        "dictionaries": {
            "admitted-keys": {"values": KEYS},
            "admitted-run-ids": {"values": [keyed_run_id(TENANT, key) for key in KEYS]},
        },
        "parameters": {
            "header.x-poimen-tenant": TENANT,
            "query.dispatch_key": {"dictionary": "admitted-keys", "probability": 0.5},
            "path.run_id": {"dictionary": "admitted-run-ids", "probability": 0.5},
            "body.dispatch_key": {"dictionary": "admitted-keys", "probability": 0.3},
        },
        "phases": {
            "examples": {"enabled": True},
            "coverage": {"enabled": True},
            "fuzzing": {"enabled": True},
            "stateful": {"enabled": False},
        },
        "generation": {"max-examples": MAX_EXAMPLES},
    }
)
schema = schemathesis.openapi.from_path(DOCUMENT, config=config)
schema.auth.set_from_requests(SigV4())


def _sent(case: schemathesis.Case[Any], dev: DevServer) -> Response:
    """The case sent to `poimen dev` and its answer judged by CHECKS; never refused by IAM authorization."""
    answer = case.call_and_validate(base_url=dev.url, timeout=30, checks=CHECKS, auth=SigV4())
    # Every request is signed for a tenant the dev key is granted: a 403 would mean the cases never reached
    # admission (the document lists IAM's 403, so the checks alone would pass them).
    assert answer.status_code != HTTPStatus.FORBIDDEN, answer.text
    return answer


@pytest.fixture(scope="module")
def admitted(dev: DevServer) -> None:
    """The runs of KEYS, admitted before anything is generated."""
    with signed_session() as http:
        for key in KEYS:
            body = {"workflow_ref": "wf/fuzz", "input": {"key": key}, "dispatch_key": key}
            answer = http.post(f"{dev.url}/v1/runs", json=body, headers={"X-Poimen-Tenant": TENANT}, timeout=30)
            assert answer.status_code == HTTPStatus.CREATED, answer.text


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
def test_generated_requests_get_the_answers_the_document_gives(
    case: schemathesis.Case[Any], dev: DevServer, admitted: None
) -> None:
    _sent(case, dev)


def test_the_answers_to_a_real_run_are_the_documented_ones(dev: DevServer) -> None:
    # Given a spawn with a dispatch_key, as Schemathesis sends it (signed, the tenant set)
    spawn = schema["/v1/runs"]["POST"]
    body: dict[str, Any] = {"workflow_ref": "wf/fuzz", "input": {"n": 1}, "dispatch_key": f"k-{uuid.uuid4().hex}"}
    headers = {"X-Poimen-Tenant": TENANT, "Content-Type": "application/json"}

    # When it is admitted, sent again, and its run is looked up by id and by key
    created = _sent(spawn.Case(body=body, headers=headers, media_type="application/json"), dev)
    replayed = _sent(spawn.Case(body=body, headers=headers, media_type="application/json"), dev)
    run_id = created.json()["run_id"]
    tenant = {"X-Poimen-Tenant": TENANT}
    by_id = _sent(schema["/v1/runs/{run_id}"]["GET"].Case(path_parameters={"run_id": run_id}, headers=tenant), dev)
    by_key = _sent(schema["/v1/runs"]["GET"].Case(query={"dispatch_key": body["dispatch_key"]}, headers=tenant), dev)

    # Then each answer is one the document gives (201 with Location, 200 Idempotent-Replayed, the Run twice)
    assert [answer.status_code for answer in (created, replayed, by_id, by_key)] == [201, 200, 200, 200]
    assert created.headers["location"] == [f"/v1/runs/{run_id}"]
    assert {replayed.json()["run_id"], by_id.json()["run_id"], by_key.json()["run_id"]} == {run_id}
    # And the key is one run in the table
    stored = [item for item in count_runs(dev.dynamodb(), dev.table_name, TENANT) if item["run_id"]["S"] == run_id]
    assert len(stored) == 1


def test_the_answers_to_a_real_batch_are_the_documented_ones(dev: DevServer, admitted: None) -> None:
    # Given a batch as Schemathesis sends it: a new key, the same key again, an admitted key with another input,
    # and a spawn the API refuses
    spawn = schema["/v1/runs"]["POST"]
    key = f"k-{uuid.uuid4().hex}"
    spawns: list[Any] = [
        {"workflow_ref": "wf/fuzz", "input": {"n": 1}, "dispatch_key": key},
        {"workflow_ref": "wf/fuzz", "input": {"n": 1}, "dispatch_key": key},
        {"workflow_ref": "wf/fuzz", "input": {"other": True}, "dispatch_key": KEYS[0]},
        {"workflow_ref": "", "input": {}},
    ]
    case = spawn.Case(body={"spawns": spawns}, headers={"X-Poimen-Tenant": TENANT}, media_type=SPAWNS_MEDIA_TYPE)
    # When it is sent, its answer judged by CHECKS against the document
    answer = _sent(case, dev)
    # Then it is the documented 200 with one result a spawn, each its own
    assert answer.status_code == 200
    results = answer.json()["results"]
    assert [result["status"] for result in results] == [201, 200, 422, 400]
    assert results[0]["run"]["run_id"] == results[1]["run"]["run_id"] == keyed_run_id(TENANT, key)
    assert results[2]["problem"]["run_id"] == keyed_run_id(TENANT, KEYS[0])
