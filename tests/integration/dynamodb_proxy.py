"""A fault-injecting HTTP proxy on loopback in front of a DynamoDB endpoint (moto server).

Each DynamoDB call through it is a kind: `put-run` (a PutItem of a run), `put-fence` (a PutItem of a
fence: its item has `item_type`), `get-run` (a GetItem of a `RUN#` key) or `other`. Faults come from a
script (per kind, the faults of the next attempts: `script`) or at random (`chaos`: each attempt of the
run kinds gets a random fault with some probability); attempts without one are forwarded as they are.
It can also refuse connections for a while (`refuse` … `accept`: its port closed, its idle connections
shut), and, to prove that the history check can fail, admit without the guard: `strip_condition` removes
the condition from every run's PutItem, so a second write overwrites the first. Every fault is counted
per kind (`injected`). A held answer or request waits for the client to hang up (its read timeout), not
for a fixed time: nothing here sleeps.
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import json
import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

# How long a held connection waits for its client to hang up, so that a failed test still ends.
HANG_UP_WAIT_SECONDS = 15.0
# The kinds of call that chaos faults (the grants, the table's creation and the scans pass untouched).
RUN_CALLS = frozenset({"put-run", "put-fence", "get-run"})


class Fault(Enum):
    COMMIT_THEN_HOLD = "forward, then hold the answer until the client hangs up, and drop it"
    COMMIT_THEN_DROP = "forward, then close the connection without an answer"
    COMMIT_THEN_500 = "forward, then answer 500 InternalServerError instead of DynamoDB's answer"
    ANSWER_500 = "answer 500 InternalServerError without forwarding"
    HOLD_THEN_DROP = "hold the request until the client hangs up, never forward it"
    HOLD_THEN_LATE = (
        "hold the request until the client hangs up and that key's resolution (a fence or a read) was "
        "answered, then forward it: a write that lands late"
    )


@dataclass
class Chaos:
    """Random faults: each attempt of a run call gets one of `faults` with probability `rate` (a read held
    to land late would change nothing: it is dropped instead)."""

    rate: float
    rng: random.Random
    faults: tuple[Fault, ...] = tuple(Fault)


@dataclass
class FaultyProxy:
    upstream: str
    url: str = ""
    faults: dict[str, list[Fault]] = field(default_factory=dict)
    chaos: Chaos | None = None
    strip_condition: bool = False
    seen: dict[str, int] = field(default_factory=dict)
    # Faults injected, by name (Fault's, lower case), and "dropped-refusing": requests that came on a
    # connection kept from before a refusal, dropped unanswered.
    injected: Counter[str] = field(default_factory=Counter)
    refusals: int = 0
    late: int = 0  # HOLD_THEN_LATE requests not yet forwarded
    active: int = 0  # requests being handled
    refusing: bool = False
    _resolutions: Counter[str] = field(default_factory=Counter)  # per key, resolutions answered
    _connections: dict[socket.socket, bool] = field(default_factory=dict)  # open connection → busy
    _changed: threading.Condition = field(default_factory=threading.Condition)
    _listener: _Listener | None = None

    def script(self, **faults: list[Fault]) -> None:
        """The faults of the next attempts per kind (put_run=[...]); everything else passes."""
        with self._changed:
            self.faults = {kind.replace("_", "-"): list(queue) for kind, queue in faults.items()}
            self.seen = {}

    def settled(self) -> bool:
        """Every scripted fault was used, and every late write forwarded."""
        with self._changed:
            return self.late == 0 and not any(self.faults.values())

    def idle(self) -> bool:
        """No request is being handled (held, forwarded, or waiting to land late)."""
        with self._changed:
            return self.active == 0

    def refuse(self) -> None:
        """Refuse connections until `accept`: the port is closed and every idle connection shut, so a
        client's next attempt finds nothing listening (nothing of it is sent)."""
        assert self._listener is not None
        with self._changed:
            self.refusing = True
            self.refusals += 1
            idle = [connection for connection, busy in self._connections.items() if not busy]
        for connection in idle:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        self._listener.stop()

    def accept(self) -> None:
        """Listen again, on the same port."""
        assert self._listener is not None
        with self._changed:
            self.refusing = False
        self._listener.start()

    def _arrived(self, connection: socket.socket) -> bool:
        """A request came on `connection`: False if it must be dropped (the proxy is refusing)."""
        with self._changed:
            if self.refusing:
                self.injected["dropped-refusing"] += 1
                return False
            self._connections[connection] = True
            self.active += 1
            return True

    def _done(self, connection: socket.socket) -> bool:
        """The request on `connection` is handled; whether to close it (a refusal began meanwhile)."""
        with self._changed:
            self.active -= 1
            if connection in self._connections:
                self._connections[connection] = False
            return self.refusing

    def _next_fault(self, kind: str) -> Fault | None:
        with self._changed:
            self.seen[kind] = self.seen.get(kind, 0) + 1
            queue = self.faults.get(kind)
            fault = queue.pop(0) if queue else None
            chaos = self.chaos
            if fault is None and chaos is not None and kind in RUN_CALLS and chaos.rng.random() < chaos.rate:
                fault = chaos.rng.choice(chaos.faults)
                if fault is Fault.HOLD_THEN_LATE and kind == "get-run":
                    fault = Fault.HOLD_THEN_DROP
            if fault is not None:
                self.injected[fault.name.lower()] += 1
            if fault is Fault.HOLD_THEN_LATE:
                self.late += 1
            return fault

    def _resolutions_of(self, pk: str) -> int:
        with self._changed:
            return self._resolutions[pk]

    def _resolution_answered(self, pk: str) -> None:
        with self._changed:
            self._resolutions[pk] += 1
            self._changed.notify_all()

    def _wait_for_resolution(self, pk: str, after: int) -> None:
        """Until a resolution of `pk` is answered beyond the first `after` (bounded)."""
        with self._changed:
            self._changed.wait_for(lambda: self._resolutions[pk] > after, timeout=HANG_UP_WAIT_SECONDS)

    def _late_forwarded(self) -> None:
        with self._changed:
            self.late -= 1


