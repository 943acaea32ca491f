"""The local API: each HTTP request becomes an API Gateway HTTP API (v2) event for the same handler.

This translation is the only local-only code on the request path; routes live in the handler.
"""

from __future__ import annotations

import base64
import io
import json
import multiprocessing
import os
import re
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from poimen_tools.local.sigv4 import Unauthorized, query_pairs

# API Gateway HTTP API quotas, neither adjustable ("Quotas for configuring and running an HTTP API in API
# Gateway": https://docs.aws.amazon.com/apigateway/latest/developerguide/http-api-quotas.html).
MAX_PAYLOAD_BYTES = 10 * 1024 * 1024  # "Payload size: 10 MB"
MAX_REQUEST_LINE_AND_HEADER_VALUES = 10240  # "Total combined size of request line and header values: 10240 bytes"

LambdaHandler = Callable[[dict[str, Any], Any], dict[str, Any]]
# (method, target, headers, body) -> the caller's principal ARN, or raise Unauthorized.
Authenticator = Callable[[str, str, list[tuple[str, str]], bytes], str]


@dataclass
class LocalLambdaContext:
    """The parts of the Lambda context object that handlers and Powertools read."""

    function_name: str
    timeout_seconds: float = 10.0
    memory_limit_in_mb: int = 512
    function_version: str = "$LATEST"
    aws_request_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    _deadline: float = field(init=False)

    def __post_init__(self) -> None:
        self._deadline = time.monotonic() + self.timeout_seconds

    @property
    def invoked_function_arn(self) -> str:
        return f"arn:aws:lambda:local:000000000000:function:{self.function_name}"

    @property
    def log_group_name(self) -> str:
        return f"/aws/lambda/{self.function_name}"

    @property
    def log_stream_name(self) -> str:
        return "local"

    def get_remaining_time_in_millis(self) -> int:
        return max(0, int((self._deadline - time.monotonic()) * 1000))


