"""Two Regions on loopback, as a multi-Region stack runs them: two `poimen dev`s (us-east-1 and us-west-2), one
moto table standing in for the MRSC global table (`--table-region`), a Kafka broker per Region with Apache
Kafka's MirrorMaker 2 replicating the dispatch topics both ways (prefixed active-active). A Region killed
mid-stream (SIGKILL: its `poimen dev` and broker) loses no run and admits none twice; two separate tables
(MREC's local conditions) admit one key twice, which is why the mode must be strong."""

from __future__ import annotations

import json
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import boto3
import botocore.credentials
import pytest
import requests
from confluent_kafka import Consumer, TopicPartition

from poimen.client import GENERATED_KEY_PREFIX, AdmissionClient, RegionalEndpoint
from poimen.contract import RunRequest
from poimen.dispatch import DispatchPublisher
from poimen.ids import keyed_run_id
from poimen.kafka import dispatch_topic, events_topic, replicated_dispatch_topic
from poimen_tools.local.event_source import local_relay_group
from poimen_tools.local.kafka_broker import KafkaBroker
from poimen_tools.local.mirror import MirrorMaker
from poimen_tools.local.moto import EmbeddedMoto
from poimen_tools.local.sigv4 import DEV_ACCESS_KEY, DEV_SECRET_KEY, signed_headers
from poimen_tools.local.stream_source import positions_file
from poimen_tools.topics import ensure_topics
from tests.conftest import count_runs
from tests.integration.conftest import DevServer, start_dev, wait_for

EAST, WEST = "us-east-1", "us-west-2"
# MirrorMaker's cluster aliases: the prefixes of the replicated topics.
ALIASES = {EAST: "east", WEST: "west"}
DEV_CREDENTIALS = botocore.credentials.Credentials(DEV_ACCESS_KEY, DEV_SECRET_KEY)


@pytest.fixture(scope="module")
def aws() -> Iterator[str]:
    """The local AWS both Regions share (moto keeps each Region's tables, queues apart), outliving any
    `poimen dev` a test kills."""
    with EmbeddedMoto() as moto:
        yield moto.endpoint


def start_region(
    folder: Path,
    aws: str,
    region: str,
    table: str,
    *,
    table_region: str | None = None,
    kafka_bootstrap: str | None = None,
    tenants: Sequence[str] | None = None,
) -> DevServer:
    """`poimen dev` for one Region on the shared local AWS, on `table` in `table_region` (default: its own)."""
    folder.mkdir()
    arguments = ["--region", region, "--concurrency", "2"]
    for service in ("dynamodb", "sqs", "s3"):
        arguments += [f"--{service}-endpoint", aws]
    if table_region is not None:
        arguments += ["--table-region", table_region]
    if kafka_bootstrap is not None:
        arguments += ["--kafka-bootstrap", kafka_bootstrap]
    return start_dev(folder, *arguments, kafka=kafka_bootstrap is not None, table_name=table, tenants=tenants)


def post_run(url: str, region: str, tenant: str, body: dict[str, Any]) -> requests.Response:
    """POST /v1/runs signed with the dev key for `region` (the credential scope the server checks)."""
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", "X-Poimen-Tenant": tenant}
    headers |= signed_headers("POST", f"{url}/v1/runs", headers, data, DEV_ACCESS_KEY, DEV_SECRET_KEY, region)
    return requests.post(f"{url}/v1/runs", data=data, headers=headers, timeout=30)


def runs(aws: str, region: str, table: str, tenant: str) -> list[dict[str, Any]]:
    """The tenant's run items in the table `table` of `region` (none if the Region has no such table)."""
    dynamodb = boto3.client("dynamodb", endpoint_url=aws, region_name=region)
    try:
        return count_runs(dynamodb, table, tenant)
    except dynamodb.exceptions.ResourceNotFoundException:
        return []


