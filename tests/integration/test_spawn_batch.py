"""The batch form of POST /v1/runs over real HTTP against `poimen dev` (its execution environments are worker
processes): batches and single spawns racing on the same keys are one run a key in the table."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import requests

from poimen.ids import keyed_run_id
from poimen.wire import SPAWN_RESULTS_MEDIA_TYPE, SPAWNS_MEDIA_TYPE
from tests.conftest import count_runs
from tests.integration.conftest import DevServer, signed_session

# Keys the racers share, and how many batches and single spawns race on them: enough concurrent requests to
# keep every `poimen dev` execution environment busy at once, so conditional writes of one key really collide.
KEYS = [f"race-{n}" for n in range(8)]
BATCHES = 12
SINGLES = 24


def _spawn(tenant: str, key: str) -> dict[str, Any]:
    return {"workflow_ref": "wf/race", "input": {"key": key}, "dispatch_key": key}


def test_concurrent_batches_and_single_spawns_on_the_same_keys_are_one_run_a_key(dev: DevServer, tenant: str) -> None:
    # Given the first key admitted already, batches of the shared keys in shuffled orders (two keys twice in
    # each), single spawns of each, and a batch reusing the first key with another workflow
    with signed_session() as session:
        first = session.post(
            f"{dev.url}/v1/runs", json=_spawn(tenant, KEYS[0]), headers={"X-Poimen-Tenant": tenant}, timeout=60
        )
    assert first.status_code == 201, first.text
    rng = random.Random(36)
    batches = [
        [_spawn(tenant, key) for key in rng.sample(KEYS, len(KEYS)) + rng.sample(KEYS, 2)] for _ in range(BATCHES)
    ]
    singles = [_spawn(tenant, KEYS[n % len(KEYS)]) for n in range(SINGLES)]
    mismatch = {**_spawn(tenant, KEYS[0]), "workflow_ref": "wf/other"}
    calls: list[tuple[str, Any]] = [("batch", spawns) for spawns in batches] + [("single", body) for body in singles]
    calls.append(("batch", [mismatch, _spawn(tenant, "race-own")]))
    rng.shuffle(calls)

    def send(call: tuple[str, Any]) -> tuple[str, Any, requests.Response]:
        kind, payload = call
        with signed_session() as session:  # a connection of its own: the requests are in flight together
            if kind == "single":
                answer = session.post(
                    f"{dev.url}/v1/runs", json=payload, headers={"X-Poimen-Tenant": tenant}, timeout=60
                )
            else:
                answer = session.post(
                    f"{dev.url}/v1/runs",
                    data=json.dumps({"spawns": payload}),
                    headers={"X-Poimen-Tenant": tenant, "Content-Type": SPAWNS_MEDIA_TYPE},
                    timeout=60,
                )
        return kind, payload, answer

    # When they are all sent at once
    with ThreadPoolExecutor(max_workers=16) as pool:
        answers = list(pool.map(send, calls))

    # Then the table holds one run a key, and nothing else
    stored = count_runs(dev.dynamodb(), dev.table_name, tenant)
    assert sorted(item["dispatch_key"]["S"] for item in stored) == sorted([*KEYS, "race-own"])
    # And every answer names its key's run: a single spawn's, and each result of every batch
    admitted: dict[str, int] = {}
    for kind, payload, answer in answers:
        if kind == "single":
            assert answer.status_code in (200, 201), answer.text
            named = [(payload["dispatch_key"], answer.status_code, answer.json()["run_id"], payload)]
        else:
            assert (answer.status_code, answer.headers["Content-Type"]) == (200, SPAWN_RESULTS_MEDIA_TYPE), answer.text
            results = answer.json()["results"]
            assert len(results) == len(payload)
            named = [
                (spawn["dispatch_key"], result["status"], (result.get("run") or result["problem"])["run_id"], spawn)
                for spawn, result in zip(payload, results, strict=True)
            ]
        for key, status, run_id, spawn in named:
            assert run_id == keyed_run_id(tenant, key)
            # the mismatch alone is a 422; every other answer is the run, admitted once (the first key before)
            assert status in ((422,) if spawn is mismatch else (200, 201))
            if status == 201:
                admitted[key] = admitted.get(key, 0) + 1
    assert admitted == dict.fromkeys([*KEYS[1:], "race-own"], 1)
