"""Relay benchmark: 1,000 dispatch records relayed to the local API, on the batch path (a call a partition's
chunk of up to 100, the default) and on the per-record path (RELAY_BATCH_SPAWNS=1, one call a record), vs a
plain keep-alive HTTP client posting one record a request; then POST /v1/runs itself, one request at a time, in
the batch form (100 spawns) and the single form, per spawn; and what a million relayed spawns cost on each path
(benchmarks.cost_model, with this run's figures). All of it against each store engine in turn, in one run:
moto (the embedded server `poimen dev` starts) and dynalite (npm, LevelDB: `make dynalite`), which costs the
machine about a third of moto's CPU a PutItem, so the table shows what the relay and admission make of a lighter
store beside what moto allows.

Run: `make bench` (or `.venv/bin/python -m benchmarks.relay_bench [--store moto,dynalite]`; the default is
both when dynalite is installed, else moto). Every side posts the same bodies (fresh dispatch keys each), the
per-record ones at the same concurrency, to one `poimen dev` stack in this process a store; the figures that
matter are the ratios, measured side by side in one run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import socket
import statistics
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.update(
    {
        # The relay signs with these: the dev key `poimen dev` knows and grants every tenant.
        "AWS_ACCESS_KEY_ID": "POIMENDEVACCESSKEY",
        "AWS_SECRET_ACCESS_KEY": "poimen-dev-secret-access-key",
        "POWERTOOLS_SERVICE_NAME": "poimen-bench",
        "POWERTOOLS_METRICS_NAMESPACE": "PoimenBench",
        "POWERTOOLS_LOG_LEVEL": "WARNING",
    }
)

import boto3
import urllib3

from benchmarks.cost_model import MEASURED, Settings, relayed_lines
from benchmarks.quiet import silenced
from poimen.relay import relay_service
from poimen.wire import MAX_BATCH_SPAWNS, SPAWNS_MEDIA_TYPE
from poimen_tools.local.dev import DevOptions, dev_stack
from poimen_tools.local.devserver import LocalLambdaContext
from poimen_tools.local.msk import KafkaRecord, msk_event
from poimen_tools.local.sigv4 import DEV_ACCESS_KEY, DEV_SECRET_KEY, signed_headers
from poimen_tools.local.template import Template, default_template_path

TENANT = "bench"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
DYNALITE = Path(__file__).resolve().parent.parent / ".cache" / "dynalite" / "node_modules" / ".bin" / "dynalite"
STORES = ("moto", "dynalite")


def _bodies(prefix: str, count: int) -> list[bytes]:
    return [
        json.dumps({"workflow_ref": "wf/bench", "input": {"n": i}, "dispatch_key": f"{prefix}-{i}"}).encode()
        for i in range(count)
    ]


def relay_seconds(handler: object, bodies: list[bytes]) -> float:
    """One invocation of the relay handler with `bodies` as one MSK batch, in seconds."""
    now = int(time.time() * 1000)
    records = [
        KafkaRecord(
            topic=f"poimen.{TENANT}.dispatch",
            partition=i % 4,
            offset=i,
            timestamp_ms=now,
            value=body,
            key=f"key-{i}".encode(),
        )
        for i, body in enumerate(bodies)
    ]
    event = msk_event(records)
    start = time.perf_counter()
    handler(event, LocalLambdaContext("InboxRelayFunction", timeout_seconds=900))  # type: ignore[operator]
    return time.perf_counter() - start


def relay_rate(handler: object, bodies: list[bytes]) -> float:
    return len(bodies) / relay_seconds(handler, bodies)


# Where each path's CPU goes, by process: this one (the relay, `poimen dev`'s front, moto's embedded server),
# the admission environments (its child processes: multiprocessing's resource tracker is one too, idle) and a
# store of its own (dynalite, a child process too). Both paths are CPU-bound on a small machine, so these, not
# the records/s alone, say what bounds the ratio and what it would be with the store's CPU off the machine.
PROCESSES = ("relay and front", "admission environments", "store")


def cpu_seconds() -> dict[str, float]:
    """CPU seconds (user and system, /proc/<pid>/stat) used so far by this process, by its child processes other
    than dynalite, and by dynalite; empty where there is no /proc."""
    if not Path("/proc/self/stat").is_file():
        return {}
    seconds = dict.fromkeys(PROCESSES, 0.0)
    seconds["relay and front"] = _process_cpu_seconds(os.getpid())
    for child in _children(os.getpid()):
        with contextlib.suppress(OSError):
            command = Path(f"/proc/{child}/cmdline").read_bytes()
            seconds["store" if b"dynalite" in command else "admission environments"] += _process_cpu_seconds(child)
    return seconds


def _children(pid: int) -> list[int]:
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            children += [int(child) for child in (task / "children").read_text().split()]
    return children


def _process_cpu_seconds(pid: int) -> float:
    try:
        # utime and stime, fields 14 and 15 of proc(5), counted after the command name's closing parenthesis.
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:  # it ended meanwhile
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def timed_relay_rate(handler: object, bodies: list[bytes], cpu: dict[str, float]) -> float:
    """relay_rate, adding each process's CPU seconds during it to `cpu`."""
    before = cpu_seconds()
    rate = relay_rate(handler, bodies)
    for name, seconds in cpu_seconds().items():
        cpu[name] = cpu.get(name, 0.0) + seconds - before.get(name, 0.0)
    return rate


