"""Two cells run locally, as two stacks on one MSK cluster (docs/operations.md#cells): `poimen dev`s serving
disjoint tenants (--tenants), each cell on a table of its own, on one broker. Cell a serves acme from two
Regions (us-east-1 and us-west-2 on one table, as a multi-Region cell's global table), cell b serves globex.
A client with the cell map sends each tenant to its own cell, the Kafka path relays each tenant within its
cell, each table holds only its own tenants' runs, a tenant sent to the wrong cell is refused with nothing
written, failover stays within the cell, and no port or consumer group of one cell is the other's."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from botocore.credentials import Credentials
from confluent_kafka.admin import AdminClient

from poimen.cells import CellMap
from poimen.client import AdmissionClient, Forbidden, RegionalEndpoint
from poimen.contract import RunRequest
from poimen.dispatch import DispatchPublisher
from poimen.ids import keyed_run_id
from poimen.kafka import dispatch_topic
from poimen_tools import runs
from poimen_tools.local.kafka_broker import KafkaBroker
from poimen_tools.local.sigv4 import DEV_ACCESS_KEY, DEV_SECRET_KEY
from tests.conftest import count_runs
from tests.integration.conftest import DevServer, start_dev, wait_for

EAST, WEST = "us-east-1", "us-west-2"
ACME, GLOBEX = "acme", "globex"


@dataclass
class Cells:
    a_east: DevServer  # cell a's API in us-east-1 (no Kafka)
    a_west: DevServer  # cell a's API in us-west-2, on cell a's table, and cell a's inbox and outbox relays
    b: DevServer  # cell b: API and relays
    map_file: Path
    dynamodb: Any  # the one local DynamoDB every cell's table is on

    @property
    def devs(self) -> list[DevServer]:
        return [self.a_east, self.a_west, self.b]

    def runs(self, dev: DevServer, tenant: str) -> set[str]:
        return {item["run_id"]["S"] for item in count_runs(self.dynamodb, dev.table_name, tenant)}

    def client(self) -> AdmissionClient:
        credentials = Credentials(DEV_ACCESS_KEY, DEV_SECRET_KEY)
        return AdmissionClient(cells=CellMap.load(self.map_file), credentials=credentials, timeout=5.0)


@pytest.fixture(scope="module")
def cells(dev: DevServer, broker: KafkaBroker, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cells]:
    """Both cells' `poimen dev`s on the session's moto server (one account and Region, as cells are) and the
    module's broker (one cluster). Over 60 s to set up on two cores: three `poimen dev`s (cell a in two Regions,
    cell b), each warming its execution environments, once for the module's tests."""
    root = tmp_path_factory.mktemp("cells")
    suffix = uuid.uuid4().hex[:8]
    table_a, table_b = f"poimen-admission-cells_a-{suffix}", f"poimen-admission-cells_b-{suffix}"
    aws = ("--dynamodb-endpoint", dev.aws_endpoint, "--concurrency", "1")
    kafka = ("--kafka-bootstrap", broker.bootstrap_servers)
    for name in ("a-east", "a-west", "b"):
        (root / name).mkdir()
    arguments = {
        "a-east": (("--region", EAST, *aws), {"table_name": table_a, "tenants": [ACME]}),
        "a-west": (
            ("--region", WEST, "--table-region", EAST, *aws, *kafka),
            {"table_name": table_a, "kafka": True, "tenants": [ACME]},
        ),
        "b": ((*aws, *kafka), {"table_name": table_b, "kafka": True, "tenants": [GLOBEX]}),
    }
    with contextlib.ExitStack() as started:
        # Started side by side, each stopped at the end once it has started, whichever failed to
        with ThreadPoolExecutor(max_workers=len(arguments)) as pool:
            starting = {
                name: pool.submit(start_dev, root / name, *extra, **options)  # type: ignore[arg-type]
                for name, (extra, options) in arguments.items()
            }
            for future in starting.values():
                if future.exception() is None:
                    started.callback(future.result().stop)
        a_east, a_west, b = (starting[name].result() for name in arguments)
        map_file = root / "cells.json"
        cell_map = {
            "a": {"endpoints": [a_east.url, {"url": a_west.url, "region": WEST}], "tenants": [ACME]},
            "b": {"endpoints": [b.url], "tenants": [GLOBEX]},
        }
        map_file.write_text(json.dumps({"cells": cell_map}))
        yield Cells(a_east, a_west, b, map_file, dev.dynamodb())