def http_api_event(
    *,
    method: str,
    target: str,
    headers: list[tuple[str, str]],
    body: bytes,
    principal_arn: str | None,
    source_ip: str,
    route_key: str = "$default",
    path_parameters: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The API Gateway HTTP API payload 2.0 event for one request, with an IAM authorizer context."""
    url = urlsplit(target)
    merged: dict[str, str] = {}
    cookies: list[str] = []
    for name, value in headers:
        lowered = name.lower()
        if lowered == "cookie":
            cookies.extend(part.strip() for part in value.split(";") if part.strip())
            continue
        merged[lowered] = f"{merged[lowered]},{value}" if lowered in merged else value
    query: dict[str, str] = {}
    for name, value in query_parameters(url.query):
        query[name] = f"{query[name]},{value}" if name in query else value
    try:
        text_body: str | None = body.decode("utf-8")
    except UnicodeDecodeError:
        text_body = None
    now = datetime.now(UTC)
    authorizer = {}
    if principal_arn:
        account = principal_arn.split(":")[4] if principal_arn.count(":") >= 5 else "000000000000"
        authorizer = {
            "iam": {
                "accessKey": "local",
                "accountId": account,
                "callerId": "local",
                "cognitoIdentity": None,
                "principalOrgId": None,
                "userArn": principal_arn,
                "userId": "local",
            }
        }
    event: dict[str, Any] = {
        "version": "2.0",
        "routeKey": route_key,
        "rawPath": url.path,
        "rawQueryString": url.query,
        "headers": merged,
        "requestContext": {
            "accountId": "000000000000",
            "apiId": "local",
            "authorizer": authorizer,
            "domainName": merged.get("host", "127.0.0.1"),
            "domainPrefix": "local",
            "http": {
                "method": method,
                "path": url.path,
                "protocol": "HTTP/1.1",
                "sourceIp": source_ip,
                "userAgent": merged.get("user-agent", ""),
            },
            "requestId": str(uuid.uuid4()),
            "routeKey": route_key,
            "stage": "$default",
            "time": now.strftime("%d/%b/%Y:%H:%M:%S +0000"),
            "timeEpoch": int(now.timestamp() * 1000),
        },
        "isBase64Encoded": text_body is None,
    }
    if cookies:
        event["cookies"] = cookies
    if query:
        event["queryStringParameters"] = query
    if path_parameters:
        event["pathParameters"] = path_parameters
    if body:
        event["body"] = text_body if text_body is not None else base64.b64encode(body).decode("ascii")
    return event


def query_parameters(raw_query: str) -> list[tuple[str, str]]:
    """The query's (name, value) pairs as API Gateway decodes them for `queryStringParameters`.

    Percent escapes are UTF-8 and `+` is a space, as in form encoding: API Gateway hands `?sort=-+createdAt`
    to the function as "- createdAt" (aws/aws-cdk#19827), and SigV4 verification reads a `+` the same way,
    so what was signed is what the handler gets. A literal plus travels as %2B. `raw_query` is off the wire
    (bytes read as ISO-8859-1), so raw UTF-8 decodes too.
    """
    try:
        data = raw_query.encode("latin-1")
    except UnicodeEncodeError:  # a caller's own text, not off the wire
        data = raw_query.encode("utf-8")
    return [(name.decode("utf-8", "replace"), value.decode("utf-8", "replace")) for name, value in query_pairs(data)]


def http_response(result: dict[str, Any]) -> tuple[int, list[tuple[str, str]], bytes]:
    """Status, headers and body bytes of a Lambda proxy response, as API Gateway sends them."""
    headers = [(name, str(value)) for name, value in (result.get("headers") or {}).items()]
    headers.extend(("Set-Cookie", cookie) for cookie in result.get("cookies") or [])
    raw = result.get("body") or ""
    body = base64.b64decode(raw) if result.get("isBase64Encoded") else str(raw).encode("utf-8")
    return int(result["statusCode"]), headers, body


@dataclass(frozen=True)
class Route:
    """One HttpApi event of the function: `POST /v1/runs`, `GET /v1/runs/{run_id}`."""

    method: str
    path: str

    @property
    def key(self) -> str:
        return f"{self.method} {self.path}"

    def match(self, method: str, path: str) -> dict[str, str] | None:
        if method != self.method:
            return None
        pattern = re.sub(r"\\{(\w+)\\}", r"(?P<\1>[^/]+)", re.escape(self.path))
        found = re.fullmatch(pattern, path)
        return None if found is None else found.groupdict()


class ExecutionEnvironments:
    """Lambda's concurrency model: each invocation runs alone in one of N worker processes.

    A Lambda execution environment never runs two invocations at once, and the handler's libraries
    rely on that (Powertools keeps the current event on the resolver). Threads sharing one handler
    would mix requests up; processes do not, and they still race each other on DynamoDB.
    """

    def __init__(self, template_path: str, logical_id: str, concurrency: int) -> None:
        self.function_name = logical_id
        self._pool = ProcessPoolExecutor(
            max_workers=concurrency,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_load_handler,
            initargs=(template_path, logical_id),
        )

    def invoke(self, event: dict[str, Any]) -> dict[str, Any]:
        return self._pool.submit(_invoke_loaded_handler, event).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class LineWriter(io.TextIOBase):
    """A text stream that hands the OS whole lines, each in one write() (atomic on an O_APPEND file)."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self._fd = fd
        self._pending = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self._pending += text
            head, newline, self._pending = self._pending.rpartition("\n")
            if newline:
                os.write(self._fd, (head + newline).encode("utf-8", "backslashreplace"))
        return len(text)

    def writable(self) -> bool:
        return True


_loaded: tuple[LambdaHandler, str] | None = None


def _load_handler(template_path: str, logical_id: str) -> None:
    from poimen_tools.local.template import Template

    # One write per line, as Lambda's log stream takes them: the environments share one stdout, and
    # buffered writes would splice their JSON lines into each other. Before the handler's import, so
    # the loggers it creates write here.
    sys.stdout = LineWriter(sys.stdout.fileno())
    global _loaded
    _loaded = (Template(Path(template_path)).load_handler(logical_id), logical_id)


def _invoke_loaded_handler(event: dict[str, Any]) -> dict[str, Any]:
    assert _loaded is not None, "worker initializer did not run"
    handler, function_name = _loaded
    return handler(event, LocalLambdaContext(function_name))


class LocalApiServer(ThreadingHTTPServer):
    """Threaded HTTP front (API Gateway's part) over the function's execution environments."""

    daemon_threads = True
    # socketserver's default listen backlog is 5: a burst of concurrent clients would be reset.
    request_queue_size = 128

    def __init__(
        self,
        address: tuple[str, int],
        environments: ExecutionEnvironments,
        routes: list[Route],
        authenticate: Authenticator,
    ) -> None:
        super().__init__(address, _RequestHandler)
        self.environments = environments
        self.routes = routes
        self.authenticate = authenticate

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"


def _gateway_message(message: str) -> bytes:
    """API Gateway's own JSON answer: `{"message":"..."}`, compact."""
    return json.dumps({"message": message}, separators=(",", ":")).encode()


class _RequestHandler(BaseHTTPRequestHandler):
    server: LocalApiServer
    protocol_version = "HTTP/1.1"

    def _invoke(self) -> None:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if length < 0 or "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self._refuse(411, "Length Required")
            return
        refusal = self._over_limit(length)
        if refusal is not None:
            self._refuse(*refusal)
            return
        body = self.rfile.read(length) if length else b""
        path = urlsplit(self.path).path
        for route in self.server.routes:
            parameters = route.match(self.command, path)
            if parameters is not None:
                break
        else:  # API Gateway answers unknown routes itself; the function never sees them
            self._answer(404, [("Content-Type", "application/json")], _gateway_message("Not Found"))
            return
        headers = list(self.headers.items())
        try:  # IAM authorization, before the function, as API Gateway does it
            principal_arn = self.server.authenticate(self.command, self.path, headers, body)
        except Unauthorized as refusal:
            self._answer(403, [("Content-Type", "application/json")], _gateway_message(str(refusal)))
            return
        event = http_api_event(
            method=self.command,
            target=self.path,
            headers=headers,
            body=body,
            principal_arn=principal_arn,
            source_ip=self.client_address[0],
            route_key=route.key,
            path_parameters=parameters,
        )
        try:
            status, headers, payload = http_response(self.server.environments.invoke(event))
        except Exception:  # the invocation failed: API Gateway answers 500
            self.log_error("handler raised:\n%s", traceback.format_exc())
            status, headers = 500, [("Content-Type", "application/json")]
            payload = _gateway_message("Internal Server Error")
        self._answer(status, headers, payload)

    def _over_limit(self, length: int) -> tuple[int, str] | None:
        """API Gateway's own refusal of a request over its size limits, checked before anything is read."""
        if len(self.requestline) + sum(len(value) for value in self.headers.values()) > (
            MAX_REQUEST_LINE_AND_HEADER_VALUES
        ):
            return 431, "Request Header Fields Too Large"
        if length > MAX_PAYLOAD_BYTES:
            return 413, "Request Entity Too Large"
        return None

    def handle_expect_100(self) -> bool:
        # A client waiting for "100 Continue" learns of a refusal before it sends the body.
        try:
            refusal = self._over_limit(int(self.headers.get("Content-Length") or 0))
        except ValueError:
            refusal = None
        if refusal is not None:
            self._refuse(*refusal)
            return False
        return super().handle_expect_100()

    def _refuse(self, status: int, message: str) -> None:
        """API Gateway's own answer, before the body is read: the connection cannot be reused."""
        self._answer(status, [("Content-Type", "application/json"), ("Connection", "close")], _gateway_message(message))
        self.close_connection = True

    def _answer(self, status: int, headers: list[tuple[str, str]], payload: bytes) -> None:
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    def __getattr__(self, name: str) -> Any:
        # Every method (do_GET, do_QUERY, ...) reaches the route table: API Gateway answers 404 for
        # any method and path it has no route for, never 501.
        if name.startswith("do_"):
            return self._invoke
        raise AttributeError(name)
