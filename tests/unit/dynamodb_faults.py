"""Faults injected into the DynamoDB attempts botocore makes (in-process moto): per attempt, after retries
are decided, so botocore retries them as it would real ones. A write can be committed and then its answer
lost, which is what admission must never mistake for "nothing written"."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from botocore.awsrequest import AWSResponse, HTTPHeaders
from botocore.endpoint import Endpoint
from botocore.exceptions import ConnectTimeoutError, EndpointConnectionError, ReadTimeoutError
from botocore.retries.standard import ExponentialBackoff

from tests.conftest import count_runs

# An attempt's fault: given the call that sends it (to moto) and the request, what the attempt returns.
Fault = Callable[[Callable[[], Any], Any], Any]


def _timeout(request: Any) -> tuple[None, Exception]:
    return None, ReadTimeoutError(endpoint_url=request.url)


def committed_then_timed_out(send: Callable[[], Any], request: Any) -> Any:
    """DynamoDB wrote the item; its answer came after the read timeout."""
    send()
    return _timeout(request)


def lost_before_dynamodb(_: Callable[[], Any], request: Any) -> Any:
    """The request left, and its read timed out; DynamoDB never saw it."""
    return _timeout(request)


def connect_refused(_: Callable[[], Any], request: Any) -> Any:
    return None, EndpointConnectionError(endpoint_url=request.url)


def connect_timed_out(_: Callable[[], Any], request: Any) -> Any:
    return None, ConnectTimeoutError(endpoint_url=request.url)


def internal_server_error(_: Callable[[], Any], request: Any) -> Any:
    """DynamoDB's 500, the request not processed (or so it says: a 5xx does not tell)."""
    body = b'{"__type":"com.amazonaws.dynamodb.v20120810#InternalServerError","message":"injected"}'
    response = AWSResponse(request.url, 500, HTTPHeaders.from_dict({"x-amzn-requestid": "r"}), _Raw(body))
    parsed = {
        "Error": {"Code": "InternalServerError", "Message": "injected"},
        "ResponseMetadata": {"HTTPStatusCode": 500, "HTTPHeaders": {}},
    }
    return (response, parsed), None


def committed_then_500(send: Callable[[], Any], request: Any) -> Any:
    send()
    return internal_server_error(send, request)


def throttled(_: Callable[[], Any], request: Any) -> Any:
    body = b'{"__type":"com.amazonaws.dynamodb.v20120810#ThrottlingException","message":"injected"}'
    response = AWSResponse(request.url, 400, HTTPHeaders.from_dict({"x-amzn-requestid": "r"}), _Raw(body))
    parsed = {
        "Error": {"Code": "ThrottlingException", "Message": "injected"},
        "ResponseMetadata": {"HTTPStatusCode": 400, "HTTPHeaders": {}},
    }
    return (response, parsed), None


def replicated_write_conflict(_: Callable[[], Any], request: Any) -> Any:
    """An MRSC global table's answer while another Region writes the same item: refused, nothing written."""
    body = b'{"__type":"com.amazonaws.dynamodb.v20120810#ReplicatedWriteConflictException","message":"injected"}'
    response = AWSResponse(request.url, 409, HTTPHeaders.from_dict({"x-amzn-requestid": "r"}), _Raw(body))
    parsed = {
        "Error": {"Code": "ReplicatedWriteConflictException", "Message": "injected"},
        "ResponseMetadata": {"HTTPStatusCode": 409, "HTTPHeaders": {}},
    }
    return (response, parsed), None


class _Raw:
    def __init__(self, body: bytes) -> None:
        self._body = body

    def stream(self, **_: Any) -> Any:
        yield self._body


def _call_kind(operation: str, body: bytes) -> str:
    """put-run, put-fence, get-run or other: which DynamoDB call an attempt is."""
    params = json.loads(body or b"{}")
    if operation == "PutItem":
        return "put-fence" if "item_type" in params.get("Item", {}) else "put-run"
    if operation == "GetItem" and params.get("Key", {}).get("pk", {}).get("S", "").startswith("RUN#"):
        return "get-run"
    return "other"


def script_attempts(monkeypatch: pytest.MonkeyPatch, **faults: list[Fault]) -> dict[str, int]:
    """Script the attempts every botocore client makes, per kind of call (`put_run=[...]`, see _call_kind):
    each attempt of that kind takes the next fault of its list, later ones go through to moto. Returns
    the attempts seen per kind, as they happen. Retries wait nothing (botocore's backoff is zero here)."""
    monkeypatch.setattr(ExponentialBackoff, "delay_amount", lambda *_: 0.0)
    seen: dict[str, int] = {}
    original = Endpoint._do_get_response  # type: ignore[attr-defined]
    pending = {kind.replace("_", "-"): list(kind_faults) for kind, kind_faults in faults.items()}

    def attempt(endpoint: Endpoint, request: Any, operation_model: Any, context: Any) -> Any:
        kind = _call_kind(operation_model.name, request.body)
        seen[kind] = seen.get(kind, 0) + 1
        queue = pending.get(kind)
        if not queue:
            return original(endpoint, request, operation_model, context)
        return queue.pop(0)(lambda: original(endpoint, request, operation_model, context), request)

    monkeypatch.setattr(Endpoint, "_do_get_response", attempt)
    return seen


def only_for(marker: str, faults: list[Fault], attempts: int = 1000) -> list[Fault]:
    """`faults`, in turn, for the attempts whose request holds `marker` (a spawn's `"dispatch_key"`, say); every
    other attempt goes through. For spawns admitted concurrently (a batch), whose attempts come in any order."""
    mine = list(faults)

    def fault(send: Callable[[], Any], request: Any) -> Any:
        body = request.body if isinstance(request.body, bytes) else str(request.body or "").encode()
        if mine and marker.encode() in body:
            return mine.pop(0)(send, request)
        return send()

    return [fault] * attempts


def runs_and_fences(dynamodb: Any, table_name: str, tenant: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    items = count_runs(dynamodb, table_name, tenant)
    return [i for i in items if "item_type" not in i], [i for i in items if "item_type" in i]