def relay_batching(batch_spawns: int) -> None:
    """The relay built anew with this many spawns a call (RELAY_BATCH_SPAWNS: 1, the per-record path)."""
    os.environ["RELAY_BATCH_SPAWNS"] = str(batch_spawns)
    relay_service.cache_clear()


def floor_rate(url: str, bodies: list[bytes], concurrency: int) -> float:
    pool = urllib3.PoolManager(maxsize=concurrency, block=True, retries=False)
    headers = {"Content-Type": "application/json", "X-Poimen-Tenant": TENANT}

    def post(body: bytes) -> int:
        # Signed like the relay's requests: IAM authorization takes a signature from every client.
        signed = signed_headers("POST", f"{url}/v1/runs", headers, body, DEV_ACCESS_KEY, DEV_SECRET_KEY, "us-east-1")
        return pool.request("POST", f"{url}/v1/runs", body=body, headers=signed).status

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as executor:
        statuses = list(executor.map(post, bodies))
    elapsed = time.perf_counter() - start
    if set(statuses) != {201}:
        raise RuntimeError(f"floor client got {sorted(set(statuses))}")
    return len(bodies) / elapsed


def route_ms_a_spawn(url: str, bodies: list[bytes], spawns_a_post: int) -> float:
    """ms a spawn of POST /v1/runs sent one request at a time, signed as the relay signs: the single form
    (`spawns_a_post` 1) or the batch form of that many spawns, every spawn answered 201."""
    pool = urllib3.PoolManager(maxsize=1, retries=False)
    posts = [bodies[n : n + spawns_a_post] for n in range(0, len(bodies), spawns_a_post)]
    media_type = "application/json" if spawns_a_post == 1 else SPAWNS_MEDIA_TYPE
    headers = {"Content-Type": media_type, "X-Poimen-Tenant": TENANT}
    start = time.perf_counter()
    for post in posts:
        body = post[0] if spawns_a_post == 1 else b'{"spawns":[' + b",".join(post) + b"]}"
        signed = signed_headers("POST", f"{url}/v1/runs", headers, body, DEV_ACCESS_KEY, DEV_SECRET_KEY, "us-east-1")
        answer = pool.request("POST", f"{url}/v1/runs", body=body, headers=signed)
        statuses = [answer.status] if spawns_a_post == 1 else [item["status"] for item in answer.json()["results"]]
        if set(statuses) != {201}:
            raise RuntimeError(f"POST /v1/runs ({media_type}) answered {sorted(set(statuses))}")
    return (time.perf_counter() - start) * 1000 / len(bodies)


