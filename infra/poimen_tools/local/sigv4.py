"""AWS Signature V4 (`execute-api`) checked the way API Gateway's IAM authorization checks it, locally.

Principals come from a JSON file (`POIMEN_LOCAL_PRINCIPALS`): access key id → secret, principal ARN, the
tenants `poimen dev` grants it and, for temporary credentials, the session token. The canonical request is
rebuilt from the request as it arrived, never from what the client claims about it: the payload hash is
taken of the body, the path and the query are decoded and encoded again, and the credential scope must
name this server's region, `execute-api` and the day of `X-Amz-Date`. Header values are signed as the bytes
that arrived, as AWS checks them: a client that signs UTF-8 and sends UTF-8 (curl, the Rust SDK) verifies; one
that signs UTF-8 but sends another encoding (botocore's str values go out as ISO-8859-1 through http.client) does
not. Refusals carry API Gateway's words.

References (IAM User Guide, "AWS Signature Version 4 for API requests"): the canonical request and the
scope, https://docs.aws.amazon.com/IAM/latest/UserGuide/reference_sigv-create-signed-request.html; header
or query string, https://docs.aws.amazon.com/IAM/latest/UserGuide/reference_sigv-authentication-methods.html.
Checked against the aws-signing-test-suite (awslabs/aws-c-auth, tests/aws-signing-test-suite/v4).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote_to_bytes, urlsplit, urlunsplit

from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from poimen.kafka import is_tenant_id

SERVICE = "execute-api"
ALGORITHM = "AWS4-HMAC-SHA256"
TERMINATOR = "aws4_request"
# API Gateway refuses a signature dated more than five minutes from its clock, either way: its refusals
# read "Signature expired: ... (<now> - 5 min.)" and "Signature not yet current: ... (<now> + 5 min.)".
MAX_SKEW = timedelta(minutes=5)
MAX_PRESIGNED_EXPIRES = 604_800  # seven days, SigV4's ceiling for X-Amz-Expires
DEV_ACCESS_KEY = "POIMENDEVACCESSKEY"
DEV_SECRET_KEY = "poimen-dev-secret-access-key"  # noqa: S105 - documented, local-only, like moto's "testing"

_ISO_BASIC = re.compile(r"\d{8}T\d{6}Z")
_QUERY_AUTH = ("X-Amz-Algorithm", "X-Amz-Credential", "X-Amz-Signature", "X-Amz-SignedHeaders", "X-Amz-Date")
_INVALID_TOKEN = "The security token included in the request is invalid."  # noqa: S105 - a message, not a secret
_MISMATCH = (
    "The request signature we calculated does not match the signature you provided. "
    "Check your AWS Secret Access Key and signing method. Consult the service documentation for details."
)


class Unauthorized(Exception):
    """The request would get API Gateway's 403; the message is what API Gateway says."""


class InvalidPrincipals(ValueError):
    """A principals file that is not one; the message names the file and what is wrong."""


@dataclass(frozen=True)
class Principal:
    access_key: str
    secret_key: str
    arn: str
    tenants: tuple[str, ...] = ()
    # Temporary credentials: requests must carry this token (X-Amz-Security-Token); long-term keys carry none.
    session_token: str | None = None


def dev_principal(arn: str) -> Principal:
    """The documented default: a fixed key pair for `poimen dev`, granted every tenant."""
    return Principal(DEV_ACCESS_KEY, DEV_SECRET_KEY, arn, ("*",))


def load_principals(path: Path) -> dict[str, Principal]:
    """`{"<access key id>": {"secret": "...", "arn": "...", "tenants": ["acme", "*"], "session_token": "..."}}`.

    `session_token` is optional: a principal that declares one stands for temporary credentials.
    InvalidPrincipals for a file that is not that (OSError for one that cannot be read).
    """
    try:
        document = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as error:  # not JSON, not UTF-8, nested too deep
        raise InvalidPrincipals(f"{path} is not JSON ({error})") from error
    if not isinstance(document, dict):
        raise InvalidPrincipals(f"{path} must be a JSON object: access key id -> {{secret, arn, tenants}}")
    return {key: _principal(path, key, entry) for key, entry in document.items()}


