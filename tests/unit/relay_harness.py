"""The relay in-process: its HTTP calls answered by the admission handler (no socket), its dead letters
sent to a moto queue made from template.yaml. What `poimen dev` does over loopback, in one process."""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import boto3
import urllib3
from aws_lambda_powertools.utilities.data_classes import KafkaEvent
from botocore.credentials import Credentials

from poimen.config import RelaySettings
from poimen.relay import BatchOutcome, Relay
from poimen.retention import RunRetention
from poimen.store import Store
from poimen.wire import SPAWNS_MEDIA_TYPE
from poimen_tools.local.devserver import LocalLambdaContext, http_api_event, http_response
from poimen_tools.local.msk import KafkaRecord, msk_event
from poimen_tools.local.sigv4 import Principal, verify
from poimen_tools.local.template import Template

RELAY_ROLE = "arn:aws:iam::123456789012:role/poimen-relay"
RELAY_KEY = Principal("AKIDRELAY", "relay-secret", RELAY_ROLE, ("*",))


class InProcessApi(urllib3.PoolManager):
    """The admission API as the relay's HTTP pool: each request is checked as http.client checks it
    before sending, authenticated (SigV4) as API Gateway does, then handed to the admission handler."""

    def __init__(self, handler: Callable[[dict[str, Any], Any], dict[str, Any]]) -> None:
        super().__init__()
        self._handler = handler
        # One execution environment: Powertools keeps the current event on the resolver.
        self._lock = threading.Lock()
        self.received: list[dict[str, str]] = []
        self.forwarded: list[str | None] = []  # each spawn's traceparent as received, alone or in a batch
        self.routes: list[str] = []  # the route key API Gateway matched for each request
        self.bodies: list[bytes] = []  # each batch's body, as received
        self.principals = {RELAY_KEY.access_key: RELAY_KEY}  # whose signatures it accepts

    # PoolManager's own signature, which narrows RequestMethods' as urllib3 itself declares it.
    def urlopen(self, method: str, url: str, redirect: bool = True, **kw: Any) -> urllib3.BaseHTTPResponse:  # type: ignore[override]
        target = urlsplit(url)
        headers = [("Host", target.netloc), *dict(kw["headers"]).items()]
        outgoing = http.client.HTTPConnection(target.netloc)  # never connected: it only checks the headers
        outgoing.putrequest(method, target.path, skip_host=True)
        for name, value in headers:
            outgoing.putheader(name, value)
        body: bytes = kw.get("body") or b""
        principal = verify(self.principals, method, target.path, headers, body)
        event = http_api_event(
            method=method,
            target=target.path,
            headers=headers,
            body=body,
            principal_arn=principal.arn,
            source_ip="127.0.0.1",
            route_key=f"{method} {target.path}",
        )
        with self._lock:
            self.received.append({name.lower(): value for name, value in headers})
            self.forwarded.extend(_traceparents(self.received[-1], body))
            self.routes.append(event["routeKey"])
            if self.received[-1].get("content-type") == SPAWNS_MEDIA_TYPE:
                self.bodies.append(body)
            # A minute, not the function's 13 s: a batch starts no spawn with less than 8.5 s left (poimen.batch),
            # and on a loaded test machine an in-process batch of moto writes can take that long; what the
            # guard does is tested on its own (tests/unit/test_spawn_batch.py).
            answer = self._handler(event, LocalLambdaContext("AdmissionFunction", timeout_seconds=60))
        status, answer_headers, payload = http_response(answer)
        return urllib3.HTTPResponse(body=payload, status=status, headers=dict(answer_headers), preload_content=True)


def _traceparents(headers: dict[str, str], body: bytes) -> list[str | None]:
    """The traceparent of each spawn of the request: the header's, or in a batch each spawn's own if it has one."""
    if headers.get("content-type") != SPAWNS_MEDIA_TYPE:
        return [headers.get("traceparent")]
    batch = json.loads(body)
    own = batch.get("traceparents") or [None] * len(batch["spawns"])
    return [traceparent or headers.get("traceparent") for traceparent in own]


def sqs_message_size(body: str, attributes: dict[str, Any]) -> int:
    """A message's size as SQS limits it: the body's bytes and each attribute's name, type and value."""
    size = len(body.encode())
    for name, attribute in attributes.items():
        size += len(name.encode()) + len(attribute["DataType"].encode()) + len(attribute["StringValue"].encode())
    return size


