"""AWS Signature V4 (`execute-api`) checked the way API Gateway's IAM authorization checks it, locally.

Principals come from a JSON file (`POIMEN_LOCAL_PRINCIPALS`): access key id → secret, principal ARN and
the tenants `poimen dev` grants it. The signature is recomputed with botocore's canonicalisation over
exactly the headers the client signed; unsigned, badly signed or stale (> 15 minutes) requests fail.
"""

from __future__ import annotations

import hmac
import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest, HTTPHeaders
from botocore.credentials import Credentials

MAX_SKEW = timedelta(minutes=15)
DEV_ACCESS_KEY = "POIMENDEVACCESSKEY"
DEV_SECRET_KEY = "poimen-dev-secret-access-key"  # noqa: S105 - documented, local-only, like moto's "testing"
_AUTHORIZATION = re.compile(
    r"^AWS4-HMAC-SHA256 Credential=(?P<key>[^/]+)/(?P<date>\d{8})/(?P<region>[^/]+)/(?P<service>[^/]+)/aws4_request,\s*"
    r"SignedHeaders=(?P<signed>[a-z0-9;_.-]+),\s*Signature=(?P<signature>[0-9a-f]{64})$"
)


class Unauthorized(Exception):
    """The request would get API Gateway's 403; the message is what API Gateway says."""


@dataclass(frozen=True)
class Principal:
    access_key: str
    secret_key: str
    arn: str
    tenants: tuple[str, ...] = ()


def dev_principal(arn: str) -> Principal:
    """The documented default: a fixed key pair for `poimen dev`, granted every tenant."""
    return Principal(DEV_ACCESS_KEY, DEV_SECRET_KEY, arn, ("*",))


def load_principals(path: Path) -> dict[str, Principal]:
    """`{"<access key id>": {"secret": "...", "arn": "...", "tenants": ["acme", "*"]}}`."""
    document: dict[str, Any] = json.loads(path.read_text())
    return {
        key: Principal(key, entry["secret"], entry["arn"], tuple(entry.get("tenants", ())))
        for key, entry in document.items()
    }


class _SignedHeadersOnly(SigV4Auth):
    """botocore's SigV4 over the headers the client listed in SignedHeaders, no more and no fewer."""

    def __init__(self, credentials: Credentials, region: str, signed: list[str]) -> None:
        super().__init__(credentials, "execute-api", region)
        self._signed = signed

    def headers_to_sign(self, request: AWSRequest) -> HTTPHeaders:
        chosen = HTTPHeaders()
        for name in self._signed:
            chosen[name] = request.headers.get(name, "")
        return chosen


def verify(
    principals: dict[str, Principal],
    method: str,
    target: str,
    headers: list[tuple[str, str]],
    body: bytes,
    now: datetime | None = None,
) -> Principal:
    """The principal that signed this request, or Unauthorized with API Gateway's message."""
    merged: dict[str, str] = {}
    for name, value in headers:
        lowered = name.lower()
        merged[lowered] = f"{merged[lowered]},{value}" if lowered in merged else value
    authorization = merged.get("authorization")
    if not authorization:
        raise Unauthorized("Missing Authentication Token")
    match = _AUTHORIZATION.match(authorization.strip())
    if match is None or match["service"] != "execute-api":
        raise Unauthorized("Authorization header requires 'Credential', 'SignedHeaders' and 'Signature'")
    principal = principals.get(match["key"])
    if principal is None:
        raise Unauthorized("The security token included in the request is invalid.")
    try:
        signed_at = datetime.strptime(merged.get("x-amz-date", ""), "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC)
    except ValueError as error:
        raise Unauthorized("Authorization header requires existence of either a 'X-Amz-Date' header") from error
    if abs((now or datetime.now(UTC)) - signed_at) > MAX_SKEW:
        raise Unauthorized("Signature expired")
    signed = match["signed"].split(";")
    if "host" not in signed:
        raise Unauthorized("The request signature must cover the host header")
    request = AWSRequest(method=method, url=f"http://{merged.get('host', '')}{target}", data=body, headers=merged)
    request.context["timestamp"] = merged["x-amz-date"]
    signer = _SignedHeadersOnly(Credentials(principal.access_key, principal.secret_key), match["region"], signed)
    canonical = signer.canonical_request(request)
    expected = signer.signature(signer.string_to_sign(request, canonical), request)
    if not hmac.compare_digest(expected, match["signature"]):
        raise Unauthorized(
            "The request signature we calculated does not match the signature you provided. "
            "Check your AWS Secret Access Key and signing method."
        )
    return principal


def signed_headers(
    method: str, url: str, headers: dict[str, str], body: bytes, access_key: str, secret_key: str, region: str
) -> dict[str, str]:
    """`headers` plus the SigV4 (`execute-api`) ones a client sends: for local clients and tests."""
    request = AWSRequest(method=method, url=url, data=body, headers=headers)
    SigV4Auth(Credentials(access_key, secret_key), "execute-api", region).add_auth(request)
    return dict(request.headers.items())
