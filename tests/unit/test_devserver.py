"""The local translation from HTTP to the API Gateway HTTP API event, against the canonical event."""

from __future__ import annotations

import base64
import io
import json
import socket
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, cast

import pytest

from poimen_tools.local.devserver import (
    MAX_INVOCATION_PAYLOAD_BYTES,
    MAX_PAYLOAD_BYTES,
    MAX_REQUEST_LINE_AND_HEADER_VALUES,
    LocalApiServer,
    Route,
    _RequestHandler,
    http_api_event,
    http_response,
    query_parameters,
)
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


# --- the HTTP front, in-process: raw request bytes in, raw response bytes out (no socket) ---------------


class _Connection:
    """What socketserver's stream handler reads from and writes to, minus the socket."""

    def __init__(self, request: bytes) -> None:
        self._incoming = io.BytesIO(request)
        self.sent = bytearray()
        self.options: dict[tuple[int, int], object] = {}

    def setsockopt(self, level: int, option: int, value: object) -> None:
        self.options[level, option] = value

    def makefile(self, mode: str, *_: object) -> io.BytesIO:
        assert "r" in mode, "responses go through sendall (wbufsize 0)"
        return self._incoming

    def sendall(self, data: bytes) -> None:
        self.sent += data


@dataclass
class _Exchange:
    status: int
    body: bytes
    raw: bytes
    authenticated: list[tuple[str, str, bytes]]
    events: list[dict[str, Any]]
    options: dict[tuple[int, int], object]


def _exchange(request: bytes, answer: dict[str, Any] | None = None) -> _Exchange:
    """One connection's worth of requests through the dev server's handler, the function a stub."""
    authenticated: list[tuple[str, str, bytes]] = []
    events: list[dict[str, Any]] = []

    def authenticate(method: str, target: str, headers: list[tuple[str, str]], body: bytes) -> str:
        authenticated.append((method, target, body))
        return "arn:aws:iam::123456789012:user/dev"

    def invoke(event: dict[str, Any]) -> dict[str, Any]:
        events.append(event)
        return answer or {"statusCode": 200, "headers": {"Content-Type": "application/json"}, "body": "{}"}

    server = SimpleNamespace(
        routes=[Route("POST", "/v1/runs"), Route("GET", "/v1/runs")],
        authenticate=authenticate,
        environments=SimpleNamespace(invoke=invoke),
    )
    connection = _Connection(request)
    _RequestHandler(cast(Any, connection), ("127.0.0.1", 40000), cast(Any, server))
    raw = bytes(connection.sent)
    head, _, body = raw.partition(b"\r\n\r\n")
    return _Exchange(int(head.split(b" ", 2)[1]), body, raw, authenticated, events, connection.options)


def test_an_answers_body_is_sent_without_waiting_for_the_clients_ack_of_its_headers() -> None:
    # Given a request on a keep-alive connection
    exchange = _exchange(b"GET /v1/runs HTTP/1.1\r\nHost: x\r\n\r\n")

    # Then its connection has Nagle's algorithm off: the body, sent after the headers, is not held until the
    # client acknowledges them (a client delaying its ACKs made every answer 40 ms late)
    assert exchange.status == 200
    assert exchange.options.get((socket.IPPROTO_TCP, socket.TCP_NODELAY))


def test_payloads_over_10_mb_get_api_gateways_413_before_the_body_is_read() -> None:
    # Given a request declaring one byte more than the HTTP API payload quota, and no body yet
    declared = b"POST /v1/runs HTTP/1.1\r\nHost: h\r\nContent-Length: %d\r\n\r\n" % (MAX_PAYLOAD_BYTES + 1)

    answer = _exchange(declared)

    assert (answer.status, json.loads(answer.body)) == (413, {"message": "Request Entity Too Large"})
    assert answer.authenticated == []
    assert b"Connection: close" in answer.raw


def test_a_client_expecting_100_continue_hears_413_instead() -> None:
    declared = b"POST /v1/runs HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n" % (
        MAX_PAYLOAD_BYTES + 1
    )

    answer = _exchange(declared)

    assert answer.status == 413
    assert b"100 Continue" not in answer.raw


def test_a_payload_of_exactly_10_mb_passes_api_gateway_and_its_event_is_refused_by_lambda() -> None:
    body = b"x" * MAX_PAYLOAD_BYTES
    request = b"POST /v1/runs HTTP/1.1\r\nHost: h\r\nContent-Length: %d\r\n\r\n" % len(body) + body

    answer = _exchange(request)

    # Within API Gateway's quota: read and authorized; but its event is over Lambda's 6 MB invocation payload
    assert [len(seen) for _, _, seen in answer.authenticated] == [MAX_PAYLOAD_BYTES]
    assert (answer.status, json.loads(answer.body), answer.events) == (500, {"message": "Internal Server Error"}, [])


