"""The batch form of POST /v1/runs: the spawns of one request admitted one by one, in order, each by the single
route's rule (`Admission.admit_run`: the same conditional write, fingerprint, 422, retention, fences and unknown
outcomes), each answered by its own result. One spawn's failure is its result alone: its exception is mapped as
the single route maps it (`refusal`, given by the API module, the one place errors become problems) and the other
spawns are admitted all the same. Spawns of different keys are admitted concurrently (at most ADMITTING_THREADS
at once, on the store's one thread-safe botocore client); the spawns of one key one after another, in order, so a
key repeated in the batch is admitted after its first spawn and answers that run (200, replayed) or 422, as two
sequential requests would. Metrics, logs and problems are made in the calling thread, in order. That client is built
there too, before the first spawn (`Admission.connect`): the batch fetches credentials once, not once a thread, and
when they cannot be fetched every spawn is answered 503 `store-unavailable` after that one bounded fetch.

A spawn is admitted only while the invocation has MIN_REMAINING_MS left: one spawn's admission ends within 8.5 s
(its write's 2 attempts of 0.75 s connect and read and botocore's backoff, 4 s; the one-attempt resolution after
an unknown outcome, 1.5 s; on the request that fetches credentials and builds the store's clients, 3 s more;
docs/architecture.md, Configuration), the caller's grants read once for the batch, before its first spawn, never
in one: so a write begun then ends before the function's timeout cuts the answer off (API Gateway's 500: every
spawn's outcome unknown). One begun later is answered 503 `store-unavailable` unwritten, to send again.

The answer is JSON text built from each run's own text (its input exactly as sent), never re-parsed, and fits
Lambda's 6 MB response payload (ANSWER_BUDGET_BYTES), past which the invocation fails and API Gateway answers 500,
every spawn's outcome unknown. A replay echoes its run as stored, which may be far larger than its spawn (an
input whose numbers were first sent long-form), and a refused spawn's problem may be several times its size: a
result that wrote nothing (a replay, a 4xx, a 503 store-unavailable) with no room left in the answer is answered
503 `store-unavailable` instead (`AnswerFull`: nothing was written, send it again), room being kept for every
later result that must be answered as it is (a new run, an outcome unknown).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from poimen.admission import Admission, Admitted
from poimen.contract import JSONText, RunRequest, SpawnBatch, json_text
from poimen.errors import AdmissionError, OutcomeUnknown, StoreUnavailable
from poimen.wire import MAX_BODY_BYTES, TRACEPARENT_PATTERN

_TRACEPARENT = re.compile(TRACEPARENT_PATTERN)
# Admissions of one batch in flight at once: each waits on its DynamoDB write, not on the CPU.
ADMITTING_THREADS = 8
MIN_REMAINING_MS = 8_500
STORE_UNAVAILABLE = "urn:poimen:problem:store-unavailable"
# Lambda's synchronous response payload, 6 MB (https://docs.aws.amazon.com/lambda/latest/dg/gettingstarted-limits.html),
# less room for the proxy response around the body (status, headers) and the results' envelope.
ANSWER_BUDGET_BYTES = 6 * 1024 * 1024 - 64 * 1024
# Room kept in the answer for a result not known yet: a failure's problem (an outcome unknown is one of a few
# hundred bytes; a larger problem wrote nothing and may be answered AnswerFull instead), or a replay's AnswerFull.
_RESERVED_RESULT_BYTES = 8 * 1024


@dataclass(frozen=True)
class Refusal:
    """What POST /v1/runs answers for a spawn that was not admitted: its status, problem (JSON text) and
    Retry-After, if any."""

    status: int
    problem: str
    retry_after: str | None = None


class SpawnTooLarge(Exception):
    """A spawn of the batch over MAX_BODY_BYTES as compact JSON, the single route's body limit."""

    def __init__(self, size: int) -> None:
        super().__init__(f"The spawn takes {size} bytes as compact JSON; a spawn holds at most {MAX_BODY_BYTES}.")
        self.size = size