def letters(aws: str, region: str, queue_url: str) -> list[dict[str, Any]]:
    """Every message of a Region's dead-letter queue (read, not consumed: they become visible again)."""
    sqs = boto3.client("sqs", endpoint_url=aws, region_name=region)
    batch = sqs.receive_message(QueueUrl=queue_url, MaxNumberOfMessages=10, VisibilityTimeout=0)
    return [json.loads(message["Body"]) for message in batch.get("Messages", [])]


def event_ids(bootstrap: str, tenant: str, wanted: set[str], timeout: float) -> Counter[str]:
    """The run ids of the events on the tenant's events topic, read from the beginning until each of
    `wanted` is in."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"check-{uuid.uuid4().hex[:8]}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    consumer.subscribe([events_topic(tenant)])
    seen: Counter[str] = Counter()

    def complete() -> bool:
        for message in consumer.consume(100, 0.5):
            if message.error() is None:
                run_id = dict(message.headers() or [])["ce_subject"]
                seen[run_id.decode() if isinstance(run_id, bytes) else str(run_id)] += 1
        return wanted <= set(seen)

    try:
        wait_for(complete, timeout=timeout, what=f"{len(wanted)} runs' events on {events_topic(tenant)}")
    finally:
        consumer.close()
    return seen


def positions(bootstrap: str, topic: str, table: str) -> tuple[dict[int, int], dict[int, int]]:
    """Each partition's end offset (its records, as none expire) and the offset committed by the group of the
    relay of `poimen dev` on `table`."""
    group = local_relay_group(table)
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        partitions = [TopicPartition(topic, p) for p in consumer.list_topics(topic, timeout=5).topics[topic].partitions]
        committed = {tp.partition: tp.offset for tp in consumer.committed(partitions, timeout=5)}
        ends = {tp.partition: consumer.get_watermark_offsets(tp, timeout=5)[1] for tp in partitions}
    finally:
        consumer.close()
    return ends, committed


def test_a_region_killed_mid_stream_loses_no_run_and_admits_none_twice(tmp_path: Path, aws: str, tenant: str) -> None:
    """Over 60 s: two Regions' brokers and `poimen dev`s of its own, one killed mid-stream and its replica
    caught up, as a Region's failure needs; the stream is sized to be in flight when the kill lands."""
    started = time.monotonic()
    table = f"mrsc-{uuid.uuid4().hex[:8]}"
    brokers = {region: KafkaBroker(tmp_path / f"kafka-{region}") for region in (EAST, WEST)}
    clusters = {ALIASES[region]: broker.bootstrap_servers for region, broker in brokers.items()}
    mirror = MirrorMaker(clusters, tmp_path / "mirror", ready_topics=[dispatch_topic(tenant)])
    devs: dict[str, DevServer] = {}
    try:
        # Given a broker per Region, each with the tenant's topics
        for broker in brokers.values():
            broker.start()
            ensure_topics(broker.bootstrap_servers, tenant, partitions=3, replication_factor=1)
        # And `poimen dev` in each Region on its own broker, both on one table (us-east-1's)
        with ThreadPoolExecutor(max_workers=2) as pool:
            starting = {
                region: pool.submit(
                    start_region,
                    tmp_path / region,
                    aws,
                    region,
                    table,
                    table_region=EAST,
                    kafka_bootstrap=brokers[region].bootstrap_servers,
                    tenants=[tenant],
                )
                for region in (EAST, WEST)
            }
            # And, meanwhile, MirrorMaker 2 replicating each Region's dispatch topic to the other, prefixed
            # with its alias (ready once each has the other's replica)
            try:
                mirror.start()
            finally:
                devs.update({region: job.result() for region, job in starting.items() if job.exception() is None})
            for job in starting.values():
                job.result()  # a Region that did not start fails the test (the others stop below)
        # And each Region refuses a signature made for the other
        for region, other in ((EAST, WEST), (WEST, EAST)):
            refused = post_run(devs[region].url, other, tenant, {"workflow_ref": "wf/x", "input": {}})
            assert refused.status_code == 403, refused.text
        client = AdmissionClient(
            [RegionalEndpoint(devs[region].url, region) for region in (EAST, WEST)],
            credentials=DEV_CREDENTIALS,
            timeout=10,
            backoff_base=0.05,
        )
        publishers = {region: DispatchPublisher(broker.bootstrap_servers) for region, broker in brokers.items()}

        def publish(region: str, keys: range, times: int) -> None:
            for _ in range(times):
                for i in keys:
                    spawn = RunRequest(workflow_ref="wf/mr", input={"i": i}, dispatch_key=f"d-{i}")
                    publishers[region].publish(tenant, spawn)
            publishers[region].flush()

        def spawn(keys: range) -> list[tuple[str, int]]:
            """Spawns through the failing-over client, keyed and as many keyless: (answering Region, attempts)."""
            answered = []
            for i in keys:
                for key in (f"a-{i}", None):
                    spawned = client.spawn(tenant, "wf/mr", {"a": i}, dispatch_key=key)
                    answered.append((spawned.endpoint.region, spawned.attempts))
            return answered

        # When dispatch messages go to both Regions (each key to both, east's twice) and callers spawn
        publish(EAST, range(0, 20), times=2)
        publish(WEST, range(0, 20), times=1)
        assert set(spawn(range(0, 5))) == {(EAST, 1)}
        # And MirrorMaker has replicated each Region's records to the other (east's 40, west's 20)
        replica = replicated_dispatch_topic(ALIASES[EAST], tenant)
        west_bootstrap = brokers[WEST].bootstrap_servers
        wait_for(lambda: sum(positions(west_bootstrap, replica, table)[0].values()) == 40, timeout=60, what=replica)
        west_replica = replicated_dispatch_topic(ALIASES[WEST], tenant)
        east_bootstrap = brokers[EAST].bootstrap_servers
        wait_for(
            lambda: sum(positions(east_bootstrap, west_replica, table)[0].values()) == 20, timeout=60, what=west_replica
        )
        # And the east Region dies mid-stream (SIGKILL: its poimen dev, then its broker)
        wait_for(lambda: len(runs(aws, EAST, table, tenant)) >= 20, timeout=60, what="runs mid-stream")
        devs[EAST].process.send_signal(signal.SIGKILL)
        devs[EAST].process.wait(timeout=30)
        brokers[EAST].kill()
        del publishers[EAST]
        # And messages keep coming to the west Region, and callers fail over to it (the first call's first
        # attempt finds east gone; every later call goes to west at once)
        publish(WEST, range(20, 30), times=2)
        after = spawn(range(5, 10))
        assert after == [(WEST, 2)] + [(WEST, 1)] * 9
        client.close()
        # Then every key is exactly one run in the table: 30 dispatch keys, 10 keyed and 10 keyless spawns
        keys = {f"d-{i}" for i in range(30)} | {f"a-{i}" for i in range(10)}

        def all_runs() -> list[dict[str, Any]] | None:
            items = runs(aws, EAST, table, tenant)
            return items if len(items) >= 50 else None

        items = wait_for(all_runs, timeout=90, what="50 runs")
        by_key = Counter(item.get("dispatch_key", {}).get("S") for item in items)
        assert {key: n for key, n in by_key.items() if n > 1} == {}
        assert {key for key in by_key if not str(key).startswith(GENERATED_KEY_PREFIX)} == keys
        assert len(by_key) == len(items) == 50
        assert {item["run_id"]["S"] for item in items} >= {keyed_run_id(tenant, key) for key in keys}
        # And every run's event is on the surviving Region's events topic (its outbox reads the table's stream)
        run_ids = {item["run_id"]["S"] for item in items}
        published = event_ids(west_bootstrap, tenant, run_ids, timeout=90)
        assert set(published) == run_ids

        # And the west relay consumed the replica of east's dispatch topic to its end (its 40 records)
        def relayed_to_the_end() -> bool:
            ends, committed = positions(west_bootstrap, replica, table)
            return committed == ends

        wait_for(relayed_to_the_end, timeout=60, what=f"the west relay to commit {replica}")
        # And nothing was dead-lettered in either Region
        for region, dev in devs.items():
            assert letters(aws, region, dev.dlq_url) == [], region
        print(
            f"two Regions, east killed mid-stream: {len(items)} runs for {len(by_key)} keys, "
            f"{sum(published.values())} events on west, "
            f"{time.monotonic() - started:.1f} s"
        )
    finally:
        mirror.stop(timeout=2)  # east is gone: a clean shutdown would wait about a minute for it
        for dev in devs.values():
            if dev.process.poll() is None:
                dev.stop()
        for broker in brokers.values():
            broker.stop()
        for region in (EAST, WEST):
            positions_file(aws, table, table_region=EAST, region=region).unlink(missing_ok=True)


