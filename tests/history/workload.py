"""The clients of a history: threads sending spawns and GETs, signed with the dev key, on a small rotating
pool of dispatch keys (so that first writes race), each operation recorded in the history.

Per key there is one request and other requests: the same request comes with its key in the body or in
the Idempotency-Key header (quoted or bare), its input's keys in another order, its goal_id null or left
out; another request for the key changes its input, workflow_ref or goal_id. Keyless spawns carry a marker
of their own in their input, and are sent again only after a store-unavailable answer (as it says).
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import requests
from urllib3.exceptions import MaxRetryError, NewConnectionError

from tests.history.history import History, Op
from tests.integration.conftest import signed_session

WORKFLOW = "wf/history"
# (connect, read) seconds: a client that waits longer for an answer gives up on it (indeterminate).
TIMEOUT = (2.0, 10.0)
# What each client does, by weight.
MIX = {
    "spawn-body": 25,
    "spawn-header": 15,
    "spawn-other": 10,
    "spawn-keyless": 20,
    "get-key": 15,
    "get-id": 15,
}
# After its connection was refused (poimen dev down), a client waits this long before its next operation.
REFUSED_PAUSE_SECONDS = 0.25


def same_request(key: str, rng: random.Random) -> dict[str, Any]:
    """The key's request, its input's keys (and its nested object's) in a random order, goal_id null or absent."""
    nested = list({"x": 1, "y": "z"}.items())
    rng.shuffle(nested)
    fields: list[tuple[str, Any]] = [("key", key), ("n", 1), ("tags", ["a", "b"]), ("nested", dict(nested))]
    rng.shuffle(fields)
    request: dict[str, Any] = {"workflow_ref": WORKFLOW, "input": dict(fields)}
    if rng.random() < 0.5:
        request["goal_id"] = None
    return request


def other_request(key: str, rng: random.Random) -> dict[str, Any]:
    """Another request for the key: its input, workflow_ref or goal_id differs from the key's request."""
    return rng.choice(
        [
            {"workflow_ref": WORKFLOW, "input": {"key": key, "n": 2}},
            {"workflow_ref": f"{WORKFLOW}-other", "input": {"key": key, "n": 1, "tags": ["a", "b"]}},
            {"workflow_ref": WORKFLOW, "input": same_request(key, rng)["input"], "goal_id": "g-1"},
        ]
    )


class KeyPool:
    """`size` live keys; each serves `uses` operations, then a fresh key takes its place. Half the picks
    go to the newest key, so its first writes race."""

    def __init__(self, size: int, uses: int) -> None:
        self._lock = threading.Lock()
        self._uses = uses
        self.created = 0
        self._live: list[list[Any]] = [[self._fresh(), uses] for _ in range(size)]
        self._runs: dict[str, str] = {}  # key → the run id an answer named
        self._keyless: deque[str] = deque(maxlen=64)  # keyless run ids answers named, newest last

    def _fresh(self) -> str:
        self.created += 1
        return f"k-{self.created:06d}"

    def pick(self, rng: random.Random) -> str:
        with self._lock:
            slot = self._live[-1] if rng.random() < 0.5 else rng.choice(self._live)
            key: str = slot[0]
            slot[1] -= 1
            if slot[1] <= 0:
                self._live.remove(slot)
                self._live.append([self._fresh(), self._uses])
            return key

    def learn(self, key: str | None, run_id: str) -> None:
        with self._lock:
            if key is None:
                self._keyless.append(run_id)
            else:
                self._runs[key] = run_id

    def known_run(self, rng: random.Random) -> tuple[str | None, str] | None:
        """A run id some answer named, with its key (None: a keyless run's), live keys' first."""
        with self._lock:
            live = [(key, self._runs[key]) for key, _ in self._live if key in self._runs]
            if self._keyless and (not live or rng.random() < 0.3):
                return None, rng.choice(self._keyless)
            return rng.choice(live) if live else None


@dataclass
class Target:
    url: str
    tenant: str


def _not_sent(error: requests.ConnectionError) -> bool:
    """Whether the connection was refused: nothing of the request reached the server."""
    cause = error.args[0] if error.args else None
    return isinstance(cause, MaxRetryError) and isinstance(cause.reason, NewConnectionError)


class Workload:
    """`clients` threads operating until `stop()`; every operation goes into `history`."""

    def __init__(self, target: Target, history: History, clients: int, seed: int, pool: KeyPool) -> None:
        self.target = target
        self.history = history
        self.pool = pool
        self._clients = clients
        self._seed = seed
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._markers = 0
        self._lock = threading.Lock()
        self.failure: str | None = None

    def start(self) -> None:
        for index in range(self._clients):
            thread = threading.Thread(target=self._client, args=(index,), name=f"history-client-{index}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        """Let each client finish the operation it is in, and end."""
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout=TIMEOUT[0] + TIMEOUT[1] + 5)

    def _client(self, index: int) -> None:
        rng = random.Random(self._seed * 1000 + index)
        kinds, weights = list(MIX), list(MIX.values())
        try:
            with signed_session() as session:
                while not self._stopping.is_set():
                    kind = rng.choices(kinds, weights)[0]
                    if kind == "spawn-keyless":
                        self._keyless(session, index, rng)
                    elif kind == "get-id":
                        self._get_by_id(session, index, rng)
                    else:
                        self._keyed(session, index, rng, kind)
        except Exception as error:  # a bug of the workload: the run fails, it is not a history
            self.failure = f"client {index}: {type(error).__name__}: {error}"
            self._stopping.set()

    def _keyed(self, session: requests.Session, index: int, rng: random.Random, kind: str) -> None:
        key = self.pool.pick(rng)
        if kind == "get-key":
            op = self.history.begin(index, "get-key", self.target.tenant, key=key)
            self._send(session, op, "GET", "/v1/runs", params={"dispatch_key": key})
            return
        request = other_request(key, rng) if kind == "spawn-other" else same_request(key, rng)
        headers = {"Content-Type": "application/json"}
        if kind == "spawn-header":
            headers["Idempotency-Key"] = f'"{key}"' if rng.random() < 0.5 else key
            body = request
        else:
            body = {**request, "dispatch_key": key}
        via = "header" if kind == "spawn-header" else "body"
        op = self.history.begin(index, "spawn", self.target.tenant, key=key, via=via, request=request)
        self._send(session, op, "POST", "/v1/runs", body=body, headers=headers)

    def _keyless(self, session: requests.Session, index: int, rng: random.Random) -> None:
        with self._lock:
            self._markers += 1
            marker = f"m-{index:02d}-{self._markers:07d}"
        request = {"workflow_ref": WORKFLOW, "input": {"marker": marker, "n": rng.randint(1, 3)}}
        for _ in range(2):  # sent again once after a store-unavailable, which says nothing was written
            op = self.history.begin(index, "spawn", self.target.tenant, marker=marker, request=request)
            self._send(session, op, "POST", "/v1/runs", body=request, headers={"Content-Type": "application/json"})
            if op.problem != "store-unavailable" or self._stopping.is_set():
                return

    def _get_by_id(self, session: requests.Session, index: int, rng: random.Random) -> None:
        known = self.pool.known_run(rng)
        if known is None:
            return
        key, run_id = known
        op = self.history.begin(index, "get-id", self.target.tenant, key=key, run_id=run_id)
        self._send(session, op, "GET", f"/v1/runs/{run_id}")

    def _send(
        self,
        session: requests.Session,
        op: Op,
        method: str,
        path: str,
        *,
        body: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        params: dict[str, str] | None = None,
    ) -> None:
        headers = {**(headers or {}), "X-Poimen-Tenant": self.target.tenant}
        data = None if body is None else json.dumps(body).encode()
        url = self.target.url + path
        try:
            response = session.request(method, url, data=data, headers=headers, params=params, timeout=TIMEOUT)
        except requests.ConnectTimeout as error:  # no connection: nothing was sent
            op.sent, op.return_, op.error = False, op.call, f"connect timeout: {error}"
            return
        except requests.ReadTimeout:
            op.error = f"no answer within {TIMEOUT[1]} s"
            return
        except requests.ConnectionError as error:
            if _not_sent(error):
                op.sent, op.return_, op.error = False, op.call, "connection refused"
                time.sleep(REFUSED_PAUSE_SECONDS)
            else:
                op.error = f"connection lost: {error}"
            return
        except requests.exceptions.ChunkedEncodingError as error:  # hung up mid-answer: outcome unknown
            op.error = f"connection lost: {error}"
            return
        try:
            answer = response.json()
        except ValueError:
            answer = None
        op.answered(response.status_code, answer, response.headers)
        named = (op.run or {}).get("run_id") or op.named
        if op.f == "spawn" and isinstance(named, str):
            self.pool.learn(op.key, named)