def _principal(path: Path, key: str, entry: Any) -> Principal:
    def wrong(what: str) -> InvalidPrincipals:
        return InvalidPrincipals(f"{path} {key}: {what}")

    if not isinstance(entry, dict):
        raise wrong("must be an object {secret, arn, tenants}")
    for field in ("secret", "arn"):
        if not isinstance(entry.get(field), str) or not entry[field]:
            raise wrong(f'"{field}" must be a string')
    tenants = entry.get("tenants", [])
    if not isinstance(tenants, list) or not all(
        isinstance(tenant, str) and (tenant == "*" or is_tenant_id(tenant)) for tenant in tenants
    ):
        raise wrong('"tenants" must be a list of tenant ids or "*"')
    token = entry.get("session_token")
    if token is not None and not isinstance(token, str):
        raise wrong('"session_token" must be a string')
    return Principal(key, entry["secret"], entry["arn"], tuple(tenants), token or None)


# --- canonical forms (the request as it arrived: the target's bytes, as http.server reads them) ----------


def wire_bytes(text: str) -> bytes:
    """The bytes of a request target or a header value: http.server hands them over decoded as ISO-8859-1."""
    try:
        return text.encode("latin-1")
    except UnicodeEncodeError:  # a caller's own text, not off the wire
        return text.encode("utf-8")


def uri_encode(data: bytes) -> str:
    """SigV4's URI encoding: every byte but A-Z a-z 0-9 - . _ ~ as %XY, uppercase hex."""
    return quote(data, safe="-._~")


def canonical_uri(raw_path: bytes) -> str:
    """The path with dot segments and empty segments removed, each segment URI-encoded once more.

    AWS: "Normalize URI paths according to RFC 3986 [...] Each path segment must be URI-encoded twice
    (except for Amazon S3 which only gets URI-encoded once)". The path arrives encoded once (the wire
    form), so encoding what arrived is the second encoding.
    """
    segments: list[bytes] = []
    for segment in raw_path.split(b"/"):
        if segment in (b"", b"."):
            continue
        if segment == b"..":
            if segments:
                segments.pop()
            continue
        segments.append(segment)
    path = "/" + "/".join(uri_encode(segment) for segment in segments)
    if segments and raw_path.endswith(b"/"):
        path += "/"
    return path


def query_pairs(raw_query: bytes) -> list[tuple[bytes, bytes]]:
    """Decoded (name, value) pairs of a query string, `+` read as a space (form encoding)."""
    pairs = []
    for piece in raw_query.split(b"&"):
        if not piece:
            continue
        name, _, value = piece.partition(b"=")
        pairs.append((unquote_to_bytes(name.replace(b"+", b" ")), unquote_to_bytes(value.replace(b"+", b" "))))
    return pairs


def canonical_query(raw_query: bytes, *, without: tuple[str, ...] = ()) -> str:
    """Every name and value decoded and URI-encoded again, sorted by name then value (encoded, bytewise)."""
    excluded = {name.encode() for name in without}
    encoded = sorted(
        (uri_encode(name), uri_encode(value)) for name, value in query_pairs(raw_query) if name not in excluded
    )
    return "&".join(f"{name}={value}" for name, value in encoded)


def _header_value(values: list[str]) -> str:
    """The canonical value: each value's bytes trimmed, inner runs of white space (obs-fold included) collapsed
    to one space, repeats joined with ",".

    The bytes are those that arrived, whatever their encoding: as text they are read as UTF-8, any byte that is
    not UTF-8 kept as a surrogate escape, so the canonical request encodes back to exactly them (`_signed_bytes`).
    White space is ASCII's (SP, HT, CR, LF, VT, FF): a UTF-8 no-break space is part of the value.
    """
    return ",".join(b" ".join(wire_bytes(value).split()).decode("utf-8", "surrogateescape") for value in values)


def _signed_bytes(text: str) -> bytes:
    """A canonical request (or a string to sign) as the bytes SigV4 hashes: its header values' own bytes."""
    return text.encode("utf-8", "surrogateescape")


def canonical_request(
    method: str, target: str, headers: dict[str, list[str]], signed: list[str], body: bytes, *, presigned: bool
) -> str:
    """The canonical request API Gateway builds; the payload hash is always the body's own."""
    path, _, raw_query = wire_bytes(target).partition(b"?")
    query = canonical_query(raw_query, without=("X-Amz-Signature",) if presigned else ())
    lines = [f"{name}:{_header_value(headers.get(name, []))}\n" for name in signed]
    return "\n".join(
        [
            method.upper(),
            canonical_uri(path),
            query,
            "".join(lines),
            ";".join(signed),
            hashlib.sha256(body).hexdigest(),
        ]
    )