@pytest.fixture(scope="module")
def east_api(aws: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevServer]:
    """The us-east-1 API (no broker) on the table `regional` of us-east-1."""
    dev = start_region(tmp_path_factory.mktemp("multi-region") / "east", aws, EAST, "regional")
    yield dev
    assert dev.stop() == 0


def spawn_concurrently(urls: dict[str, str], tenant: str, key: str, count: int) -> list[tuple[str, int, str]]:
    """`count` identical keyed spawns at once, alternating between the Regions' APIs: (Region, status, run id)."""
    body = {"workflow_ref": "wf/race", "input": {"n": 1}, "dispatch_key": key}
    regions = [region for _ in range(count // len(urls)) for region in urls]
    barrier = threading.Barrier(len(regions))

    def one(region: str) -> tuple[str, int, str]:
        barrier.wait(timeout=30)
        answer = post_run(urls[region], region, tenant, body)
        return region, answer.status_code, answer.json()["run_id"]

    with ThreadPoolExecutor(max_workers=len(regions)) as pool:
        return list(pool.map(one, regions))


def test_separate_tables_per_region_admit_one_key_twice(
    tmp_path: Path, aws: str, east_api: DevServer, tenant: str
) -> None:
    # Given the west Region on its own table (MREC: each replica checks conditions locally)
    west = start_region(tmp_path / "west", aws, WEST, "regional")
    try:
        # When 20 identical spawns of one key race, half to each Region
        answers = spawn_concurrently({EAST: east_api.url, WEST: west.url}, tenant, "race-1", 20)
    finally:
        assert west.stop() == 0
    # Then each Region admitted it: two 201s for one run id, two items across the tables
    created = sorted(region for region, status, _ in answers if status == 201)
    assert created == [EAST, WEST]
    assert Counter(status for _, status, _ in answers) == {201: 2, 200: 18}
    assert {run_id for _, _, run_id in answers} == {keyed_run_id(tenant, "race-1")}
    items = runs(aws, EAST, "regional", tenant) + runs(aws, WEST, "regional", tenant)
    assert [item["dispatch_key"]["S"] for item in items] == ["race-1", "race-1"]


def test_one_table_shared_by_both_regions_admits_one_key_once(
    tmp_path: Path, aws: str, east_api: DevServer, tenant: str
) -> None:
    # Given the west Region on the east Region's table (MRSC: one table, conditions checked against it)
    west = start_region(tmp_path / "west", aws, WEST, "regional", table_region=EAST)
    try:
        assert f"table: regional ({EAST})" in west.log.read_text()
        # When 20 identical spawns of one key race, half to each Region
        answers = spawn_concurrently({EAST: east_api.url, WEST: west.url}, tenant, "race-1", 20)
    finally:
        assert west.stop() == 0
    # Then one admitted it and every other answer replays that run: one item, in the one table
    assert Counter(status for _, status, _ in answers) == {201: 1, 200: 19}
    assert {run_id for _, _, run_id in answers} == {keyed_run_id(tenant, "race-1")}
    assert [item["dispatch_key"]["S"] for item in runs(aws, EAST, "regional", tenant)] == ["race-1"]
    assert runs(aws, WEST, "regional", tenant) == []
