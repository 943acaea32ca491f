"""Kafka naming shared by producers and consumers: the per-tenant topics and the partition key."""

from __future__ import annotations

import re

from poimen.contract import TENANT_PATTERN

_DISPATCH_TOPIC = re.compile(rf"^poimen\.(?P<tenant>{TENANT_PATTERN.strip('^$')})\.dispatch$")
# Every tenant's dispatch topic, as a librdkafka subscription pattern.
DISPATCH_TOPIC_PATTERN = r"^poimen\.[a-z0-9][a-z0-9-]{0,62}\.dispatch$"


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
    tenant id cannot contain `/`, so the key splits unambiguously; the default partitioner (murmur2 of
    these bytes) sends a run's dispatch and its events to the same partition number.
    """
    return f"{tenant_id}/{run_id}".encode()
