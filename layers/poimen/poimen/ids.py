"""Run identifiers: derived from (tenant, dispatch_key) for keyed spawns, time-ordered for the rest; and the
identifier of one admission of a run, its event's CloudEvents id."""

from __future__ import annotations

import hashlib
import os
import time
from decimal import Decimal
from json.encoder import encode_basestring
from typing import Any

_KEYED_RUN_ID_DOMAIN = b"poimen/run-id/v1\x00"
_ADMISSION_ID_DOMAIN = b"poimen/admission-id/v1\x00"


def keyed_run_id(tenant_id: str, dispatch_key: str) -> str:
    """The run id of a keyed spawn: a UUIDv8 from SHA-256 over (tenant, dispatch_key).

    A publisher can compute it before admission (the Kafka partition key needs it), and the
    conditional put on this id *is* the unique index on (tenant, dispatch_key). The NUL separator
    cannot occur in a tenant id, so no two (tenant, key) pairs hash the same input.
    """
    return _uuid8(_KEYED_RUN_ID_DOMAIN + tenant_id.encode() + b"\x00" + dispatch_key.encode("utf-8", "surrogatepass"))


def admission_id(run_id: str, attempt_id: str) -> str:
    """The id of one admission of a run (its event's CloudEvents `id`): a UUIDv8 from SHA-256 over (run id,
    the attempt id of the write that admitted it), both stored in the run's item.

    So every copy of an admission's event has it (a redelivery of the stream batch, a backfill, the outbox
    of every Region reading its replica of the item), and a re-admission, the same run id written again by
    another request once the first expired (run retention), has another: each write has its own attempt id
    (a uuid4; a retried PutItem of one request keeps it, and writes the same admission).
    """
    return _uuid8(_ADMISSION_ID_DOMAIN + run_id.encode() + b"\x00" + attempt_id.encode())


def _uuid8(data: bytes) -> str:
    """A UUIDv8 of the first 16 bytes of SHA-256(data)."""
    raw = bytearray(hashlib.sha256(data).digest()[:16])
    raw[6] = (raw[6] & 0x0F) | 0x80  # version 8: custom, RFC 9562
    raw[8] = (raw[8] & 0x3F) | 0x80  # RFC 9562 variant
    return _uuid_text(raw)


def unkeyed_run_id() -> str:
    """The run id of a keyless spawn: a UUIDv7, so ids sort by creation time."""
    return uuid7()


def uuid7() -> str:
    """A UUIDv7: millisecond timestamp then 74 random bits, so ids sort by creation time."""
    millis = time.time_ns() // 1_000_000
    raw = bytearray(millis.to_bytes(6, "big") + os.urandom(10))
    raw[6] = (raw[6] & 0x0F) | 0x70  # version 7
    raw[8] = (raw[8] & 0x3F) | 0x80
    return _uuid_text(raw)


def new_attempt_id() -> str:
    """A random id of one admission attempt: `uuid.uuid4().hex`, the same 32 hex digits (version 4, RFC 9562
    variant), without building a `uuid.UUID` on every admission."""
    raw = bytearray(os.urandom(16))
    raw[6] = (raw[6] & 0x0F) | 0x40  # version 4
    raw[8] = (raw[8] & 0x3F) | 0x80
    return raw.hex()


def _uuid_text(raw: bytes | bytearray) -> str:
    """`str(uuid.UUID(bytes=raw))` (8-4-4-4-12 lower-case hex digits), without building the UUID: admission
    makes one or two ids a request."""
    digits = raw.hex()
    return f"{digits[:8]}-{digits[8:12]}-{digits[12:16]}-{digits[16:20]}-{digits[20:]}"


def request_fingerprint(workflow_ref: str, run_input: dict[str, Any], goal_id: str | None) -> str:
    """SHA-256 of the canonical JSON of what a spawn asks for; key order inside `input` is irrelevant.

    Canonical: keys sorted, no whitespace, non-ASCII written out, and each number written from its exact
    decimal value (see `_number`), so `1`, `1.0` and `1e0` are one request and `0.1` and
    `0.1000000000000000055511151231257827` two. Inputs with no fraction, exponent or integer ending in
    zero keep the fingerprints computed before numbers were exact. Used only to tell a true replay from
    a reused dispatch_key, never to deduplicate.
    """
    canonical = (
        f'{{"goal_id":{"null" if goal_id is None else encode_basestring(goal_id)},'
        f'"input":{_canonical(run_input)},"workflow_ref":{encode_basestring(workflow_ref)}}}'
    )
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()


def _canonical(value: Any) -> str:
    if isinstance(value, str):
        return encode_basestring(value)
    if isinstance(value, dict):
        return "{" + ",".join(encode_basestring(key) + ":" + _canonical(value[key]) for key in sorted(value)) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_canonical(item) for item in value) + "]"
    if value is None or isinstance(value, bool):
        return _LITERALS[value]
    if isinstance(value, int):
        return _number(value < 0, str(abs(value)), 0)
    # A Decimal (a JSONNumber) as read; a float from a caller in-process as the JSON text it is sent as.
    sign, digits, exponent = (value if isinstance(value, Decimal) else Decimal(repr(value))).as_tuple()
    if not isinstance(exponent, int):  # NaN or Infinity, which JSON cannot hold
        raise ValueError(f"{value} is not a JSON number")
    return _number(bool(sign), "".join(map(str, digits)), exponent)


def _number(negative: bool, digits: str, exponent: int) -> str:
    """Sign, significant digits and exponent, trailing zeros moved into the exponent: one text per value.

    0 is "0" (as is -0), 1.5 is "15e-1", 100 is "1e2", 7 is "7". Never expanded into zeros, so 1e300
    stays short. (RFC 8785 writes numbers as IEEE-754 doubles do, which would make 12345678901234567.25
    and 12345678901234567.0 equal.)
    """
    significant = digits.rstrip("0")
    if not significant:
        return "0"
    exponent += len(digits) - len(significant)
    return ("-" if negative else "") + significant + (f"e{exponent}" if exponent else "")


_LITERALS = {None: "null", True: "true", False: "false"}
