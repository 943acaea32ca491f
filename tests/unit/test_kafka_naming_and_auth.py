"""Kafka naming, the partition key, and MSK IAM client settings (offline, static credentials)."""

from __future__ import annotations

import base64
import time
from urllib.parse import parse_qs, urlparse

from botocore.credentials import CredentialProvider, Credentials

from poimen.ids import keyed_run_id
from poimen.kafka import events_topic, partition_key
from poimen.kafka_client import client_config, msk_iam_token_callback


class _Static(CredentialProvider):
    METHOD = "static"

    def load(self) -> Credentials:
        return Credentials("AKIDEXAMPLE", "secret", "session-token")


def test_partition_key_is_tenant_slash_run_id_in_utf8() -> None:
    run_id = keyed_run_id("acme", "order-42")

    assert partition_key("acme", run_id) == f"acme/{run_id}".encode()
    assert events_topic("acme") == "poimen.acme.events"


def test_msk_iam_callback_returns_a_signed_token_and_its_expiry_in_seconds() -> None:
    oauth_cb = msk_iam_token_callback("eu-west-1", _Static())

    token, expiry = oauth_cb(None)

    url = urlparse(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode())
    query = parse_qs(url.query)
    assert url.hostname == "kafka.eu-west-1.amazonaws.com"
    assert query["Action"] == ["kafka-cluster:Connect"]
    assert query["X-Amz-Credential"][0].startswith("AKIDEXAMPLE/")
    assert query["X-Amz-Security-Token"] == ["session-token"]
    assert time.time() < expiry < time.time() + 3 * 3600  # seconds since the epoch, not milliseconds


def test_client_config_plaintext_locally_and_iam_for_msk() -> None:
    assert client_config("127.0.0.1:9092") == {"bootstrap.servers": "127.0.0.1:9092"}

    iam = client_config("b-1.msk:9098", "us-east-1", **{"acks": "all"})

    assert iam["security.protocol"] == "SASL_SSL"
    assert iam["sasl.mechanism"] == "OAUTHBEARER"
    assert callable(iam["oauth_cb"])
    assert iam["acks"] == "all"


def test_published_values_keep_numbers_exactly_as_given() -> None:
    from poimen.contract import RunRequest, parse_json
    from poimen.dispatch import DispatchPublisher

    produced: list[bytes] = []

    class Recorder:
        def produce(self, topic: str, key: bytes, value: bytes, on_delivery: object) -> None:
            produced.append(value)

        def poll(self, timeout: float) -> int:
            return 0

    publisher = DispatchPublisher("127.0.0.1:1")
    publisher._producer = Recorder()  # type: ignore[assignment]
    spawn = RunRequest(workflow_ref="wf", input=parse_json('{"n": 12345678901234567.25, "e": 1e15}'), dispatch_key="k")

    publisher.publish("acme", spawn)

    assert produced == [
        b'{"workflow_ref":"wf","input":{"n":12345678901234567.25,"e":1e15},"goal_id":null,"dispatch_key":"k"}'
    ]
