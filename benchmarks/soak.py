"""Soak: dispatch messages through a real broker and `poimen dev` while both are knocked over.

10,000 keyed dispatch messages over two tenants (with `--tenants 2,100`, the same messages again over 100),
30 % of them published a second time later in the stream, go through a local KRaft broker and a `poimen dev`
subprocess (its local MSK event source and relay) while `poimen dev` is killed with SIGKILL twice and the
broker is restarted once. The table, the relay's DLQ and its failed-batches bucket live in a moto server of
this script's own, so they outlive `poimen dev`. The outbox relay of `poimen dev` publishes each run to
`poimen.<tenant>.events` meanwhile. Then the pipeline checker (tests/history/pipeline.py) judges what was
left: every dispatch_key exactly one run, nothing dead-lettered or parked, every run exactly one event (its
`ce_id` the id of a stored admission, poimen.ids.admission_id, on its own tenant's topic), every event a
run's, and every duplicate (after a kill or the broker's restart) identical to the first copy.
tests/integration/test_pipeline_history.py runs a bounded stream, keyless dispatches included (published
without a key by name, `DispatchPublisher.publish_without_dispatch_key`), through `run_stream`.

Each soak's tenants are generated ids the template accepts, as long as a stack's `Tenants` list allows (half
of them at the longest: 29 characters at 100 tenants), each dispatch's tenant drawn at random, so the stream
spreads over every tenant's `poimen.<tenant>.dispatch` topic; the keys, inputs, duplicates and their order
are the same whatever the number of tenants.

Run: `make soak`, or `.venv/bin/python -m benchmarks.soak --messages 500` for a quick check. Prints one
table a soak, then, for several tenant counts, one table of their throughput and relay lag side by side.
Exit codes: 0 the soak held (the pipeline check passed, every disruption was made);
1 it did not (the keys at fault are named);
2 the local stack could not start (the one-line cause is printed); 130 interrupted (every process it
started is stopped).
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import random
import re
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config

from benchmarks.harness import run_in_work_folder
from poimen.contract import RunRequest
from poimen.dispatch import DispatchPublisher
from poimen.kafka import dispatch_topic
from poimen_tools.deploy_check import MAX_TENANT_CHARACTERS, limit_refusal
from poimen_tools.local.event_source import local_relay_group
from poimen_tools.local.kafka_broker import BrokerError, KafkaBroker, free_port
from poimen_tools.local.processes import SessionProcess, kill_group
from poimen_tools.local.stream_source import LOCAL_STACK, positions_file
from poimen_tools.topics import ensure_topics
from tests.history.observe import (
    Uncommitted,
    read_dead_letters,
    read_dispatches,
    read_events,
    read_parked,
    redeliveries,
    scan_runs,
)
from tests.history.pipeline import Dispatched, Pipeline, Redelivery, Spawn
from tests.history.pipeline import Report as PipelineReport
from tests.history.pipeline import check as check_pipeline

REPO = Path(__file__).resolve().parent.parent
POIMEN = Path(sys.executable).parent / "poimen"
# The longest tenant id the template's Tenants pattern takes.
MAX_TENANT_ID = 63
PARTITIONS = 6
TABLE = "poimen-admission-local"  # `poimen dev`'s defaults, which this script leaves as they are
DLQ = "poimen-relay-dlq-local"
# What `poimen dev` announces and the soak reads back (the same after every restart).
ANNOUNCED = ("Admission API", "Relay dead-letter queue", "Kafka bootstrap", "Failed batches (S3)", "Outbox relay")
# The consumer group `poimen dev`'s event source uses; its committed offsets count the records handled.
RELAY_GROUP = local_relay_group(TABLE)
# The outbox's failed-batches bucket, in its banner line: "... (failed batches, S3: <bucket>; ...".
OUTBOX_BUCKET = re.compile(r"S3: ([^;)\s]+)")
# A moto server in its own process, with the item writes serialised as in `poimen dev` (DynamoDB's
# writes are atomic per item; bare moto checks a condition and writes with no lock in between).
MOTO_SERVER = (
    "import signal, sys\n"
    "from poimen_tools.local.moto import EmbeddedMoto\n"
    "with EmbeddedMoto(int(sys.argv[1])):\n"
    "    signal.pause()\n"
)
# The busiest stretch of a soak whose admissions a second it reports: the relay catching up after a disruption.
PEAK_WINDOW_SECONDS = 10.0
# Bound of one committed-offset look-up (benchmarks.committed), its start included.
LOOKUP_SECONDS = 30.0
AWS = Config(connect_timeout=2, read_timeout=30, retries={"max_attempts": 3, "mode": "standard"})
# The disruptions, each at a share of the records the relay has handled: `kill` is SIGKILL of `poimen dev`'s
# process group and its restart, `broker` the broker stopped and started again.
PLAN: tuple[tuple[float, str], ...] = ((0.25, "kill"), (0.50, "broker"), (0.75, "kill"))


class StackError(RuntimeError):
    """A part of the local stack (moto, the broker, `poimen dev`) did not start."""


@dataclass(frozen=True)
class Dispatch:
    tenant: str
    request: RunRequest
    duplicate: bool


def tenant_ids(count: int) -> tuple[str, ...]:
    """`count` tenant ids one stack serves: every other one as long as the template's `Tenants` list lets all
    of them be (MAX_TENANT_CHARACTERS; 29 characters at 100 tenants), the others short ("t000")."""
    longest = min(MAX_TENANT_ID, (MAX_TENANT_CHARACTERS + 1) // count - 1)
    ids = tuple(f"t{i:03d}" if i % 2 == 0 else f"t{i:03d}-".ljust(longest, "x") for i in range(count))
    refusal = limit_refusal(list(ids), peer_aliases=0)
    if refusal is not None:
        raise ValueError(refusal)
    return ids


def build_stream(messages: int, duplicate_ratio: float, rng: random.Random, tenants: tuple[str, ...]) -> list[Dispatch]:
    """`messages` distinct keys over `tenants`; a share of them again, each copy after its original. The tenants
    are drawn from a generator of their own, so the keys, duplicates and order are `rng`'s whatever `tenants`."""
    draw = random.Random(rng.random())
    originals = [
        Dispatch(
            draw.choice(tenants),
            RunRequest(workflow_ref="wf/soak", input={"n": i}, dispatch_key=f"soak-{i:06d}"),
            duplicate=False,
        )
        for i in range(messages)
    ]
    ordered = [(float(i), dispatch) for i, dispatch in enumerate(originals)]
    for i in rng.sample(range(messages), round(messages * duplicate_ratio)):
        # Anywhere after the original: the same body (a replay, not a reused key with a new payload).
        position = i + 0.5 + rng.random() * (messages - i)
        ordered.append((position, Dispatch(originals[i].tenant, originals[i].request, duplicate=True)))
    ordered.sort(key=lambda entry: entry[0])
    return [dispatch for _, dispatch in ordered]


