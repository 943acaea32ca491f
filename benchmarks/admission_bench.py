"""Admission benchmark: ours vs Powertools @idempotent vs two floors, on one moto server.

Run: `make bench` (or `.venv/bin/python -m benchmarks.admission_bench`). The handler runs as it ships: its
variables from template.yaml (INFO logging, metrics, the grants cache), one log line and one EMF line per
admission (sent to /dev/null). Two floors, side by side in the same run:
- the same-item floor sends the very PutItem admission sends (its item, same attributes and sizes, its
  ConditionExpression and ReturnValuesOnConditionCheckFailure) through a bare botocore client configured
  as the store's, so ours / same-item floor is our code's own cost;
- the old floor puts a two-attribute item without a condition, so same-item / old floor is what the
  store charges for our item.
Then the cold import of both Lambda handlers (admission and inbox relay) against `import botocore.session`.
The figures that matter are ratios measured side by side in this run, not absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

from poimen_tools.local.template import Template

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = Template(REPO / "template.yaml")
PRINCIPAL = "arn:aws:iam::000000000000:role/bench"
TENANT = "bench"
TABLE = "bench-admission"

# The admission function's variables as template.yaml sets them, read when Powertools is imported and when
# admission's settings are first read (TABLE_NAME is the one a deploy would set).
os.environ.update(
    {
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
        **TEMPLATE.function_environment("AdmissionFunction", {}),
        "TABLE_NAME": TABLE,
        "TENANTS": TENANT,
    }
)

import boto3  # noqa: E402  (Powertools reads the settings above when it is imported)
import botocore.session  # noqa: E402
from aws_lambda_powertools.utilities.idempotency import (  # noqa: E402
    DynamoDBPersistenceLayer,
    IdempotencyConfig,
    idempotent_function,
)
from botocore.config import Config  # noqa: E402

from benchmarks.quiet import silenced  # noqa: E402
from poimen import api  # noqa: E402
from poimen.admission import Admission, Admitted, RunView  # noqa: E402
from poimen.contract import Run, RunRequest  # noqa: E402
from poimen.ids import unkeyed_run_id  # noqa: E402
from poimen.store import Store, run_pk  # noqa: E402
from poimen_tools.local.devserver import LocalLambdaContext  # noqa: E402
from poimen_tools.local.moto import EmbeddedMoto  # noqa: E402

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
        self,
        principal: str | None,
        tenant_id: str,
        request: RunRequest,
        *,
        traceparent: str | None = None,
        authorized: bool = False,
    ) -> Admitted:
        if not authorized:
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
    # Entered around each batch of admissions: what makes the handler use this variant's admission.
    active: Callable[[], AbstractContextManager[Any]] = field(default=nullcontext)


_EVENT: dict[str, Any] = json.loads((REPO / "tests/events/http_api_create_run.json").read_text())
_EVENT["headers"]["x-poimen-tenant"] = TENANT
_EVENT["requestContext"]["authorizer"]["iam"]["userArn"] = PRINCIPAL


def _event(key: str) -> dict[str, Any]:
    body = json.dumps({"workflow_ref": "wf/bench", "input": {"n": 1, "s": "x" * 64}, "dispatch_key": key})
    return {**_EVENT, "body": body}


def _through_handler(handler: Handler) -> Callable[[str], dict[str, Any]]:
    def admit(key: str) -> dict[str, Any]:
        result = handler(_event(key), LocalLambdaContext("bench"))
        if result["statusCode"] >= 300:
            raise RuntimeError(f"{result['statusCode']}: {result['body']}")
        return result

    return admit


def _store_client_config(client: Any) -> Config:
    """The configuration of `client` as botocore would build it again: `meta.config` keeps retries, timeouts
    and pool size but not parameter_validation, which pynamodb turns off."""
    return client.meta.config.merge(Config(parameter_validation=False))  # type: ignore[no-any-return]


def captured_put(handler: Handler, store_client: Any) -> dict[str, Any]:
    """The PutItem parameters admission sends for one admission through the handler."""
    captured: dict[str, Any] = {}

    def capture(params: dict[str, Any], **_: Any) -> None:
        captured.update(params)

    store_client.meta.events.register("provide-client-params.dynamodb.PutItem", capture, unique_id="bench-capture")
    try:
        _through_handler(handler)(str(uuid.uuid4()))
    finally:
        store_client.meta.events.unregister("provide-client-params.dynamodb.PutItem", unique_id="bench-capture")
    if not {"ConditionExpression", "ReturnValuesOnConditionCheckFailure"} <= captured.keys():
        raise RuntimeError(f"admission's PutItem is not conditional: {sorted(captured)}")
    return captured


def same_item_floor(put: dict[str, Any], store_client: Any) -> tuple[Callable[[str], None], Any]:
    """Admission's own PutItem with nothing around it: a bare botocore client configured as the store's sends
    `put` with the key's attributes replaced by ones of the same size. The key is a UUID, as long as a run
    id, so it stands for the run id too. A replay gets ConditionalCheckFailed with the stored item, as
    admission's replay does."""
    client: Any = botocore.session.get_session().create_client("dynamodb", config=_store_client_config(store_client))
    if type(client._serializer) is not type(store_client._serializer):  # parameter validation on one of them
        raise RuntimeError("the same-item floor's client is not configured as the store's")

    def admit(key: str) -> None:
        item = {**put["Item"], "pk": {"S": run_pk(TENANT, key)}, "run_id": {"S": key}, "dispatch_key": {"S": key}}
        with suppress(client.exceptions.ConditionalCheckFailedException):
            client.put_item(**{**put, "Item": item})

    return admit, client


