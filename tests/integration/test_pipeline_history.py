"""The whole pipeline's history (dispatch → inbox relay → admission → outbox) holds under a kill and a broker
restart, as the pipeline checker judges it (tests/history/pipeline.py): keyed dispatches over two tenants, a
share of them published twice, and keyless ones carrying a unique marker go through a real broker and `poimen
dev` (its local MSK event source, relay, admission and outbox) while `poimen dev`'s process group is killed
with SIGKILL and restarted, and the broker is stopped and started again. The soak's own stack and run
(benchmarks/soak.py), bounded; `make soak` runs it long. The check is not vacuous:
tests/unit/test_pipeline_checker.py holds it to bad pipelines written by hand."""

from __future__ import annotations

import random
import uuid
from pathlib import Path

import pytest

from benchmarks.soak import Dispatch, build_stream, run_stream, tenant_ids
from poimen.contract import RunRequest

KEYED = 150
KEYLESS = 40
# One of each disruption, mid-stream: about two minutes on two loaded cores.
PLAN = ((0.3, "kill"), (0.6, "broker"))
TENANTS = tenant_ids(2)


# Its keyless dispatches are asked for by name (benchmarks.soak.Publisher): the warning each one makes is expected.
@pytest.mark.filterwarnings("ignore::poimen.dispatch.KeylessDispatchWarning")
def test_the_pipeline_under_a_kill_and_a_broker_restart_is_a_bijection_of_runs_and_events(tmp_path: Path) -> None:
    """Over 60 s (about two and a half minutes on two cores): a broker and `poimen dev` of its own (it kills one and
    restarts the other), 190 dispatches at 40 a second, each disruption waiting for the relay to resume. 150 keyed
    with 30 % duplicates and 40 keyless over two tenants is what puts records in flight at both disruptions (the
    redeliveries and replays asserted below); `make soak` runs 10,000."""
    # Given keyed dispatches with 30 % duplicates and keyless ones (published without a key, by name), interleaved
    # over both tenants
    rng = random.Random(29)
    stream = build_stream(KEYED, 0.3, rng, TENANTS)
    for _ in range(KEYLESS):
        request = RunRequest(workflow_ref="wf/soak", input={"marker": str(uuid.uuid4())})
        stream.insert(rng.randrange(len(stream) + 1), Dispatch(rng.choice(TENANTS), request, duplicate=False))
    # When they are published through poimen dev while it is killed and the broker restarted
    soaked = run_stream(tmp_path, stream, TENANTS, rate=40.0, timeout=120.0, plan=PLAN)
    report = soaked.report
    print(f"\n{report.figures()}\n{[(d.name, round(d.down_seconds, 1)) for d in soaked.disruptions]}")
    # Then every dispatch is one run (or a keyless one redelivered, again), every run one event
    assert report.ok, report.summary()
    assert soaked.publisher.failure is None
    assert [disruption.name for disruption in soaked.disruptions] == [
        "SIGKILL poimen dev (group) #1",
        "broker stop + start",
    ]
    assert (report.dispatches, report.keyless) == (KEYED + KEYLESS, KEYLESS)
    assert report.runs >= KEYED + KEYLESS
    assert report.events >= report.runs
    # And the relay was given records again (the duplicates, and what was in flight at the disruptions)
    assert (soaked.outcome.handled or 0) >= len(stream)
    assert soaked.admissions["run replayed"] > 0
