"""The built bundle run as Lambda runs it (poimen_tools.local.rie): each function of `sam build`'s output
(the x86_64 variant of template.yaml) in a Lambda Runtime Interface Emulator of its own, awslambdaric in a
python3.13 venv holding nothing else, the task root and /opt read-only, the template's environment only.

Adding a function: one entry in CASES (its local values, first event and what that must have stored).
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, Message

from poimen.ids import admission_id
from poimen.kafka import events_topic
from poimen.store import grant_pk
from poimen_tools.local import rie
from poimen_tools.local.kafka_broker import KafkaBroker
from poimen_tools.local.msk import KafkaRecord, msk_event
from poimen_tools.topics import ensure_topics
from tests.conftest import REPO, count_runs, load_event
from tests.integration.conftest import RELAY_ROLE, DevServer, dead_letters, next_tenant, wait_for

# Both build into .cache/rie-build (rie.build_bundle) and the RIE tests run functions from it: one worker.
pytestmark = pytest.mark.xdist_group("rie-build")

ORCHESTRATOR = "arn:aws:iam::123456789012:role/poimen-orchestrator"
# What Lambda gives every function (region, the role's credentials): here the ones `poimen dev` accepts.
CREDENTIALS = {
    "AWS_REGION": "us-east-1",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
}


@dataclass
class Local:
    """What the functions reach on loopback: `poimen dev` (its moto, table and API), a tenant, a DLQ, and
    a Kafka broker (started on first use: only the outbox relay needs one)."""

    dev: DevServer
    tenant: str
    dlq: str
    broker: Callable[[], KafkaBroker]

    @classmethod
    def granted(cls, dev: DevServer, tenant: str, broker: Callable[[], KafkaBroker]) -> Local:
        """`tenant` granted to the orchestrator's role, and a dead-letter queue of its own."""
        dev.dynamodb().put_item(
            TableName=dev.table_name, Item={"pk": {"S": grant_pk(ORCHESTRATOR)}, "tenants": {"SS": [tenant]}}
        )
        dlq: str = dev.sqs().create_queue(QueueName=f"dlq-{uuid.uuid4().hex[:12]}")["QueueUrl"]
        return cls(dev, tenant, dlq, broker)

    def fresh(self) -> Local:
        """Another tenant and DLQ on the same local services: nothing of this one's is seen."""
        return Local.granted(self.dev, next_tenant(), self.broker)  # one the dev serves

    def runtime(self) -> dict[str, str]:
        endpoint = self.dev.aws_endpoint
        return {
            **CREDENTIALS,
            "AWS_ENDPOINT_URL_DYNAMODB": endpoint,
            "AWS_ENDPOINT_URL_SQS": self.dev.sqs_endpoint or endpoint,
        }


@dataclass(frozen=True)
class Case:
    """One function: the template variables only a deploy knows (here local), its first event, and what
    that event must have done (asserted on stored state)."""

    function: str
    values: Callable[[Local], dict[str, str]]
    first_event: Callable[[Local], dict[str, Any]]
    stored: Callable[[Local, Any], None]
    # SnapStart hooks it registers with the runtime: before the snapshot, after a restore (in order).
    hooks: tuple[list[str], list[str]]


def http_event(method: str, path: str, tenant: str, body: Any = None, query: str = "") -> dict[str, Any]:
    """The canonical HTTP API event (payload 2.0), as the orchestrator's role, for this route."""
    event = load_event("http_api_create_run.json")
    event["routeKey"] = event["requestContext"]["routeKey"] = f"{method} {path}"
    event["rawPath"] = event["requestContext"]["http"]["path"] = path
    event["requestContext"]["http"]["method"] = method
    event["headers"]["x-poimen-tenant"] = tenant
    event["rawQueryString"] = query
    if query:
        event["queryStringParameters"] = dict(part.split("=", 1) for part in query.split("&"))
    event.pop("body", None)
    if body is not None:
        event["body"] = json.dumps(body)
    return event


def _admission_values(local: Local) -> dict[str, str]:
    return {
        "TABLE_NAME": local.dev.table_name,
        "RELAY_PRINCIPAL": RELAY_ROLE,
        "TENANTS": local.tenant,
    }