def _counted(client: Any, calls: list[str]) -> None:
    client.meta.events.register("before-call.dynamodb", lambda model, **_: calls.append(model.name))


def _rate(admit: Callable[[str], Any], keys: list[str]) -> float:
    start = time.perf_counter()
    for key in keys:
        admit(key)
    return len(keys) / (time.perf_counter() - start)


def _calls_per(variant: Variant, keys: list[str]) -> float:
    variant.calls.clear()
    with variant.active():
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
    environments = {name: os.environ | TEMPLATE.function_environment(FUNCTIONS[name], {}) for name in HANDLERS}
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


def _load() -> str:
    """The machine's load averages, as uptime prints them: ratios are the figure on a loaded machine."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} on {os.cpu_count()} CPUs"


@contextmanager
def _admission_of_handler(admission: Admission) -> Iterator[None]:
    """The handler's routes use `admission` instead of the one built from the environment."""
    with mock.patch.object(api, "admission_service", return_value=admission):
        yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--admissions", type=int, default=300, help="admissions per variant and round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median is reported")
    parser.add_argument("--import-rounds", type=int, default=7, help="cold imports of each module measured")
    args = parser.parse_args()
    # Powertools warns per call about an unregistered Lambda context and look-ups without metrics.
    warnings.simplefilter("ignore", UserWarning)
    load_before = _load()

    with EmbeddedMoto() as moto, silenced():
        os.environ["AWS_ENDPOINT_URL_DYNAMODB"] = moto.endpoint
        client = boto3.client("dynamodb")
        client.create_table(**TEMPLATE.create_table_request("AdmissionTable", TABLE))
        client.create_table(
            TableName="bench-idempotency",
            KeySchema=[{"AttributeName": "id", "KeyType": "HASH"}],
            AttributeDefinitions=[{"AttributeName": "id", "AttributeType": "S"}],
            BillingMode="PAY_PER_REQUEST",
        )
        handler = TEMPLATE.load_handler("AdmissionFunction")
        ours = api.admission_service()  # as the handler builds it, from the variables above
        store = ours._store
        store.grant(PRINCIPAL, "*")
        put = captured_put(handler, store.client)
        powertools_client = boto3.client("dynamodb")
        theirs = PowertoolsAdmission(store, "bench-idempotency", powertools_client)
        same_item, same_item_client = same_item_floor(put, store.client)
        old_floor_client = boto3.client("dynamodb")
        variants = {
            "ours": Variant("poimen admission (handler)", _through_handler(handler), []),
            "powertools": Variant(
                "Powertools @idempotent (handler)",
                _through_handler(handler),
                [],
                lambda: _admission_of_handler(theirs),
            ),
            "same-item": Variant("same PutItem, bare botocore (floor)", same_item, []),
            "old-floor": Variant(
                "2-attribute put_item (old floor)",
                lambda key: old_floor_client.put_item(
                    TableName=TABLE, Item={"pk": {"S": run_pk(TENANT, key)}, "input": {"S": '{"n": 1}'}}
                ),
                [],
            ),
        }
        _counted(store.client, variants["ours"].calls)
        _counted(store.client, variants["powertools"].calls)  # its run write goes through the store
        _counted(powertools_client, variants["powertools"].calls)
        _counted(same_item_client, variants["same-item"].calls)
        _counted(old_floor_client, variants["old-floor"].calls)
        for variant in variants.values():  # warm caches (grants, clients, connections)
            with variant.active():
                variant.admit(str(uuid.uuid4()))

        fresh: dict[str, list[float]] = {name: [] for name in variants}
        replay: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, variant in variants.items():
                keys = [str(uuid.uuid4()) for _ in range(args.admissions)]
                with variant.active():
                    fresh[name].append(_rate(variant.admit, keys))
                    replay[name].append(_rate(variant.admit, keys))

        probe = [str(uuid.uuid4()) for _ in range(50)]
        calls_fresh = {name: _calls_per(variant, probe) for name, variant in variants.items()}
        calls_replay = {name: _calls_per(variant, probe) for name, variant in variants.items()}
        duplicates = {"ours": _concurrent_duplicates(ours), "powertools": _concurrent_duplicates(theirs)}

    imports = cold_imports(rounds=args.import_rounds)
    rate_fresh = {name: statistics.median(values) for name, values in fresh.items()}
    rate_replay = {name: statistics.median(values) for name, values in replay.items()}

    print(f"\nAdmission benchmark: {args.admissions} admissions x {args.rounds} rounds, one moto server, medians")
    print(f"({load_before} before, {_load()} after)\n")
    header = f"{'variant':36} {'fresh/s':>8} {'ms each':>8} {'replay/s':>9} {'calls fresh':>12} {'calls replay':>13}"
    print(header)
    print("-" * len(header))
    for name, variant in variants.items():
        print(
            f"{variant.name:36} {rate_fresh[name]:8.0f} {1000 / rate_fresh[name]:8.2f} {rate_replay[name]:9.0f} "
            f"{calls_fresh[name]:12.2f} {calls_replay[name]:13.2f}"
        )
    print()
    print(f"{'20 concurrent duplicates (threads)':36} {'errors':>8} {'run_ids':>8}  errors raised")
    labels = {"ours": "poimen Admission.admit_run", "powertools": "Powertools @idempotent_function"}
    for name, label in labels.items():
        errors, run_ids = duplicates[name]
        raised = sorted(set(theirs.errors)) if name == "powertools" else []
        print(f"{label:36} {errors:8d} {run_ids:8d}  {', '.join(raised) or '-'}")
    ours_ms, same_ms = 1000 / rate_fresh["ours"], 1000 / rate_fresh["same-item"]
    print()
    print("Ratios of fresh throughput (goal in brackets)")
    ratios = [
        ("ours / Powertools", "ours", "powertools", "[>= 1.5]"),
        ("ours / same-item floor: our code's own cost", "ours", "same-item", "[>= 0.9]"),
        ("same-item / old floor: the store's cost of our item", "same-item", "old-floor", ""),
        ("ours / old floor: the two together", "ours", "old-floor", "[>= 0.7]"),
    ]
    for label, numerator, denominator, goal in ratios:
        print(f"  {label:52} {rate_fresh[numerator] / rate_fresh[denominator]:6.2f}  {goal}".rstrip())
    print()
    print("Per admission, in-process against moto (docs/operations.md#what-a-tenant-costs)")
    print(f"  admission handler            {ours_ms:6.2f} ms")
    print(f"  of which the handler's own   {ours_ms - same_ms:6.2f} ms ({(ours_ms - same_ms) / ours_ms:.0%})")
    print()
    print_cold_imports(imports, args.import_rounds)


if __name__ == "__main__":
    main()
