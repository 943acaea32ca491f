"""The HTTP contract's names and limits: header names, id patterns, body limits. Without its models (those
are `poimen.contract`), so the relay and Kafka naming import them without loading pydantic, a third of
the relay's cold start.
"""

from __future__ import annotations

from datetime import UTC, datetime

TENANT_PATTERN = r"^[a-z0-9][a-z0-9-]{0,62}$"
# 1-255 characters, none of them a C0/C1 control character or DEL.
DISPATCH_KEY_PATTERN = r"^[^\x00-\x1f\x7f-\x9f]{1,255}$"
MAX_BODY_BYTES = 256 * 1024
# Levels of JSON nesting in a body, the body object being the first: deep enough for any real input,
# shallow enough that nothing which reads a run (the JSON stacks of Python, Powertools, pydantic, callers'
# parsers) ever meets its recursion limit.
MAX_JSON_DEPTH = 64
# Run ids are UUIDs (v8 when derived from a dispatch_key, v7 otherwise), lower-case as the API writes them.
RUN_ID_PATTERN = r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"
# W3C Trace Context: version-traceid-parentid-flags in lowercase hex; version ff and all-zero ids are invalid.
TRACEPARENT_PATTERN = r"^(?!ff)[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}$"

TENANT_HEADER = "X-Poimen-Tenant"
REPLAYED_HEADER = "Idempotent-Replayed"
# The dispatch_key as a header (RFC 8941 string, or the key itself unquoted): poimen.contract.idempotency_key.
IDEMPOTENCY_KEY_HEADER = "Idempotency-Key"


def rfc3339(moment: datetime | None = None) -> str:
    """`moment` (now if None) as the API writes times (`created_at`): RFC 3339, UTC, milliseconds, `Z`."""
    return (moment or datetime.now(UTC)).astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