class SpawnDeferred(StoreUnavailable):
    """A spawn of the batch that wrote nothing, answered 503 `store-unavailable` for a reason of the batch's (its
    message, the problem's detail) rather than the store's: send it again."""


def _answer_full() -> SpawnDeferred:
    # The batch's capacity, not a failure: marked throttled, the API asking to send it again (wire.asks_to_slow_down).
    return SpawnDeferred(
        "The batch's answer has no room left for this spawn's result (Lambda answers at most 6 MB); nothing was "
        "written: send it again, in a smaller batch or alone.",
        retry_after_seconds=0,
        throttled=True,
    )


def admit_spawns(
    admission: Admission,
    principal: str | None,
    tenant_id: str,
    batch: SpawnBatch,
    traceparent: str | None,
    *,
    remaining_ms: Callable[[], int],
    refusal: Callable[[str | None, Exception], Refusal],
    admitted: Callable[[str | None, Admitted], None],
) -> str:
    """The results of `batch`, JSON text (poimen.contract.SpawnResults): each spawn validated as a RunRequest,
    then admitted, for `tenant_id` by `principal` (whom the caller has authorized for it already).
    `admitted` is told of each admission (metrics, logs) and `refusal` maps a failure to its answer, each given
    the spawn's dispatch_key (None for a keyless or invalid spawn), in the spawns' order;
    `remaining_ms` is the invocation's time left."""
    traceparents: list[str | None] = batch.traceparents or [None] * len(batch.spawns)
    outcomes: list[Admitted | Exception | None] = [None] * len(batch.spawns)
    requests: dict[int, RunRequest] = {}
    for index, spawn in enumerate(batch.spawns):
        try:
            requests[index] = _request(spawn)
        except Exception as error:
            outcomes[index] = error

    def admit_in_order(indexes: list[int]) -> None:
        # A key's spawn after one that failed (unwritten, or its outcome unknown) is not begun: admitted, it would
        # be the key's run ahead of the earlier spawn, which sent again could then only replay it or be the 422;
        # and a spawn after one of its ordering key that failed would overtake it (a Kafka key's later record).
        held: Exception | None = None
        for index in indexes:
            trace = traceparents[index] if traceparents[index] is not None else traceparent
            if held is not None:
                outcomes[index] = SpawnDeferred(
                    "An earlier spawn of this dispatch_key or ordering key in the batch was not admitted, so this one "
                    "was not begun: nothing was written; send it again after that one.",
                    getattr(held, "retry_after_seconds", 1),
                    # A throttle's if the earlier spawn was throttled: the batch asks to slow down only then.
                    throttled=getattr(held, "throttled", False),
                )
                continue
            if remaining_ms() < MIN_REMAINING_MS:
                outcomes[index] = SpawnDeferred(
                    "The invocation has too little time left to admit this spawn: nothing was written; send it again.",
                    throttled=True,  # the invocation's capacity, not a failure: the earlier spawns took its time
                )
                continue
            try:
                outcomes[index] = admission.admit_run(
                    principal, tenant_id, requests[index], traceparent=_well_formed(trace), authorized=True
                )
            except Exception as error:
                outcomes[index] = error
                # Not a refusal of the spawn's own (422, 413, 400): unwritten, unknown, or unforeseen (500).
                if isinstance(error, StoreUnavailable | OutcomeUnknown) or not isinstance(error, AdmissionError):
                    held = error

    groups = _sequences(requests, batch.ordering_keys or [None] * len(batch.spawns))
    with contextlib.ExitStack() as connection:
        try:
            if groups:  # once for the batch, not once in each admitting thread (a fetch each, and a service model read)
                connection.enter_context(admission.connected())
        except StoreUnavailable as error:  # no credentials: no spawn can be sent, and each is answered so
            for index in requests:
                outcomes[index] = error
            groups = []
        if len(groups) > 1:
            list(_pool().map(admit_in_order, groups))
        elif groups:
            admit_in_order(groups[0])
    runs = [_admitted(outcome) if isinstance(outcome, Admitted) else "" for outcome in outcomes]
    # Room kept for each result from the next on: a new run's exact size (it was written: it is always answered).
    kept = [
        _size(text) if isinstance(outcome, Admitted) and not outcome.replayed else _RESERVED_RESULT_BYTES
        for outcome, text in zip(outcomes, runs, strict=True)
    ]
    room = ANSWER_BUDGET_BYTES - sum(kept)
    results = []
    for index, outcome in enumerate(outcomes):
        key = requests[index].dispatch_key if index in requests else None
        room += kept[index]
        if isinstance(outcome, Admitted):
            text = runs[index]
            if outcome.replayed and _size(text) > room:
                text = _refused(refusal(key, _answer_full()))
            else:
                admitted(key, outcome)
        else:
            answer = refusal(key, outcome or RuntimeError("spawn not admitted"))
            text = _refused(answer)
            if _size(text) > room and _wrote_nothing(answer):
                text = _refused(refusal(key, _answer_full()))
        room -= _size(text)
        results.append(text)
    return json_text({"results": [JSONText(text) for text in results]})