def _check_every_record_became_a_run(
    dynamodb_endpoint: str, sqs_endpoint: str, table_name: str, dlq_url: str, expected: int
) -> None:
    """A fast run that dead-lettered or dropped records would be no result: count what was admitted."""
    sqs = boto3.client("sqs", endpoint_url=sqs_endpoint)
    waiting = sqs.get_queue_attributes(QueueUrl=dlq_url, AttributeNames=["ApproximateNumberOfMessages"])
    if waiting["Attributes"]["ApproximateNumberOfMessages"] != "0":
        raise RuntimeError(f"the relay dead-lettered records: {waiting['Attributes']}")
    pages = (
        boto3.client("dynamodb", endpoint_url=dynamodb_endpoint)
        .get_paginator("scan")
        .paginate(
            TableName=table_name,
            Select="COUNT",
            FilterExpression="begins_with(pk, :p)",
            ExpressionAttributeValues={":p": {"S": f"RUN#{TENANT}#"}},
        )
    )
    runs = sum(page["Count"] for page in pages)
    if runs != expected:
        raise RuntimeError(f"{runs} runs for {expected} distinct dispatch keys")


@contextlib.contextmanager
def dynalite() -> Iterator[str]:
    """A dynalite server on a free loopback port (tables ACTIVE at once), its endpoint; stopped on the way out."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [str(DYNALITE), "--port", str(port), "--createTableMs", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while not _accepts(port):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"dynalite did not listen on port {port} (exit status {process.poll()})")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=10)


def _accepts(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@contextlib.contextmanager
def store_endpoint(store: str) -> Iterator[str | None]:
    """The DynamoDB endpoint `poimen dev` is given for `store`: None for moto (its embedded server)."""
    if store == "moto":
        yield None
        return
    with dynalite() as endpoint:
        yield endpoint


@dataclasses.dataclass(frozen=True)
class Figures:
    """One store's medians: records/s of each relay path and the floor, ms a record in invocations of the
    template's batch size, ms a spawn of each form of POST /v1/runs."""

    relay: float
    single: float
    floor: float
    batch_ms: dict[int, float]
    route_ms: dict[int, float]
    # CPU seconds a 1,000 relayed records of each path's rounds, by process (PROCESSES); empty without /proc.
    relay_cpu: dict[str, float]
    single_cpu: dict[str, float]


