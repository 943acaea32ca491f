"""MSK event source mapping events, built the way Lambda delivers them (the local stand-in's output)."""

from __future__ import annotations

import base64
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

LOCAL_CLUSTER_ARN = "arn:aws:kafka:us-east-1:000000000000:cluster/poimen-local/00000000-0000-0000-0000-000000000000-1"


@dataclass(frozen=True)
class KafkaRecord:
    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    value: bytes | None  # None: a tombstone
    key: bytes | None = None
    headers: list[tuple[str, bytes]] = field(default_factory=list)
    timestamp_type: str = "CREATE_TIME"  # or LOG_APPEND_TIME


def msk_event(
    records: Iterable[KafkaRecord], bootstrap_servers: str = "127.0.0.1:9092", cluster_arn: str = LOCAL_CLUSTER_ARN
) -> dict[str, Any]:
    """`aws:kafka` event: records grouped under "<topic>-<partition>", key and value base64,
    each header a one-entry object of its byte values, timestamps in milliseconds. As Lambda does, a
    null key is left out and a null value (tombstone) is sent as null."""
    grouped: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        entry: dict[str, Any] = {
            "topic": record.topic,
            "partition": record.partition,
            "offset": record.offset,
            "timestamp": record.timestamp_ms,
            "timestampType": record.timestamp_type,
        }
        if record.key is not None:
            entry["key"] = base64.b64encode(record.key).decode("ascii")
        entry["value"] = None if record.value is None else base64.b64encode(record.value).decode("ascii")
        entry["headers"] = [{name: list(value)} for name, value in record.headers]
        grouped.setdefault(f"{record.topic}-{record.partition}", []).append(entry)
    return {
        "eventSource": "aws:kafka",
        "eventSourceArn": cluster_arn,
        "bootstrapServers": bootstrap_servers,
        "records": grouped,
    }
