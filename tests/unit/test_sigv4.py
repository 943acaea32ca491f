"""Local SigV4 verification: what API Gateway's IAM authorization accepts and refuses."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from poimen_tools.local.sigv4 import Principal, Unauthorized, signed_headers, verify

ALICE = Principal("AKIDALICE", "alice-secret", "arn:aws:iam::1:user/alice", ("acme",))
PRINCIPALS = {ALICE.access_key: ALICE}
URL = "http://127.0.0.1:8080/v1/runs?dispatch_key=k%201"
BODY = b'{"workflow_ref": "wf", "input": {}}'


def _signed(secret: str = ALICE.secret_key, key: str = ALICE.access_key, body: bytes = BODY) -> list[tuple[str, str]]:
    headers = signed_headers(
        "POST", URL, {"Content-Type": "application/json", "X-Poimen-Tenant": "acme"}, body, key, secret, "us-east-1"
    )
    return [*headers.items(), ("Host", "127.0.0.1:8080"), ("User-Agent", "unsigned/1.0")]


def test_a_correctly_signed_request_names_its_principal() -> None:
    assert verify(PRINCIPALS, "POST", "/v1/runs?dispatch_key=k%201", _signed(), BODY) == ALICE


@pytest.mark.parametrize(
    ("headers", "method", "body", "message"),
    [
        ([("Host", "127.0.0.1:8080")], "POST", BODY, "Missing Authentication Token"),
        (_signed(secret="wrong"), "POST", BODY, "signature we calculated does not match"),
        (_signed(key="AKIDNOBODY"), "POST", BODY, "security token included in the request is invalid"),
        (_signed(), "POST", b'{"workflow_ref": "other", "input": {}}', "signature we calculated does not match"),
        (_signed(), "GET", BODY, "signature we calculated does not match"),
        ([("Host", "h"), ("Authorization", "Bearer x")], "POST", BODY, "requires 'Credential'"),
    ],
    ids=["unsigned", "wrong-secret", "unknown-key", "tampered-body", "other-method", "not-sigv4"],
)
def test_requests_api_gateway_would_refuse(
    headers: list[tuple[str, str]], method: str, body: bytes, message: str
) -> None:
    with pytest.raises(Unauthorized, match=message):
        verify(PRINCIPALS, method, "/v1/runs?dispatch_key=k%201", headers, body)


def test_a_tampered_tenant_header_breaks_the_signature() -> None:
    headers = [(name, "globex" if name.lower() == "x-poimen-tenant" else value) for name, value in _signed()]

    with pytest.raises(Unauthorized, match="does not match"):
        verify(PRINCIPALS, "POST", "/v1/runs?dispatch_key=k%201", headers, BODY)


def test_signatures_older_than_15_minutes_are_stale() -> None:
    later = datetime.now(UTC) + timedelta(minutes=16)

    with pytest.raises(Unauthorized, match="Signature expired"):
        verify(PRINCIPALS, "POST", "/v1/runs?dispatch_key=k%201", _signed(), BODY, now=later)
    assert verify(PRINCIPALS, "POST", "/v1/runs?dispatch_key=k%201", _signed(), BODY, now=later - timedelta(minutes=2))