class MotoServer:
    """The local AWS (DynamoDB, SQS, S3) in a process of its own, so its state outlives `poimen dev`."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._log = log
        self._process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> None:
        with self._log.open("ab") as out:
            self._process = subprocess.Popen(
                [sys.executable, "-c", MOTO_SERVER, str(self.port)],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                start_new_session=True,
            )
        client = self.dynamodb()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise StackError(f"the moto server exited with {self._process.returncode}; see {self._log}")
            try:
                client.list_tables()
                return
            except Exception:
                time.sleep(0.2)
        raise StackError(f"the moto server did not answer within {timeout:.0f} s; see {self._log}")

    def dynamodb(self) -> Any:
        return boto3.client("dynamodb", endpoint_url=self.endpoint, config=AWS)

    def sqs(self) -> Any:
        return boto3.client("sqs", endpoint_url=self.endpoint, config=AWS)

    def s3(self) -> Any:
        return boto3.client("s3", endpoint_url=self.endpoint, config=AWS)

    def stop(self) -> None:
        if self._process is not None:
            kill_group(self._process.pid)
            self._process.wait()
            self._process = None


class DevProcess(SessionProcess):
    """`poimen dev` as a subprocess in its own session, so its whole process group can be killed."""

    def __init__(self, folder: Path, bootstrap: str, aws_endpoint: str, tenants: tuple[str, ...]) -> None:
        super().__init__()
        self._folder = folder
        self._tenants = tenants
        self._port = free_port()
        self._bootstrap = bootstrap
        self._aws_endpoint = aws_endpoint
        self.starts = 0

    @property
    def logs(self) -> list[Path]:
        return sorted(self._folder.glob("poimen-dev-*.log"))

    def start(self, timeout: float = 180.0) -> dict[str, str]:
        """Start it; what it announced ("Failed batches (S3)": bucket, ...) once it is serving."""
        self.starts += 1
        log = self._folder / f"poimen-dev-{self.starts}.log"
        command = [str(POIMEN), "dev", "--port", str(self._port), "--kafka-bootstrap", self._bootstrap]
        # Every service on this script's moto server: the table, the DLQ and the failed-batches bucket
        # must outlive `poimen dev` (its embedded moto would die with it).
        for service in ("dynamodb", "sqs", "s3"):
            command += [f"--{service}-endpoint", self._aws_endpoint]
        command += ["--table-name", TABLE, "--dlq-name", DLQ, "--tenants", ",".join(self._tenants)]
        with log.open("ab") as out:  # append mode: the execution environments share this file
            self.process = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                start_new_session=True,
                # INFO: the admission handler logs each run it admits or replays, counted below.
                env={**os.environ, "POWERTOOLS_LOG_LEVEL": "INFO"},
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = log.read_text(errors="replace")[-2000:]
                raise StackError(f"poimen dev exited with {self.process.returncode}; see {log}:\n{tail}")
            text = log.read_text(errors="replace")
            if "Kafka bootstrap: " in text:
                lines = dict(line.split(": ", 1) for line in text.splitlines() if ": " in line)
                return {name: lines[name].strip() for name in ANNOUNCED}
            time.sleep(0.2)
        raise StackError(f"poimen dev did not announce itself within {timeout:.0f} s; see {log}")


class Publisher(threading.Thread):
    """Publishes the stream at a steady rate, recording when each key was first published."""

    def __init__(self, bootstrap: str, stream: list[Dispatch], rate: float) -> None:
        super().__init__(name="soak-publisher", daemon=True)
        # log_level 0: while the broker restarts librdkafka would print each refused connection; the
        # delivery reports still say whether every record made it.
        self._publisher = DispatchPublisher(bootstrap, log_level=0)
        self._stream = stream
        self._rate = rate
        self.published = 0
        self.first_published: dict[tuple[str, str], float] = {}
        self.failure: str | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            start = time.monotonic()
            for index, dispatch in enumerate(self._stream):
                if self._rate > 0:
                    delay = start + index / self._rate - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
                key = (dispatch.tenant, dispatch.request.dispatch_key or "")
                self.first_published.setdefault(key, time.time())
                if dispatch.request.dispatch_key is None:
                    # A keyless dispatch of the stream (tests/integration/test_pipeline_history.py), asked for by
                    # name: the at-least-once delivery the pipeline check bounds. The publisher would key it.
                    self._publisher.publish_without_dispatch_key(dispatch.tenant, dispatch.request)
                else:
                    self._publisher.publish(dispatch.tenant, dispatch.request)
                self.published = index + 1
            self._publisher.flush(300)
        except Exception as error:
            self.failure = f"{type(error).__name__}: {error}"
        finally:
            self.done.set()


class Relay:
    """How far the relay in `poimen dev` has got: the offsets its consumer group committed, looked up in a
    process of its own (benchmarks.committed: librdkafka's admin client can abort the process it runs in at a
    broker restart), started again when it dies or does not answer within LOOKUP_SECONDS."""

    def __init__(self, bootstrap: str, tenants: tuple[str, ...]) -> None:
        self._command = [sys.executable, "-m", "benchmarks.committed", bootstrap, RELAY_GROUP]
        self._lookups: subprocess.Popen[str] | None = None
        self.failed_lookups = 0
        self._partitions = json.dumps(
            [[dispatch_topic(tenant), partition] for tenant in tenants for partition in range(PARTITIONS)]
        )

    def handled(self) -> int | None:
        """Records handled (committed), or None while the broker does not answer."""
        committed = self.committed()
        return None if committed is None else sum(committed.values())

    def committed(self) -> dict[tuple[str, int], int] | None:
        """The group's committed offset of each dispatch partition, or None while the broker does not answer."""
        try:
            answer = json.loads(self._ask())
        except (OSError, ValueError):  # it died, or did not answer in time: the next look-up starts another
            self.close()
            answer = None
        if not isinstance(answer, list):
            self.failed_lookups += 1
            return None
        return {(topic, partition): offset for topic, partition, offset in answer}

    def _ask(self) -> str:
        """One look-up's answer line, from the look-up process (started if there is none)."""
        if self._lookups is None:
            self._lookups = subprocess.Popen(
                self._command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                cwd=REPO,
            )
        lookups = self._lookups
        assert lookups.stdin is not None
        assert lookups.stdout is not None
        lookups.stdin.write(self._partitions + "\n")
        lookups.stdin.flush()
        # One answer line a look-up, so nothing is left in the pipe's buffer when it is read.
        if not select.select([lookups.stdout], [], [], LOOKUP_SECONDS)[0]:
            raise TimeoutError(f"no answer within {LOOKUP_SECONDS:.0f} s")
        line = lookups.stdout.readline()
        if not line:
            raise ConnectionError("the look-up process ended")
        return line

    def close(self) -> None:
        """End the look-up process, if there is one."""
        if self._lookups is not None:
            self._lookups.kill()
            self._lookups.wait()
            self._lookups = None

    def wait_committed(self, timeout: float) -> dict[tuple[str, int], int] | None:
        """The committed offsets, once the broker answers; None if it does not within `timeout` (not {}: that
        would say nothing was committed, and every record could come again)."""
        deadline = time.monotonic() + timeout
        while (committed := self.committed()) is None and time.monotonic() < deadline:
            time.sleep(0.2)
        return committed

    def wait_beyond(self, handled: int, timeout: float, progress: Callable[[], None]) -> bool:
        """Whether more than `handled` records are handled within `timeout` seconds."""
        return _wait(lambda: (self.handled() or 0) > handled, timeout, poll=0.2, progress=progress)


