"""An embedded moto server on loopback: the local AWS (DynamoDB, SQS) reached over HTTP.

moto is imported by what starts or patches it, not with this module: every `poimen` command imports it (through
poimen_tools.local.dev), and only `poimen dev` runs moto; importing it took about a quarter of each other
command's start.
"""

from __future__ import annotations

import functools
import logging
import threading
from types import TracebackType
from typing import Any

_WRITE_OPERATIONS = ("put_item", "update_item", "delete_item", "transact_write_items", "batch_write_item")
_write_lock = threading.RLock()


def serialise_dynamodb_writes() -> None:
    """Make moto's item writes atomic, as DynamoDB's are.

    moto evaluates a ConditionExpression and then stores the item with no lock in between, so two
    threads can both pass `attribute_not_exists`: check-then-insert inside the stand-in. Real
    DynamoDB never does that, and the concurrent-redelivery tests exist to prove our side of it.
    """
    from moto.dynamodb.models import DynamoDBBackend

    for name in _WRITE_OPERATIONS:
        original = getattr(DynamoDBBackend, name)
        if getattr(original, "_poimen_serialised", False):
            continue
        setattr(DynamoDBBackend, name, _locked(original))


def _locked(operation: Any) -> Any:
    @functools.wraps(operation)
    def locked(*args: Any, **kwargs: Any) -> Any:
        with _write_lock:
            return operation(*args, **kwargs)

    locked._poimen_serialised = True  # type: ignore[attr-defined]
    return locked


class EmbeddedMoto:
    """moto server in a thread of this process: `with EmbeddedMoto() as moto: moto.endpoint`."""

    def __init__(self, port: int = 0) -> None:
        from moto.server import ThreadedMotoServer

        serialise_dynamodb_writes()
        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no access log line per AWS call
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)

    def __enter__(self) -> EmbeddedMoto:
        self._server.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._server.stop()

    @property
    def endpoint(self) -> str:
        host, port = self._server.get_host_and_port()
        return f"http://{host}:{port}"
