"""Local SigV4 verification: what API Gateway's IAM authorization accepts and refuses.

Clients here are botocore's signer over an exact URL (it signs a URL's path and query as given), so a
test can stand for a client that canonicalises right or one that does not.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import parse_qsl, quote, urlencode, urlsplit

import pytest
from botocore.auth import SigV4Auth, SigV4QueryAuth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from poimen_tools.local.sigv4 import (
    Principal,
    Unauthorized,
    canonical_query,
    canonical_uri,
    load_principals,
    signed_headers,
    verify,
)

ALICE = Principal("AKIDALICE", "alice-secret", "arn:aws:iam::1:user/alice", ("acme",))
TEMPORARY = Principal("ASIATEMP", "temp-secret", "arn:aws:sts::1:assumed-role/r/s", ("acme",), "the-token")
PRINCIPALS = {ALICE.access_key: ALICE, TEMPORARY.access_key: TEMPORARY}
HOST = "127.0.0.1:8080"
TARGET = "/v1/runs?dispatch_key=k%201"
URL = f"http://{HOST}{TARGET}"
BODY = b'{"workflow_ref": "wf", "input": {}}'
MISMATCH = "The request signature we calculated does not match the signature you provided."
INVALID_TOKEN = "The security token included in the request is invalid."


def _signed(secret: str = ALICE.secret_key, key: str = ALICE.access_key, body: bytes = BODY) -> list[tuple[str, str]]:
    headers = signed_headers(
        "POST", URL, {"Content-Type": "application/json", "X-Poimen-Tenant": "acme"}, body, key, secret, "us-east-1"
    )
    return [*headers.items(), ("Host", HOST), ("User-Agent", "unsigned/1.0")]


def _sign(
    method: str,
    url: str,
    body: bytes = b"",
    *,
    principal: Principal = ALICE,
    region: str = "us-east-1",
    service: str = "execute-api",
    token: str | None = None,
    extra: dict[str, str] | None = None,
) -> list[tuple[str, str]]:
    """botocore's SigV4 over exactly this URL: its path encoded once more, its query as it stands."""
    request = AWSRequest(method=method, url=url, data=body, headers={"Host": urlsplit(url).netloc, **(extra or {})})
    SigV4Auth(Credentials(principal.access_key, principal.secret_key, token), service, region).add_auth(request)
    return list(request.headers.items())


def _target(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.path}?{parts.query}" if parts.query else parts.path


def test_a_correctly_signed_request_names_its_principal() -> None:
    assert verify(PRINCIPALS, "POST", TARGET, _signed(), BODY) == ALICE


# Headers are signed when the test runs, not when it is collected: a slow run must not outlast the window.
@pytest.mark.parametrize(
    ("sign", "method", "body", "message"),
    [
        (lambda: [("Host", HOST)], "POST", BODY, "Missing Authentication Token"),
        (lambda: _signed(secret="wrong"), "POST", BODY, MISMATCH),
        (lambda: _signed(key="AKIDNOBODY"), "POST", BODY, INVALID_TOKEN),
        (_signed, "POST", b'{"workflow_ref": "other", "input": {}}', MISMATCH),
        (_signed, "GET", BODY, MISMATCH),
    ],
    ids=["unsigned", "wrong-secret", "unknown-key", "tampered-body", "other-method"],
)
def test_requests_api_gateway_would_refuse(
    sign: Callable[[], list[tuple[str, str]]], method: str, body: bytes, message: str
) -> None:
    with pytest.raises(Unauthorized) as refused:
        verify(PRINCIPALS, method, TARGET, sign(), body)

    assert str(refused.value).startswith(message)


