"""Kafka naming shared by producers and consumers: the per-tenant topics and the partition key.

A tenant id is what `poimen.wire.TENANT_PATTERN` allows, the one rule the API (its header), topic names
(so the relay's subscription), publishers and the CLI all apply: `is_tenant_id` here.

A tenant's dispatch topic is `poimen.<tenant>.dispatch`, or in a multi-Region deployment also its replica
from another Region's cluster, `<alias>.poimen.<tenant>.dispatch` (MirrorMaker 2's default replication
policy prefixes the source cluster's alias). One hop only: an alias has no dot, so a name with two
prefixes (a topic replicated back and forth) is no dispatch topic.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from poimen.wire import TENANT_PATTERN

_TENANT = TENANT_PATTERN.strip("^$")
_TENANT_ID = re.compile(_TENANT)
# A source cluster's alias in replicated topic names (MirrorMaker 2 `clusters`, MSK Replicator's prefix).
CLUSTER_ALIAS_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
_ALIAS = CLUSTER_ALIAS_PATTERN.strip("^$")
_CLUSTER_ALIAS = re.compile(_ALIAS)
_DISPATCH_TOPIC = re.compile(rf"(?:(?P<alias>{_ALIAS})\.)?poimen\.(?P<tenant>{_TENANT})\.dispatch")
# Every tenant's dispatch topic, local or replicated, as a librdkafka subscription pattern (a leading ^
# marks a regex). A plain group, no `(?:`: librdkafka may compile it as a POSIX extended regex.
DISPATCH_TOPIC_PATTERN = rf"^({_ALIAS}\.)?poimen\.{_TENANT}\.dispatch$"


def dispatch_topics_pattern(tenants: Iterable[str]) -> str:
    """The dispatch topics of `tenants` only, local or replicated, as a librdkafka subscription pattern:
    what one event source mapping per tenant topic consumes (InvalidTenant for what is not a tenant id)."""
    names = "|".join(_checked(tenant) for tenant in sorted(tenants))
    return rf"^({_ALIAS}\.)?poimen\.({names})\.dispatch$"


class InvalidTenant(ValueError):
    """Not a tenant id: no topic is named for it, and the API refuses it."""

    def __init__(self, tenant_id: str) -> None:
        super().__init__(f"{tenant_id!r} is not a tenant id ({TENANT_PATTERN})")
        self.tenant_id = tenant_id


class InvalidClusterAlias(ValueError):
    """Not a cluster alias: no replicated topic is named for it."""

    def __init__(self, alias: str) -> None:
        super().__init__(f"{alias!r} is not a cluster alias ({CLUSTER_ALIAS_PATTERN})")
        self.alias = alias


def is_tenant_id(value: str) -> bool:
    # fullmatch: `$` alone would also match before a trailing newline.
    return _TENANT_ID.fullmatch(value) is not None


def dispatch_topic(tenant_id: str) -> str:
    """`poimen.<tenant>.dispatch`; InvalidTenant for what is not a tenant id."""
    return f"poimen.{_checked(tenant_id)}.dispatch"


def events_topic(tenant_id: str) -> str:
    """`poimen.<tenant>.events`; InvalidTenant for what is not a tenant id."""
    return f"poimen.{_checked(tenant_id)}.events"


def replicated_dispatch_topic(alias: str, tenant_id: str) -> str:
    """`<alias>.poimen.<tenant>.dispatch`, the replica of a tenant's dispatch topic from the cluster `alias`;
    InvalidClusterAlias or InvalidTenant for what is not one."""
    if _CLUSTER_ALIAS.fullmatch(alias) is None:
        raise InvalidClusterAlias(alias)
    return f"{alias}.{dispatch_topic(tenant_id)}"


def tenant_of_dispatch_topic(topic: str) -> str | None:
    """The tenant a dispatch topic (`poimen.<tenant>.dispatch` or `<alias>.poimen.<tenant>.dispatch`)
    belongs to; None for any other name."""
    match = _DISPATCH_TOPIC.fullmatch(topic)
    return None if match is None else match["tenant"]


def source_alias_of_dispatch_topic(topic: str) -> str | None:
    """The alias of the cluster a replicated dispatch topic comes from; None for a local dispatch topic
    (and for any name that is no dispatch topic: see tenant_of_dispatch_topic)."""
    match = _DISPATCH_TOPIC.fullmatch(topic)
    return None if match is None else match["alias"]


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
