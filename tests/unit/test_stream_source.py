"""The local DynamoDB stream event source reads a stream as Lambda's mapping does when the stream misbehaves:
an expired shard iterator or trimmed data is read again from the last checkpoint, DescribeStream is read
page by page, and a child shard waits until its parent is drained. A fake DynamoDB Streams API stands in
for moto, which neither expires iterators, trims, splits shards nor pages DescribeStream."""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import pytest
from botocore.exceptions import ClientError

from poimen_tools.local.stream_source import LocalStreamEventSource
from tests.conftest import wait_for

STREAM = "arn:aws:dynamodb:us-east-1:123456789012:table/t/stream/2026-12-01T00:00:00.000"


class ExpiredIteratorException(ClientError):
    pass


class TrimmedDataAccessException(ClientError):
    pass


def _error(kind: type[ClientError], operation: str) -> ClientError:
    return kind({"Error": {"Code": kind.__name__, "Message": kind.__name__}}, operation)


@dataclass
class Shard:
    shard_id: str
    sequence_numbers: list[int]
    parent: str | None = None
    closed: bool = False
    # Sequence numbers below this one are trimmed (gone from the stream).
    trimmed_below: int = 0


@dataclass
class FakeStreams:
    """DynamoDB Streams as Lambda meets it: iterators that expire, records that are trimmed, shards that
    close and have children, DescribeStream in pages of `page_size` shards."""

    shards: list[Shard]
    page_size: int = 1
    expired: set[str] = field(default_factory=set)
    issued: list[str] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)
    _positions: dict[str, tuple[str, int]] = field(default_factory=dict)
    _tokens: Iterator[int] = field(default_factory=itertools.count)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    class exceptions:
        ExpiredIteratorException = ExpiredIteratorException
        TrimmedDataAccessException = TrimmedDataAccessException

    def describe_stream(self, StreamArn: str, ExclusiveStartShardId: str | None = None) -> dict[str, Any]:
        self.calls.append(f"describe_stream({ExclusiveStartShardId})")
        ids = [shard.shard_id for shard in self.shards]
        start = ids.index(ExclusiveStartShardId) + 1 if ExclusiveStartShardId else 0
        page = self.shards[start : start + self.page_size]
        description: dict[str, Any] = {
            "StreamArn": StreamArn,
            "Shards": [
                {"ShardId": shard.shard_id, **({"ParentShardId": shard.parent} if shard.parent else {})}
                for shard in page
            ],
        }
        if start + self.page_size < len(self.shards):
            description["LastEvaluatedShardId"] = page[-1].shard_id
        return {"StreamDescription": description}

    def get_shard_iterator(
        self, StreamArn: str, ShardId: str, ShardIteratorType: str, SequenceNumber: str = ""
    ) -> dict[str, Any]:
        shard = self._shard(ShardId)
        if ShardIteratorType == "TRIM_HORIZON":
            position = shard.trimmed_below
        elif int(SequenceNumber) < shard.trimmed_below:
            raise _error(TrimmedDataAccessException, "GetShardIterator")
        else:
            position = int(SequenceNumber) + 1
        return {"ShardIterator": self._issue(ShardId, position)}

    def get_records(self, ShardIterator: str, Limit: int) -> dict[str, Any]:
        with self._lock:
            if ShardIterator in self.expired:
                raise _error(ExpiredIteratorException, "GetRecords")
            shard_id, position = self._positions[ShardIterator]
        shard = self._shard(shard_id)
        if position < shard.trimmed_below:
            raise _error(TrimmedDataAccessException, "GetRecords")
        numbers = [n for n in shard.sequence_numbers if n >= position][:Limit]
        after = numbers[-1] + 1 if numbers else position
        drained = shard.closed and not [n for n in shard.sequence_numbers if n >= after]
        page: dict[str, Any] = {"Records": [_record(shard_id, n) for n in numbers]}
        if not drained:
            page["NextShardIterator"] = self._issue(shard_id, after)
        return page

    def expire_every_iterator(self) -> None:
        """Every iterator issued so far expires (15 minutes after it was issued, on DynamoDB Streams)."""
        with self._lock:
            self.expired.update(self.issued)

    def _issue(self, shard_id: str, position: int) -> str:
        with self._lock:
            token = f"iterator-{next(self._tokens)}"
            self._positions[token] = (shard_id, position)
            self.issued.append(token)
            return token

    def _shard(self, shard_id: str) -> Shard:
        return next(shard for shard in self.shards if shard.shard_id == shard_id)


def _record(shard_id: str, number: int) -> dict[str, Any]:
    return {
        "eventID": f"{shard_id}-{number}",
        "eventName": "INSERT",
        "dynamodb": {
            "SequenceNumber": str(number),
            "ApproximateCreationDateTime": datetime(2026, 12, 1, tzinfo=UTC),
            "NewImage": {"pk": {"S": f"RUN#acme#{shard_id}-{number}"}},
        },
    }