@dataclass
class Disruption:
    name: str
    at_handled: int
    down_seconds: float = 0.0
    resumed_after: float | None = None  # from back up to the relay's next commit
    detail: str = ""
    # The relay's committed offsets when its batches in flight were lost: what it may be given again.
    uncommitted: Uncommitted | None = None


@dataclass
class Outcome:
    runs: int = 0
    created: dict[tuple[str, str], float] = field(default_factory=dict)  # keyed runs' created_at, epoch s
    handled: int | None = None
    dead_letters_approximate: int = 0  # the queue's own count, beside the letters the check received
    check: PipelineReport | None = None


@dataclass
class Soaked:
    """One run of a stream through the stack under the disruptions, and what the pipeline check made of it."""

    stream: list[Dispatch]
    tenants: tuple[str, ...]
    publisher: Publisher
    outcome: Outcome
    disruptions: list[Disruption]
    admissions: dict[str, int]

    @property
    def report(self) -> PipelineReport:
        assert self.outcome.check is not None
        return self.outcome.check


def _log(started: float, text: str) -> None:
    print(f"[{time.monotonic() - started:7.1f}s] {text}", file=sys.stderr, flush=True)


def _wait(
    condition: Callable[[], bool], timeout: float, poll: float = 0.5, progress: Callable[[], None] | None = None
) -> bool:
    """Poll `condition` until it holds or `timeout` passes; `progress` is called every 30 s meanwhile."""
    deadline = time.monotonic() + timeout
    reported = time.monotonic()
    while time.monotonic() < deadline:
        if condition():
            return True
        if progress is not None and time.monotonic() - reported >= 30:
            progress()
            reported = time.monotonic()
        time.sleep(poll)
    return condition()


