"""Kafka naming shared by producers and consumers: the per-tenant topics."""

from __future__ import annotations

import re

from poimen.contract import TENANT_PATTERN

_DISPATCH_TOPIC = re.compile(rf"^poimen\.(?P<tenant>{TENANT_PATTERN.strip('^$')})\.dispatch$")


def dispatch_topic(tenant_id: str) -> str:
    return f"poimen.{tenant_id}.dispatch"


def tenant_of_dispatch_topic(topic: str) -> str | None:
    """The tenant a `poimen.<tenant>.dispatch` topic belongs to; None for any other name."""
    match = _DISPATCH_TOPIC.match(topic)
    return None if match is None else match["tenant"]