def _sequences(requests: Mapping[int, RunRequest], ordering_keys: list[str | None]) -> list[list[int]]:
    """The valid spawns (by index) in groups admitted one after another, each in the batch's order: spawns sharing
    a dispatch_key or an ordering key, and so on transitively (a spawn of key a and ordering key x, one of key b and
    ordering key x: one group); every other spawn a group of its own."""
    group_of = {index: index for index in requests}

    def root(index: int) -> int:
        while group_of[index] != index:
            group_of[index] = index = group_of[group_of[index]]
        return index

    first: dict[tuple[str, str], int] = {}
    for index, request in requests.items():
        for kind, value in (("dispatch_key", request.dispatch_key), ("ordering_key", ordering_keys[index])):
            if value is None:
                continue
            if (kind, value) in first:
                group_of[root(index)] = root(first[kind, value])
            else:
                first[kind, value] = index
    groups: dict[int, list[int]] = {}
    for index in sorted(requests):
        groups.setdefault(root(index), []).append(index)
    return list(groups.values())


@lru_cache(maxsize=1)
def _pool() -> ThreadPoolExecutor:
    """The admitting threads, started on a first batch (never before a SnapStart snapshot) and kept."""
    return ThreadPoolExecutor(max_workers=ADMITTING_THREADS, thread_name_prefix="admit")


def _request(spawn: Mapping[str, Any]) -> RunRequest:
    """The spawn as the single route's body: SpawnTooLarge, pydantic's ValidationError, or the request."""
    size = len(json_text(spawn).encode("utf-8", "surrogatepass"))
    if size > MAX_BODY_BYTES:
        raise SpawnTooLarge(size)
    return RunRequest.model_validate(spawn)


def _size(result: str) -> int:
    """The result's bytes at most in Lambda's response, a comma after it: the body is a JSON string there, its
    quotes and backslashes escaped (python3.12 and later keep other characters as UTF-8; earlier runtimes
    \\u-escape them, which json.dumps' count bounds too)."""
    return len(json.dumps(result)) + 1


def _wrote_nothing(answer: Refusal) -> bool:
    """Whether the refused spawn is known to have written nothing: a 4xx, or 503 store-unavailable."""
    return answer.status < 500 or (answer.status == 503 and json.loads(answer.problem).get("type") == STORE_UNAVAILABLE)


def _well_formed(traceparent: str | None) -> str | None:
    return traceparent if traceparent is not None and _TRACEPARENT.fullmatch(traceparent) else None


def _admitted(outcome: Admitted) -> str:
    status = 200 if outcome.replayed else 201
    return json_text({"status": status, "replayed": outcome.replayed, "run": JSONText(outcome.run.body)})


def _refused(answer: Refusal) -> str:
    """The spawn's result: its problem embedded as the single route answers it (json_text's text already)."""
    result: dict[str, Any] = {"status": answer.status, "problem": JSONText(answer.problem)}
    if answer.retry_after is not None:
        result["retry_after"] = int(answer.retry_after)
    return json_text(result)