def _signature(secret_key: str, scope: list[str], string_to_sign: str) -> str:
    key = ("AWS4" + secret_key).encode()
    for part in scope:
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    return hmac.new(key, string_to_sign.encode(), hashlib.sha256).hexdigest()


# --- verification -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Claim:
    """What the client says about its signature, from the Authorization header or the query string."""

    algorithm: str
    credential: str
    signed_headers: str
    signature: str
    timestamp: str
    security_token: str | None
    expires: str | None
    presigned: bool


def _header_claim(authorization: str, headers: dict[str, list[str]]) -> _Claim:
    algorithm, _, rest = authorization.strip().partition(" ")
    parameters: dict[str, str] = {}
    for item in re.split(r"[,\s]+", rest):
        name, equals, value = item.partition("=")
        if equals:
            parameters[name] = value
    timestamp = _first(headers, "x-amz-date") or _first(headers, "date")
    missing = "".join(
        f"Authorization header requires '{name}' parameter. "
        for name in ("Credential", "Signature", "SignedHeaders")
        if not parameters.get(name)
    )
    if not timestamp:
        missing += "Authorization header requires existence of either a 'X-Amz-Date' or a 'Date' header. "
    if missing:
        raise Unauthorized(f"{missing}Authorization={authorization}")
    return _Claim(
        algorithm,
        parameters["Credential"],
        parameters["SignedHeaders"],
        parameters["Signature"],
        timestamp or "",
        _first(headers, "x-amz-security-token"),
        None,
        presigned=False,
    )


def _query_claim(query: dict[str, str]) -> _Claim:
    missing = "".join(
        f"AWS query-string parameters must include '{name}'. " for name in _QUERY_AUTH if not query.get(name)
    )
    if missing:
        raise Unauthorized(f"{missing}Re-examine the query-string parameters.")
    return _Claim(
        query["X-Amz-Algorithm"],
        query["X-Amz-Credential"],
        query["X-Amz-SignedHeaders"],
        query["X-Amz-Signature"],
        query["X-Amz-Date"],
        query.get("X-Amz-Security-Token"),
        query.get("X-Amz-Expires"),
        presigned=True,
    )


def _first(headers: dict[str, list[str]], name: str) -> str | None:
    values = headers.get(name)
    return values[0].strip() if values else None


def _stamp(moment: datetime) -> str:
    return moment.strftime("%Y%m%dT%H%M%SZ")