def _relay_values(local: Local) -> dict[str, str]:
    return {"ADMISSION_API_URL": local.dev.url, "DLQ_URL": local.dlq}


def _create(tenant: str, key: str) -> dict[str, Any]:
    return http_event("POST", "/v1/runs", tenant, {"workflow_ref": "wf/rie", "input": {"n": 1}, "dispatch_key": key})


def _admitted_once(local: Local, answer: Any) -> None:
    assert answer["statusCode"] == 201, answer
    run_id = json.loads(answer["body"])["run_id"]
    assert [item["pk"]["S"] for item in count_runs(local.dev.dynamodb(), local.dev.table_name, local.tenant)] == [
        f"RUN#{local.tenant}#{run_id}"
    ]


def _dispatch_batch(local: Local) -> dict[str, Any]:
    """A batch of two records on the tenant's topic: a good dispatch message, and one that is not JSON."""
    topic = f"poimen.{local.tenant}.dispatch"
    good = json.dumps({"workflow_ref": "wf/rie", "input": {}, "dispatch_key": "relayed-1"}).encode()
    now = int(time.time() * 1000)
    return msk_event(
        [
            KafkaRecord(topic, 0, 1, now, good, key=f"{local.tenant}/relayed-1".encode()),
            KafkaRecord(topic, 0, 2, now, b"{not json", key=f"{local.tenant}/bad".encode()),
        ]
    )


def _relayed_and_dead_lettered(local: Local, answer: Any) -> None:
    assert answer is None  # the batch succeeded: Lambda commits its offsets
    runs = count_runs(local.dev.dynamodb(), local.dev.table_name, local.tenant)
    assert [run["dispatch_key"]["S"] for run in runs] == ["relayed-1"]
    letters = dead_letters(local.dev, local.dlq)
    assert [(letter["reason"]["kind"], letter["record"]["offset"]) for letter in letters] == [("invalid-json", 2)]


def _outbox_values(local: Local) -> dict[str, str]:
    broker = local.broker().bootstrap_servers
    ensure_topics(broker, local.tenant, partitions=1, replication_factor=1)
    # The local broker has no MSK IAM: plaintext, as `poimen dev` runs the outbox relay.
    return {
        "KAFKA_BOOTSTRAP_SERVERS": broker,
        "KAFKA_AUTH": "none",
        "POIMEN_STACK_NAME": "local",
        # Never written: the batch's one event is delivered.
        "OUTBOX_FAILED_BATCHES_BUCKET": "poimen-outbox-failed-batches-local",
    }


def _stream_insert(local: Local) -> dict[str, Any]:
    """The canonical stream batch (an admitted run, then a grant), the run's tenant this test's."""
    text = json.dumps(load_event("dynamodb_stream_insert.json")).replace("RUN#acme#", f"RUN#{local.tenant}#")
    event: dict[str, Any] = json.loads(text)
    event["Records"][0]["dynamodb"]["NewImage"]["tenant_id"] = {"S": local.tenant}
    return event


def _published_once(local: Local, answer: Any) -> None:
    assert answer is None  # the batch succeeded: the stream's iterator moves on
    consumer = Consumer(
        {
            "bootstrap.servers": local.broker().bootstrap_servers,
            "group.id": f"rie-{uuid.uuid4().hex[:8]}",
            "auto.offset.reset": "earliest",
        }
    )
    consumer.subscribe([events_topic(local.tenant)])
    try:
        message = wait_for(lambda: _message(consumer), timeout=60, what="the run's event")
    finally:
        consumer.close()
    headers = dict(message.headers() or [])
    image = _stream_insert(local)["Records"][0]["dynamodb"]["NewImage"]
    assert headers["ce_subject"] == b"28f956d5-cb15-83b0-bfc9-6c1d99e2e4ae"
    assert headers["ce_id"] == admission_id(image["run_id"]["S"], image["attempt_id"]["S"]).encode()


def _message(consumer: Consumer) -> Message | None:
    message = consumer.poll(0.5)
    return message if message is not None and message.error() is None else None