def measure(store: str, args: argparse.Namespace, template: Template) -> Figures:
    """Everything relay_bench times, against one `poimen dev` stack on `store`."""
    with (
        store_endpoint(store) as endpoint,
        silenced(),
        dev_stack(
            DevOptions(
                port=0,
                concurrency=args.environments,
                kafka=False,
                tenants=(TENANT,),
                dynamodb_endpoint=endpoint,
                table_name=f"poimen-admission-bench-{store}",
            )
        ) as stack,
    ):
        thread = threading.Thread(target=stack.server.serve_forever, daemon=True)
        thread.start()
        os.environ.update(
            {
                "ADMISSION_API_URL": stack.server.url,
                "DLQ_URL": stack.dlq_url,
                "RELAY_MAX_CONCURRENCY": str(args.concurrency),
            }
        )
        handler = template.load_handler("InboxRelayFunction")
        relay: list[float] = []
        single: list[float] = []
        floor: list[float] = []
        relay_cpu: dict[str, float] = {}
        single_cpu: dict[str, float] = {}
        floor_rate(stack.server.url, _bodies("warm-floor", 100), args.concurrency)  # start every environment
        relay_batching(1)
        relay_rate(handler, _bodies("warm-single", 100))
        relay_batching(MAX_BATCH_SPAWNS)
        relay_rate(handler, _bodies("warm-relay", 100))
        for round_ in range(args.rounds):
            relay_batching(MAX_BATCH_SPAWNS)
            relay.append(timed_relay_rate(handler, _bodies(f"relay-{round_}", args.records), relay_cpu))
            relay_batching(1)
            single.append(timed_relay_rate(handler, _bodies(f"single-{round_}", args.records), single_cpu))
            floor.append(floor_rate(stack.server.url, _bodies(f"floor-{round_}", args.records), args.concurrency))
        # The cost model's duration: invocations of the template's batch size, as the event source sends them.
        batch_ms: dict[int, list[float]] = {}
        for spawns in (MAX_BATCH_SPAWNS, 1):
            relay_batching(spawns)
            batch_ms[spawns] = [
                relay_seconds(handler, _bodies(f"batch-{spawns}-{number}", args.batch_size)) * 1000
                for number in range(args.batches)
            ]
        route: dict[int, list[float]] = {MAX_BATCH_SPAWNS: [], 1: []}
        for round_ in range(args.rounds):
            for spawns in route:
                bodies = _bodies(f"route-{spawns}-{round_}", args.route_spawns)
                route[spawns].append(route_ms_a_spawn(stack.server.url, bodies, spawns))
        _check_every_record_became_a_run(
            stack.endpoints.dynamodb,
            stack.endpoints.sqs,
            stack.table_name,
            stack.dlq_url,
            300
            + 3 * args.records * args.rounds
            + 2 * args.batch_size * args.batches
            + 2 * args.route_spawns * args.rounds,
        )
        stack.server.shutdown()
        thread.join()
    return Figures(
        relay=statistics.median(relay),
        single=statistics.median(single),
        floor=statistics.median(floor),
        batch_ms={spawns: statistics.median(times) for spawns, times in batch_ms.items()},
        route_ms={spawns: statistics.median(times) for spawns, times in route.items()},
        relay_cpu={name: seconds * 1000 / (args.records * args.rounds) for name, seconds in relay_cpu.items()},
        single_cpu={name: seconds * 1000 / (args.records * args.rounds) for name, seconds in single_cpu.items()},
    )