def _check_time(claim: _Claim, now: datetime) -> None:
    try:
        if not _ISO_BASIC.fullmatch(claim.timestamp):
            raise ValueError(claim.timestamp)
        signed_at = datetime.strptime(claim.timestamp, "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC)
    except ValueError as error:
        raise Unauthorized(
            f"Date must be in ISO-8601 'basic format'. Got '{claim.timestamp}'. See http://en.wikipedia.org/wiki/ISO_8601"
        ) from error
    if signed_at > now + MAX_SKEW:
        raise Unauthorized(
            f"Signature not yet current: {claim.timestamp} is still later than {_stamp(now + MAX_SKEW)} "
            f"({_stamp(now)} + {_span(MAX_SKEW)})"
        )
    window = MAX_SKEW
    if claim.expires is not None:  # a presigned URL is good from X-Amz-Date for X-Amz-Expires seconds
        if not claim.expires.isdigit() or not 1 <= int(claim.expires) <= MAX_PRESIGNED_EXPIRES:
            raise Unauthorized(f"X-Amz-Expires must be between 1 and {MAX_PRESIGNED_EXPIRES} seconds")
        window = timedelta(seconds=int(claim.expires))
    if signed_at < now - window:
        raise Unauthorized(
            f"Signature expired: {claim.timestamp} is now earlier than {_stamp(now - window)} "
            f"({_stamp(now)} - {_span(window)})"
        )


def _span(window: timedelta) -> str:
    seconds = int(window.total_seconds())
    return f"{seconds // 60} min." if seconds % 60 == 0 else f"{seconds} sec."


def _check_scope(claim: _Claim, region: str) -> tuple[str, list[str]]:
    elements = claim.credential.rstrip("/").split("/")
    if len(elements) != 5:
        raise Unauthorized(
            "Credential must have exactly 5 slash-delimited elements, e.g. keyid/date/region/service/term, "
            f"got '{claim.credential}'"
        )
    key, day, scope_region, service, terminator = elements
    # All that is wrong at once, in API Gateway's order and words.
    wrong = ""
    if scope_region != region:
        wrong += f"Credential should be scoped to a valid region, not '{scope_region}'. "
    if service != SERVICE:
        wrong += f"Credential should be scoped to correct service: '{SERVICE}'. "
    if terminator != TERMINATOR:
        wrong += f"Credential should be scoped with a valid terminator: '{TERMINATOR}', not '{terminator}'. "
    if day != claim.timestamp[:8]:
        wrong += (
            "Date in Credential scope does not match YYYYMMDD from ISO-8601 version of date from HTTP: "
            f"'{day}' != '{claim.timestamp[:8]}', from '{claim.timestamp}'."
        )
    if wrong:
        raise Unauthorized(wrong)
    return key, [day, scope_region, service, terminator]


def server_region() -> str:
    """The region `poimen dev` serves (it sets AWS_REGION from --region before serving)."""
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"


def verify(
    principals: dict[str, Principal],
    method: str,
    target: str,
    headers: list[tuple[str, str]],
    body: bytes,
    now: datetime | None = None,
    region: str | None = None,
) -> Principal:
    """The principal that signed this request, or Unauthorized with API Gateway's message.

    `target` and the header values are as http.server reads them (bytes decoded as ISO-8859-1); `region` is
    the server's (default: `server_region()`).
    """
    merged: dict[str, list[str]] = {}
    for name, value in headers:
        merged.setdefault(name.lower(), []).append(value)
    query = {
        name.decode("utf-8", "replace"): value.decode("utf-8", "replace")
        for name, value in query_pairs(wire_bytes(target).partition(b"?")[2])
    }
    authorization = _first(merged, "authorization")
    if authorization and "X-Amz-Algorithm" in query:
        raise Unauthorized("Found both 'X-Amz-Algorithm' as a query-string param and 'Authorization' as HTTP header.")
    if authorization:
        claim = _header_claim(authorization, merged)
    elif "X-Amz-Algorithm" in query:
        claim = _query_claim(query)
    else:
        raise Unauthorized("Missing Authentication Token")

    _check_time(claim, now or datetime.now(UTC))
    signed = claim.signed_headers.split(";")
    if "host" not in signed:
        raise Unauthorized("'Host' or ':authority' must be a 'SignedHeader' in the AWS Authorization.")
    if claim.algorithm != ALGORITHM:
        raise Unauthorized(f"Unsupported AWS 'algorithm': '{claim.algorithm}' (only {ALGORITHM} for now). ")
    key, scope = _check_scope(claim, region or server_region())
    principal = principals.get(key)
    if principal is None:
        raise Unauthorized(_INVALID_TOKEN)

    canonical = canonical_request(method, target, merged, signed, body, presigned=claim.presigned)
    string_to_sign = "\n".join(
        [ALGORITHM, claim.timestamp, "/".join(scope), hashlib.sha256(_signed_bytes(canonical)).hexdigest()]
    )
    if not hmac.compare_digest(_signature(principal.secret_key, scope, string_to_sign), claim.signature):
        # API Gateway shows what it signed, which is how a client finds its canonicalisation bug.
        raise Unauthorized(
            f"{_MISMATCH}\n\nThe Canonical String for this request should have been\n'{canonical}'\n\n"
            f"The String-to-Sign should have been\n'{string_to_sign}'\n"
        )
    # Temporary credentials are valid only with their token; long-term keys carry none.
    token, expected = claim.security_token or None, principal.session_token
    if (token is None) != (expected is None) or (
        token is not None and expected is not None and not hmac.compare_digest(token.encode(), expected.encode())
    ):
        raise Unauthorized(_INVALID_TOKEN)
    return principal


def signed_headers(
    method: str,
    url: str,
    headers: dict[str, str],
    body: bytes,
    access_key: str,
    secret_key: str,
    region: str,
    session_token: str | None = None,
) -> dict[str, str]:
    """`headers` plus the SigV4 (`execute-api`) ones a client sends: for local clients and tests.

    botocore signs a URL's query as it finds it, so it is handed the canonical query (the URL sent may
    keep its own encoding, `+` for a space included: the server decodes both the same way).
    """
    parts = urlsplit(url)
    canonical_url = urlunsplit(parts._replace(query=canonical_query(wire_bytes(parts.query))))
    request = AWSRequest(method=method, url=canonical_url, data=body, headers=headers)
    SigV4Auth(Credentials(access_key, secret_key, session_token), SERVICE, region).add_auth(request)
    return dict(request.headers.items())