CASES = [
    Case(
        "AdmissionFunction",
        _admission_values,
        lambda local: _create(local.tenant, "first"),
        _admitted_once,
        (["warm"], ["reseed_random", "cache_clear"]),
    ),
    Case(
        "InboxRelayFunction",
        _relay_values,
        _dispatch_batch,
        _relayed_and_dead_lettered,
        ([], ["reseed_random", "cache_clear"]),
    ),
    Case(
        "OutboxRelayFunction",
        _outbox_values,
        _stream_insert,
        _published_once,
        ([], ["reseed_random", "cache_clear"]),
    ),
]
CASE_IDS = [case.function for case in CASES]


@pytest.fixture(scope="session")
def bundle() -> dict[str, rie.FunctionBundle]:
    """The x86_64 variant of template.yaml, built once per session and compiled as `make build` does."""
    return rie.functions(rie.build_bundle())


@pytest.fixture
def local(dev: DevServer, tenant: str, request: pytest.FixtureRequest) -> Local:
    """This test's tenant, granted to the orchestrator's role, and a dead-letter queue of its own."""
    return Local.granted(dev, tenant, lambda: request.getfixturevalue("broker"))


@pytest.fixture
def run_function(bundle: dict[str, rie.FunctionBundle], tmp_path: Path) -> Iterator[Callable[..., rie.RunningFunction]]:
    """Start a function of the bundle in its own RIE; every one started is stopped after the test."""
    started: list[rie.RunningFunction] = []

    def start(case: Case, local: Local, **runtime: str) -> rie.RunningFunction:
        function = rie.start(bundle[case.function], case.values(local), {**local.runtime(), **runtime}, tmp_path)
        started.append(function)
        return function

    yield start
    for function in started:
        assert function.stop() in (0, -15, 143), function.log()[-2000:]


# --- the bundle and the sandbox --------------------------------------------------------------------------


def test_the_variant_differs_from_template_yaml_only_in_architecture() -> None:
    text = (REPO / "template.yaml").read_text()
    variant = rie.x86_64_variant(text)
    changed = [(a, b) for a, b in zip(text.splitlines(), variant.splitlines(), strict=True) if a != b]

    layers = text.count("Type: AWS::Serverless::LayerVersion")
    assert len(changed) == 1 + 2 * layers
    assert all(a.replace("arm64", "x86_64") == b for a, b in changed)


def test_every_function_of_the_template_has_a_case(bundle: dict[str, rie.FunctionBundle]) -> None:
    assert sorted(bundle) == sorted(CASE_IDS)


def test_every_python_file_of_the_bundle_has_its_bytecode(bundle: dict[str, rie.FunctionBundle]) -> None:
    trees = {function.task_root for function in bundle.values()} | {
        layer for function in bundle.values() for layer in function.layers
    }
    for tree in trees:
        sources = sorted(tree.rglob("*.py"))
        missing = [s for s in sources if not (s.parent / "__pycache__" / f"{s.stem}.{rie.BYTECODE_TAG}.pyc").is_file()]
        assert sources
        assert missing == [], tree


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_the_function_sees_only_its_bundle_read_only(
    case: Case, bundle: dict[str, rie.FunctionBundle], local: Local
) -> None:
    probe = """
import importlib.util, json, os, sys
def writable(path):
    try:
        open(os.path.join(path, "probe"), "w").close()
    except OSError:
        return False
    return True
print(json.dumps({
    "path": sys.path,
    "stdlib": sys.base_prefix,
    "site": sys.prefix,
    "dev": [m for m in ("pytest", "moto", "poimen_tools", "yaml", "requests") if importlib.util.find_spec(m)],
    "writable": {p: writable(p) for p in ("/var/task", "/opt", "/tmp")},
    "env": sorted(os.environ),
}))
"""
    result = rie.run_in_sandbox(bundle[case.function], case.values(local), local.runtime(), probe)

    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    # The task root (the working directory), the layers, the interpreter's standard library, the runtime venv.
    assert seen["site"] == f"{rie.SANDBOX_CACHE}/{rie.RUNTIME.relative_to(rie.CACHE)}"
    assert [p for p in seen["path"] if not p.startswith(("/opt/python", seen["stdlib"], seen["site"]))] == [""]
    assert seen["dev"] == []
    assert seen["writable"] == {"/var/task": False, "/opt": False, "/tmp": True}
    declared = set(bundle[case.function].environment(case.values(local)))
    lambda_set = set(rie.lambda_variables(bundle[case.function], local.runtime()))
    # Besides those: what the shell's `cd` sets, and Python's C-locale coercion where en_US.UTF-8 is not installed.
    assert set(seen["env"]) - {"PWD", "OLDPWD", "SHLVL", "_", "LC_CTYPE"} == declared | lambda_set


