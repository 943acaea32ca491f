"""The local stand-in for Lambda's DynamoDB stream event source mapping: read the table's stream, invoke.

It reads the stream through the DynamoDB Streams API (DescribeStream, GetShardIterator, GetRecords; moto
server serves it), from TRIM_HORIZON as a new mapping does, keeps the records the mapping's FilterCriteria
(template.yaml) lets through, builds events in the `aws:dynamodb` shape Lambda delivers, and invokes the
*same* outbox handler in-process. A batch is handled once the handler returned, or, after `max_attempts`
failures, once it went to the on-failure destination in the record Lambda writes to an S3 destination
(batch metadata plus the whole event); only then does the shard's position move past it, and, with a
`positions` file, is kept there as the mapping keeps its checkpoint. Stopping or being killed while a
batch is not yet handled keeps it: a restart reads from the last checkpoint (or the trim horizon), so the
batch comes again (identical duplicates, never a gap). As the mapping, it reads every page of
DescribeStream, reads a shard only once its parent is drained, and replaces an iterator that expired
(15 minutes) or met trimmed records (24 hours) by one from the last checkpoint, the trim horizon if that
is trimmed too.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import boto3

from poimen.on_failure import stream_batch_info
from poimen_tools.local.mapping import (
    Handler,
    LocalMapping,
    OnFailure,
    invocation_record,
    park_in_s3,
    parked_batch_key,
)
from poimen_tools.local.template import Template

log = logging.getLogger(__name__)
# The stack name of `poimen dev`, in its events' CloudEvents source: urn:poimen:local:<tenant>.
LOCAL_STACK = "local"


def lambda_stream_record(record: Mapping[str, Any], stream_arn: str) -> dict[str, Any]:
    """A GetRecords record as Lambda delivers it: `eventSourceARN` added, ApproximateCreationDateTime in
    seconds since the epoch (boto3 reads it as a datetime)."""
    dynamodb = dict(record["dynamodb"])
    created = dynamodb.get("ApproximateCreationDateTime")
    if isinstance(created, datetime):
        dynamodb["ApproximateCreationDateTime"] = int(created.timestamp())
    return {
        "eventID": record["eventID"],
        "eventName": record["eventName"],
        "eventVersion": record.get("eventVersion", "1.1"),
        "eventSource": "aws:dynamodb",
        "awsRegion": record.get("awsRegion", "us-east-1"),
        "dynamodb": dynamodb,
        "eventSourceARN": stream_arn,
    }


def matches(pattern: Any, value: Any) -> bool:
    """Whether `value` matches an event filtering pattern (the subset template.yaml uses: nested objects,
    lists of exact values, and `{"prefix": ...}`)."""
    if isinstance(pattern, Mapping):
        return isinstance(value, Mapping) and all(
            name in value and matches(part, value[name]) for name, part in pattern.items()
        )
    if isinstance(pattern, list):
        return any(_matches_one(option, value) for option in pattern)
    raise ValueError(f"unsupported filter pattern {pattern!r}")


def _matches_one(option: Any, value: Any) -> bool:
    if isinstance(option, Mapping):
        if set(option) == {"prefix"}:
            return isinstance(value, str) and value.startswith(option["prefix"])
        raise ValueError(f"unsupported filter rule {option!r}")
    return bool(option == value)


def passes(filters: Sequence[Mapping[str, Any]], record: Mapping[str, Any]) -> bool:
    """Lambda's filtering: a record passes if any filter's pattern matches it (every record without filters)."""
    return not filters or any(matches(json.loads(f["Pattern"]), record) for f in filters)


def on_failure_record(event: dict[str, Any], attempts: int, shard_id: str, function_name: str) -> dict[str, Any]:
    """What Lambda writes to a DynamoDB stream mapping's S3 OnFailure destination for the batch `event`: its
    metadata (DDBStreamBatchInfo) and, as an S3 destination gets it, the whole event in `payload`."""
    return {
        **invocation_record(function_name, attempts),
        "DDBStreamBatchInfo": stream_batch_info(event["Records"], shard_id),
        "payload": json.dumps(event),
    }


def failed_batch_key(record: dict[str, Any], mapping_id: str) -> str:
    """An S3 key for a parked stream batch, named for its shard (poimen_tools.local.mapping)."""
    return parked_batch_key(mapping_id, record["DDBStreamBatchInfo"]["shardId"])


class LocalStreamEventSource(LocalMapping):
    """Polls every shard of one table's stream in a thread and feeds the handler, batch by batch."""

    def __init__(
        self,
        endpoint_url: str,
        table_name: str,
        handler: Handler,
        on_failure: OnFailure,
        *,
        filters: Sequence[Mapping[str, Any]] = (),
        function_name: str = "OutboxRelayFunction",
        batch_size: int = 100,
        poll_seconds: float = 0.2,
        max_attempts: int = 3,
        retry_base_seconds: float = 0.5,
        function_timeout_seconds: float = 60.0,
        positions: Path | None = None,
        region: str | None = None,
    ) -> None:
        super().__init__(
            handler,
            on_failure,
            function_name=function_name,
            max_attempts=max_attempts,
            retry_base_seconds=retry_base_seconds,
            function_timeout_seconds=function_timeout_seconds,
        )
        # `region`: the table's (None: this process's).
        self._streams = boto3.client("dynamodbstreams", endpoint_url=endpoint_url, region_name=region)
        self._dynamodb = boto3.client("dynamodb", endpoint_url=endpoint_url, region_name=region)
        self._table_name = table_name
        self._filters = list(filters)
        self._batch_size = batch_size
        self._poll = poll_seconds
        # Shard id -> the iterator of its next unread records (None: the shard is closed and drained).
        self._iterators: dict[str, str | None] = {}
        # Shard id -> the sequence number of its last handled record: where a new iterator starts after one
        # expired or met trimmed data (kept in `positions` too, if given).
        self._handled: dict[str, str] = {}
        # Where each shard's position past its last handled batch is kept across restarts; None: in memory
        # only, and a new source starts at the trim horizon.
        self._positions = positions

    def _run(self) -> None:
        stream_arn: str | None = None
        last_failure = ""
        while not self._stop.is_set():
            try:
                stream_arn = stream_arn or self._stream_arn()
                busy = self._poll_once(stream_arn)
                last_failure = ""
            except Exception as error:  # local AWS away, or no stream: positions are kept; try again
                failure = f"{type(error).__name__}: {error}"
                if failure != last_failure:  # once per distinct failure, not every second
                    log.warning("local stream event source: %s (retrying every second)", failure)
                last_failure = failure
                self._stop.wait(1.0)
                continue
            if not busy:
                self._stop.wait(self._poll)

    def _stream_arn(self) -> str:
        table = self._dynamodb.describe_table(TableName=self._table_name)["Table"]
        if "LatestStreamArn" not in table:
            raise RuntimeError(f"table {self._table_name} has no stream (this DynamoDB engine keeps none)")
        arn: str = table["LatestStreamArn"]
        return arn

    def _poll_once(self, stream_arn: str) -> bool:
        """Read one batch from each shard whose parent is drained; whether any shard had records."""
        shards = self._shards(stream_arn)
        listed = {shard["ShardId"] for shard in shards}
        busy = False
        for shard in shards:
            shard_id = shard["ShardId"]
            parent = shard.get("ParentShardId")
            if parent is not None and parent in listed and self._iterators.get(parent, "unread") is not None:
                # As the mapping does: a shard's records come after its parent's (one item's writes stay in
                # order across a split), so a child waits until its parent is drained (or trimmed away).
                continue
            if shard_id not in self._iterators:
                self._iterators[shard_id] = self._first_iterator(stream_arn, shard_id)
            iterator = self._iterators[shard_id]
            if iterator is None:
                continue
            try:
                page = self._streams.get_records(ShardIterator=iterator, Limit=self._batch_size)
            except (
                self._streams.exceptions.ExpiredIteratorException,
                self._streams.exceptions.TrimmedDataAccessException,
            ) as error:
                # An iterator lives 15 minutes, and records 24 hours: read on from the last handled record.
                log.warning("local stream event source: shard %s: %s; reading on from its checkpoint", shard_id, error)
                self._iterators[shard_id] = self._first_iterator(stream_arn, shard_id)
                busy = True
                continue
            records = [lambda_stream_record(record, stream_arn) for record in page["Records"]]
            kept = [record for record in records if passes(self._filters, record)]
            event = {"Records": kept}
            failed = functools.partial(on_failure_record, event, shard_id=shard_id, function_name=self._function_name)
            if kept and not self._deliver(event, failed):
                return False  # stopping: the position stays before this batch
            self._iterators[shard_id] = page.get("NextShardIterator")
            if records:
                self._checkpoint(stream_arn, shard_id, records[-1]["dynamodb"]["SequenceNumber"])
            busy = busy or bool(records)
        return busy

    def _shards(self, stream_arn: str) -> list[dict[str, Any]]:
        """Every shard of the stream: DescribeStream, page after page (LastEvaluatedShardId)."""
        shards: list[dict[str, Any]] = []
        page: dict[str, Any] = {}
        while True:
            described = self._streams.describe_stream(StreamArn=stream_arn, **page)["StreamDescription"]
            shards += described["Shards"]
            if not described.get("LastEvaluatedShardId"):
                return shards
            page = {"ExclusiveStartShardId": described["LastEvaluatedShardId"]}

    def _first_iterator(self, stream_arn: str, shard_id: str) -> str:
        """After the shard's last handled record (in memory, else its checkpoint kept for this stream), else
        from the trim horizon; from the trim horizon too if that record is trimmed already. Lambda's mapping
        does the same: records the stream trimmed (24 h) before they were handled are lost to it, and it
        reads on from the oldest one left (the template parks records older than OutboxMaxRecordAgeSeconds
        before that happens)."""
        after = self._handled.get(shard_id) or self._checkpoints(stream_arn).get(shard_id)
        if after:
            try:
                return self._iterator(
                    stream_arn, shard_id, ShardIteratorType="AFTER_SEQUENCE_NUMBER", SequenceNumber=after
                )
            except self._streams.exceptions.TrimmedDataAccessException:
                log.warning(
                    "local stream event source: shard %s is trimmed past its checkpoint %s: records after it were "
                    "lost; reading on from its trim horizon",
                    shard_id,
                    after,
                )
        return self._iterator(stream_arn, shard_id, ShardIteratorType="TRIM_HORIZON")

    def _iterator(self, stream_arn: str, shard_id: str, **position: str) -> str:
        iterator: str = self._streams.get_shard_iterator(StreamArn=stream_arn, ShardId=shard_id, **position)[
            "ShardIterator"
        ]
        return iterator

    def _checkpoints(self, stream_arn: str) -> dict[str, str]:
        """{shard id: last handled sequence number} kept in `positions` for this stream (another stream's,
        e.g. of a table created again, is not this one's)."""
        if self._positions is None or not self._positions.is_file():
            return {}
        try:
            kept = json.loads(self._positions.read_text())
        except ValueError:
            return {}
        shards = kept.get("shards") if isinstance(kept, dict) and kept.get("streamArn") == stream_arn else None
        return {str(k): str(v) for k, v in shards.items()} if isinstance(shards, dict) else {}

    def _checkpoint(self, stream_arn: str, shard_id: str, sequence_number: str) -> None:
        """Keep the shard's position past a handled batch, as the mapping keeps its checkpoint: in memory, and in
        `positions` written to a temporary file and renamed over the old one, so a kill leaves one or the
        other whole."""
        self._handled[shard_id] = sequence_number
        if self._positions is None:
            return
        shards = {**self._checkpoints(stream_arn), shard_id: sequence_number}
        self._positions.parent.mkdir(parents=True, exist_ok=True)
        staged = self._positions.with_suffix(".tmp")
        staged.write_text(json.dumps({"streamArn": stream_arn, "shards": shards}))
        os.replace(staged, self._positions)


