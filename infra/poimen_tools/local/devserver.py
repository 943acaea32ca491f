"""The local API: each HTTP request becomes an API Gateway HTTP API (v2) event for the same handler.

This translation is the only local-only code on the request path; routes live in the handler.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import errno
import io
import json
import multiprocessing
import os
import queue
import re
import signal
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

from poimen_tools.local.sigv4 import Unauthorized, query_pairs, wire_bytes

# API Gateway HTTP API quotas, neither adjustable ("Quotas for configuring and running an HTTP API in API
# Gateway": https://docs.aws.amazon.com/apigateway/latest/developerguide/http-api-quotas.html).
MAX_PAYLOAD_BYTES = 10 * 1024 * 1024  # "Payload size: 10 MB"
MAX_REQUEST_LINE_AND_HEADER_VALUES = 10240  # "Total combined size of request line and header values: 10240 bytes"
# Lambda's synchronous invocation payload, request and response, 6 MB ("Lambda quotas",
# https://docs.aws.amazon.com/lambda/latest/dg/gettingstarted-limits.html): Invoke refuses a larger event
# ("Request must be smaller than 6291456 bytes", RequestEntityTooLargeException), the whole event as JSON, the body
# inside it escaped or base64-encoded.
MAX_INVOCATION_PAYLOAD_BYTES = 6 * 1024 * 1024

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
    """The API Gateway HTTP API payload 2.0 event for one request, with an IAM authorizer context.

    `headers` are as http.server reads them (bytes decoded as ISO-8859-1); the event has each value's bytes
    read as UTF-8 (`header_text`).
    """
    url = urlsplit(target)
    merged: dict[str, str] = {}
    cookies: list[str] = []
    for name, raw in headers:
        lowered, value = name.lower(), header_text(raw)
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


class InvocationPayloadTooLarge(Exception):
    """An event, or a function's answer, over Lambda's MAX_INVOCATION_PAYLOAD_BYTES: Lambda refuses the invocation
    (or fails it), and API Gateway answers 500 ("Handling Lambda errors with an API Gateway API",
    https://docs.aws.amazon.com/lambda/latest/dg/services-apigateway-errors.html)."""

    def __init__(self, which: str, size: int) -> None:
        super().__init__(
            f"the invocation's {which} payload is {size} bytes; Lambda takes at most {MAX_INVOCATION_PAYLOAD_BYTES}"
        )


def invocation_payload_bytes(payload: Mapping[str, Any]) -> int:
    """The bytes of `payload` as Lambda's Invoke carries it: compact JSON, UTF-8 (a lower bound of any encoding's,
    so that nothing AWS takes is refused here)."""
    return len(json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass"))


def _within_lambdas_payload(which: str, payload: Mapping[str, Any]) -> None:
    size = invocation_payload_bytes(payload)
    if size > MAX_INVOCATION_PAYLOAD_BYTES:
        raise InvocationPayloadTooLarge(which, size)


def header_text(value: str) -> str:
    """A header value as the function gets it: the bytes that arrived (`value` is them read as ISO-8859-1, as
    http.server reads them) decoded as UTF-8, what a UTF-8 client sent (the SigV4 signature covers those bytes).
    AWS documents no decoding of header bytes; a sequence that is not UTF-8 becomes U+FFFD, so the event stays
    JSON and the function refuses the value as it refuses any non-ASCII key.
    """
    return wire_bytes(value).decode("utf-8", "replace")


def query_parameters(raw_query: str) -> list[tuple[str, str]]:
    """The query's (name, value) pairs as API Gateway decodes them for `queryStringParameters`.

    Percent escapes are UTF-8 and `+` is a space, as in form encoding: API Gateway hands `?sort=-+createdAt`
    to the function as "- createdAt" (aws/aws-cdk#19827), and SigV4 verification reads a `+` the same way,
    so what was signed is what the handler gets. A literal plus travels as %2B. `raw_query` is off the wire
    (bytes read as ISO-8859-1), so raw UTF-8 decodes too.
    """
    pairs = query_pairs(wire_bytes(raw_query))
    return [(name.decode("utf-8", "replace"), value.decode("utf-8", "replace")) for name, value in pairs]


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


@dataclass
class _Environment:
    """One execution environment: a pool of one spawned process, and that process's id once it has imported the
    handler (its init phase, which the function's timeout does not count)."""

    pool: ProcessPoolExecutor
    ready: Future[int]


class ExecutionEnvironments:
    """Lambda's concurrency model: each invocation runs alone in one of N worker processes.

    A Lambda execution environment never runs two invocations at once, and the handler's libraries
    rely on that (Powertools keeps the current event on the resolver). Threads sharing one handler
    would mix requests up; processes do not, and they still race each other on DynamoDB.

    Each environment has the function's own variables from the template (Globals', then its own: the
    `Ref`s `refs` names or parameter defaults resolve, and `variables` for what only a deploy knows) over the
    variables of the process that starts it, less those the template gives only other functions, and its
    timeout (the function's, else Globals', else Lambda's 3 s default): an invocation still running at its
    timeout is ended, its process killed, and fails (InvocationTimedOut), as Lambda ends it and resets the
    environment.

    `start()` launches all N and each imports the handler (Lambda's init phase) at once; `wait_ready()`
    returns when every one has, so the first requests never wait for an import. The environments
    ignore Ctrl-C and SIGTERM (their owner stops them with `close()`), and end with their owner
    however it ends, SIGKILL included. Each is a process pool of its own: one that dies (kill -9, out of
    memory, a crash, its timeout) fails only the invocation it was running, as Lambda's "Runtime exited" does,
    and is replaced by a new one, which imports the handler before its first invocation (a cold start); one
    pool of N would fail every invocation in flight and refuse every later one.
    """

    def __init__(
        self,
        template_path: str,
        logical_id: str,
        concurrency: int,
        *,
        refs: Mapping[str, str] | None = None,
        variables: Mapping[str, str] | None = None,
    ) -> None:
        from poimen_tools.local.template import Template

        self.function_name = logical_id
        self.concurrency = concurrency
        self._template_path = template_path
        template = Template(Path(template_path))
        self.timeout_seconds = template.function_timeout(logical_id)
        self.variables = {**template.function_environment(logical_id, refs or {}), **(variables or {})}
        # Unset in its environments if the starting process holds them (`poimen dev`'s holds admission's
        # TABLE_NAME): a function sees no other's variables, as on Lambda.
        self._unset = sorted(template.other_functions_variables(logical_id) - set(self.variables))
        self._environments: list[_Environment] = []
        self._idle: queue.SimpleQueue[int] = queue.SimpleQueue()  # the environments free, by index
        self._lock = threading.Lock()  # replacing an environment and closing, one at a time
        self._closed = False
        self._loaded: Any = None  # multiprocessing.synchronize.Barrier
        self._load_timeout = 120.0

    def start(self, load_timeout: float = 120.0) -> None:
        """Launch every environment (without waiting): each imports the handler."""
        if self._environments:
            raise RuntimeError("the execution environments are already started")
        self._load_timeout = load_timeout
        # Each warm-up call waits here until all N have loaded the handler: N calls mean N environments
        # started and loaded.
        self._loaded = multiprocessing.get_context("spawn").Barrier(self.concurrency)
        # A process started with Ctrl-C blocked keeps it blocked until its initializer ignores it: a
        # Ctrl-C while it is still starting is never a traceback. (multiprocessing's resource
        # tracker is started the same way.)
        with _stop_signals_blocked():
            pools = [self._pool() for _ in range(self.concurrency)]
            # A pool starts its process at its first call.
            self._environments = [
                _Environment(pool, pool.submit(_wait_until_all_loaded, load_timeout)) for pool in pools
            ]
        for index in range(self.concurrency):
            self._idle.put(index)

    def _pool(self) -> ProcessPoolExecutor:
        """One execution environment's pool: one spawned process, started by the pool's first call."""
        return ProcessPoolExecutor(
            max_workers=1,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_start_environment,
            initargs=(
                self._template_path,
                self.function_name,
                self.variables,
                self._unset,
                self._loaded,
                os.getpid(),
                # The parent-death signal fires when the *thread* that started a process ends (it is
                # started by the first call, from this thread): ask for it only from the main thread,
                # whose end is the process's.
                threading.current_thread() is threading.main_thread(),
            ),
        )

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Until every environment has imported the handler; raises if one could not."""
        deadline = time.monotonic() + timeout
        try:
            for environment in self._environments:
                environment.ready.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            raise EnvironmentsNotReady(
                f"the {self.function_name} execution environments did not load the handler within {timeout:.0f} s"
            ) from None
        except Exception as error:  # the initializer raised (its traceback is on stderr) or a process died
            raise EnvironmentsNotReady(
                f"an execution environment of {self.function_name} failed to load the handler ({error!r}); "
                "see the traceback above"
            ) from error

    def invoke(self, event: dict[str, Any], timeout_seconds: float | None = None) -> dict[str, Any]:
        """The handler's answer to `event`, from the next free environment, under a context of `timeout_seconds`
        (None: the function's); InvocationTimedOut once that has passed."""
        if not self._environments:
            raise RuntimeError("the execution environments are not started")
        timeout = self.timeout_seconds if timeout_seconds is None else timeout_seconds
        index = self._idle.get()
        try:
            return self._invoke_in(index, event, timeout)
        finally:
            self._idle.put(index)

    def _invoke_in(self, index: int, event: dict[str, Any], timeout: float) -> dict[str, Any]:
        environment = self._environments[index]
        try:
            pid = environment.ready.result(timeout=self._load_timeout)  # a new one's init phase, then the invoke
            invocation = environment.pool.submit(_invoke_loaded_handler, event, timeout)
        # It died between invocations (or while the others started): Lambda would not have chosen it.
        except (BrokenProcessPool, threading.BrokenBarrierError):
            environment = self._replace(index)
            pid = environment.ready.result(timeout=self._load_timeout)
            invocation = environment.pool.submit(_invoke_loaded_handler, event, timeout)
        try:
            return invocation.result(timeout=timeout)
        except FutureTimeout:
            # Lambda ends an invocation at the function's timeout and resets its execution environment (AWS Lambda
            # Developer Guide, "Understand the Lambda execution environment lifecycle", "Failures during the
            # invoke phase": https://docs.aws.amazon.com/lambda/latest/dg/lambda-runtime-environment.html).
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            self._replace(index)
            raise InvocationTimedOut(timeout) from None
        except BrokenProcessPool:  # it died running this invocation, which fails; the next gets a new one
            self._replace(index)
            raise

    def _replace(self, index: int) -> _Environment:
        """A new environment in place of the dead one at `index`, its process started (by this thread)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the execution environments are closed")
            self._environments[index].pool.shutdown(wait=False)
            with _stop_signals_blocked():
                pool = self._pool()
                # Its process starts now, with the stop signals blocked, and answers once it has loaded the handler.
                environment = self._environments[index] = _Environment(pool, pool.submit(os.getpid))
            return environment

    def handler(self, event: dict[str, Any], _context: LocalLambdaContext) -> dict[str, Any]:
        """`invoke` as a handler is called (what a local event source mapping invokes): under the function's
        timeout, whatever the caller's context says, as the function's configuration sets it on Lambda; the
        invocation's context is made in the environment when it starts there."""
        return self.invoke(event)

    def close(self) -> None:
        with self._lock:
            if not self._environments or self._closed:
                return
            self._closed = True
        self._loaded.abort()  # environments still waiting for the others give up: shutdown is prompt
        for environment in self._environments:  # all asked to stop at once, then waited for
            environment.pool.shutdown(wait=False, cancel_futures=True)
        for environment in self._environments:
            environment.pool.shutdown(wait=True)


class InvocationTimedOut(TimeoutError):
    """The invocation ran past the function's timeout and was ended (Lambda's "Task timed out")."""

    def __init__(self, timeout_seconds: float) -> None:
        super().__init__(f"Task timed out after {timeout_seconds:.2f} seconds")


class EnvironmentsNotReady(RuntimeError):
    """The function's execution environments could not load the handler."""


_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


@contextlib.contextmanager
def _stop_signals_blocked() -> Iterator[None]:
    """Processes started inside inherit SIGINT and SIGTERM blocked (this thread's mask, across exec)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with_parent(parent_pid: int, *, parent_death_signal: bool = True) -> None:
    """End this process as soon as `parent_pid`, its parent, ends, however it ends (SIGKILL included).

    On Linux the kernel sends SIGKILL at the parent's death (PR_SET_PDEATHSIG: it fires when the
    thread that started this process ends, so only ask for it when that was the parent's main
    thread). Everywhere, a thread also watches for this process being re-parented.
    """
    if parent_death_signal and sys.platform == "linux":
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # it died before the signal was asked for
        os._exit(1)
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), name="parent-watch", daemon=True).start()


def _exit_when_orphaned(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)


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
_all_loaded: Any = None  # the environments' shared barrier (multiprocessing.synchronize.Barrier)


def _start_environment(
    template_path: str,
    logical_id: str,
    variables: Mapping[str, str],
    unset: list[str],
    all_loaded: Any,
    parent_pid: int,
    parent_death_signal: bool,
) -> None:
    """An execution environment's init phase: outlive nothing, ignore stop signals, take the function's
    variables (before the handler's modules read them at import) and none of other functions' (`unset`),
    import the handler."""
    _die_with_parent(parent_pid, parent_death_signal=parent_death_signal)
    # Ctrl-C reaches the whole process group; the environments are stopped by their owner instead.
    for stop in _STOP_SIGNALS:
        signal.signal(stop, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)  # one that came meanwhile is dropped
    for name in unset:
        os.environ.pop(name, None)
    os.environ.update(variables)
    global _all_loaded
    _all_loaded = all_loaded
    _load_handler(template_path, logical_id)


def _wait_until_all_loaded(timeout: float) -> int:
    _all_loaded.wait(timeout)
    return os.getpid()


def _load_handler(template_path: str, logical_id: str) -> None:
    from poimen_tools.local.template import Template

    # One write per line, as Lambda's log stream takes them: the environments share one stdout, and
    # buffered writes would splice their JSON lines into each other. Before the handler's import, so
    # the loggers it creates write here.
    sys.stdout = LineWriter(sys.stdout.fileno())
    global _loaded
    _loaded = (Template(Path(template_path)).load_handler(logical_id), logical_id)


def _invoke_loaded_handler(event: dict[str, Any], timeout_seconds: float) -> dict[str, Any]:
    assert _loaded is not None, "worker initializer did not run"
    handler, function_name = _loaded
    return handler(event, LocalLambdaContext(function_name, timeout_seconds=timeout_seconds))


class PortInUse(OSError):
    """The API's address is taken (another `poimen dev`, or another server, listens there)."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(
            errno.EADDRINUSE,
            f"{host}:{port} is already in use (another poimen dev?): stop what listens there, "
            "or choose another port with --port (0: any free port)",
        )
        self.host, self.port = host, port

    def __str__(self) -> str:
        return str(self.strerror)


class LocalApiServer(ThreadingHTTPServer):
    """Threaded HTTP front (API Gateway's part) over the function's execution environments.

    It binds its port when made (so a taken port fails at once, and the URL is known) and accepts
    connections only after `listen()`: its owner calls that once a request would be answered, so
    nothing connects to a server that cannot answer yet.
    """

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
        super().__init__(address, _RequestHandler, bind_and_activate=False)
        self.environments = environments
        self.routes = routes
        self.authenticate = authenticate
        with self._port_in_use_named(address):
            self.server_bind()

    def listen(self) -> None:
        """Start accepting connections (served once `serve_forever` runs)."""
        with self._port_in_use_named(self.server_address[:2]):
            self.server_activate()

    @contextlib.contextmanager
    def _port_in_use_named(self, address: tuple[Any, ...]) -> Iterator[None]:
        try:
            yield
        except OSError as error:
            self.server_close()
            if error.errno == errno.EADDRINUSE:
                raise PortInUse(str(address[0]), int(address[1])) from None
            raise

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that gave up (closed, reset) is not the server's error: no traceback for it.
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"


def _gateway_message(message: str) -> bytes:
    """API Gateway's own JSON answer: `{"message":"..."}`, compact."""
    return json.dumps({"message": message}, separators=(",", ":")).encode()


class _OverQuota(Exception):
    """A chunked body grows past MAX_PAYLOAD_BYTES."""


class _BadFraming(Exception):
    """What follows `Transfer-Encoding: chunked` is not a chunked body."""


# A chunk-size line: at most 16 hex digits (a 64-bit size), with any chunk extensions, within 1 KiB.
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")
_MAX_CHUNK_LINE = 1024


class _RequestHandler(BaseHTTPRequestHandler):
    server: LocalApiServer
    protocol_version = "HTTP/1.1"
    # An answer is written as its status line and headers, then its body: with Nagle's algorithm on, the body
    # waits for the client to acknowledge the headers, which a client delaying its ACKs (Linux: 40 ms) holds
    # back, so each answer on a keep-alive connection took 40 ms more than its function. API Gateway has no
    # such stall.
    disable_nagle_algorithm = True
    # RFC 9110's reason phrases, as Python 3.13 has them and the problem+json titles (poimen.api) say;
    # 3.11 and 3.12 still have RFC 7231's "Request Entity Too Large" and RFC 4918's "Unprocessable Entity".
    responses = MappingProxyType(
        {**BaseHTTPRequestHandler.responses, 413: ("Content Too Large", ""), 422: ("Unprocessable Content", "")}
    )

    def _invoke(self) -> None:
        body = self._body()
        if body is None:
            return
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
            _within_lambdas_payload("request", event)
            result = self.server.environments.invoke(event)
            _within_lambdas_payload("response", result)
            status, headers, payload = http_response(result)
        except Exception:  # the invocation failed, or Lambda refused it: API Gateway answers 500
            self.log_error("handler raised:\n%s", traceback.format_exc())
            status, headers = 500, [("Content-Type", "application/json")]
            payload = _gateway_message("Internal Server Error")
        self._answer(status, headers, payload)

    def _body(self) -> bytes | None:
        """The request's body, by Content-Length or de-chunked; None once a refusal has been answered.

        API Gateway documents no refusal of a chunked request body (HTTP APIs' known issues and quotas name
        none), so it is accepted, de-chunked, under the same 10 MB payload quota. A request carrying both
        framings is read as chunked (RFC 9112, 6.3), and its connection closed afterwards.
        """
        coding = self.headers.get("Transfer-Encoding")
        if coding is not None:
            if coding.strip().lower() != "chunked":
                self._refuse(501, "Not Implemented")  # RFC 9112, 6.1: a transfer coding not understood
                return None
            if self.headers.get("Content-Length") is not None:
                self.close_connection = True
            refusal = self._over_limit(0)
            if refusal is not None:
                self._refuse(*refusal)
                return None
            try:
                return self._dechunked()
            except _OverQuota:
                self._refuse(413, "Request Entity Too Large")
            except _BadFraming:
                self._refuse(400, "Bad Request")
            return None
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if length < 0:
            self._refuse(411, "Length Required")
            return None
        refusal = self._over_limit(length)
        if refusal is not None:
            self._refuse(*refusal)
            return None
        return self.rfile.read(length) if length else b""

    def _dechunked(self) -> bytes:
        """The chunked body (RFC 9112, 7.1) read to its end, trailer fields read and dropped; _OverQuota past
        MAX_PAYLOAD_BYTES, before the chunk that would exceed it is read; _BadFraming if it is no chunked body."""
        body = bytearray()
        while True:
            size_line = self.rfile.readline(_MAX_CHUNK_LINE + 1)
            size, _, _extensions = size_line.rstrip(b"\r\n").partition(b";")
            if not size_line.endswith(b"\r\n") or not _CHUNK_SIZE.fullmatch(size.strip()):
                raise _BadFraming
            length = int(size.strip(), 16)
            if length == 0:
                break
            if len(body) + length > MAX_PAYLOAD_BYTES:
                raise _OverQuota
            chunk = self.rfile.read(length + 2)
            if len(chunk) != length + 2 or not chunk.endswith(b"\r\n"):
                raise _BadFraming
            body += chunk[:-2]
        trailer = 0
        while (line := self.rfile.readline(_MAX_CHUNK_LINE + 1)) != b"\r\n":
            trailer += len(line)
            if not line.endswith(b"\r\n") or trailer > MAX_REQUEST_LINE_AND_HEADER_VALUES:
                raise _BadFraming
        return bytes(body)

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