# --- each function from the built bundle alone -----------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_the_first_invocation_answers_from_the_bundle(
    case: Case, run_function: Callable[..., rie.RunningFunction], local: Local
) -> None:
    # Given the function in its own RIE, not yet initialised
    function = run_function(case, local)

    # When its first event arrives (INIT, then the invocation)
    answer = function.invoke(case.first_event(local))

    # Then it did what that event asks, and its INIT was reported
    case.stored(local, answer)
    assert function.init_duration_ms() is not None, function.log()[-2000:]


@pytest.fixture
def admission(run_function: Callable[..., rie.RunningFunction], local: Local) -> rie.RunningFunction:
    return run_function(CASES[0], local)


def _answer(answer: dict[str, Any]) -> tuple[int, dict[str, str], Any]:
    return answer["statusCode"], answer.get("headers") or {}, json.loads(answer.get("body") or "null")


def test_admission_admits_replays_and_refuses_a_reused_key(admission: rie.RunningFunction, local: Local) -> None:
    # Given a run admitted from the built function
    first = _answer(admission.invoke(_create(local.tenant, "k-1")))

    # When the same request comes again, then the same key with another body
    replay = _answer(admission.invoke(_create(local.tenant, "k-1")))
    other = _create(local.tenant, "k-1")
    other["body"] = json.dumps({"workflow_ref": "wf/other", "input": {}, "dispatch_key": "k-1"})
    reused = _answer(admission.invoke(other))

    # Then one run is stored, the replay answers it, and the reuse is a problem+json 422
    assert first[0] == 201
    assert replay[0] == 200
    assert replay[1]["Idempotent-Replayed"] == "true"
    assert replay[2]["run_id"] == first[2]["run_id"]
    assert reused[0] == 422
    assert reused[1]["Content-Type"] == "application/problem+json"
    assert len(count_runs(local.dev.dynamodb(), local.dev.table_name, local.tenant)) == 1


def test_admission_answers_the_look_ups(admission: rie.RunningFunction, local: Local) -> None:
    # Given a run admitted from the built function
    created = _answer(admission.invoke(_create(local.tenant, "k-2")))[2]

    # When it is looked up by id, by dispatch key, and the API document is asked for
    by_id = _answer(admission.invoke(http_event("GET", f"/v1/runs/{created['run_id']}", local.tenant)))
    by_key = _answer(admission.invoke(http_event("GET", "/v1/runs", local.tenant, query="dispatch_key=k-2")))
    unknown = _answer(admission.invoke(http_event("GET", f"/v1/runs/{uuid.uuid4()}", local.tenant)))
    document = _answer(admission.invoke(http_event("GET", "/openapi.json", local.tenant)))

    # Then each answers what the table holds
    assert (by_id[0], by_id[2]) == (200, created)
    assert (by_key[0], by_key[2]) == (200, created)
    assert unknown[0] == 404
    assert document[0] == 200
    assert "/v1/runs" in document[2]["paths"]


# Issue 35's budget: what one admission may add to CloudWatch Logs, counted as CloudWatch Logs meters ingestion.
ADMISSION_LOG_BUDGET_BYTES = 450
# The audit fields each admission's line carries, as docs/operations.md#finding-an-admission queries them.
AUDIT_FIELDS = {"message", "tenant_id", "run_id", "dispatch_key", "status", "correlation_id", "latency_ms"}