OUTBOX_FUNCTION = "OutboxRelayFunction"
OUTBOX_SOURCE = "OutboxRelaySource"
OUTBOX_BUCKET = "OutboxFailedBatchesBucket"


def positions_file(
    dynamodb_endpoint: str, table_name: str, *, table_region: str = "us-east-1", region: str = "us-east-1"
) -> Path:
    """Where the outbox of `poimen dev` in `region` keeps its stream checkpoints of one table (in
    `table_region`) at one endpoint. One file per reading Region: the outboxes of two Regions sharing one
    table (each replica of a global table has its own stream and mapping) each publish every run to their
    own broker, so neither may move the other's position."""
    where = f"{dynamodb_endpoint} {table_region} {table_name} {region}"
    name = hashlib.sha256(where.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / "poimen-dev" / f"stream-positions-{name}.json"


def start_local_outbox(
    template: Template,
    bootstrap_servers: str,
    dynamodb_endpoint: str,
    table_name: str,
    bucket: str,
    cleanup: contextlib.ExitStack,
    *,
    table_region: str,
    region: str,
    keep_positions: bool = False,
) -> LocalStreamEventSource:
    """`poimen dev`'s outbox relay in `region`: the stream of the table (in `table_region`) feeding the outbox
    handler of template.yaml, which produces to the local broker; failed batches parked in `bucket` (S3, an
    existing bucket) as Lambda parks them, and the events the handler sets aside written there by it.

    It creates no topic: `poimen dev` creates its tenants' at start, as a deploy needs them created first,
    and an event of a topic that does not exist is set aside, as on MSK. With `keep_positions` (a table
    that outlives `poimen dev`) the shards' checkpoints are kept in a file of the temporary directory
    named for the endpoint, the table and the Regions (positions_file), so a restart resumes after the
    last handled batch.
    """
    function = template.function_environment(OUTBOX_FUNCTION, {OUTBOX_BUCKET: bucket})
    # The outbox's variables, for the local broker: plaintext, and a stack named "local". Not its
    # POWERTOOLS_SERVICE_NAME, as this process's environment is also the API environments': its service is
    # given as OUTBOX_SERVICE_NAME, so its metrics are the outbox's, as the dashboard reads them.
    os.environ.update(
        {name: value for name, value in function.items() if name.startswith("OUTBOX_")}
        | {"KAFKA_BOOTSTRAP_SERVERS": bootstrap_servers, "KAFKA_AUTH": "none", "POIMEN_STACK_NAME": LOCAL_STACK}
        | {"OUTBOX_SERVICE_NAME": function["POWERTOOLS_SERVICE_NAME"]}
    )
    handler = template.load_handler(OUTBOX_FUNCTION)
    s3 = boto3.client("s3")
    mapping_id = str(uuid.uuid4())
    source = LocalStreamEventSource(
        dynamodb_endpoint,
        table_name,
        handler,
        park_in_s3(s3, bucket, lambda record: failed_batch_key(record, mapping_id)),
        filters=template.properties(OUTBOX_SOURCE).get("FilterCriteria", {}).get("Filters", []),
        function_timeout_seconds=float(template.properties(OUTBOX_FUNCTION).get("Timeout", 60)),
        positions=(
            positions_file(dynamodb_endpoint, table_name, table_region=table_region, region=region)
            if keep_positions
            else None
        ),
        region=table_region,
    )
    source.start()
    cleanup.callback(source.stop)
    return source
