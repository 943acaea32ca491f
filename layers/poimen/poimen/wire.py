"""The HTTP contract's names and limits: header names, id patterns, body limits. Without its models (those
are `poimen.contract`), so the relay and Kafka naming import them without loading pydantic, a third of
the relay's cold start.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

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

# The batch form of POST /v1/runs (poimen.batch): a media type of its own, so a JSON body keeps its one meaning (one
# spawn) and the batch answer its own schema. Its limits hold the request and the answer within Lambda's 6 MB
# synchronous payload, the event base64-encoded (4/3) and each result echoing its run or a bounded problem, and
# so within API Gateway's 10 MB (https://docs.aws.amazon.com/lambda/latest/dg/gettingstarted-limits.html,
# https://docs.aws.amazon.com/apigateway/latest/developerguide/http-api-quotas.html). 100 spawns: a Kafka
# event source mapping's default batch of records.
SPAWNS_MEDIA_TYPE = "application/vnd.poimen.spawns+json"
SPAWN_RESULTS_MEDIA_TYPE = "application/vnd.poimen.spawn-results+json"
MAX_BATCH_SPAWNS = 100
MAX_BATCH_BODY_BYTES = 1024 * 1024
# The statuses of an answer to a whole batch that refuse its envelope, not its spawns: a body the API refuses as a
# whole (over MAX_BATCH_BODY_BYTES, nesting or text it reads in no body, whichever spawn holds it) or an API that
# takes no batch (415). Such an answer wrote nothing and says nothing of any one spawn: each spawn of the batch is
# sent again alone, for the answer the single route gives it (the relay and poimen.client, one rule).
ENVELOPE_REFUSED_STATUSES = frozenset({400, 413, 415})

# The member of a 503 `store-unavailable` problem that says the API asks its caller to slow down (`true`; absent when
# the store failed), as API Gateway's own 429 does: DynamoDB throttled the request, or a batch had no time or answer
# room left for the spawn (or it waits behind a throttled one). `asks_to_slow_down` is the rule.
THROTTLED_MEMBER = "throttled"
_STORE_UNAVAILABLE = "urn:poimen:problem:store-unavailable"

TENANT_HEADER = "X-Poimen-Tenant"
REPLAYED_HEADER = "Idempotent-Replayed"
# The dispatch_key as a header (RFC 8941 string, or the key itself unquoted): poimen.contract.idempotency_key.
IDEMPOTENCY_KEY_HEADER = "Idempotency-Key"
_DELAY_SECONDS = re.compile(r"[0-9]+")  # RFC 9110 delay-seconds: 1*DIGIT, and DIGIT is ASCII (RFC 5234)


def rfc3339(moment: datetime | None = None) -> str:
    """`moment` (now if None) as the API writes times (`created_at`): RFC 3339, UTC, milliseconds, `Z`."""
    return (moment or datetime.now(UTC)).astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def retry_after_seconds(value: str | None, now: datetime | None = None) -> float | None:
    """Retry-After as delay-seconds or an HTTP-date (RFC 9110 10.2.3), in seconds from `now`; None if absent or
    unreadable, which a client ignores. delay-seconds is ASCII digits only: float() would take "1e9", "inf",
    "+3", "3.0" or Arabic-Indic digits, and `str.isdigit` "²" (which float refuses)."""
    if not value:
        return None
    text = value.strip()
    if _DELAY_SECONDS.fullmatch(text):
        return float(text)
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:  # "-0000": UTC, as HTTP-dates always are
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())


def asks_to_slow_down(status: int, answer: object) -> bool:
    """Whether an answer (its status, and its body parsed: a problem, API Gateway's message, or text) asks its caller
    to slow down rather than says the API failed: API Gateway's throttle (429), or a 503 `store-unavailable` problem
    marked THROTTLED_MEMBER (DynamoDB throttled the spawn, nothing written); the member on any other answer (a 500, an
    outcome unknown: no answer the API gives) is no throttle. A Retry-After alone says when to try again, not why: the
    API gives one with every 503 it answers, an outage's included."""
    if status == 429:
        return True
    return (
        status == 503
        and isinstance(answer, dict)
        and answer.get("type") == _STORE_UNAVAILABLE
        and answer.get(THROTTLED_MEMBER) is True
    )