def test_an_authorization_header_that_is_not_sigv4_is_refused_in_api_gateways_words() -> None:
    with pytest.raises(Unauthorized) as refused:
        verify(PRINCIPALS, "POST", TARGET, [("Host", HOST), ("Authorization", "Bearer x")], BODY)

    assert str(refused.value) == (
        "Authorization header requires 'Credential' parameter. Authorization header requires 'Signature' parameter. "
        "Authorization header requires 'SignedHeaders' parameter. Authorization header requires existence of either "
        "a 'X-Amz-Date' or a 'Date' header. Authorization=Bearer x"
    )


def test_a_signature_mismatch_shows_the_canonical_request_as_api_gateway_does() -> None:
    with pytest.raises(Unauthorized) as refused:
        verify(PRINCIPALS, "POST", TARGET, _signed(secret="wrong"), BODY)

    message = str(refused.value)
    assert (
        "\n\nThe Canonical String for this request should have been\n'POST\n/v1/runs\ndispatch_key=k%201\n" in message
    )
    assert (
        f"\n{hashlib.sha256(BODY).hexdigest()}'\n\nThe String-to-Sign should have been\n'AWS4-HMAC-SHA256\n" in message
    )


def test_a_tampered_tenant_header_breaks_the_signature() -> None:
    headers = [(name, "globex" if name.lower() == "x-poimen-tenant" else value) for name, value in _signed()]

    with pytest.raises(Unauthorized, match="does not match"):
        verify(PRINCIPALS, "POST", TARGET, headers, BODY)


# --- header values are signed as the bytes that arrived -----------------------------------------------------


def _as_http_server_reads(headers: list[tuple[str, str]], sent_as: str) -> list[tuple[str, str]]:
    """Headers whose values went out in `sent_as`, as http.server hands them over (bytes read as ISO-8859-1)."""
    return [(name, value.encode(sent_as).decode("latin-1")) for name, value in headers]


def test_a_header_value_signed_and_sent_as_utf8_verifies() -> None:
    # Given a non-ASCII header signed as its UTF-8 bytes (as curl and the Rust SDK sign what they send)
    signed = _sign("POST", URL, BODY, extra={"Idempotency-Key": "ключ-é", "Content-Type": "application/json"})

    # When those bytes arrive, then the signature holds
    assert verify(PRINCIPALS, "POST", TARGET, _as_http_server_reads(signed, "utf-8"), BODY) == ALICE


def test_a_header_value_signed_as_utf8_but_sent_as_latin1_is_refused() -> None:
    # Given botocore's signature over a str value (UTF-8), sent as http.client sends str values (ISO-8859-1)
    signed = _sign("POST", URL, BODY, extra={"Idempotency-Key": "clé"})

    # Then what arrived is not what was signed: AWS hashes the bytes it received
    with pytest.raises(Unauthorized, match="does not match"):
        verify(PRINCIPALS, "POST", TARGET, _as_http_server_reads(signed, "latin-1"), BODY)


# --- the payload hash is computed from the body ------------------------------------------------------------


def test_a_replayed_signature_with_another_body_and_the_old_body_hash_is_refused() -> None:
    # Given a captured signed POST
    captured = _sign("POST", URL, BODY, extra={"Content-Type": "application/json"})
    # When it is replayed with another body and X-Amz-Content-SHA256 claiming the first body's hash
    replayed = [*captured, ("X-Amz-Content-SHA256", hashlib.sha256(BODY).hexdigest())]
    other = b'{"workflow_ref": "evil", "input": {}}'

    # Then the hash API Gateway computes is the new body's, and the signature fails
    with pytest.raises(Unauthorized, match=MISMATCH):
        verify(PRINCIPALS, "POST", TARGET, replayed, other)
    assert verify(PRINCIPALS, "POST", TARGET, replayed, BODY) == ALICE


def test_unsigned_payload_is_not_accepted_for_execute_api() -> None:
    # botocore signs the X-Amz-Content-SHA256 header's value as the payload hash when the header is set
    headers = _sign("POST", URL, BODY, extra={"X-Amz-Content-SHA256": "UNSIGNED-PAYLOAD"})

    for body in (BODY, b'{"workflow_ref": "other", "input": {}}'):
        with pytest.raises(Unauthorized, match=MISMATCH):
            verify(PRINCIPALS, "POST", TARGET, headers, body)