def _progress(started: float, publisher: Publisher, relay: Relay) -> None:
    _log(started, f"published {publisher.published}, handled {relay.handled()}")


def _count_runs(dynamodb: Any) -> int:
    pages = dynamodb.get_paginator("scan").paginate(
        TableName=TABLE,
        Select="COUNT",
        FilterExpression="begins_with(pk, :p)",
        ExpressionAttributeValues={":p": {"S": "RUN#"}},
    )
    return sum(page["Count"] for page in pages)


def dispatched(stream: list[Dispatch], redelivered: dict[tuple[str, str], list[Redelivery]]) -> list[Dispatched]:
    """The stream as the pipeline check reads it: each dispatch once, with its copies and, for a keyless one
    (told by its tenant and the `marker` of its input), why the relay may have been given it again."""
    found: dict[tuple[str, str | None, str | None], int] = {}
    spawns: dict[tuple[str, str | None, str | None], Spawn] = {}
    for dispatch in stream:
        request = dispatch.request
        marker = None if request.dispatch_key is not None else str(request.input.get("marker"))
        name = (dispatch.tenant, request.dispatch_key, marker)
        found[name] = found.get(name, 0) + 1
        spawn = Spawn.of(request.workflow_ref, request.input, request.goal_id)
        if spawns.setdefault(name, spawn) != spawn:  # its copies are replays: the same body
            raise ValueError(f"{name} is dispatched with two bodies: {spawns[name]}, {spawn}")
    return [
        Dispatched(
            tenant,
            key,
            marker,
            copies,
            tuple(redelivered.get((tenant, marker or ""), ())) if key is None else (),
            spawn=spawns[(tenant, key, marker)],
        )
        for (tenant, key, marker), copies in found.items()
    ]


