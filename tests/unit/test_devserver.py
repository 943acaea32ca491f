"""The local translation from HTTP to the API Gateway HTTP API event, against the canonical event."""

from __future__ import annotations

import base64
import json

from poimen_tools.local.devserver import Route, http_api_event, http_response
from poimen_tools.local.template import Template
from tests.conftest import load_event


def test_translated_event_has_the_shape_of_a_real_http_api_event() -> None:
    canonical = load_event("http_api_create_run.json")

    event = http_api_event(
        method="POST",
        target="/v1/runs?a=1&a=2&b=",
        headers=[("Content-Type", "application/json"), ("X-Poimen-Tenant", "acme"), ("Cookie", "c=1; d=2")],
        body=b'{"workflow_ref": "wf"}',
        principal_arn="arn:aws:iam::123456789012:user/dev",
        source_ip="127.0.0.1",
        route_key="POST /v1/runs",
    )

    assert set(canonical) <= set(event)
    assert set(canonical["requestContext"]) == set(event["requestContext"])
    assert set(canonical["requestContext"]["authorizer"]["iam"]) == set(event["requestContext"]["authorizer"]["iam"])
    assert event["routeKey"] == event["requestContext"]["routeKey"] == canonical["routeKey"]
    assert event["requestContext"]["stage"] == canonical["requestContext"]["stage"]
    assert event["headers"]["x-poimen-tenant"] == "acme"
    assert event["queryStringParameters"] == {"a": "1,2", "b": ""}
    assert event["cookies"] == ["c=1", "d=2"]
    assert event["requestContext"]["authorizer"]["iam"]["accountId"] == "123456789012"
    assert (event["body"], event["isBase64Encoded"]) == ('{"workflow_ref": "wf"}', False)


def test_binary_bodies_are_base64_and_no_principal_means_no_authorizer() -> None:
    event = http_api_event(
        method="POST", target="/v1/runs", headers=[], body=b"\xff\xfe", principal_arn=None, source_ip="::1"
    )

    assert event["isBase64Encoded"] is True
    assert base64.b64decode(event["body"]) == b"\xff\xfe"
    assert event["requestContext"]["authorizer"] == {}


def test_proxy_response_becomes_status_headers_and_bytes() -> None:
    status, headers, body = http_response(
        {
            "statusCode": 201,
            "headers": {"Location": "/v1/runs/1"},
            "cookies": ["s=1"],
            "body": base64.b64encode(json.dumps({"ok": True}).encode()).decode(),
            "isBase64Encoded": True,
        }
    )

    assert status == 201
    assert headers == [("Location", "/v1/runs/1"), ("Set-Cookie", "s=1")]
    assert json.loads(body) == {"ok": True}


def test_routes_of_the_template_match_like_api_gateway(template: Template) -> None:
    routes = [Route(method, path) for method, path in template.http_routes("AdmissionFunction")]

    def matching(method: str, path: str) -> list[tuple[str, dict[str, str]]]:
        return [(r.key, found) for r in routes if (found := r.match(method, path)) is not None]

    assert matching("POST", "/v1/runs") == [("POST /v1/runs", {})]
    assert matching("GET", "/v1/runs/abc-1") == [("GET /v1/runs/{run_id}", {"run_id": "abc-1"})]
    assert matching("GET", "/v1/runs/a/b") == []
    assert matching("DELETE", "/v1/runs") == []