def _groups_by_topic(bootstrap: str) -> dict[str, set[str]]:
    """Per topic, the consumer groups whose members are assigned some partition of it."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    listed = admin.list_consumer_groups(request_timeout=10).result()
    names = [group.group_id for group in listed.valid]
    found: dict[str, set[str]] = {}
    for name, future in admin.describe_consumer_groups(names, request_timeout=10).items():
        for member in future.result().members:
            for partition in member.assignment.topic_partitions:
                found.setdefault(partition.topic, set()).add(name)
    return found


def test_each_tenant_is_admitted_in_its_own_cell_only(cells: Cells, broker: KafkaBroker) -> None:
    # Given both cells, and a client with the cell map
    with cells.client() as api:
        # When acme and globex spawn through the client, twice each with one key
        spawned = {
            tenant: [api.spawn(tenant, "wf/cells", {"n": n // 2}, dispatch_key=f"api-{n // 2}") for n in range(4)]
            for tenant in (ACME, GLOBEX)
        }
    # And each publishes a spawn to its dispatch topic on the one broker
    publisher = DispatchPublisher(broker.bootstrap_servers)
    for tenant in (ACME, GLOBEX):
        publisher.publish(tenant, RunRequest(workflow_ref="wf/cells", input={}, dispatch_key="kafka-1"))
    publisher.flush()

    # Then acme's calls reached cell a, globex's cell b
    assert {each.endpoint.url for each in spawned[ACME]} == {cells.a_east.url}
    assert {each.endpoint.url for each in spawned[GLOBEX]} == {cells.b.url}
    # And each cell's table holds its own tenant's runs, one per key (API and Kafka), and none of the other's
    expected = {
        tenant: {keyed_run_id(tenant, key) for key in ("api-0", "api-1", "kafka-1")} for tenant in (ACME, GLOBEX)
    }
    wait_for(lambda: cells.runs(cells.a_east, ACME) == expected[ACME], timeout=30, what="acme's runs in cell a")
    wait_for(lambda: cells.runs(cells.b, GLOBEX) == expected[GLOBEX], timeout=30, what="globex's runs in cell b")
    assert cells.runs(cells.a_east, GLOBEX) == set()
    assert cells.runs(cells.b, ACME) == set()
    # And each cell relayed only its own tenant's topic, in a consumer group of its own
    topics = {dispatch_topic(ACME), dispatch_topic(GLOBEX)}

    def assigned() -> dict[str, set[str]] | None:
        found = _groups_by_topic(broker.bootstrap_servers)
        return found if found.keys() >= topics else None

    groups = wait_for(assigned, timeout=30, what="both cells' relays assigned their tenants' dispatch topics")
    assert groups[dispatch_topic(ACME)].isdisjoint(groups[dispatch_topic(GLOBEX)]), groups
    # And no port is another dev's: APIs and their own local AWS
    ports = [dev.url for dev in cells.devs] + [dev.sqs_endpoint or "" for dev in cells.devs]
    assert len(set(ports)) == len(ports), ports


def test_a_tenant_sent_to_the_wrong_cell_is_refused_and_nothing_written(cells: Cells) -> None:
    credentials = Credentials(DEV_ACCESS_KEY, DEV_SECRET_KEY)
    before = cells.runs(cells.a_east, ACME)

    # When acme is sent to cell b directly (a base URL, not the map), though the dev key is granted every tenant
    with (
        AdmissionClient(cells.b.url, region=EAST, credentials=credentials) as wrong,
        pytest.raises(Forbidden) as refused,
    ):
        wrong.spawn(ACME, "wf/cells", {}, dispatch_key="wrong-cell-1")

    # Then cell b refused it, and neither table holds the key
    assert refused.value.problem is not None
    assert (refused.value.status, refused.value.problem.type) == (403, "urn:poimen:problem:tenant-not-served")
    assert cells.runs(cells.b, ACME) == set()
    assert cells.runs(cells.a_east, ACME) == before
    assert keyed_run_id(ACME, "wrong-cell-1") not in before


def test_failover_stays_within_the_cell(cells: Cells, capsys: pytest.CaptureFixture[str]) -> None:
    # Given cell a's us-east-1 API gone (killed, as a Region's outage)
    cells.a_east.process.kill()
    cells.a_east.process.wait()

    # When acme spawns through the map, with the library and with poimen runs
    with cells.client() as api:
        spawned = api.spawn(ACME, "wf/cells", {}, dispatch_key="failover-1")
        globex = api.spawn(GLOBEX, "wf/cells", {}, dispatch_key="failover-1")
    argv = ["spawn", "--cells", str(cells.map_file), "--tenant", ACME, "--workflow-ref", "wf/cells", "--input", "{}"]
    code = runs.main([*argv, "--dispatch-key", "failover-2", "--dev-key", "--timeout", "5"])

    # Then cell a's us-west-2 API admitted both, in cell a's table; cell b was not asked for acme
    assert (spawned.endpoint, code) == (RegionalEndpoint(cells.a_west.url, WEST), 0), capsys.readouterr().err
    assert globex.endpoint.url == cells.b.url
    assert {keyed_run_id(ACME, "failover-1"), keyed_run_id(ACME, "failover-2")} <= cells.runs(cells.a_west, ACME)
    assert cells.runs(cells.b, ACME) == set()