def _observe_and_check(
    moto: MotoServer,
    bootstrap: str,
    announced: dict[str, str],
    soaked: Soaked,
    timeout: float,
) -> None:
    """Read what the pipeline left (while `poimen dev`'s outbox still publishes the last runs' events) and
    check it (tests/history/pipeline.py)."""
    outcome = soaked.outcome
    runs = scan_runs(moto.dynamodb(), TABLE)
    outcome.runs = len(runs)
    outcome.created = {
        (run.tenant, run.dispatch_key): datetime.fromisoformat(run.created_at.replace("Z", "+00:00")).timestamp()
        for run in runs
        if run.dispatch_key is not None
    }
    letters, outcome.dead_letters_approximate = read_dead_letters(moto.sqs(), announced["Relay dead-letter queue"])
    parked = read_parked(moto.s3(), announced["Failed batches (S3)"], "relay")
    events = read_events(bootstrap, soaked.tenants, runs, timeout)
    outbox_bucket = OUTBOX_BUCKET.search(announced["Outbox relay"])
    if outbox_bucket is None:
        raise StackError(f"poimen dev announced no outbox bucket: {announced['Outbox relay']}")
    parked += read_parked(moto.s3(), outbox_bucket[1], "outbox")
    records = read_dispatches(bootstrap, soaked.tenants, soaked.publisher.published, timeout)
    again = redeliveries(records, [d.uncommitted for d in soaked.disruptions if d.uncommitted is not None])
    pipeline = Pipeline(
        dispatched(soaked.stream, again.by_dispatch),
        runs,
        events,
        letters,
        parked,
        stack=LOCAL_STACK,
        unobserved=again.unobserved,
    )
    outcome.check = check_pipeline(pipeline)


def _admissions(logs: list[Path]) -> dict[str, int]:
    """The handler's own account of each POST it served: "run admitted" / "run replayed" lines."""
    counts = {"run admitted": 0, "run replayed": 0}
    for log in logs:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("{") and ('"run admitted"' in line or '"run replayed"' in line):
                try:
                    message = json.loads(line)["message"]
                except (ValueError, KeyError):
                    continue
                counts[message] = counts.get(message, 0) + 1
    return counts


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(share * len(ordered)) - 1))]


def soak(args: argparse.Namespace, folder: Path, tenants: tuple[str, ...]) -> tuple[int, Figures]:
    """One soak over `tenants` in `folder`: its exit code and figures."""
    stream = build_stream(args.messages, args.duplicate_ratio, random.Random(args.seed), tenants)
    soaked = run_stream(folder, stream, tenants, rate=args.rate, timeout=args.timeout)
    figures = Figures.of(tenants, soaked.publisher.first_published, soaked.outcome.created)
    return _report(args, soaked, figures), figures


