"""Kafka naming shared by producers and consumers: the per-tenant topics and the partition key."""

from __future__ import annotations

import re

from poimen.wire import TENANT_PATTERN

_TENANT = TENANT_PATTERN.strip("^$")
_DISPATCH_TOPIC = re.compile(rf"^poimen\.(?P<tenant>{_TENANT})\.dispatch$")
# Every tenant's dispatch topic, as a librdkafka subscription pattern (a leading ^ marks a regex).
DISPATCH_TOPIC_PATTERN = rf"^poimen\.{_TENANT}\.dispatch$"


def dispatch_topic(tenant_id: str) -> str:
    return f"poimen.{tenant_id}.dispatch"


def events_topic(tenant_id: str) -> str:
    return f"poimen.{tenant_id}.events"


def tenant_of_dispatch_topic(topic: str) -> str | None:
    """The tenant a `poimen.<tenant>.dispatch` topic belongs to; None for any other name."""
    match = _DISPATCH_TOPIC.match(topic)
    return None if match is None else match["tenant"]


def partition_key(tenant_id: str, run_id: str) -> bytes:
    """The Kafka key of every record about one run, on `.dispatch` and `.events` alike.

    Byte format: UTF-8 of `<tenant_id>/<run_id>`, e.g. `acme/3d7b1368-cb64-8e4b-b3d9-a9f4d69125b4`. A
    tenant id cannot contain `/`, so the key splits unambiguously. Producers partition it with murmur2
    (Java's default; `DispatchPublisher` sets librdkafka's `murmur2_random` to match), so on topics with
    equal partition counts a run's dispatch and its events land on the same partition number.
    """
    return f"{tenant_id}/{run_id}".encode()