# --- the credential scope ----------------------------------------------------------------------------------


def _rescoped(old: str, new: str) -> list[tuple[str, str]]:
    return [
        (name, value.replace(old, new) if name == "Authorization" else value)
        for name, value in _sign("GET", URL, principal=ALICE)
    ]


def _today() -> str:
    return datetime.now(UTC).strftime("%Y%m%d")


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        (
            lambda: _sign("GET", URL, region="xx-nowhere-9"),
            "Credential should be scoped to a valid region, not 'xx-nowhere-9'. ",
        ),
        (
            lambda: _sign("GET", URL, service="apigateway"),
            "Credential should be scoped to correct service: 'execute-api'. ",
        ),
        (
            lambda: _rescoped("/aws4_request", "/aws5_request"),
            "Credential should be scoped with a valid terminator: 'aws4_request', not 'aws5_request'. ",
        ),
        (
            lambda: _rescoped(f"/{_today()}/", "/20150830/"),
            "Date in Credential scope does not match YYYYMMDD from ISO-8601 version of date from HTTP: "
            "'20150830' != '{today}', from '{stamp}'.",
        ),
    ],
    ids=["region", "service", "terminator", "date"],
)
def test_the_credential_scope_names_this_region_execute_api_and_the_signing_day(
    headers: Callable[[], list[tuple[str, str]]], message: str
) -> None:
    signed = headers()
    stamp = dict(signed)["X-Amz-Date"]

    with pytest.raises(Unauthorized) as refused:
        verify(PRINCIPALS, "GET", TARGET, signed, b"", region="us-east-1")

    assert str(refused.value) == message.format(today=stamp[:8], stamp=stamp)


def test_the_region_is_the_servers() -> None:
    signed = _sign("GET", URL, region="eu-west-1")

    assert verify(PRINCIPALS, "GET", TARGET, signed, b"", region="eu-west-1") == ALICE
    with pytest.raises(Unauthorized, match="not 'eu-west-1'"):
        verify(PRINCIPALS, "GET", TARGET, signed, b"", region="us-east-1")


# --- the canonical URI and query ---------------------------------------------------------------------------

SPECIAL_KEYS = ["with space", "hash#", "plus+", "slash/", "star*", "quote'", "(paren)", "bang!", "comma,", "per%cent"]
SPECIAL_KEYS += ["tilde~", "ünïcødé-键", "all # + / * ' ( ) ! , % ~ é"]


@pytest.mark.parametrize("key", SPECIAL_KEYS)
def test_the_query_is_decoded_and_encoded_again_whatever_the_client_sent(key: str) -> None:
    escaped = quote(key, safe="-_.~")
    headers = _sign("GET", f"http://{HOST}/v1/runs?dispatch_key={escaped}")
    # what different clients put on the wire for the same value
    wires = [
        escaped,  # every reserved byte escaped, uppercase hex
        re.sub(r"%[0-9A-F]{2}", lambda escape: escape[0].lower(), escaped),  # lowercase hex
        quote(key, safe="-_.~/*'()!,"),  # sub-delimiters left as typed
        urlencode({"dispatch_key": key}).split("=", 1)[1],  # form encoding: a space as "+"
    ]

    for wire in wires:
        assert verify(PRINCIPALS, "GET", f"/v1/runs?dispatch_key={wire}", headers, b"") == ALICE, wire


def test_query_parameters_are_sorted_by_name_then_value() -> None:
    headers = _sign("GET", f"http://{HOST}/v1/runs?a=1&a=2&b=2")

    assert verify(PRINCIPALS, "GET", "/v1/runs?b=2&a=2&a=1", headers, b"") == ALICE