class _Listener:
    """The proxy's listening socket and its accept loop, which can stop and start again on its port."""

    def __init__(self, server: ThreadingHTTPServer) -> None:
        self.server = server
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None and self.server.socket.fileno() < 0:  # stopped: listen again on its port
            self._rebind()
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self.server.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self.server.socket.close()

    def _rebind(self) -> None:
        deadline = time.monotonic() + 10.0
        while True:
            self.server.socket = socket.socket(self.server.address_family, self.server.socket_type)
            try:
                self.server.server_bind()
                self.server.server_activate()
                return
            except OSError as error:  # the port is briefly someone else's (an outgoing connection's)
                self.server.socket.close()
                if error.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def call_kind(target: str, body: bytes) -> tuple[str, str | None]:
    """The kind of a DynamoDB call (see the module doc) and the key it is about."""
    params: dict[str, Any] = json.loads(body or b"{}")
    operation = target.rsplit(".", 1)[-1]
    if operation == "PutItem":
        item = params.get("Item", {})
        return ("put-fence" if "item_type" in item else "put-run"), item.get("pk", {}).get("S")
    pk = params.get("Key", {}).get("pk", {}).get("S")
    if operation == "GetItem" and pk is not None and pk.startswith("RUN#"):
        return "get-run", pk
    return "other", pk


def without_condition(body: bytes) -> bytes:
    """A PutItem with no condition: it writes whatever is there (the broken admission of the vacuity test)."""
    params: dict[str, Any] = json.loads(body)
    for name in ("ConditionExpression", "ExpressionAttributeNames", "ExpressionAttributeValues"):
        params.pop(name, None)
    return json.dumps(params).encode()


_INTERNAL_SERVER_ERROR = json.dumps(
    {"__type": "com.amazonaws.dynamodb.v20120810#InternalServerError", "message": "injected by the proxy"}
).encode()


@contextmanager
def faulty_proxy(upstream: str) -> Iterator[FaultyProxy]:
    proxy = FaultyProxy(upstream)
    target = urlsplit(upstream)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def handle(self) -> None:
            # A client killed with its connection open, or an idle connection shut by `refuse`: nothing to answer.
            with contextlib.suppress(ConnectionError):
                super().handle()

        def setup(self) -> None:
            super().setup()
            with proxy._changed:
                proxy._connections[self.connection] = False

        def finish(self) -> None:
            with proxy._changed:
                proxy._connections.pop(self.connection, None)
            super().finish()

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length)
            if len(body) < length:  # the client went away mid-request (killed): nothing to forward
                self.close_connection = True
                return
            if not proxy._arrived(self.connection):
                self.close_connection = True
                return
            try:
                self._handle(body)
            finally:
                if proxy._done(self.connection):
                    self.close_connection = True

        def _handle(self, body: bytes) -> None:
            kind, pk = call_kind(self.headers.get("X-Amz-Target", ""), body)
            if kind == "put-run" and proxy.strip_condition:
                body = without_condition(body)
            fault = proxy._next_fault(kind)
            if fault in (Fault.HOLD_THEN_DROP, Fault.HOLD_THEN_LATE):
                resolutions = proxy._resolutions_of(pk) if pk is not None else 0
                self._wait_for_hang_up()
                if fault is Fault.HOLD_THEN_LATE and pk is not None:
                    proxy._wait_for_resolution(pk, resolutions)
                    self._forward(body)
                    proxy._late_forwarded()
                self.close_connection = True
                return
            if fault is Fault.ANSWER_500:
                self._answer(500, [("Content-Type", "application/x-amz-json-1.0")], _INTERNAL_SERVER_ERROR)
                return
            status, headers, data = self._forward(body)
            if kind in ("put-fence", "get-run") and pk is not None:
                proxy._resolution_answered(pk)
            if fault is Fault.COMMIT_THEN_HOLD:
                self._wait_for_hang_up()
                self.close_connection = True
            elif fault is Fault.COMMIT_THEN_DROP:
                self.close_connection = True
            elif fault is Fault.COMMIT_THEN_500:
                self._answer(500, [("Content-Type", "application/x-amz-json-1.0")], _INTERNAL_SERVER_ERROR)
            else:
                self._answer(status, headers, data)

        def _forward(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
            connection = http.client.HTTPConnection(target.netloc, timeout=30)
            try:
                # Content-Length is http.client's to set: the body may have been rewritten.
                dropped = ("connection", "content-length")
                headers = {name: value for name, value in self.headers.items() if name.lower() not in dropped}
                connection.request("POST", self.path, body=body, headers=headers)
                response = connection.getresponse()
                data = response.read()
                kept = [
                    (name, value)
                    for name, value in response.getheaders()
                    if name.lower() not in ("connection", "content-length", "transfer-encoding")
                ]
                return response.status, kept, data
            finally:
                connection.close()

        def _answer(self, status: int, headers: list[tuple[str, str]], data: bytes) -> None:
            self.send_response(status)
            for name, value in headers:
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _wait_for_hang_up(self) -> None:
            """Until the client closes the connection (it sends nothing while it waits for an answer)."""
            self.connection.settimeout(HANG_UP_WAIT_SECONDS)
            try:
                while self.connection.recv(1024):
                    pass
            except OSError:
                pass

        def log_message(self, format: str, *args: Any) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    proxy._listener = _Listener(server)
    proxy._listener.start()
    proxy.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield proxy
    finally:
        proxy._listener.stop()
