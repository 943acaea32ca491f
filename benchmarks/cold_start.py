"""Cold start of what ships: each function of the built bundle (`sam build`, bytecode as `make build` compiles
it) initialised fresh in the Lambda Runtime Interface Emulator, read-only /opt, against the floor: a minimal
built function that imports botocore (its own layer, compiled too) and calls DynamoDB once
(benchmarks/floor/). The figure is the ratio of INIT REPORT medians, measured side by side in this run.
After its first answer, the admission function (and the floor) answer `--warm` more requests in the same
environment: their REPORT Duration, the duration Lambda bills, is the per-admission figure of the cost model
(docs/operations.md#what-a-tenant-costs) as the built bundle gives it.

Run: `make bench` (or `.venv/bin/python -m benchmarks.cold_start [--inits 7] [--without-bytecode]`).
`--without-bytecode` builds the bundle as sam build leaves it (no .pyc), as it shipped before `make build`
compiled it; the floor keeps its bytecode either way.
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3

from poimen.store import grant_pk
from poimen_tools.local import rie
from poimen_tools.local.moto import EmbeddedMoto
from poimen_tools.local.template import Template

REPO = Path(__file__).resolve().parent.parent
FLOOR = Path(__file__).resolve().parent / "floor" / "template.yaml"
TENANT = "bench"
ROLE = "arn:aws:iam::123456789012:role/bench"
# Goals of docs/architecture.md (Benchmarks), without SnapStart.
GOALS = {"AdmissionFunction": 1.5, "InboxRelayFunction": 1.2}
# The RIE's REPORT line of each invocation: "REPORT RequestId: … Init Duration: … Duration: 12.34 ms Billed …".
_DURATION = re.compile(r"REPORT RequestId: .*?(?<!Init )(?<!Billed )Duration: ([0-9.]+) ms")


@dataclass
class Measured:
    name: str
    init_ms: list[float] = field(default_factory=list)
    first_ms: list[float] = field(default_factory=list)  # the first invocation's answer, INIT included
    warm_ms: list[float] = field(default_factory=list)  # REPORT Duration of the invocations after the first
    log_bytes: list[float] = field(default_factory=list)  # what CloudWatch Logs ingests of a warm invocation


@dataclass(frozen=True)
class Subject:
    """A function to initialise fresh, the local values of its template variables, and a first event that
    needs nothing but moto (the relays' are empty batches: INIT is what is measured)."""

    function: rie.FunctionBundle
    values: dict[str, str]
    event: Callable[[int], dict[str, Any]]
    warm: bool = False  # answers warm requests too (the relays' empty batches would measure nothing)


def _http_create(number: int) -> dict[str, Any]:
    body = f'{{"workflow_ref": "wf/bench", "input": {{}}, "dispatch_key": "cold-{number}-{time.time_ns()}"}}'
    return {
        "version": "2.0",
        "routeKey": "POST /v1/runs",
        "rawPath": "/v1/runs",
        "rawQueryString": "",
        "headers": {"content-type": "application/json", "x-poimen-tenant": TENANT},
        "requestContext": {
            "http": {"method": "POST", "path": "/v1/runs", "protocol": "HTTP/1.1", "sourceIp": "127.0.0.1"},
            "authorizer": {"iam": {"userArn": "arn:aws:sts::123456789012:assumed-role/bench/cold"}},
            "requestId": f"cold-{number}",
            "routeKey": "POST /v1/runs",
            "stage": "$default",
        },
        "body": body,
        "isBase64Encoded": False,
    }


def subjects(bundle: dict[str, rie.FunctionBundle], floor: rie.FunctionBundle, table: str) -> list[Subject]:
    unused = "http://127.0.0.1:9"  # never reached: the relays' first batches are empty
    by_name = {
        "AdmissionFunction": ({"TABLE_NAME": table, "RELAY_PRINCIPAL": ROLE, "TENANTS": TENANT}, _http_create),
        "InboxRelayFunction": (
            {"ADMISSION_API_URL": unused, "DLQ_URL": f"{unused}/123456789012/dlq"},
            lambda _: {"eventSource": "aws:kafka", "records": {}},
        ),
        "OutboxRelayFunction": (
            {
                "KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:9",
                "KAFKA_AUTH": "none",
                "POIMEN_STACK_NAME": "bench",
                "OUTBOX_FAILED_BATCHES_BUCKET": "bench",  # never written: its batches are empty
            },
            lambda _: {"Records": []},
        ),
    }
    found = [Subject(floor, {"TABLE_NAME": table}, lambda _: {}, warm=True)]
    found += [
        Subject(bundle[name], values, event, warm=name == "AdmissionFunction")
        for name, (values, event) in by_name.items()
        if name in bundle
    ]
    return found


def measure(subject: Subject, runtime: dict[str, str], logs: Path, number: int, warm: int, into: Measured) -> None:
    """One fresh INIT: a new RIE, its first invocation, its INIT REPORT; then `warm` more invocations (a
    warm subject's), each one's REPORT Duration."""
    with rie.running(subject.function, subject.values, runtime, logs) as function:
        started = time.perf_counter()
        function.invoke(subject.event(number))
        into.first_ms.append((time.perf_counter() - started) * 1000)
        init = function.init_duration_ms()
        if init is None:
            raise SystemExit(f"{subject.function.name}: no INIT REPORT in {function.log_path}")
        into.init_ms.append(init)
        if subject.warm:
            _reported_durations(function, 1)  # the first invocation's REPORT is in, before counting bytes
            logged = len(function.log())
            for request in range(1, warm + 1):
                function.invoke(subject.event(number * 1000 + request))
            reported = _reported_durations(function, warm + 1)
            if len(reported) != warm + 1:
                raise SystemExit(f"{subject.function.name}: {len(reported)} REPORT lines for {warm + 1} invocations")
            into.warm_ms.extend(reported[1:])
            ingested = subject.function.ingested_log_bytes(function.log()[logged:])
            into.log_bytes.append(ingested / max(warm, 1))


def _reported_durations(function: rie.RunningFunction, expected: int, timeout: float = 10.0) -> list[float]:
    """The REPORT Durations in the function's log, once `expected` are there (the RIE may write the last one
    just after answering) or the timeout passed."""
    deadline = time.monotonic() + timeout
    while True:
        reported = [float(duration) for duration in _DURATION.findall(function.log())]
        if len(reported) >= expected or time.monotonic() > deadline:
            return reported
        time.sleep(0.05)


def table(results: list[Measured], inits: int, bytecode: bool) -> str:
    floor = statistics.median(results[0].init_ms)
    lines = [
        f"Cold start of the built bundle under the RIE (x86_64 variant, read-only /opt, "
        f"{'bytecode as make build compiles it' if bytecode else 'NO bytecode, as sam build leaves it'}); "
        f"median of {inits} fresh inits",
        f"{'function':34} {'INIT ms':>9} {'min':>7} {'max':>7} {'x floor':>8} {'goal':>6} {'first answer ms':>16} "
        f"{'warm ms':>8} {'log B':>6}",
    ]
    for result in results:
        median = statistics.median(result.init_ms)
        goal = GOALS.get(result.name)
        lines.append(
            f"{result.name:34} {median:9.0f} {min(result.init_ms):7.0f} {max(result.init_ms):7.0f} "
            f"{median / floor:7.2f}x {f'{goal:.1f}x' if goal else '':>6} {statistics.median(result.first_ms):16.0f} "
            f"{f'{statistics.median(result.warm_ms):.1f}' if result.warm_ms else '':>8} "
            f"{f'{statistics.median(result.log_bytes):.0f}' if result.log_bytes else '':>6}"
        )
    lines.append(
        "warm ms: median REPORT Duration (what Lambda bills) of the requests each fresh environment answered after "
        "its first; log B: what CloudWatch Logs would ingest of each (rie.FunctionBundle.ingested_log_bytes). The "
        "admission function's are the cost model's duration and log bytes per admission "
        "(docs/operations.md#what-a-tenant-costs)"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inits", type=int, default=7, help="fresh inits per function (the median; 5 or more)")
    parser.add_argument("--warm", type=int, default=20, help="warm requests after each first one (admission, floor)")
    parser.add_argument("--without-bytecode", action="store_true", help="the bundle without .pyc, as before")
    parser.add_argument(
        "--template", type=Path, default=REPO / "template.yaml", help="another checkout's template.yaml, to compare"
    )
    arguments = parser.parse_args()

    root = rie.BUILD_ROOT / ("bench-without-bytecode" if arguments.without_bytecode else "bench")
    if arguments.template != REPO / "template.yaml":
        root = root.with_name(f"{root.name}-other")
    built = rie.build_bundle(arguments.template.resolve(), root, bytecode=not arguments.without_bytecode)
    bundle = rie.functions(built)
    floor = rie.functions(rie.build_bundle(FLOOR, rie.BUILD_ROOT / "floor"))["FloorFunction"]
    with EmbeddedMoto() as moto, tempfile.TemporaryDirectory() as logs:
        dynamodb = boto3.client(
            "dynamodb",
            endpoint_url=moto.endpoint,
            region_name="us-east-1",
            aws_access_key_id="bench",
            aws_secret_access_key="bench",
        )
        name = "poimen-bench"
        dynamodb.create_table(**Template(REPO / "template.yaml").create_table_request("AdmissionTable", name))
        dynamodb.put_item(TableName=name, Item={"pk": {"S": grant_pk(ROLE)}, "tenants": {"SS": [TENANT]}})
        runtime = {
            "AWS_REGION": "us-east-1",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_SESSION_TOKEN": "bench",
            "AWS_ENDPOINT_URL_DYNAMODB": moto.endpoint,
            "AWS_ENDPOINT_URL_SQS": moto.endpoint,
        }
        measured = subjects(bundle, floor, name)
        results = [
            Measured("floor: botocore + 1 PutItem" if s.function is floor else s.function.name) for s in measured
        ]
        # Round-robin, so that a busy moment of the machine falls on every function alike.
        for number in range(max(arguments.inits, 1)):
            for subject, result in zip(measured, results, strict=True):
                measure(subject, runtime, Path(logs), number, arguments.warm, result)
    print(table(results, arguments.inits, not arguments.without_bytecode))


if __name__ == "__main__":
    main()
