"""One rule for what a dispatch record may become: a spawn to POST to /v1/runs (its value verbatim, for the
tenant of its topic), or a dead letter with its reason. The inbox relay judges each record it is delivered
with it, and `poimen dlq redrive` judges each record again with it before sending it, so that a redrive
never admits what the relay refuses.

Standard library only (no pydantic: the relay's cold start); records are the mappings MSK delivers.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from poimen.dead_letter import INVALID_TOPIC_DETAIL, DeadLetterReason, age_text
from poimen.kafka import source_alias_of_dispatch_topic, tenant_of_dispatch_topic
from poimen.retention import RunRetention
from poimen.wire import TRACEPARENT_PATTERN

_TRACEPARENT = re.compile(TRACEPARENT_PATTERN)
# The admission API's answers that are worth sending again (with a dispatch_key: it can only admit or replay
# that run); and the answers that blame the record itself, which is dead-lettered as `rejected`. Any other
# refusal (401, 403, 404, 405, 3xx, ...) says the caller or the API is misconfigured, which every record
# would hit alike: the relay fails the batch, redrive stops, and a fix lets the same records through.
RETRYABLE_STATUSES = frozenset({408, 429}) | frozenset(range(500, 600))
RECORD_FAULT_STATUSES = frozenset({400, 413, 415, 422})
# How far a record's timestamp may be ahead of the relay's clock and still be trusted, under a run retention:
# clocks disagree a little, and a dispatch topic declared with message.timestamp.type=LogAppendTime carries
# the broker's time, but a publisher's CreateTime can be anything. Past it the record is dead-lettered as
# `future-timestamp`; within it, the record is held to its retention as if this much older, so that a
# timestamp ahead of the truth by up to the skew never makes a record past its run's expiry look young.
MAX_CLOCK_SKEW_MS = 5 * 60 * 1000


@dataclass(frozen=True)
class Spawn:
    """A record whose value is a spawn request for the tenant of its topic."""

    tenant: str
    body: bytes  # the value, sent verbatim
    fields: dict[str, Any]  # the value, parsed
    timestamp_ms: int | None  # the record's Kafka timestamp; None for a record without one (-1)
    traceparent: str | None  # its traceparent header, if well-formed W3C Trace Context

    @property
    def dispatch_key(self) -> Any:
        """The spawn's own dispatch_key (None: the publisher set none)."""
        return self.fields.get("dispatch_key")


@dataclass(frozen=True)
class HeldBack:
    """A spawn the relay does not admit, dead-lettered with `reason`: still a spawn, which an operator may
    redrive when asking for its kind by name."""

    spawn: Spawn
    reason: DeadLetterReason


Verdict = Spawn | HeldBack | DeadLetterReason


def judge(
    record: Mapping[str, Any], now_ms: float, *retentions: RunRetention, seen_by_ms: float | None = None
) -> Verdict:
    """What the record may become at `now_ms`, held to the shortest of these run retentions: a Spawn to admit,
    a HeldBack spawn, or why it is no spawn at all. `seen_by_ms`: a time by which the record is known to have
    existed (redrive's: when its letter was dead-lettered, or its batch failed); its age is then the older of
    that and its timestamp, since a record is never younger than its letter, whatever its timestamp says."""
    spawn = read_spawn(record)
    if isinstance(spawn, DeadLetterReason):
        return spawn
    held = _held_back(spawn, str(record.get("topic")), now_ms, retentions, seen_by_ms)
    return spawn if held is None else HeldBack(spawn, held)


def read_spawn(record: Mapping[str, Any]) -> Spawn | DeadLetterReason:
    """The spawn the record's value holds for the tenant of its topic, or why it holds none."""
    tenant = tenant_of_dispatch_topic(str(record.get("topic")))
    if tenant is None:
        return DeadLetterReason("invalid-topic", INVALID_TOPIC_DETAIL)
    value = record.get("value")
    if value is None:  # a tombstone: Kafka's null value
        return DeadLetterReason("empty-value", "the record has no value")
    try:
        body = base64.b64decode(value, validate=True)
        fields = json.loads(body.decode("utf-8"))
    except (binascii.Error, TypeError) as error:
        return DeadLetterReason("undecodable", f"value is not base64: {error}")
    except UnicodeDecodeError as error:
        return DeadLetterReason("undecodable", f"value is not UTF-8: {error}")
    except (ValueError, RecursionError) as error:
        return DeadLetterReason("invalid-json", f"value is not JSON: {error}")
    if not isinstance(fields, dict):
        return DeadLetterReason("invalid-json", "value is not a JSON object")
    return Spawn(tenant, body, fields, record_timestamp_ms(record), traceparent(record))


