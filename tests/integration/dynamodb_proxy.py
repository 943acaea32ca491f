"""A fault-injecting HTTP proxy on loopback in front of a DynamoDB endpoint (moto server).

Each DynamoDB call through it is a kind: `put-run` (a PutItem of a run), `put-fence` (a PutItem of a
fence: its item has `item_type`), `get-run` (a GetItem of a `RUN#` key) or `other`. Per kind, the test
scripts faults for the next attempts; attempts without one are forwarded as they are. A held answer or
request waits for the client to hang up (its read timeout), not for a fixed time: nothing here sleeps.
"""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

# How long a held connection waits for its client to hang up, so that a failed test still ends.
HANG_UP_WAIT_SECONDS = 15.0


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
class FaultyProxy:
    upstream: str
    url: str = ""
    faults: dict[str, list[Fault]] = field(default_factory=dict)
    seen: dict[str, int] = field(default_factory=dict)
    late: int = 0  # HOLD_THEN_LATE requests not yet forwarded
    _resolved: set[str] = field(default_factory=set)
    _changed: threading.Condition = field(default_factory=threading.Condition)

    def script(self, **faults: list[Fault]) -> None:
        """The faults of the next attempts per kind (put_run=[...]); everything else passes."""
        with self._changed:
            self.faults = {kind.replace("_", "-"): list(queue) for kind, queue in faults.items()}
            self.seen = {}
            self._resolved = set()

    def settled(self) -> bool:
        """Every scripted fault was used, and every late write forwarded."""
        with self._changed:
            return self.late == 0 and not any(self.faults.values())

    def _next_fault(self, kind: str) -> Fault | None:
        with self._changed:
            self.seen[kind] = self.seen.get(kind, 0) + 1
            queue = self.faults.get(kind)
            fault = queue.pop(0) if queue else None
            if fault is Fault.HOLD_THEN_LATE:
                self.late += 1
            return fault

    def _resolution_answered(self, pk: str) -> None:
        with self._changed:
            self._resolved.add(pk)
            self._changed.notify_all()

    def _wait_for_resolution(self, pk: str) -> None:
        with self._changed:
            self._changed.wait_for(lambda: pk in self._resolved, timeout=HANG_UP_WAIT_SECONDS)

    def _late_forwarded(self) -> None:
        with self._changed:
            self.late -= 1


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


_INTERNAL_SERVER_ERROR = json.dumps(
    {"__type": "com.amazonaws.dynamodb.v20120810#InternalServerError", "message": "injected by the proxy"}
).encode()


@contextmanager
def faulty_proxy(upstream: str) -> Iterator[FaultyProxy]:
    proxy = FaultyProxy(upstream)
    target = urlsplit(upstream)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            kind, pk = call_kind(self.headers.get("X-Amz-Target", ""), body)
            fault = proxy._next_fault(kind)
            if fault in (Fault.HOLD_THEN_DROP, Fault.HOLD_THEN_LATE):
                self._wait_for_hang_up()
                if fault is Fault.HOLD_THEN_LATE and pk is not None:
                    proxy._wait_for_resolution(pk)
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
                headers = {name: value for name, value in self.headers.items() if name.lower() != "connection"}
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
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    proxy.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield proxy
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