class FakeTable:
    def describe_table(self, TableName: str) -> dict[str, Any]:
        return {"Table": {"TableName": TableName, "LatestStreamArn": STREAM}}


@dataclass
class Running:
    source: LocalStreamEventSource
    streams: FakeStreams
    seen: list[str]


@pytest.fixture
def run_source(tmp_path: Path) -> Iterator[Callable[..., Running]]:
    """Start a local stream event source on a FakeStreams (and a positions file of this test's)."""
    started: list[LocalStreamEventSource] = []

    def start(streams: FakeStreams, positions: dict[str, str] | None = None, batch_size: int = 100) -> Running:
        seen: list[str] = []
        lock = threading.Lock()

        def handler(event: dict[str, Any], context: Any) -> None:
            with lock:
                seen.extend(record["eventID"] for record in event["Records"])

        kept = tmp_path / "positions.json"
        if positions is not None:
            kept.write_text(json.dumps({"streamArn": STREAM, "shards": positions}))
        source = LocalStreamEventSource(
            "http://127.0.0.1:9", "t", handler, on_failure=lambda _: None, positions=kept, batch_size=batch_size,
            poll_seconds=0.01,
        )  # fmt: skip
        source._streams, source._dynamodb = cast(Any, streams), cast(Any, FakeTable())
        source.start()
        started.append(source)
        return Running(source, streams, seen)

    yield start
    for source in started:
        source.stop()


def test_an_expired_iterator_is_replaced_from_the_last_checkpoint(run_source: Callable[..., Running]) -> None:
    # Given a shard whose first records were handled
    shard = Shard("shard-1", [1, 2])
    running = run_source(FakeStreams([shard]))
    wait_for(lambda: running.seen == ["shard-1-1", "shard-1-2"], what="the first records")
    # When its iterator expires (15 minutes of no new record), and records come after
    running.streams.expire_every_iterator()
    shard.sequence_numbers += [3, 4]
    # Then a new iterator from the last handled record reads on: the new records, nothing twice
    wait_for(lambda: len(running.seen) == 4, what="the records after the expiry")
    assert running.seen == ["shard-1-1", "shard-1-2", "shard-1-3", "shard-1-4"]


def test_trimmed_data_is_read_again_from_the_checkpoint_and_past_the_trim_horizon(
    run_source: Callable[..., Running],
) -> None:
    # Given a checkpoint (a restart) older than what the stream still holds: records 1-2 were trimmed
    shard = Shard("shard-1", [1, 2, 3, 4], trimmed_below=3)
    # When the source starts there
    running = run_source(FakeStreams([shard]), positions={"shard-1": "1"})
    # Then it goes on from the oldest record left, as Lambda's mapping does (what was trimmed is lost)
    wait_for(lambda: running.seen == ["shard-1-3", "shard-1-4"], what="the records left")


def test_records_trimmed_under_an_iterator_are_read_again_from_the_checkpoint(
    run_source: Callable[..., Running],
) -> None:
    # Given a shard read up to record 2, then trimmed past it while its iterator waits
    shard = Shard("shard-1", [1, 2])
    running = run_source(FakeStreams([shard]))
    wait_for(lambda: running.seen == ["shard-1-1", "shard-1-2"], what="the first records")
    shard.sequence_numbers += [3, 4, 5]
    shard.trimmed_below = 4
    # Then it reads on from the trim horizon: record 3 is gone, the rest is read once
    wait_for(lambda: len(running.seen) == 4, what="the records left after the trim")
    assert running.seen == ["shard-1-1", "shard-1-2", "shard-1-4", "shard-1-5"]


def test_every_page_of_shards_is_read_and_a_child_waits_until_its_parent_is_drained(
    run_source: Callable[..., Running],
) -> None:
    # Given a stream of three shards, one per DescribeStream page: a closed parent of two records, read one
    # record a batch, its child listed before it, and an unrelated shard on the last page
    parent = Shard("shard-parent", [1, 2], closed=True)
    child = Shard("shard-child", [10, 11], parent="shard-parent")
    other = Shard("shard-other", [20])
    running = run_source(FakeStreams([child, parent, other], page_size=1), batch_size=1)
    # When it has read them all
    wait_for(lambda: len(running.seen) == 5, what="every shard's records")
    # Then every page was read, and the child's records came only after every one of its parent's
    assert "describe_stream(shard-parent)" in running.streams.calls
    order = running.seen
    assert sorted(order) == sorted(
        ["shard-parent-1", "shard-parent-2", "shard-child-10", "shard-child-11", "shard-other-20"]
    )
    assert max(order.index("shard-parent-1"), order.index("shard-parent-2")) < order.index("shard-child-10")


def test_a_child_whose_parent_is_gone_from_the_stream_is_read(run_source: Callable[..., Running]) -> None:
    # Given a child shard whose parent was trimmed away (no longer listed)
    running = run_source(FakeStreams([Shard("shard-child", [10], parent="shard-gone")]))
    # Then it is read
    wait_for(lambda: running.seen == ["shard-child-10"], what="the child's record")
