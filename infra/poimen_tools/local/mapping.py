"""What the local event source mappings share (poimen_tools.local.event_source for MSK, .stream_source for the
DynamoDB stream), as Lambda's mappings do: a polling thread, the invocation of the function with retries and
exponential backoff, and, once the attempts are spent, the on-failure destination: the invocation record
Lambda writes to an S3 destination, parked under a key of Lambda's shape. A mapping without bounded retries
(`max_attempts` None: an MSK mapping with on-demand event pollers) retries a failing batch until it is handled,
its backoff capped at MAX_RETRY_DELAY_SECONDS, and parks nothing.
"""

from __future__ import annotations

import abc
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from poimen import on_failure
from poimen_tools.local.devserver import LambdaHandler, LocalLambdaContext

log = logging.getLogger(__name__)
# The longest wait between two tries of a batch retried until it is handled (max_attempts None).
MAX_RETRY_DELAY_SECONDS = 30.0
OnFailure = Callable[[dict[str, Any]], None]
Handler = LambdaHandler | Callable[[dict[str, Any], Any], Any]


class LocalMapping(abc.ABC):
    """A mapping's thread (`_run`, polling until `_stop` is set) and its invocation of the function."""

    def __init__(
        self,
        handler: Handler,
        on_failure: OnFailure,
        *,
        function_name: str,
        max_attempts: int | None,
        retry_base_seconds: float,
        function_timeout_seconds: float,
    ) -> None:
        self._handler = handler
        self._on_failure = on_failure
        self._function_name = function_name
        self._max_attempts = max_attempts
        self._retry_base = retry_base_seconds
        self._timeout = function_timeout_seconds
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError(f"the event source of {self._function_name} is already running")
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=f"local-mapping-{self._function_name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    @abc.abstractmethod
    def _run(self) -> None:
        """The mapping's polling loop, on the thread, until `_stop` is set."""

    def _deliver(self, event: dict[str, Any], on_failure_record: Callable[[int], dict[str, Any]]) -> bool:
        """True once the batch is handled: by the function, or, after `max_attempts` failures, sent to the
        on-failure destination as `on_failure_record(attempts)` (never, when `max_attempts` is None: retried until
        the function handles it). False: stopping before it began (a batch left waiting for an execution
        environment is not invoked once its owner is asked to stop) or while it still fails."""
        if self._stop.is_set():
            return False
        limit = self._max_attempts
        attempt = 0
        while limit is None or attempt < limit:
            attempt += 1
            try:
                self._handler(event, LocalLambdaContext(self._function_name, timeout_seconds=self._timeout))
                return True
            except Exception as error:  # the function failed: retry the same batch, as the mapping does
                of = "until handled" if limit is None else str(limit)
                log.warning("%s invocation %d/%s failed: %s", self._function_name, attempt, of, error)
            delay = min(MAX_RETRY_DELAY_SECONDS, self._retry_base * 2 ** min(attempt - 1, 30))
            if (limit is None or attempt < limit) and self._stop.wait(delay):
                return False
        self._on_failure(on_failure_record(attempt))
        return True


def invocation_record(function_name: str, attempts: int) -> dict[str, Any]:
    """The part every on-failure invocation record has, whatever the source: the failed invocation's context
    (poimen.on_failure), for a local function. The source's batch information and `payload` follow it."""
    return on_failure.invocation_record(f"arn:aws:lambda:local:000000000000:function:{function_name}", attempts)


def parked_batch_key(mapping_id: str, source: str) -> str:
    """An S3 key for a parked batch, after Lambda's `aws/lambda/<mapping>/<source>/YYYY/MM/DD/<time>-<id>`."""
    return on_failure.object_key(f"aws/lambda/{mapping_id}/{source}")


def park_in_s3(s3: Any, bucket: str, key: Callable[[dict[str, Any]], str]) -> OnFailure:
    """The S3 on-failure destination: each record stored as JSON in `bucket` under `key(record)`."""
    return lambda record: s3.put_object(Bucket=bucket, Key=key(record), Body=json.dumps(record).encode())