def test_a_query_signed_as_it_arrived_is_refused() -> None:
    # curl before 8.3 signs the query as typed: "star*" where SigV4 signs "star%2A"
    headers = _sign("GET", f"http://{HOST}/v1/runs?dispatch_key=star*(x)")

    with pytest.raises(Unauthorized) as refused:
        verify(PRINCIPALS, "GET", "/v1/runs?dispatch_key=star*(x)", headers, b"")

    assert "\n/v1/runs\ndispatch_key=star%2A%28x%29\n" in str(refused.value)


def test_a_plus_in_the_query_is_a_space_and_a_literal_plus_travels_as_2b() -> None:
    as_space = _sign("GET", f"http://{HOST}/v1/runs?dispatch_key=a%20b")
    as_plus = _sign("GET", f"http://{HOST}/v1/runs?dispatch_key=a%2Bb")

    assert verify(PRINCIPALS, "GET", "/v1/runs?dispatch_key=a+b", as_space, b"") == ALICE
    assert verify(PRINCIPALS, "GET", "/v1/runs?dispatch_key=a%2Bb", as_plus, b"") == ALICE
    with pytest.raises(Unauthorized, match=MISMATCH):
        verify(PRINCIPALS, "GET", "/v1/runs?dispatch_key=a+b", as_plus, b"")


def test_the_path_is_normalised_and_each_segment_encoded_once_more() -> None:
    # botocore encodes the path it is given once more, as execute-api expects
    headers = _sign("GET", f"http://{HOST}/v1/runs/a%20b")
    single = _sign("GET", f"http://{HOST}/v1/runs/a b")  # a client that signs the wire path as it is

    assert verify(PRINCIPALS, "GET", "/v1/runs/a%20b", headers, b"") == ALICE
    assert verify(PRINCIPALS, "GET", "/v1/./runs//x/../a%20b", headers, b"") == ALICE
    with pytest.raises(Unauthorized) as refused:
        verify(PRINCIPALS, "GET", "/v1/runs/a%20b", single, b"")
    assert "\n/v1/runs/a%2520b\n" in str(refused.value)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        # the aws-signing-test-suite's normalize-path and query cases (awslabs/aws-c-auth)
        (b"/example space/", "/example%20space/"),
        ("/\u1234".encode(), "/%E1%88%B4"),
        (b"//example//", "/example/"),
        (b"/example1/example2/../..", "/"),
        (b"/./", "/"),
        (b"/-._~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz", None),
        (b"", "/"),
    ],
)
def test_canonical_uri_matches_the_aws_test_suite(raw: bytes, expected: str | None) -> None:
    assert canonical_uri(raw) == (expected or raw.decode())


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"Param-3=Value3&Param=Value2&%E1%88%B4=Value1", "%E1%88%B4=Value1&Param=Value2&Param-3=Value3"),
        (b"Param2=value2&Param1=value1", "Param1=value1&Param2=value2"),
        ("\u1234=bar".encode(), "%E1%88%B4=bar"),
        (b"Param1=", "Param1="),
        (b"v", "v="),
        (b"a=%2a&a=*&&b=%7e", "a=%2A&a=%2A&b=~"),
    ],
)
def test_canonical_query_matches_the_aws_test_suite(raw: bytes, expected: str) -> None:
    assert canonical_query(raw) == expected


# --- time ---------------------------------------------------------------------------------------------------


