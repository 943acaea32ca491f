"""The history: every operation a client sent, with when it was called and answered, and what the answer
said; what the nemesis did; and the table's final consistent scan. Written as JSON lines, which the checker
(main.go) reads; a line is one of

- `{"type": "meta", ...}`: the run's parameters (seed, clients, tenant), free-form;
- `{"type": "op", "id", "client", "f", "tenant", "key", "via", "marker", "request", "run_id", "call",
  "return", "sent", "status", "problem", "named", "replayed", "run", "error"}`: `f` is `spawn` (POST
  /v1/runs of `request`, its `key` in the body or the Idempotency-Key header as `via` says, or keyless with
  a unique `marker` in its input), `get-key` (GET /v1/runs?dispatch_key=`key`) or `get-id` (GET
  /v1/runs/`run_id`, with `key` when the id is a keyed run's); `call` and `return` are monotonic
  nanoseconds, `return` null when no answer came (a timeout, a lost connection, `poimen dev` killed);
  `sent` false when the connection was refused (nothing reached the server); `problem` is the problem
  type without `urn:poimen:problem:`, `named` the run id a problem names, `run` the run a 200/201 carries;
- `{"type": "nemesis", "what", "start", "end", "detail"}`: a fault window or a kill;
- `{"type": "scan", "at", "runs", "fences"}`: every run of the history's tenants in the table, read once
  nothing could write any more, and how many fences it holds; always the last line.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PROBLEM = "urn:poimen:problem:"


def now() -> int:
    """The history's clock: monotonic nanoseconds, one clock for every client of this process."""
    return time.monotonic_ns()


@dataclass
class Op:
    id: int
    client: int
    f: str
    tenant: str
    call: int
    key: str | None = None
    via: str | None = None
    marker: str | None = None
    request: dict[str, Any] | None = None
    run_id: str | None = None
    sent: bool = True
    status: int | None = None
    problem: str | None = None
    named: str | None = None
    replayed: bool = False
    run: dict[str, Any] | None = None
    error: str | None = None
    # Set once the answer came (or the op was given up on): None stays "no answer".
    return_: int | None = field(default=None)

    def answered(self, status: int, body: Any, headers: Mapping[str, str]) -> None:
        """Record an HTTP answer: its status, and the problem or run its body carries."""
        self.return_ = now()
        self.status = status
        self.replayed = headers.get("Idempotent-Replayed") == "true"
        if not isinstance(body, dict):
            return
        kind = body.get("type")
        if isinstance(kind, str) and kind.startswith(PROBLEM):
            self.problem = kind.removeprefix(PROBLEM)
            named = body.get("run_id")
            self.named = named if isinstance(named, str) else None
        elif status in (200, 201):
            self.run = body

    def line(self) -> dict[str, Any]:
        fields = asdict(self)
        fields["return"] = fields.pop("return_")
        return {"type": "op", **fields}


@dataclass
class Event:
    what: str
    start: int
    end: int
    detail: str = ""


class History:
    """Operations and nemesis events, appended from many threads; written once, with the final scan."""

    def __init__(self, meta: dict[str, Any]) -> None:
        self.meta = meta
        self.ops: list[Op] = []
        self.events: list[Event] = []
        self._lock = threading.Lock()

    def begin(self, client: int, f: str, tenant: str, **fields: Any) -> Op:
        with self._lock:
            op = Op(id=len(self.ops), client=client, f=f, tenant=tenant, call=now(), **fields)
            self.ops.append(op)
        return op

    @contextmanager
    def event(self, what: str, detail: str = "") -> Iterator[Event]:
        """A nemesis event lasting as long as the block; the block may add to its detail."""
        event = Event(what, now(), 0, detail)
        try:
            yield event
        finally:
            event.end = now()
            with self._lock:
                self.events.append(event)

    def sent(self) -> int:
        with self._lock:
            return sum(op.sent for op in self.ops)

    def write(self, path: Path, scan_at: int, runs: list[dict[str, Any]], fences: int) -> None:
        with self._lock, path.open("w") as out:
            for line in (
                {"type": "meta", **self.meta},
                *(op.line() for op in self.ops),
                *({"type": "nemesis", **asdict(event)} for event in self.events),
                {"type": "scan", "at": scan_at, "runs": runs, "fences": fences},
            ):
                out.write(json.dumps(line) + "\n")
