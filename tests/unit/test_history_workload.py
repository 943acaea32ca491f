"""The history's clients record what reached them: an answer cut off mid-body is no answer (the
spawn's outcome is unknown), never a failure of the run itself."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import requests

from tests.history.history import History
from tests.history.workload import KeyPool, Target, Workload


@contextmanager
def _cut_off_server() -> Iterator[str]:
    """A server that answers every request with its status line and headers, then hangs up mid-body
    (what a kill -9 of poimen dev while it writes an answer looks like to a client)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            with connection:
                connection.recv(65536)
                connection.sendall(
                    b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nContent-Length: 280\r\n\r\n"
                )

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        # shutdown, not close alone: it wakes the accept() the serving thread is blocked in.
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        thread.join(timeout=5)


def test_an_answer_cut_off_mid_body_leaves_the_spawn_without_an_answer() -> None:
    history = History({})
    with _cut_off_server() as url:
        workload = Workload(Target(url, "t"), history, 1, 1, KeyPool(1, 1))
        op = history.begin(0, "spawn", "t", key="k")
        with requests.Session() as session:
            workload._send(session, op, "POST", "/v1/runs", body={"workflow_ref": "wf"})
    assert op.sent
    assert op.return_ is None
    assert op.status is None
    assert op.error is not None
    assert op.error.startswith("connection lost")
