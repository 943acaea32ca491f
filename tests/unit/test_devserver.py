"""The local translation from HTTP to the API Gateway HTTP API event, against the canonical event."""

from __future__ import annotations

import base64
import json

from poimen.local.devserver import http_api_event, http_response
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
    )

    assert set(canonical) <= set(event)
    assert set(canonical["requestContext"]) == set(event["requestContext"])
    assert set(canonical["requestContext"]["authorizer"]["iam"]) - {"cognitoIdentity"} <= set(
        event["requestContext"]["authorizer"]["iam"]
    )
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
            "multiValueHeaders": {"X-Many": ["a", "b"]},
            "cookies": ["s=1"],
            "body": base64.b64encode(json.dumps({"ok": True}).encode()).decode(),
            "isBase64Encoded": True,
        }
    )

    assert status == 201
    assert headers == [("Location", "/v1/runs/1"), ("X-Many", "a"), ("X-Many", "b"), ("Set-Cookie", "s=1")]
    assert json.loads(body) == {"ok": True}