def _log_once_reported(function: rie.RunningFunction, invocations: int) -> str:
    """The function's log once it holds the REPORT lines of `invocations` (the RIE may write one just after
    answering)."""
    log: str = wait_for(
        lambda: (text := function.log()).count("REPORT RequestId: ") >= invocations and text,
        timeout=10,
        what=f"{invocations} REPORT lines",
    )
    return log


def test_a_warm_admission_logs_one_emf_line_within_the_budget(
    admission: rie.RunningFunction, local: Local, bundle: dict[str, rie.FunctionBundle]
) -> None:
    """Counted as CloudWatch Logs meters it (rie.FunctionBundle.ingested_log_bytes: each event's UTF-8 bytes plus
    26). The RIE knows no LoggingConfig: it prints START, END and REPORT whatever the level (and lines of its
    own, which no log group gets), so the count leaves them out as Lambda does under the template's
    SystemLogLevel WARN; the runtime gets the JSON format as Lambda gives it (AWS_LAMBDA_LOG_FORMAT). A tenant
    id of 14 characters and a dispatch key of 6: each ASCII character more of either is a byte more, another six or
    twelve (escaped; benchmarks.cost_model.ID_SIZES, held to the handler by tests/unit/test_admission_log.py)."""
    # Given the built admission function, initialised by a first admission
    admission.invoke(_create(local.tenant, "k-cold"))
    before = _log_once_reported(admission, 1)

    # When a warm admission comes
    answer = _answer(admission.invoke(_create(local.tenant, "k-warm")))
    written = _log_once_reported(admission, 2)[len(before) :]

    # Then what CloudWatch Logs would ingest of it is one line within the budget
    function = bundle["AdmissionFunction"]
    events = function.log_events(written)
    ingested = function.ingested_log_bytes(written)
    print(f"a warm admission: {len(written.encode())} bytes printed under the RIE, {len(events)} events, {ingested} B")
    assert ingested <= ADMISSION_LOG_BUDGET_BYTES, written
    assert len(events) == 1, written
    # And that line is its metric's EMF line, the audit fields in it as metadata
    line = json.loads(events[0])
    assert line["_aws"]["CloudWatchMetrics"][0]["Metrics"] == [{"Name": "RunsAdmitted", "Unit": "Count"}]
    assert line["_aws"]["CloudWatchMetrics"][0]["Dimensions"] == [["service"]]
    assert set(line) >= AUDIT_FIELDS
    assert (line["tenant_id"], line["run_id"], line["dispatch_key"]) == (local.tenant, answer[2]["run_id"], "k-warm")
    assert (line["message"], line["status"]) == ("run admitted", 201)


@pytest.fixture
def unanswering_dynamodb() -> Iterator[tuple[str, list[socket.socket]]]:
    """A DynamoDB endpoint that accepts connections and never answers (an outage short of a refusal)."""
    server = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                accepted.append(server.accept()[0])
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}", accepted
    server.close()
    thread.join(timeout=5)
    for connection in accepted:
        connection.close()


def test_admission_answers_503_within_its_timeout_when_dynamodb_does_not_answer(
    run_function: Callable[..., rie.RunningFunction],
    local: Local,
    unanswering_dynamodb: tuple[str, list[socket.socket]],
    bundle: dict[str, rie.FunctionBundle],
) -> None:
    endpoint, accepted = unanswering_dynamodb
    # Given the built admission function whose DynamoDB endpoint accepts and never answers
    function = run_function(CASES[0], local, AWS_ENDPOINT_URL_DYNAMODB=endpoint)
    function.invoke(http_event("GET", "/openapi.json", local.tenant))  # INIT outside the measured call

    # When a run is asked for
    started = time.monotonic()
    status, headers, problem = _answer(function.invoke(_create(local.tenant, "k-outage")))
    elapsed = time.monotonic() - started

    # Then it answers 503 problem+json well within the function's timeout, having tried DynamoDB
    assert status == 503
    assert headers["Content-Type"] == "application/problem+json"
    assert problem["status"] == 503
    assert elapsed < bundle["AdmissionFunction"].timeout - 2
    assert "Task timed out" not in function.log()
    assert accepted
    assert count_runs(local.dev.dynamodb(), local.dev.table_name, local.tenant) == []
    # And under the JSON log format it still logged why, at WARNING: the cause, and the request's ids
    events = [json.loads(event) for event in bundle["AdmissionFunction"].log_events(function.log())]
    (warned,) = [event for event in events if event.get("level") == "WARNING"]
    assert warned["message"] == "store unavailable"
    assert "Read timeout" in warned["reason"]
    assert warned["correlation_id"]
    assert warned["function_request_id"]
    # And the runbook's query finds it by tenant and dispatch key (docs/operations.md#finding-an-admission)
    assert (warned["tenant_id"], warned["dispatch_key"], warned["status"]) == (local.tenant, "k-outage", 503)


