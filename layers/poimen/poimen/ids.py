"""Run identifiers: derived from (tenant, dispatch_key) for keyed spawns, time-ordered for the rest."""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from typing import Any

_KEYED_RUN_ID_DOMAIN = b"poimen/run-id/v1\x00"


def keyed_run_id(tenant_id: str, dispatch_key: str) -> str:
    """The run id of a keyed spawn: a UUIDv8 from SHA-256 over (tenant, dispatch_key).

    A publisher can compute it before admission (the Kafka partition key needs it), and the
    conditional put on this id *is* the unique index on (tenant, dispatch_key). The NUL separator
    cannot occur in a tenant id, so no two (tenant, key) pairs hash the same input.
    """
    digest = hashlib.sha256(
        _KEYED_RUN_ID_DOMAIN + tenant_id.encode() + b"\x00" + dispatch_key.encode("utf-8", "surrogatepass")
    ).digest()
    raw = bytearray(digest[:16])
    raw[6] = (raw[6] & 0x0F) | 0x80  # version 8: custom, RFC 9562
    raw[8] = (raw[8] & 0x3F) | 0x80  # RFC 9562 variant
    return str(uuid.UUID(bytes=bytes(raw)))


def unkeyed_run_id() -> str:
    """A UUIDv7: millisecond timestamp then 74 random bits, so ids sort by creation time."""
    millis = time.time_ns() // 1_000_000
    raw = bytearray(millis.to_bytes(6, "big") + os.urandom(10))
    raw[6] = (raw[6] & 0x0F) | 0x70  # version 7
    raw[8] = (raw[8] & 0x3F) | 0x80
    return str(uuid.UUID(bytes=bytes(raw)))


def request_fingerprint(workflow_ref: str, run_input: dict[str, Any], goal_id: str | None) -> str:
    """SHA-256 of the canonical JSON of what a spawn asks for; key order inside `input` is irrelevant.

    Used only to tell a true replay from a reused dispatch_key, never to deduplicate.
    """
    canonical = json.dumps(
        {"workflow_ref": workflow_ref, "input": run_input, "goal_id": goal_id},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()