def _post(body: bytes) -> bytes:
    return b"POST /v1/runs HTTP/1.1\r\nHost: h\r\nContent-Length: %d\r\n\r\n" % len(body) + body


@pytest.mark.parametrize(
    "body",
    [
        # 6 MiB of JSON text: the event (the body a JSON string in it, and the request's context) is over 6 MiB
        b'{"spawns":["' + b"x" * (MAX_INVOCATION_PAYLOAD_BYTES - 14) + b'"]}',
        # 4.6 MiB that is not UTF-8: base64 in the event, 6.1 MiB
        b"\xff" * (46 * 1024 * 1024 // 10),
        # 3.2 MiB of quotes: each escaped in the event, 6.4 MiB
        b'"' * (32 * 1024 * 1024 // 10),
    ],
    ids=["text", "base64", "escapes"],
)
def test_a_request_whose_event_is_over_lambdas_6_mb_gets_api_gateways_500_and_never_reaches_the_function(
    body: bytes,
) -> None:
    # Given a body within API Gateway's 10 MB whose event is over Lambda's invocation payload (API Gateway: "If the
    # Lambda API rejects the invocation request, API Gateway returns a 500 error code",
    # https://docs.aws.amazon.com/lambda/latest/dg/services-apigateway-errors.html)
    answer = _exchange(_post(body))

    # Then API Gateway's own 500, as an invocation that failed; the function never ran (no 413 problem of its own)
    assert (answer.status, json.loads(answer.body), answer.events) == (500, {"message": "Internal Server Error"}, [])


def test_a_request_whose_event_is_within_6_mb_reaches_the_function() -> None:
    answer = _exchange(_post(b'{"spawns":["' + b"x" * (MAX_INVOCATION_PAYLOAD_BYTES - 4096) + b'"]}'))

    assert (answer.status, len(answer.events)) == (200, 1)


def test_a_function_answer_over_lambdas_6_mb_response_payload_is_api_gateways_500() -> None:
    big = {
        "statusCode": 200,
        "headers": {"Content-Type": "application/json"},
        "body": "x" * MAX_INVOCATION_PAYLOAD_BYTES,
    }

    answer = _exchange(b"GET /v1/runs HTTP/1.1\r\nHost: h\r\n\r\n", big)

    assert (answer.status, json.loads(answer.body)) == (500, {"message": "Internal Server Error"})


def _with_header_values_of(total: int) -> bytes:
    request_line = b"GET /v1/runs HTTP/1.1"
    filler = total - len(request_line) - len(b"h")
    return request_line + b"\r\nHost: h\r\nX-Filler: " + b"f" * filler + b"\r\n\r\n"


def test_request_line_and_header_values_over_10240_bytes_are_refused() -> None:
    at_limit = _exchange(_with_header_values_of(MAX_REQUEST_LINE_AND_HEADER_VALUES))
    over = _exchange(_with_header_values_of(MAX_REQUEST_LINE_AND_HEADER_VALUES + 1))

    assert at_limit.status == 200
    assert (over.status, json.loads(over.body)) == (431, {"message": "Request Header Fields Too Large"})
    assert over.authenticated == []


def test_gateway_answers_are_compact_json_like_api_gateways() -> None:
    answer = _exchange(b"DELETE /v1/runs HTTP/1.1\r\nHost: h\r\nContent-Length: 0\r\n\r\n")

    assert (answer.status, answer.body) == (404, b'{"message":"Not Found"}')


def test_query_parameters_decode_plus_as_space_and_escapes_as_utf8() -> None:
    # "+" is a space and %2B a plus (as API Gateway decodes queryStringParameters; aws/aws-cdk#19827),
    # and raw UTF-8 bytes on the wire decode as UTF-8; rawQueryString stays as sent.
    raw_target = "/v1/runs?dispatch_key=a+b%2Bc&x=%C3%A9&y=\u00c3\u00a9"  # as http.server reads the bytes

    event = http_api_event(
        method="GET", target=raw_target, headers=[], body=b"", principal_arn=None, source_ip="127.0.0.1"
    )

    assert event["queryStringParameters"] == {"dispatch_key": "a b+c", "x": "é", "y": "é"}
    assert event["rawQueryString"] == "dispatch_key=a+b%2Bc&x=%C3%A9&y=\u00c3\u00a9"
    assert query_parameters("a=1&&b") == [("a", "1"), ("b", "")]


def test_header_values_reach_the_function_as_the_utf8_that_was_sent() -> None:
    # As http.server reads the bytes: UTF-8 "ключ", and a lone 0xE9 that is no UTF-8
    utf8, not_utf8 = "ключ".encode().decode("latin-1"), "cl\u00e9"

    event = http_api_event(
        method="POST",
        target="/v1/runs",
        headers=[("Idempotency-Key", utf8), ("X-Other", not_utf8)],
        body=b"",
        principal_arn=None,
        source_ip="127.0.0.1",
    )

    assert (event["headers"]["idempotency-key"], event["headers"]["x-other"]) == ("ключ", "cl\ufffd")


@pytest.mark.parametrize(("status", "phrase"), [(413, b"Content Too Large"), (422, b"Unprocessable Content")])
def test_status_lines_have_rfc_9110s_reason_phrases_as_the_problem_titles_do(status: int, phrase: bytes) -> None:
    problem = {"statusCode": status, "headers": {"Content-Type": "application/problem+json"}, "body": "{}"}

    answer = _exchange(b"POST /v1/runs HTTP/1.1\r\nHost: h\r\nContent-Length: 0\r\n\r\n", problem)

    assert answer.raw.startswith(b"HTTP/1.1 %d %s\r\n" % (status, phrase))


@pytest.mark.parametrize("gone", [BrokenPipeError, ConnectionResetError, ConnectionAbortedError])
def test_a_client_that_went_away_is_not_a_server_error(
    gone: type[ConnectionError], capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a client that closed its connection before the answer was written
    try:
        raise gone("the client hung up")
    except ConnectionError:
        # When socketserver reports it
        LocalApiServer.handle_error(cast(Any, None), None, ("127.0.0.1", 40000))

    # Then nothing is printed: no traceback for a client's own choice
    assert capsys.readouterr() == ("", "")


# --- chunked request bodies: API Gateway documents no refusal of them, so they are accepted, de-chunked -----


def _chunked(*chunks: bytes, trailer: bytes = b"") -> bytes:
    framed = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for chunk in chunks)
    return (
        b"POST /v1/runs HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"
        + framed
        + b"0\r\n"
        + trailer
        + b"\r\n"
    )


def test_a_chunked_body_reaches_the_function_de_chunked() -> None:
    body = b'{"workflow_ref": "wf", "input": {}}'

    answer = _exchange(_chunked(body[:10], body[10:], trailer=b"X-Trailer: t\r\n"))

    assert answer.status == 200
    assert [seen for _, _, seen in answer.authenticated] == [body]  # signed over the body itself
    assert [base64.b64decode(e["body"]) if e["isBase64Encoded"] else e["body"].encode() for e in answer.events] == [
        body
    ]


def test_a_chunked_body_and_the_next_request_share_the_connection() -> None:
    # Given a chunked request then a plain one on the same connection
    second = b"GET /v1/runs HTTP/1.1\r\nHost: h\r\n\r\n"

    answer = _exchange(_chunked(b"{}") + second)

    # Then both are answered: the chunked body was read to its end, no byte of it taken for a request
    assert answer.raw.count(b"HTTP/1.1 200 ") == 2
    assert len(answer.events) == 2


def test_a_chunked_body_over_10_mb_gets_413_and_never_reaches_the_function() -> None:
    chunk = b"x" * (1024 * 1024)

    answer = _exchange(_chunked(*[chunk] * 10, b"y"))

    assert (answer.status, json.loads(answer.body)) == (413, {"message": "Request Entity Too Large"})
    assert answer.authenticated == []
    assert b"Connection: close" in answer.raw


def test_a_chunked_body_of_exactly_10_mb_passes_api_gateways_quota() -> None:
    chunk = b"x" * (1024 * 1024)

    answer = _exchange(_chunked(*[chunk] * 10))

    # Read whole and authorized; its event, over Lambda's 6 MB, is refused as any such event is
    assert [len(seen) for _, _, seen in answer.authenticated] == [MAX_PAYLOAD_BYTES]
    assert (answer.status, answer.events) == (500, [])


@pytest.mark.parametrize(
    "framing",
    [b"zz\r\n{}\r\n0\r\n\r\n", b"2\r\n{}XX0\r\n\r\n", b"5\r\n{}\r\n", b"-1\r\n\r\n", b"1" * 20 + b"\r\n"],
)
def test_malformed_chunked_framing_is_400_and_never_reaches_the_function(framing: bytes) -> None:
    request = b"POST /v1/runs HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n" + framing

    answer = _exchange(request)

    assert (answer.status, json.loads(answer.body)) == (400, {"message": "Bad Request"})
    assert answer.authenticated == []
    assert b"Connection: close" in answer.raw


def test_a_transfer_coding_other_than_chunked_is_501() -> None:
    request = b"POST /v1/runs HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n"

    answer = _exchange(request)

    assert (answer.status, json.loads(answer.body)) == (501, {"message": "Not Implemented"})
    assert answer.authenticated == []
