"""Outbox benchmark: the outbox relay handler publishing stream batches to a local broker vs a bare producer.

Run: `make bench` (or `.venv/bin/python -m benchmarks.outbox_bench`). One local KRaft broker (the jars of
`make kafka-jars`). The handler, loaded as it ships (template.yaml's variables; KAFKA_AUTH none for the local
broker), is invoked with batches of admitted runs' stream records, as many a batch as its event source's
BatchSize; side by side, the same records are produced by a producer configured as the outbox's and flushed
once a batch (the floor). Every record must be on the topic at the end. The ms per record is the cost model's
outbox duration (docs/operations.md#what-a-tenant-costs); the figure to compare is the ratio to the floor.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from poimen_tools.local.template import Template

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = Template(REPO / "template.yaml")
TENANT = "bench"
STACK = "bench"

os.environ.update(
    {
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
        **TEMPLATE.function_environment("OutboxRelayFunction", {}),
        "KAFKA_AUTH": "none",
        "POIMEN_STACK_NAME": STACK,
        # Where an undeliverable event would be set aside: never written here, the tenant's topics exist
        # (a set-aside event would fail the benchmark, no S3 being reachable).
        "OUTBOX_FAILED_BATCHES_BUCKET": "bench-outbox-failed-batches",
    }
)

from confluent_kafka import Consumer, TopicPartition  # noqa: E402

from benchmarks.quiet import silenced  # noqa: E402
from poimen.config import OutboxSettings  # noqa: E402
from poimen.kafka import events_topic  # noqa: E402
from poimen.outbox import _kafka_producer, events_of_batch, outbox_service  # noqa: E402
from poimen.store import run_pk  # noqa: E402
from poimen_tools.local.devserver import LocalLambdaContext  # noqa: E402
from poimen_tools.local.kafka_broker import KafkaBroker  # noqa: E402
from poimen_tools.topics import ensure_topics  # noqa: E402

_INSERT: dict[str, Any] = json.loads((REPO / "tests/events/dynamodb_stream_insert.json").read_text())["Records"][0]


def stream_batch(size: int) -> dict[str, Any]:
    """A DynamoDB stream event of `size` admitted runs of the tenant, each its own run id and key."""
    records = []
    for _ in range(size):
        record = copy.deepcopy(_INSERT)
        run_id = str(uuid.uuid4())
        image = record["dynamodb"]["NewImage"]
        image.update(
            {
                "pk": {"S": run_pk(TENANT, run_id)},
                "run_id": {"S": run_id},
                "tenant_id": {"S": TENANT},
                "dispatch_key": {"S": run_id},
            }
        )
        record["dynamodb"]["Keys"] = {"pk": image["pk"]}
        record["eventID"] = uuid.uuid4().hex
        records.append(record)
    return {"Records": records}


def outbox_batch_ms(handler: Callable[[dict[str, Any], Any], Any], batch: dict[str, Any]) -> float:
    """One invocation of the handler, in milliseconds."""
    started = time.perf_counter()
    handler(batch, LocalLambdaContext("OutboxRelayFunction", timeout_seconds=60))
    return (time.perf_counter() - started) * 1000


def floor_batch_ms(producer: Any, batch: dict[str, Any]) -> float:
    """The batch's events (built beforehand) produced and flushed by a bare producer, in milliseconds."""
    events = events_of_batch(batch, STACK)
    started = time.perf_counter()
    for event in events:
        producer.produce(event.topic, value=event.value, key=event.key, headers=list(event.headers))
    if producer.flush(60) != 0:
        raise RuntimeError("the floor's producer did not deliver its batch")
    return (time.perf_counter() - started) * 1000


def records_on_topic(bootstrap: str, topic: str) -> int:
    """How many records the topic holds (its partitions' end offsets: nothing is deleted here)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-{uuid.uuid4().hex[:8]}"})
    try:
        partitions = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        return sum(consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1] for p in partitions)
    finally:
        consumer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    batch_size = int(TEMPLATE.properties("OutboxRelaySource")["BatchSize"])
    parser.add_argument("--batches", type=int, default=20, help="batches per variant and round")
    parser.add_argument("--batch-size", type=int, default=batch_size, help="records a batch (the template's)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median is reported")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as data, KafkaBroker(Path(data)) as broker:
        os.environ["KAFKA_BOOTSTRAP_SERVERS"] = broker.bootstrap_servers
        ensure_topics(broker.bootstrap_servers, TENANT)
        handler = TEMPLATE.load_handler("OutboxRelayFunction")
        outbox_service.cache_clear()
        producer = _kafka_producer(OutboxSettings.from_env())
        ours: list[float] = []
        floor: list[float] = []
        with silenced():
            outbox_batch_ms(handler, stream_batch(args.batch_size))  # connect, metadata
            floor_batch_ms(producer, stream_batch(args.batch_size))
            for _ in range(args.rounds):
                ours.append(
                    statistics.median(
                        outbox_batch_ms(handler, stream_batch(args.batch_size)) for _ in range(args.batches)
                    )
                )
                floor.append(
                    statistics.median(
                        floor_batch_ms(producer, stream_batch(args.batch_size)) for _ in range(args.batches)
                    )
                )
        published = records_on_topic(broker.bootstrap_servers, events_topic(TENANT))
        expected = (2 + 2 * args.rounds * args.batches) * args.batch_size
        if published != expected:
            raise RuntimeError(f"{published} events on {events_topic(TENANT)} for {expected} records sent")

    relay, plain = statistics.median(ours), statistics.median(floor)
    print(
        f"\nOutbox benchmark: batches of {args.batch_size} stream records (OutboxRelaySource BatchSize), "
        f"{args.batches} batches x {args.rounds} rounds, one local broker, medians\n"
    )
    print(f"{'variant':44} {'ms a batch':>11} {'ms a record':>12}")
    print("-" * 69)
    print(f"{'outbox relay handler (stream -> events)':44} {relay:11.1f} {relay / args.batch_size:12.3f}")
    print(f"{'bare producer, same records (floor)':44} {plain:11.1f} {plain / args.batch_size:12.3f}")
    print(f"\nRatio outbox / floor {relay / plain:.2f} (time a batch; the relay's own work is the excess)")


if __name__ == "__main__":
    main()