def test_signatures_more_than_five_minutes_old_are_expired() -> None:
    headers = _signed()
    stamp = dict(headers)["X-Amz-Date"]
    signed_at = datetime.strptime(stamp, "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC)
    later = signed_at + timedelta(minutes=6)

    with pytest.raises(Unauthorized) as refused:
        verify(PRINCIPALS, "POST", TARGET, headers, BODY, now=later)

    earliest = (later - timedelta(minutes=5)).strftime("%Y%m%dT%H%M%SZ")
    assert str(refused.value) == (
        f"Signature expired: {stamp} is now earlier than {earliest} ({later:%Y%m%dT%H%M%SZ} - 5 min.)"
    )
    assert verify(PRINCIPALS, "POST", TARGET, headers, BODY, now=signed_at + timedelta(minutes=4)) == ALICE


def test_signatures_more_than_five_minutes_ahead_are_not_yet_current() -> None:
    headers = _signed()
    stamp = dict(headers)["X-Amz-Date"]
    signed_at = datetime.strptime(stamp, "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC)
    earlier = signed_at - timedelta(minutes=6)

    with pytest.raises(Unauthorized) as refused:
        verify(PRINCIPALS, "POST", TARGET, headers, BODY, now=earlier)

    latest = (earlier + timedelta(minutes=5)).strftime("%Y%m%dT%H%M%SZ")
    assert str(refused.value) == (
        f"Signature not yet current: {stamp} is still later than {latest} ({earlier:%Y%m%dT%H%M%SZ} + 5 min.)"
    )
    assert verify(PRINCIPALS, "POST", TARGET, headers, BODY, now=signed_at - timedelta(minutes=4)) == ALICE


# --- signed headers -----------------------------------------------------------------------------------------


def test_the_host_header_must_be_signed() -> None:
    unsigned_host = [
        (name, value.replace("SignedHeaders=content-type;host;", "SignedHeaders=content-type;"))
        for name, value in _signed()
    ]

    with pytest.raises(Unauthorized) as refused:
        verify(PRINCIPALS, "POST", TARGET, unsigned_host, BODY)

    assert str(refused.value) == "'Host' or ':authority' must be a 'SignedHeader' in the AWS Authorization."


def test_only_aws4_hmac_sha256_is_supported() -> None:
    other = [(name, value.replace("AWS4-HMAC-SHA256 ", "AWS4-HMAC-SHA512 ")) for name, value in _signed()]

    with pytest.raises(Unauthorized, match=r"^Unsupported AWS 'algorithm': 'AWS4-HMAC-SHA512'"):
        verify(PRINCIPALS, "POST", TARGET, other, BODY)


# --- temporary credentials ----------------------------------------------------------------------------------


def test_temporary_credentials_need_the_principals_session_token() -> None:
    with_token = _sign("GET", URL, principal=TEMPORARY, token="the-token")
    wrong_token = _sign("GET", URL, principal=TEMPORARY, token="another-token")
    no_token = _sign("GET", URL, principal=TEMPORARY)
    long_term_with_token = _sign("GET", URL, principal=ALICE, token="the-token")

    assert verify(PRINCIPALS, "GET", TARGET, with_token, b"") == TEMPORARY
    for headers in (wrong_token, no_token, long_term_with_token):
        with pytest.raises(Unauthorized) as refused:
            verify(PRINCIPALS, "GET", TARGET, headers, b"")
        assert str(refused.value) == INVALID_TOKEN


def test_principals_files_may_declare_a_session_token(tmp_path: Path) -> None:
    path = tmp_path / "principals.json"
    path.write_text(
        json.dumps(
            {
                "AKIDLONG": {"secret": "s", "arn": "arn:aws:iam::1:user/u", "tenants": ["acme"]},
                "ASIATEMP": {"secret": "t", "arn": "arn:aws:sts::1:assumed-role/r/s", "session_token": "tok"},
            }
        )
    )

    principals = load_principals(path)

    assert principals["AKIDLONG"].session_token is None
    assert principals["ASIATEMP"] == Principal("ASIATEMP", "t", "arn:aws:sts::1:assumed-role/r/s", (), "tok")


# --- query-string (presigned) signatures --------------------------------------------------------------------


def _presigned(url: str, expires: int = 300, principal: Principal = ALICE, token: str | None = None) -> str:
    request = AWSRequest(method="GET", url=url, headers={"Host": HOST})
    SigV4QueryAuth(
        Credentials(principal.access_key, principal.secret_key, token), "execute-api", "us-east-1", expires
    ).add_auth(request)
    return _target(request.prepare().url)


def test_a_presigned_url_is_accepted_within_its_expiry() -> None:
    target = _presigned(f"http://{HOST}/v1/runs?dispatch_key=a%20b%2Bc", expires=600)
    signed_at = datetime.strptime(dict(_query(target))["X-Amz-Date"], "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC)

    assert verify(PRINCIPALS, "GET", target, [("Host", HOST)], b"") == ALICE
    assert verify(PRINCIPALS, "GET", target, [("Host", HOST)], b"", now=signed_at + timedelta(minutes=9)) == ALICE
    with pytest.raises(Unauthorized, match=r"^Signature expired: "):
        verify(PRINCIPALS, "GET", target, [("Host", HOST)], b"", now=signed_at + timedelta(minutes=11))


def test_a_presigned_url_with_temporary_credentials_carries_its_token() -> None:
    target = _presigned(f"http://{HOST}/v1/runs?dispatch_key=k", principal=TEMPORARY, token="the-token")

    assert verify(PRINCIPALS, "GET", target, [("Host", HOST)], b"") == TEMPORARY


def _query(target: str) -> list[tuple[str, str]]:
    return parse_qsl(urlsplit(target).query)


def test_a_presigned_url_changed_after_signing_is_refused() -> None:
    target = _presigned(f"http://{HOST}/v1/runs?dispatch_key=mine")

    with pytest.raises(Unauthorized, match=MISMATCH):
        verify(PRINCIPALS, "GET", target.replace("dispatch_key=mine", "dispatch_key=theirs"), [("Host", HOST)], b"")


def test_presigned_urls_are_refused_as_api_gateway_refuses_them() -> None:
    target = _presigned(f"http://{HOST}/v1/runs?dispatch_key=k")
    unsigned = "&".join(part for part in target.split("&") if not part.startswith("X-Amz-Signature="))

    with pytest.raises(Unauthorized) as both:
        verify(PRINCIPALS, "GET", target, [("Host", HOST), ("Authorization", dict(_signed())["Authorization"])], b"")
    with pytest.raises(Unauthorized) as incomplete:
        verify(PRINCIPALS, "GET", unsigned, [("Host", HOST)], b"")

    assert str(both.value) == (
        "Found both 'X-Amz-Algorithm' as a query-string param and 'Authorization' as HTTP header."
    )
    assert str(incomplete.value) == (
        "AWS query-string parameters must include 'X-Amz-Signature'. Re-examine the query-string parameters."
    )


# --- the client helper ---------------------------------------------------------------------------------------


def test_the_signing_helper_signs_the_query_as_the_server_reads_it() -> None:
    # requests form-encodes params (a space as "+"); the helper signs what the server will decode
    url = f"http://{HOST}/v1/runs?{urlencode({'dispatch_key': 'a b+c*'})}"
    headers = signed_headers("GET", url, {}, b"", ALICE.access_key, ALICE.secret_key, "us-east-1")

    assert verify(PRINCIPALS, "GET", _target(url), [*headers.items(), ("Host", HOST)], b"") == ALICE


@pytest.mark.parametrize("stamp", ["Sun, 29 Nov 2026 17:00:00 GMT", "20261399T250000Z"])
def test_a_date_not_in_iso_8601_basic_format_is_refused(stamp: str) -> None:
    headers = [(name, stamp if name == "X-Amz-Date" else value) for name, value in _signed()]

    with pytest.raises(Unauthorized) as refused:
        verify(PRINCIPALS, "POST", TARGET, headers, BODY)

    assert str(refused.value) == (
        f"Date must be in ISO-8601 'basic format'. Got '{stamp}'. See http://en.wikipedia.org/wiki/ISO_8601"
    )
