"""Kafka naming shared by producers and consumers: the per-tenant topics and the partition key.

A tenant id is what `poimen.wire.TENANT_PATTERN` allows, the one rule the API (its header), topic names
(so the relay's subscription), publishers and the CLI all apply: `is_tenant_id` here.
"""

from __future__ import annotations

import re

from poimen.wire import TENANT_PATTERN

_TENANT = TENANT_PATTERN.strip("^$")
_TENANT_ID = re.compile(_TENANT)
_DISPATCH_TOPIC = re.compile(rf"poimen\.(?P<tenant>{_TENANT})\.dispatch")
# Every tenant's dispatch topic, as a librdkafka subscription pattern (a leading ^ marks a regex).
DISPATCH_TOPIC_PATTERN = rf"^poimen\.{_TENANT}\.dispatch$"


class InvalidTenant(ValueError):
    """Not a tenant id: no topic is named for it, and the API refuses it."""

    def __init__(self, tenant_id: str) -> None:
        super().__init__(f"{tenant_id!r} is not a tenant id ({TENANT_PATTERN})")
        self.tenant_id = tenant_id


def is_tenant_id(value: str) -> bool:
    # fullmatch: `$` alone would also match before a trailing newline.
    return _TENANT_ID.fullmatch(value) is not None


def dispatch_topic(tenant_id: str) -> str:
    """`poimen.<tenant>.dispatch`; InvalidTenant for what is not a tenant id."""
    return f"poimen.{_checked(tenant_id)}.dispatch"


def events_topic(tenant_id: str) -> str:
    """`poimen.<tenant>.events`; InvalidTenant for what is not a tenant id."""
    return f"poimen.{_checked(tenant_id)}.events"


def tenant_of_dispatch_topic(topic: str) -> str | None:
    """The tenant a `poimen.<tenant>.dispatch` topic belongs to; None for any other name."""
    match = _DISPATCH_TOPIC.fullmatch(topic)
    return None if match is None else match["tenant"]


def partition_key(tenant_id: str, run_id: str) -> bytes:
    """The Kafka key of every record about one run, on `.dispatch` and `.events` alike.

    Byte format: UTF-8 of `<tenant_id>/<run_id>`, e.g. `acme/3d7b1368-cb64-8e4b-b3d9-a9f4d69125b4`. A
    tenant id cannot contain `/`, so the key splits unambiguously. Producers partition it with murmur2
    (Java's default; `DispatchPublisher` sets librdkafka's `murmur2_random` to match), so on topics with
    equal partition counts a run's dispatch and its events land on the same partition number.
    """
    return f"{tenant_id}/{run_id}".encode()


def _checked(tenant_id: str) -> str:
    if not is_tenant_id(tenant_id):
        raise InvalidTenant(tenant_id)
    return tenant_id
