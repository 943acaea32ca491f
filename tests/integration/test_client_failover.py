"""Callers fail over between Regions: two `poimen dev`s, us-east-1 and us-west-2, each verifying signatures
for its own Region only, share one table (us-west-2's through --table-region us-east-1, on a moto server
that outlives both, as a global table outlives a Region's outage). us-east-1's is killed in the middle of a
stream of keyed spawns; the client moves to us-west-2 and the table holds exactly one run per key."""

from __future__ import annotations

import io
import json
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pytest

from poimen.client import AdmissionClient, Forbidden, RegionalEndpoint, Spawned
from poimen.ids import keyed_run_id
from poimen_tools import runs
from tests.conftest import count_runs
from tests.integration.conftest import DevServer, free_port, start_dev, wait_for

EAST, WEST = "us-east-1", "us-west-2"


@dataclass
class TwoRegions:
    east: DevServer
    west: DevServer
    table_name: str

    @property
    def endpoints(self) -> list[RegionalEndpoint]:
        """us-east-1 first, as a caller near it would list them."""
        return [RegionalEndpoint(self.east.url, EAST), RegionalEndpoint(self.west.url, WEST)]


@pytest.fixture
def regions(dev: DevServer, tmp_path: Path) -> Iterator[TwoRegions]:
    """Both Regions' `poimen dev` on one table of the session's moto server (us-east-1's), no Kafka."""
    table = f"poimen-failover-{uuid.uuid4().hex[:8]}"
    shared = ("--dynamodb-endpoint", dev.aws_endpoint, "--concurrency", "2", "--no-kafka")
    (tmp_path / "east").mkdir()
    (tmp_path / "west").mkdir()
    east = start_dev(tmp_path / "east", "--region", EAST, *shared, table_name=table)
    try:
        west = start_dev(tmp_path / "west", "--region", WEST, "--table-region", EAST, *shared, table_name=table)
    except BaseException:
        east.stop()
        raise
    try:
        yield TwoRegions(east, west, table)
    finally:
        west.stop()
        east.stop()  # a killed one has stopped already: its exit status is the signal's


def test_callers_fail_over_when_a_region_dies_mid_stream(dev: DevServer, regions: TwoRegions, tenant: str) -> None:
    # Given a client listing us-east-1 then us-west-2, and a stream of keyed spawns, each key twice in a row
    keys = [f"order-{n}" for n in range(30)]
    stream = [key for key in keys for _ in range(2)]
    answered: list[Spawned] = []
    lock = threading.Lock()
    client = AdmissionClient(regions.endpoints, timeout=5.0, backoff_base=0.05, max_attempts=5)

    def spawn(key: str) -> Spawned:
        spawned = client.spawn(tenant, "wf/failover", {"key": key}, dispatch_key=key)
        with lock:
            answered.append(spawned)
        return spawned

    with client, ThreadPoolExecutor(max_workers=4) as pool:
        futures = [pool.submit(spawn, key) for key in stream]
        # When us-east-1's poimen dev is killed (SIGKILL) once a quarter of the stream is answered, the
        # spawns in flight then losing their connection
        wait_for(lambda: len(answered) >= 15, timeout=60, what="a quarter of the stream to be answered")
        regions.east.process.kill()
        regions.east.process.wait()
        with lock:
            at_kill = len(answered)
        assert at_kill <= len(stream) // 2, "the stream ended too soon for the kill to be mid-stream"
        results = [future.result() for future in futures]

        # Then every spawn was answered: the first ones by us-east-1 (at most those answered by the kill and
        # the 4 in flight), the rest by us-west-2, some of them after a failed attempt at us-east-1
        by_region = Counter(spawned.endpoint.region for spawned in results)
        assert 15 <= by_region[EAST] <= at_kill + 4
        assert by_region[WEST] == len(stream) - by_region[EAST]
        assert any(spawned.attempts > 1 for spawned in results if spawned.endpoint.region == WEST)
        assert client.endpoint == RegionalEndpoint(regions.west.url, WEST)  # where it stays
        # and both spawns of a key answered its one run, admitted by at most one of them
        for key in keys:
            spawns = spawns_of(results, key)
            assert {spawned.run_id for spawned in spawns} == {keyed_run_id(tenant, key)}
            assert sum(not spawned.replayed for spawned in spawns) <= 1
        assert client.find(tenant, keys[0]) == spawns_of(results, keys[0])[0].run

    # And the one table holds exactly one run per key
    items = count_runs(dev.dynamodb(), regions.table_name, tenant)
    assert sorted(item["dispatch_key"]["S"] for item in items) == sorted(keys)


def spawns_of(results: list[Spawned], key: str) -> list[Spawned]:
    return [spawned for spawned in results if spawned.run.dispatch_key == key]


def poimen_runs(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = runs.main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_each_region_verifies_its_own_signatures_and_poimen_runs_fails_over(
    dev: DevServer, regions: TwoRegions, tenant: str
) -> None:
    # Given us-west-2's poimen dev, which refuses a call signed for us-east-1
    with AdmissionClient(RegionalEndpoint(regions.west.url, EAST)) as misdirected, pytest.raises(Forbidden) as refused:
        misdirected.find(tenant, "k")
    assert refused.value.status == 403
    assert f"not '{EAST}'" in refused.value.body["message"]

    # When poimen runs spawns with a first --base-url nothing answers and us-west-2's as REGION=URL
    closed = f"http://127.0.0.1:{free_port()}"
    where = ("--base-url", closed, "--base-url", f"{WEST}={regions.west.url}", "--tenant", tenant)
    spawn = ("spawn", *where, "--workflow-ref", "wf/cli", "--input", '{"n": 1}', "--dispatch-key", "cli-1")
    code, out, err = poimen_runs(*spawn)
    # and finds the run through us-east-1's endpoint first
    east_first = ("--base-url", regions.east.url, "--base-url", f"{WEST}={regions.west.url}", "--tenant", tenant)
    found = poimen_runs("find", *east_first, "cli-1")

    # Then the spawn landed in us-west-2, signed for it, in the table us-east-1 reads too: one run
    assert (code, err) == (0, "")
    run = json.loads(out)["run"]
    assert run["run_id"] == keyed_run_id(tenant, "cli-1")
    assert (found[0], json.loads(found[1])) == (0, run)
    assert len(count_runs(dev.dynamodb(), regions.table_name, tenant)) == 1