def _stores(text: str) -> tuple[str, ...]:
    stores = tuple(store.strip() for store in text.split(",") if store.strip())
    unknown = sorted(set(stores) - set(STORES))
    if not stores or unknown:
        raise argparse.ArgumentTypeError(f"stores are a comma-separated list of {', '.join(STORES)}, not {text!r}")
    if "dynalite" in stores and not DYNALITE.is_file():
        raise argparse.ArgumentTypeError(f"dynalite is not installed ({DYNALITE}): run `make dynalite`")
    return stores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds; the median is reported")
    parser.add_argument("--concurrency", type=int, default=16, help="relay pool size = floor client threads")
    parser.add_argument("--environments", type=int, default=4, help="API execution environments")
    template = Template(default_template_path())
    batch_size = int(template.document["Parameters"]["RelayBatchSize"]["Default"])
    parser.add_argument("--batch-size", type=int, default=batch_size, help="records a timed batch (RelayBatchSize)")
    parser.add_argument("--batches", type=int, default=10, help="batches of --batch-size timed one by one")
    parser.add_argument("--route-spawns", type=int, default=500, help="spawns POSTed a form, one request at a time")
    parser.add_argument(
        "--store",
        type=_stores,
        default=STORES if DYNALITE.is_file() else ("moto",),
        help="DynamoDB engines, measured one after another in this run (default: moto,dynalite if installed)",
    )
    args = parser.parse_args()

    figures = {store: measure(store, args, template) for store in args.store}

    print(
        f"\nRelay benchmark: {args.records} records x {args.rounds} rounds over 4 partitions, concurrency "
        f"{args.concurrency}, {args.environments} API environments, medians, on each store\n"
    )
    header = "".join(f" {store + ' records/s':>19} {'ms a record':>12}" for store in figures)
    print(f"{'variant':54}{header}")
    print("-" * (54 + 33 * len(figures)))
    for name, rates in (
        (f"inbox relay, batch path (<= {MAX_BATCH_SPAWNS} spawns a POST)", [f.relay for f in figures.values()]),
        ("inbox relay, per-record path (a POST a record)", [f.single for f in figures.values()]),
        ("plain keep-alive HTTP client, a POST a record (floor)", [f.floor for f in figures.values()]),
    ):
        print(f"{name:54}" + "".join(f" {rate:19.0f} {1000 / rate:12.2f}" for rate in rates))
    print()
    for store, f in figures.items():
        print(
            f"{store}: Ratio batch path / per-record path {f.relay / f.single:.2f}  [>= 5]; "
            f"Ratio relay / floor {f.single / f.floor:.2f}  (per-record path)  [>= 0.8]"
        )
    for store, f in figures.items():
        print_cpu(store, f)
    settings = Settings.of(template)
    for store, f in figures.items():
        print()
        relay_ms = {spawns: per_batch / args.batch_size for spawns, per_batch in f.batch_ms.items()}
        for spawns, label in ((MAX_BATCH_SPAWNS, "batch path"), (1, "per-record path")):
            print(
                f"{store}: per record, {label} (docs/operations.md#what-a-tenant-costs): {args.batches} invocations"
                f" of {args.batch_size} records (RelayBatchSize: {batch_size}), median {f.batch_ms[spawns]:.0f} ms an"
                f" invocation, {relay_ms[spawns]:.2f} ms a record, {args.concurrency} calls in flight at most"
            )
        batch_route, single_route = f.route_ms[MAX_BATCH_SPAWNS], f.route_ms[1]
        print(
            f"{store}: POST /v1/runs, one request at a time, {args.route_spawns} spawns a form x {args.rounds} rounds,"
            f" medians: batch form ({MAX_BATCH_SPAWNS} spawns) {batch_route:.2f} ms a spawn, single form"
            f" {single_route:.2f} ms a spawn; batch / single per spawn {batch_route / single_route:.2f}  [<= 1]"
        )
        measured = dataclasses.replace(
            MEASURED,
            relay_ms_a_record=round(relay_ms[1], 2),
            batch_relay_ms_a_record=round(relay_ms[MAX_BATCH_SPAWNS], 2),
            batch_admission_ms_a_spawn=round(batch_route, 2),
        )
        costs = {spawns: sum(line.usd for line in relayed_lines(settings, measured, spawns)) for spawns in f.route_ms}
        print(
            f"{store}: A million relayed spawns (benchmarks.cost_model, this run's relay ms a record and batch ms a"
            f" spawn, the single admission's {MEASURED.admission_ms:g} ms as measured under the RIE): batch path"
            f" ${costs[MAX_BATCH_SPAWNS]:.2f}  [<= 1.00], per-record path ${costs[1]:.2f}"
        )


def print_cpu(store: str, f: Figures) -> None:
    """Each path's CPU seconds a 1,000 relayed records by process, and the ratio of our processes' alone: what a
    CPU-bound machine's batch path / per-record path would be were the store's CPU off it (moto, embedded in this
    process, is not told apart from it)."""
    if not f.relay_cpu:
        return
    shown = [name for name in PROCESSES if name != "store" or store != "moto"]
    for label, cpu in (("batch path", f.relay_cpu), ("per-record path", f.single_cpu)):
        parts = ", ".join(f"{name} {cpu[name]:.2f}" for name in shown)
        print(f"{store}: CPU s a 1,000 records, {label} (/proc/<pid>/stat): {parts}, all {sum(cpu.values()):.2f}")
    every = sum(f.single_cpu.values()) / sum(f.relay_cpu.values())
    if store == "moto":
        print(f"{store}: CPU per-record path / batch path {every:.2f} (moto's CPU is in this process's)")
        return
    ours = ("relay and front", "admission environments")
    alone = sum(f.single_cpu[name] for name in ours) / sum(f.relay_cpu[name] for name in ours)
    print(f"{store}: CPU per-record path / batch path {every:.2f}, ours alone (no store CPU) {alone:.2f}")


if __name__ == "__main__":
    main()