def run_stream(
    folder: Path,
    stream: list[Dispatch],
    tenants: tuple[str, ...],
    *,
    rate: float,
    timeout: float,
    plan: tuple[tuple[float, str], ...] = PLAN,
) -> Soaked:
    """Publish `stream` through a stack serving `tenants` at `rate` a second under the disruptions of `plan`,
    wait (`timeout` each time) until the relay has handled every record and each dispatch is a run, and check
    the pipeline."""
    started = time.monotonic()
    duplicates = sum(dispatch.duplicate for dispatch in stream)
    distinct = len(dispatched(stream, {}))
    moto = MotoServer(folder / "moto.log")
    broker = KafkaBroker(folder / "kafka")
    dev: DevProcess | None = None
    relay: Relay | None = None
    disruptions: list[Disruption] = []
    try:
        moto.start()
        broker.start()
        _log(started, f"moto {moto.endpoint}, broker {broker.bootstrap_servers}")
        ensure_topics(broker.bootstrap_servers, tenants, partitions=PARTITIONS, replication_factor=1)
        dev = DevProcess(folder, broker.bootstrap_servers, moto.endpoint, tenants)
        announced = dev.start()
        relay = Relay(broker.bootstrap_servers, tenants)
        _log(started, f"poimen dev up; publishing {len(stream)} messages ({duplicates} duplicates)")
        publisher = Publisher(broker.bootstrap_servers, stream, rate)
        publisher.start()
        soaked = Soaked(stream, tenants, publisher, Outcome(), disruptions, {})
        dynamodb = moto.dynamodb()

        def kill_dev(disruption: Disruption) -> int:
            assert dev is not None
            disruption.detail = f"{dev.kill()} processes in its group killed"
            at_ms = time.time() * 1000
            # Exact: nothing commits for the group until a restarted relay has rejoined it.
            committed = relay.wait_committed(60.0)
            disruption.uncommitted = Uncommitted(disruption.name, at_ms, committed)
            return disruption.at_handled if committed is None else sum(committed.values())

        def stop_broker(disruption: Disruption) -> int:
            # The offsets just before it goes away: a commit meanwhile only shrinks what may come again.
            committed = relay.wait_committed(60.0)
            broker.stop()
            disruption.uncommitted = Uncommitted(disruption.name, time.time() * 1000, committed)
            return disruption.at_handled

        def start_dev() -> None:
            assert dev is not None
            if dev.start() != announced:
                raise StackError("poimen dev announced other endpoints after a restart")

        kinds: dict[str, tuple[str, Callable[[Disruption], int], Callable[[], None]]] = {
            "kill": ("SIGKILL poimen dev (group)", kill_dev, start_dev),
            "broker": ("broker stop + start", stop_broker, broker.start),
        }
        kills = 0
        # Each at a share of the records the relay has handled, so each lands mid-stream, after the
        # relay recovered from the one before: take it down (-> records handled), bring it back.
        for share, kind in plan:
            name, take_down, bring_back = kinds[kind]
            if kind == "kill":
                kills += 1
                name += f" #{kills}"
            threshold = int(share * len(stream))
            if not relay.wait_beyond(threshold - 1, timeout, lambda: _progress(started, publisher, relay)):
                _log(started, f"the relay did not reach {threshold} handled records within {timeout:.0f} s")
                break
            disruption = Disruption(name, relay.handled() or 0)
            _log(started, f"{name} at {disruption.at_handled} handled, {publisher.published} published")
            down = time.monotonic()
            handled = take_down(disruption)
            bring_back()
            back = time.monotonic()
            disruption.down_seconds = back - down
            # The first commit after it is back: the relay (re)joined its group and handled a batch.
            if handled < len(stream) and relay.wait_beyond(handled, timeout, lambda: None):
                disruption.resumed_after = time.monotonic() - back
            disruptions.append(disruption)
            resumed = "-" if disruption.resumed_after is None else f"{disruption.resumed_after:.1f} s"
            _log(
                started,
                f"back after {disruption.down_seconds:.1f} s; relay resumed after {resumed} "
                f"({relay.failed_lookups} failed offset look-ups so far)",
            )

        if not publisher.done.wait(timeout):
            _log(started, "the publisher did not finish in time")
        _log(started, f"published {publisher.published}; waiting for {distinct} runs")
        finished = _wait(
            # The cheap check first: a scan of the whole table is only worth it once every record is handled.
            lambda: (relay.handled() or 0) >= len(stream) and _count_runs(dynamodb) >= distinct,
            timeout,
            poll=2.0,
            progress=lambda: _progress(started, publisher, relay),
        )
        if not finished:
            _log(started, f"deadline: not every record was handled within {timeout} s")
        soaked.outcome.handled = relay.handled()
        _log(started, f"checking the pipeline: the table, {len(tenants)} tenants' poimen.<tenant>.events, DLQ, S3")
        _observe_and_check(moto, broker.bootstrap_servers, announced, soaked, timeout)
        dev.stop()
        soaked.admissions.update(_admissions(dev.logs))
    finally:
        if relay is not None:
            relay.close()
        if dev is not None:
            dev.stop()
        broker.stop()
        # The outbox's stream checkpoints of this soak's table, which `poimen dev` keeps between its starts.
        positions_file(moto.endpoint, TABLE).unlink(missing_ok=True)
        moto.stop()
    return soaked