# --- what the layers hold against what the functions import ---------------------------------------------


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def layer_distributions(layer: Path) -> dict[str, set[str]]:
    """Each distribution in the layer (its .dist-info; a package without one by its own name), with the
    top-level names it installs."""
    site = layer / "python"
    found: dict[str, set[str]] = {}
    for info in site.glob("*.dist-info"):
        name = _canonical(importlib.metadata.Distribution.at(info).metadata["Name"])
        tops = set()
        for line in (info / "RECORD").read_text().splitlines():
            first = line.split(",")[0].split("/")[0]
            if not first.endswith((".dist-info", ".data")) and first not in ("..", "__pycache__"):
                tops.add(first.removesuffix(".py"))
        found[name] = tops
    claimed = set().union(*found.values())
    for entry in site.iterdir():
        name = entry.name.removesuffix(".py")
        if name not in claimed and not entry.name.endswith((".dist-info", ".data", ".txt")) and name != "__pycache__":
            found[name] = {name}
    return found


def _imported_top_levels(log: str) -> set[str]:
    """Top-level modules named by `python -X importtime` lines (PYTHONPROFILEIMPORTTIME) in a function's log."""
    names = re.findall(r"import time:\s+\d+ \|\s+\d+ \|\s+([\w.]+)", log)
    return {name.split(".")[0] for name in names}


# Installed because a distribution declares it, imported by no function at init or first invocation: the MSK
# IAM signer requires click for its command line, which Lambda never runs.
NEVER_IMPORTED: dict[str, set[str]] = {"KafkaLayer": {"click"}}


def test_each_layer_holds_only_what_its_functions_import(
    bundle: dict[str, rie.FunctionBundle], run_function: Callable[..., rie.RunningFunction], local: Local
) -> None:
    # Given every function run in its RIE with Python's import trace on, through INIT and its first event
    imported: dict[str, set[str]] = {}
    for case in CASES:
        own = local.fresh()
        function = run_function(case, own, PYTHONPROFILEIMPORTTIME="1")
        case.stored(own, function.invoke(case.first_event(own)))
        imported[case.function] = _imported_top_levels(function.log())

    # Then each layer's distributions are exactly those some function using that layer imported
    layers = {layer for function in bundle.values() for layer in function.layers}
    listing = {}
    for layer in sorted(layers):
        users = [name for name, function in bundle.items() if layer in function.layers]
        tops = set().union(*(imported[name] for name in users))
        held = layer_distributions(layer)
        listing[layer.name] = {
            dist: sorted(name for name in users if names & imported[name]) for dist, names in held.items()
        }
        unused = {dist for dist, names in held.items() if not names & tops}
        assert unused == NEVER_IMPORTED.get(layer.name, set()), listing
    print(json.dumps(listing, indent=1, sort_keys=True))