@dataclass
class RelayHarness:
    relay: Relay
    api: InProcessApi
    sqs: Any
    queue_url: str
    tenant: str

    @classmethod
    def start(
        cls,
        template: Template,
        handler: Callable[[dict[str, Any], Any], dict[str, Any]],
        store: Store,
        sqs: Any | None = None,
        run_retention_days: int | None = None,
    ) -> RelayHarness:
        """Inside mock_aws: a fresh DLQ, the relay's role granted every tenant, and the test's own tenant, the
        first the `dynamodb` fixture has the stack serve (tests/unit/conftest.py)."""
        store.grant(RELAY_ROLE, "*")
        queue_client = boto3.client("sqs")
        request = template.create_queue_request("RelayDeadLetterQueue", f"dlq-{uuid.uuid4().hex[:8]}")
        queue_url: str = queue_client.create_queue(**request)["QueueUrl"]
        api = InProcessApi(handler)
        settings = RelaySettings(
            admission_api_url="https://api.example",
            dlq_url=queue_url,
            region="us-east-1",
            run_retention=RunRetention(run_retention_days),
        )
        credentials = Credentials(RELAY_KEY.access_key, RELAY_KEY.secret_key)
        relay = Relay(settings, sqs=sqs or queue_client, http=api, credentials=credentials)
        return cls(relay, api, queue_client, queue_url, os.environ["TENANTS"].split(",")[0])

    def with_settings(self, **changes: Any) -> RelayHarness:
        """The same queue, API and tenant, relayed by a relay with these settings changed."""
        settings = dataclasses.replace(self.relay._settings, **changes)
        credentials = Credentials(RELAY_KEY.access_key, RELAY_KEY.secret_key)
        relay = Relay(settings, sqs=self.sqs, http=self.api, credentials=credentials)
        return dataclasses.replace(self, relay=relay)

    def with_environment(self, environment: dict[str, str]) -> RelayHarness:
        """The same queue, API and tenant, relayed by a relay configured from these variables (a function's
        environment as template.yaml sets it), pointed at this harness's API and queue."""
        pointed = {"ADMISSION_API_URL": "https://api.example", "DLQ_URL": self.queue_url, "AWS_REGION": "us-east-1"}
        settings = RelaySettings.from_env({**environment, **pointed})
        credentials = Credentials(RELAY_KEY.access_key, RELAY_KEY.secret_key)
        return dataclasses.replace(self, relay=Relay(settings, sqs=self.sqs, http=self.api, credentials=credentials))

    def run(self, records: list[KafkaRecord], seconds: float = 60) -> BatchOutcome:
        """One invocation of these records with `seconds` left; raises as the handler would."""
        return self.run_event(msk_event(records), seconds)

    def run_event(self, event: dict[str, Any], seconds: float = 60) -> BatchOutcome:
        outcome = BatchOutcome()
        deadline = time.monotonic() + seconds
        self.relay.relay_batch(KafkaEvent(event), lambda: int((deadline - time.monotonic()) * 1000), outcome)
        return outcome

    def dead_letters(self) -> list[tuple[int, dict[str, Any]]]:
        """(size in bytes as SQS counts it: body and attributes, letter) of every message in the DLQ, consumed."""
        return [
            (sqs_message_size(message["Body"], message.get("MessageAttributes", {})), json.loads(message["Body"]))
            for message in self.dead_letter_messages()
        ]

    def dead_letter_messages(self) -> list[dict[str, Any]]:
        """Every message in the DLQ with its message attributes, consumed."""
        received: list[dict[str, Any]] = []
        while True:
            batch = self.sqs.receive_message(
                QueueUrl=self.queue_url, MaxNumberOfMessages=10, MessageAttributeNames=["All"]
            )
            messages = batch.get("Messages", [])
            if not messages:
                return received
            for message in messages:
                received.append(message)
                self.sqs.delete_message(QueueUrl=self.queue_url, ReceiptHandle=message["ReceiptHandle"])

    def record(self, value: Any, offset: int, key: bytes | None = None, **changes: Any) -> KafkaRecord:
        """A record of this tenant's dispatch topic; `value` JSON-encoded unless bytes or None."""
        encoded = value if value is None or isinstance(value, bytes) else json.dumps(value).encode()
        fields: dict[str, Any] = {
            "topic": f"poimen.{self.tenant}.dispatch",
            "partition": 0,
            "offset": offset,
            "timestamp_ms": -1,  # Kafka's NO_TIMESTAMP: no age, under any run retention
            "value": encoded,
            "key": key,
            **changes,
        }
        return KafkaRecord(**fields)