@dataclass(frozen=True)
class Figures:
    """A soak's throughput and relay lag: runs admitted a second, over the soak and at its busiest
    PEAK_WINDOW_SECONDS (the relay catching up after a disruption), and each key's first publish -> its run's
    admission (created_at), in seconds."""

    tenants: tuple[str, ...]
    runs: int
    wall: float
    peak_rate: float
    latencies: list[float]

    @classmethod
    def of(
        cls, tenants: tuple[str, ...], published: dict[tuple[str, str], float], created: dict[tuple[str, str], float]
    ) -> Figures:
        first = min(published.values(), default=0.0)
        last = max(created.values(), default=first)
        stamps = sorted(created.values())
        window = PEAK_WINDOW_SECONDS
        busiest = max((bisect.bisect_right(stamps, at + window) - i for i, at in enumerate(stamps)), default=0)
        latencies = [created[key] - at for key, at in published.items() if key in created]
        return cls(tenants, len(created), max(last - first, 1e-9), busiest / window, latencies)

    @property
    def rate(self) -> float:
        return self.runs / self.wall

    def lag(self, share: float) -> str:
        return f"{_percentile(self.latencies, share):.2f}" if self.latencies else "-"


def _compare(runs: list[Figures]) -> None:
    """The soaks' throughput and relay lag side by side, one column a tenant count."""
    print(f"\nThroughput and relay lag by tenants (the same {runs[0].runs} keys' stream, one machine, one run)\n")
    rows = [
        ("tenants (topics poimen.<tenant>.dispatch)", [f"{len(run.tenants)}" for run in runs]),
        ("longest tenant id (characters)", [f"{max(map(len, run.tenants))}" for run in runs]),
        ("runs admitted", [f"{run.runs}" for run in runs]),
        ("runs/s admitted (runs / wall time)", [f"{run.rate:.1f}" for run in runs]),
        (f"runs/s admitted, busiest {PEAK_WINDOW_SECONDS:.0f} s", [f"{run.peak_rate:.1f}" for run in runs]),
        ("relay lag p50 (s, publish -> admission)", [run.lag(0.5) for run in runs]),
        ("relay lag p99 (s)", [run.lag(0.99) for run in runs]),
        ("relay lag max (s)", [run.lag(1.0) for run in runs]),
    ]
    for name, values in rows:
        print(f"{name:42} " + " ".join(f"{value:>10}" for value in values))


