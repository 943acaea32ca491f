"""Lambda's on-failure record as an S3 destination receives it, and the keys of such objects.

The format of OutboxFailedBatchesBucket: its event source mapping parks a stream batch it gave up on as one
(poimen_tools.local.stream_source writes the same locally), and the outbox relay writes one itself for the
events it sets aside (poimen.outbox), so `poimen events backfill` and the runbook read both alike. The local
MSK event source builds its records from `invocation_record` too.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from poimen.wire import rfc3339

RETRY_ATTEMPTS_EXHAUSTED = "RetryAttemptsExhausted"


def invocation_record(
    function_arn: str,
    attempts: int,
    *,
    condition: str = RETRY_ATTEMPTS_EXHAUSTED,
    request_id: str | None = None,
    executed_version: str = "$LATEST",
    function_error: str | None = "Unhandled",
) -> dict[str, Any]:
    """The part every on-failure record has, whatever the source: the failed invocation's context. The
    source's batch information and `payload` follow it."""
    return {
        "requestContext": {
            "requestId": request_id or str(uuid.uuid4()),
            "functionArn": function_arn,
            "condition": condition,
            "approximateInvokeCount": attempts,
        },
        "responseContext": {"statusCode": 200, "executedVersion": executed_version, "functionError": function_error},
        "version": "1.0",
        "timestamp": rfc3339(),
    }


def stream_batch_info(records: Sequence[Mapping[str, Any]], shard_id: str | None) -> dict[str, Any]:
    """DDBStreamBatchInfo of a DynamoDB stream batch (records as Lambda delivers them, at least one). The
    function is not told its shard: what it writes itself carries None."""
    arrivals = [record["dynamodb"].get("ApproximateCreationDateTime", 0) for record in records]
    return {
        "shardId": shard_id,
        "startSequenceNumber": records[0]["dynamodb"].get("SequenceNumber"),
        "endSequenceNumber": records[-1]["dynamodb"].get("SequenceNumber"),
        "approximateArrivalOfFirstRecord": _iso(min(arrivals)),
        "approximateArrivalOfLastRecord": _iso(max(arrivals)),
        "batchSize": len(records),
        "streamArn": records[0].get("eventSourceARN"),
    }


def object_key(prefix: str, at: datetime | None = None, name: str | None = None) -> str:
    """`<prefix>/YYYY/MM/DD/<time>-<id>`, the shape of Lambda's `aws/lambda/<mapping>/<source>/...` keys: now and
    a random id, unless given (a key derived from what the object holds is the same each time it is written)."""
    when = (at or datetime.now(UTC)).astimezone(UTC)
    return f"{prefix}/{when:%Y/%m/%d}/{when:%Y-%m-%dT%H.%M.%S}-{name or uuid.uuid4()}"


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
