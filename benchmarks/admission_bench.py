"""Admission benchmark: ours vs Powertools @idempotent vs a bare put_item loop, on one moto server.

Run: `make bench` (or `.venv/bin/python -m benchmarks.admission_bench`). Prints the admission table,
then the cold import of both Lambda handlers (admission and inbox relay) against `import botocore.session`;
the figures that matter are ratios measured side by side in this run, not absolute times.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PRINCIPAL = "arn:aws:iam::000000000000:role/bench"
TENANT = "bench"

os.environ.update(
    {
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
        "POWERTOOLS_SERVICE_NAME": "poimen-bench",
        "POWERTOOLS_METRICS_NAMESPACE": "PoimenBench",
        "POWERTOOLS_LOG_LEVEL": "CRITICAL",  # the 500s Powertools causes below would log a trace each
    }
)

import boto3  # noqa: E402  (Powertools reads the settings above when it is imported)
from aws_lambda_powertools.utilities.idempotency import (  # noqa: E402
    DynamoDBPersistenceLayer,
    IdempotencyConfig,
    idempotent_function,
)

from poimen.admission import Admission, Admitted, RunView  # noqa: E402
from poimen.api import admission_service, app  # noqa: E402
from poimen.config import Settings  # noqa: E402
from poimen.contract import Run, RunRequest  # noqa: E402
from poimen.ids import unkeyed_run_id  # noqa: E402
from poimen.store import Store, run_pk  # noqa: E402
from poimen_tools.local.devserver import LocalLambdaContext  # noqa: E402
from poimen_tools.local.moto import EmbeddedMoto  # noqa: E402
from poimen_tools.local.template import Template  # noqa: E402

Handler = Callable[[dict[str, Any], Any], dict[str, Any]]


class PowertoolsAdmission(Admission):
    """The same admission written the way a user would reach for first: Powertools @idempotent,
    key = (tenant, dispatch_key), the run written by an unconditional save inside it."""

    def __init__(self, store: Store, idempotency_table: str, client: Any) -> None:
        super().__init__(store, grants_cache_seconds=3600, tenants={TENANT})
        self.persistence = DynamoDBPersistenceLayer(table_name=idempotency_table, boto3_client=client)
        self._executed = threading.local()
        self.errors: list[str] = []
        config = IdempotencyConfig(event_key_jmespath="[tenant_id, dispatch_key]")

        @idempotent_function(  # type: ignore[untyped-decorator]
            data_keyword_argument="spawn", persistence_store=self.persistence, config=config
        )
        def admit(spawn: dict[str, Any]) -> dict[str, Any]:
            self._executed.value = True
            run = Run(
                run_id=unkeyed_run_id(),
                status="admitted",
                created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                **spawn,
            )
            fields = run.model_dump()
            input_json = json.dumps(fields.pop("input"))
            record = store.runs(
                run_pk(run.tenant_id, run.run_id), fingerprint="-", attempt_id="-", input_json=input_json, **fields
            )
            record.save()
            return run.model_dump(mode="json")

        self._admit = admit

    def admit_run(
        self, principal: str | None, tenant_id: str, request: RunRequest, *, traceparent: str | None = None
    ) -> Admitted:
        self.authorize(principal, tenant_id)
        self._executed.value = False
        try:
            answer = self._admit(spawn={"tenant_id": tenant_id, **request.model_dump()})
        except Exception as error:
            self.errors.append(type(error).__name__)
            raise
        run = RunView(answer["run_id"], tenant_id, request.dispatch_key, answer["created_at"], json.dumps(answer))
        return Admitted(run, replayed=not self._executed.value)


@dataclass
class Variant:
    name: str
    admit: Callable[[str], Any]  # dispatch_key -> None; raises on an error answer
    calls: list[str]


def _event(key: str) -> dict[str, Any]:
    event: dict[str, Any] = json.loads((REPO / "tests/events/http_api_create_run.json").read_text())
    event["headers"]["x-poimen-tenant"] = TENANT
    event["requestContext"]["authorizer"]["iam"]["userArn"] = PRINCIPAL
    event["body"] = json.dumps({"workflow_ref": "wf/bench", "input": {"n": 1, "s": "x" * 64}, "dispatch_key": key})
    return event


def _through_handler(handler: Handler, service: Admission) -> Callable[[str], dict[str, Any]]:
    def admit(key: str) -> dict[str, Any]:
        app.dependency_overrides[admission_service] = lambda: service
        result = handler(_event(key), LocalLambdaContext("bench"))
        if result["statusCode"] >= 300:
            raise RuntimeError(f"{result['statusCode']}: {result['body']}")
        return result

    return admit


def _counted(client: Any, calls: list[str]) -> None:
    client.meta.events.register("before-call.dynamodb", lambda model, **_: calls.append(model.name))


def _rate(admit: Callable[[str], Any], keys: list[str]) -> float:
    start = time.perf_counter()
    for key in keys:
        admit(key)
    return len(keys) / (time.perf_counter() - start)


def _calls_per(variant: Variant, keys: list[str]) -> float:
    variant.calls.clear()
    for key in keys:
        variant.admit(key)
    return len(variant.calls) / len(keys)


def _concurrent_duplicates(admission: Admission, copies: int = 20) -> tuple[int, int]:
    """Twenty threads admit one key at once through the admission logic the handler calls.

    Threads call the logic, not the handler: a Lambda environment runs one invocation at a time, and
    Powertools' resolver keeps the current event on the instance.
    """
    request = RunRequest(workflow_ref="wf/bench", input={"n": 1}, dispatch_key=f"dup-{uuid.uuid4()}")
    barrier = threading.Barrier(copies)

    def one(_: int) -> str:
        barrier.wait()
        try:
            return admission.admit_run(PRINCIPAL, TENANT, request).run.run_id
        except Exception:
            return "error"

    with ThreadPoolExecutor(max_workers=copies) as pool:
        answers = list(pool.map(one, range(copies)))
    run_ids = {answer for answer in answers if answer != "error"}
    return answers.count("error"), len(run_ids)


def _import_seconds(statement: str, environment: dict[str, str]) -> float:
    code = f"import time; t = time.perf_counter(); {statement}; print(time.perf_counter() - t)"
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=REPO, env=environment
    )
    return float(out.stdout.strip().splitlines()[-1])


HANDLERS = {"admission": "functions/admission/app.py", "inbox relay": "functions/inbox_relay/app.py"}
FUNCTIONS = {"admission": "AdmissionFunction", "inbox relay": "InboxRelayFunction"}
BASELINE = "import botocore.session"


def _handler_import(path: str) -> str:
    return (
        f"import importlib.util as u; s = u.spec_from_file_location('app', {path!r}); "
        "m = u.module_from_spec(s); s.loader.exec_module(m)"
    )


def cold_imports(rounds: int) -> dict[str, float]:
    """Median seconds to import each handler, and `import botocore.session`, each in a fresh interpreter."""
    statements = {name: _handler_import(path) for name, path in HANDLERS.items()} | {"botocore.session": BASELINE}
    # Each handler with its function's variables from template.yaml (PYDANTIC_DISABLE_PLUGINS among them).
    template = Template(REPO / "template.yaml")
    environments = {name: os.environ | template.function_environment(FUNCTIONS[name], {}) for name in HANDLERS}
    seconds: dict[str, list[float]] = {name: [] for name in statements}
    for _ in range(rounds):  # interleaved, so every statement sees the same machine load
        for name, statement in statements.items():
            seconds[name].append(_import_seconds(statement, environments.get(name, dict(os.environ))))
    return {name: statistics.median(values) for name, values in seconds.items()}


def print_cold_imports(medians: dict[str, float], rounds: int) -> None:
    baseline = medians["botocore.session"]
    print(f"Cold import, {rounds} fresh interpreters each, interleaved, medians (goal: handler <= 1.5x)")
    header = f"{'module':34} {'ms':>9} {'x botocore.session':>19}"
    print(header)
    print("-" * len(header))
    for name, path in [*HANDLERS.items(), ("botocore.session", BASELINE)]:
        print(f"{path:34} {medians[name] * 1000:9.0f} {medians[name] / baseline:19.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--admissions", type=int, default=300, help="admissions per variant and round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median is reported")
    parser.add_argument("--import-rounds", type=int, default=7, help="cold imports of each module measured")
    args = parser.parse_args()
    # Powertools warns per call about an unregistered Lambda context and look-ups without metrics.
    warnings.simplefilter("ignore", UserWarning)

    template = Template(REPO / "template.yaml")
    with EmbeddedMoto() as moto:
        os.environ["AWS_ENDPOINT_URL_DYNAMODB"] = moto.endpoint
        client = boto3.client("dynamodb")
        client.create_table(**template.create_table_request("AdmissionTable", "bench-admission"))
        client.create_table(
            TableName="bench-idempotency",
            KeySchema=[{"AttributeName": "id", "KeyType": "HASH"}],
            AttributeDefinitions=[{"AttributeName": "id", "AttributeType": "S"}],
            BillingMode="PAY_PER_REQUEST",
        )
        settings = Settings.from_env({"TABLE_NAME": "bench-admission", "AWS_REGION": "us-east-1"})
        store = Store(settings)
        store.grant(PRINCIPAL, "*")
        handler = template.load_handler("AdmissionFunction")

        ours = Admission(store, grants_cache_seconds=3600, tenants={TENANT})
        powertools_client = boto3.client("dynamodb")
        theirs = PowertoolsAdmission(store, "bench-idempotency", powertools_client)
        floor_client = boto3.client("dynamodb")
        variants = {
            "ours": Variant("poimen admission (handler)", _through_handler(handler, ours), []),
            "powertools": Variant("Powertools @idempotent (handler)", _through_handler(handler, theirs), []),
            "floor": Variant(
                "bare put_item loop (floor)",
                lambda key: floor_client.put_item(
                    TableName="bench-admission",
                    Item={"pk": {"S": f"RUN#{TENANT}#{key}"}, "input": {"S": '{"n": 1}'}},
                ),
                [],
            ),
        }
        _counted(store.client, variants["ours"].calls)
        _counted(store.client, variants["powertools"].calls)  # its run write goes through the store
        _counted(powertools_client, variants["powertools"].calls)
        _counted(floor_client, variants["floor"].calls)
        # The handler prints one EMF metrics line per admission, as in Lambda; keep them out of the table.
        with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
            for variant in variants.values():  # warm caches (grants, clients, connections)
                variant.admit(f"warm-{uuid.uuid4()}")

            fresh: dict[str, list[float]] = {name: [] for name in variants}
            replay: dict[str, list[float]] = {name: [] for name in variants}
            for _ in range(args.rounds):
                for name, variant in variants.items():
                    keys = [f"{name}-{uuid.uuid4()}" for _ in range(args.admissions)]
                    fresh[name].append(_rate(variant.admit, keys))
                    replay[name].append(_rate(variant.admit, keys))

            probe = [f"probe-{uuid.uuid4()}" for _ in range(50)]
            calls_fresh = {name: _calls_per(variant, probe) for name, variant in variants.items()}
            calls_replay = {name: _calls_per(variant, probe) for name, variant in variants.items()}
            duplicates = {"ours": _concurrent_duplicates(ours), "powertools": _concurrent_duplicates(theirs)}

    imports = cold_imports(rounds=args.import_rounds)
    rate_fresh = {name: statistics.median(values) for name, values in fresh.items()}
    rate_replay = {name: statistics.median(values) for name, values in replay.items()}

    print(f"\nAdmission benchmark: {args.admissions} admissions x {args.rounds} rounds, one moto server, medians\n")
    header = f"{'variant':34} {'fresh/s':>9} {'replay/s':>9} {'calls fresh':>12} {'calls replay':>13}"
    print(header)
    print("-" * len(header))
    for name, variant in variants.items():
        print(
            f"{variant.name:34} {rate_fresh[name]:9.0f} {rate_replay[name]:9.0f} "
            f"{calls_fresh[name]:12.2f} {calls_replay[name]:13.2f}"
        )
    print()
    print(f"{'20 concurrent duplicates (threads)':34} {'errors':>9} {'run_ids':>9}  errors raised")
    labels = {"ours": "poimen Admission.admit_run", "powertools": "Powertools @idempotent_function"}
    for name, label in labels.items():
        errors, run_ids = duplicates[name]
        raised = sorted(set(theirs.errors)) if name == "powertools" else []
        print(f"{label:34} {errors:9d} {run_ids:9d}  {', '.join(raised) or '-'}")
    print()
    print("Ratios (goal in brackets)")
    print(f"  fresh throughput, ours / Powertools     {rate_fresh['ours'] / rate_fresh['powertools']:6.2f}  [>= 1.5]")
    print(f"  fresh throughput, ours / bare put floor {rate_fresh['ours'] / rate_fresh['floor']:6.2f}  [>= 0.7]")
    print()
    print_cold_imports(imports, args.import_rounds)


if __name__ == "__main__":
    main()