# --- SnapStart -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_snapstart_hooks_run_in_the_runtime_then_the_function_answers(
    case: Case, bundle: dict[str, rie.FunctionBundle], local: Local
) -> None:
    # Given the handler module loaded as the runtime loads it (task root first), with the runtime's own
    # hook registry (snapshot_restore_py, which awslambdaric brings)
    module, _, attribute = bundle[case.function].handler.rpartition(".")
    probe = f"""
import json, sys
import snapshot_restore_py
from awslambdaric import lambda_runtime_hooks_runner
from awslambdaric.lambda_context import LambdaContext
handler = getattr(__import__({module!r}), {attribute!r})
before = [f.__name__ for f, _, _ in snapshot_restore_py.get_before_snapshot()]
after = [f.__name__ for f, _, _ in snapshot_restore_py.get_after_restore()]
# When the runtime runs them around a snapshot (awslambdaric's runner), then the first event arrives
lambda_runtime_hooks_runner.run_before_snapshot()
lambda_runtime_hooks_runner.run_after_restore()
context = LambdaContext("rie-probe", None, None, int((__import__("time").time() + 30) * 1000), "arn:probe", None)
answer = handler(json.loads(sys.stdin.read()), context)
print(json.dumps({{"before": before, "after": after, "answer": answer}}))
"""
    function = bundle[case.function]
    env = {**rie.lambda_variables(function, local.runtime()), **function.environment(case.values(local))}
    result = subprocess.run(
        rie.sandbox_command(function, str(rie.runtime_python()), "-c", probe),
        input=json.dumps(case.first_event(local)),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )

    # Then the function registered its hooks, they ran, and the restored environment did its work
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.splitlines()[-1])
    assert (seen["before"], seen["after"]) == case.hooks
    case.stored(local, seen["answer"])


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_a_snapstart_init_runs_the_before_snapshot_hooks_to_completion_under_the_rie(
    case: Case, bundle: dict[str, rie.FunctionBundle], local: Local, tmp_path: Path
) -> None:
    # Given the function in an RIE that initialises as SnapStart does (before-snapshot hooks, then /restore/next)
    function = rie.start(bundle[case.function], case.values(local), local.runtime(), tmp_path, init_caching=True)
    try:
        # When an invocation starts its INIT (the RIE never restores: the invocation itself cannot finish)
        threading.Thread(target=_invoke_ignoring_the_end, args=(function, case.first_event(local)), daemon=True).start()

        # Then INIT completed through the hooks: the runtime reached /restore/next without an init error
        log = wait_for(lambda: "INIT RTDONE" in function.log() and function.log(), timeout=60, what="INIT")
        assert "INIT START(type: snap-start" in log
        assert "INIT RTDONE(status: success)" in log
    finally:
        function.stop()


def _invoke_ignoring_the_end(function: rie.RunningFunction, event: dict[str, Any]) -> None:
    try:
        function.invoke(event, timeout=function.function.timeout + 5)
    except OSError:  # the RIE is stopped under it
        return


# --- by hand ---------------------------------------------------------------------------------------------


def test_one_function_runs_by_hand_as_docs_local_md_says(bundle: dict[str, rie.FunctionBundle], local: Local) -> None:
    # Given the command docs/local.md gives, for the admission function
    docs = (REPO / "docs" / "local.md").read_text()
    assert "python -m poimen_tools.local.rie serve AdmissionFunction" in docs
    values = [f"{name}={value}" for name, value in _admission_values(local).items()]
    port = rie.free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "poimen_tools.local.rie", "serve", "AdmissionFunction", *values, "--port", str(port)],
        env={"PATH": "/usr/bin:/bin", **local.runtime()},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        announced = process.stdout.readline()

        # When the announced URL is invoked
        url = announced.split()[-1]
        answer = rie.invoke(url, _create(local.tenant, "by-hand"), timeout=60)
    finally:
        process.terminate()
        process.wait(timeout=15)

    # Then it admitted the run
    assert url == f"http://127.0.0.1:{port}{rie.INVOCATIONS}"
    _admitted_once(local, answer)


def test_the_cold_start_benchmark_prints_its_table() -> None:
    """About 60 s: `make bench`'s cold-start step on the built bundle under the RIE, one fresh init per function
    (the fewest that print the table it checks)."""
    # Given `make bench`'s first step, on one fresh init per function
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.cold_start", "--inits", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )

    # Then it printed each function's INIT beside the floor's, with the ratio
    assert result.returncode == 0, result.stderr[-3000:]
    *table, footnote = result.stdout.splitlines()[2:]  # the title, the header; the rows, what warm ms are
    assert footnote.startswith("warm ms: median REPORT Duration")
    rows = {line.split()[0]: line for line in table}
    assert sorted(rows) == sorted(["floor:", *CASE_IDS])
    assert all(re.search(r" \d+\.\d\dx ", row) for row in rows.values())