def _report(args: argparse.Namespace, soaked: Soaked, figures: Figures) -> int:
    publisher, outcome, disruptions, report = soaked.publisher, soaked.outcome, soaked.disruptions, soaked.report
    tenants, wall = soaked.tenants, figures.wall
    received = sum(report.dead_letters.values())
    # The checker judges the letters it received; the queue's own count says none was left unread.
    held = report.ok and publisher.failure is None and outcome.dead_letters_approximate <= received

    print(
        f"\nSoak: {args.messages} dispatch keys over {len(tenants)} tenants ({tenants[0]} ... {tenants[-1]}), "
        f"{args.duplicate_ratio:.0%} published "
        f"twice, seed {args.seed}, publish rate {args.rate or 'unpaced'}/s\n"
    )
    rows = [
        ("messages published", f"{publisher.published}"),
        ("  of which duplicates", f"{sum(dispatch.duplicate for dispatch in soaked.stream)}"),
        ("records handled by the relay (committed)", f"{outcome.handled}"),
        ("msgs/s (runs / wall time)", f"{outcome.runs / wall:.1f}"),
        ("wall time, first publish -> last run (s)", f"{wall:.1f}"),
        ("p50 publish -> run latency (s)", figures.lag(0.5)),
        ("p99 publish -> run latency (s)", figures.lag(0.99)),
        ("max publish -> run latency (s)", figures.lag(1.0)),
        ("dead letters (queue's approximate count)", f"{outcome.dead_letters_approximate}"),
        (
            "API answers (poimen dev logs)",
            f"{soaked.admissions.get('run admitted', 0)} admitted, {soaked.admissions.get('run replayed', 0)} replayed",
        ),
        *report.figures(),
    ]
    if publisher.failure:
        rows.append(("publisher failure", publisher.failure))
    for name, value in rows:
        print(f"{name:42} {value}")
    print(f"\n{'disruption':32} {'at handled':>10} {'down (s)':>9} {'relay resumed after (s)':>24}")
    print("-" * 78)
    for disruption in disruptions:
        # "-": nothing was left to handle when it came back, or the relay never resumed (then runs are short)
        resumed = f"{disruption.resumed_after:.1f}" if disruption.resumed_after is not None else "-"
        print(
            f"{disruption.name:32} {disruption.at_handled:10d} {disruption.down_seconds:9.1f} {resumed:>24}"
            + (f"  ({disruption.detail})" if disruption.detail else "")
        )
    print(f"\n{'PASS' if held else 'FAIL'}: {report.summary()}")
    return 0 if held and len(disruptions) == len(PLAN) else 1


def tenant_counts(value: str) -> tuple[int, ...]:
    """Numbers of tenants, comma-separated, each a list of tenant_ids one stack serves."""
    try:
        counts = tuple(int(count) for count in value.split(","))
        for count in counts:
            if count < 1:
                raise ValueError(f"{count} tenants")
            tenant_ids(count)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error
    return counts


def soak_each(args: argparse.Namespace, folder: Path) -> int:
    """A soak over each of `args.tenants` tenant counts, each in a folder of its own; then, for more than one,
    their figures side by side. The worst exit code."""
    results = []
    for count in args.tenants:
        (folder / f"tenants-{count}").mkdir()
        results.append(soak(args, folder / f"tenants-{count}", tenant_ids(count)))
    if len(results) > 1:
        _compare([figures for _, figures in results])
    return max(code for code, _ in results)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=10_000, help="distinct dispatch keys (default: %(default)s)")
    parser.add_argument(
        "--duplicate-ratio", type=float, default=0.3, help="share published twice (default: %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=1, help="tenants and duplicate positions (default: %(default)s)")
    parser.add_argument(
        "--rate", type=float, default=40.0, help="messages published per second, 0 for unpaced (default: %(default)s)"
    )
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="bound of each wait, seconds (default: %(default)s)"
    )
    parser.add_argument(
        "--tenants",
        type=tenant_counts,
        default=(2,),
        metavar="N[,N...]",
        help="a soak over each number of tenants, one after the other, the same messages (default: 2)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, broker data) on success")
    args = parser.parse_args()
    if args.messages < 4 or not 0 <= args.duplicate_ratio <= 1:
        parser.error("--messages must be at least 4 and --duplicate-ratio within [0, 1]")
    return run_in_work_folder(
        "soak",
        lambda folder: soak_each(args, folder),
        cannot_run=(StackError, BrokerError),
        cause="the local stack did not start",
        kept="logs and broker data",
        keep=args.keep,
    )


if __name__ == "__main__":
    sys.exit(main())