def _held_back(
    spawn: Spawn, topic: str, now_ms: float, retentions: tuple[RunRetention, ...], seen_by_ms: float | None
) -> DeadLetterReason | None:
    timestamp_ms = spawn.timestamp_ms
    born_ms = _oldest(timestamp_ms, seen_by_ms)  # the record existed by then at the latest
    holding = _holding(retentions, born_ms)
    if born_ms is not None and holding is not None:
        if holding.expired(born_ms - MAX_CLOCK_SKEW_MS, now_ms):
            since = "" if born_ms == timestamp_ms else " (dead-lettered, or its batch failed, that long ago)"
            detail = (
                f"the record is {age_text(now_ms - born_ms)} old{since}, older than {holding.describe(born_ms)}: "
                "its run may have expired, and admitting it again would be a second run"
            )
            return DeadLetterReason("expired", detail)
        if timestamp_ms is not None and timestamp_ms > now_ms + MAX_CLOCK_SKEW_MS:
            detail = (
                f"the record's timestamp is {age_text(timestamp_ms - now_ms)} ahead of the relay's clock (more than "
                f"the {age_text(MAX_CLOCK_SKEW_MS)} of skew allowed): its age, held to "
                f"{holding.describe(born_ms)}, cannot be told, and trusting it could admit a spawn again after "
                "its run expired; fix the publisher's clock, or declare the topic with "
                "message.timestamp.type=LogAppendTime"
            )
            return DeadLetterReason("future-timestamp", detail)
    source_alias = source_alias_of_dispatch_topic(topic)
    if spawn.dispatch_key is None and source_alias is not None:
        # Its original, on the source Region's own topic, is relayed there; relayed here too, it would be a
        # second run (nothing ties a keyless spawn's two relays to one run id).
        detail = (
            f"a spawn without dispatch_key replicated from cluster {source_alias}: relayed only in its "
            "source Region, from its original topic; redrive it only if that Region lost the original"
        )
        return DeadLetterReason("keyless-replica", detail)
    return None


def _oldest(*times: float | None) -> float | None:
    return min((moment for moment in times if moment is not None), default=None)


def _holding(retentions: tuple[RunRetention, ...], timestamp_ms: float | None) -> RunRetention | None:
    """Of these retentions, the one that holds a record of this timestamp the shortest (None: none holds it)."""
    if timestamp_ms is None:
        return None
    held = [retention for retention in retentions if retention.days_for(timestamp_ms) is not None]
    return min(held, key=lambda retention: retention.days_for(timestamp_ms) or 0, default=None)


def rejected(status: int, answer: Any) -> DeadLetterReason:
    """The reason of a record the admission API refused with one of RECORD_FAULT_STATUSES."""
    return DeadLetterReason("rejected", f"the admission API answered {status}", status, answer)


def record_timestamp_ms(record: Mapping[str, Any]) -> int | None:
    """The record's Kafka timestamp in milliseconds; None for a record without one (-1, Kafka's NO_TIMESTAMP):
    no lag, no age. 0 is a time (1970, a producer's clock never set), not the absence of one: under a run
    retention such a record is expired, not admitted whatever its age."""
    value = record.get("timestamp")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def traceparent(record: Mapping[str, Any]) -> str | None:
    """The record's traceparent header if it is well-formed W3C Trace Context; anything else stays behind
    (a CR or LF in a header value would make an HTTP client refuse the whole request)."""
    value = header(record, "traceparent")
    if value is None:
        return None
    text = value.decode("ascii", "replace")
    return text if _TRACEPARENT.fullmatch(text) else None


def header(record: Mapping[str, Any], name: str) -> bytes | None:
    """The last header of that name (case-insensitive, as Powertools' decoded_headers), its bytes as MSK
    delivers them: a list of integers, signed (Java bytes) or not. A header whose value is null (Kafka
    allows it) counts as absent, as aws-lambda-go reads it, rather than as a fault of the record; a value
    no Kafka client could have produced raises (TypeError, ValueError): the relay dead-letters such a
    record as `relay-error`."""
    found = None
    for entry in record.get("headers") or []:
        for key, value in entry.items():
            if key.lower() == name and value is not None:
                found = bytes(byte + 256 if byte < 0 else byte for byte in value)
    return found
