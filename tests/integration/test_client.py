"""poimen.client and `poimen runs` against `poimen dev` over real HTTP: spawn and replay, typed refusals,
and retries after an answer lost on the way back, counted in the table."""

from __future__ import annotations

import http.client
import io
import json
import os
import shlex
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from botocore.credentials import Credentials

from poimen.client import (
    GENERATED_KEY_PREFIX,
    AdmissionClient,
    DispatchKeyReused,
    Forbidden,
    InvalidRequest,
    NotFound,
    Spawned,
    SpawnRequest,
)
from poimen.ids import keyed_run_id
from poimen.wire import MAX_JSON_DEPTH
from poimen_tools import runs
from tests.conftest import count_runs
from tests.integration.conftest import DevServer, free_port, start_dev

INPUT = {"amount": 1, "month": "2026-11"}


@pytest.fixture
def api(dev: DevServer) -> Iterator[AdmissionClient]:
    # Signed by the botocore chain: tests/conftest.py's "testing" key, which `poimen dev` grants every tenant.
    with AdmissionClient(dev.url) as client:
        yield client


def test_spawn_then_replay_is_one_run(dev: DevServer, api: AdmissionClient, tenant: str) -> None:
    first = api.spawn(tenant, "wf/report", INPUT, goal_id="g-7", dispatch_key="report-2026-11")
    again = api.spawn(tenant, "wf/report", INPUT, goal_id="g-7", dispatch_key="report-2026-11")

    assert (first.replayed, again.replayed) == (False, True)
    assert again.run == first.run
    assert first.run_id == keyed_run_id(tenant, "report-2026-11")
    assert api.get(tenant, first.run_id) == first.run
    assert api.find(tenant, "report-2026-11") == first.run
    assert len(count_runs(dev.dynamodb(), dev.table_name, tenant)) == 1


def test_keyless_spawns_are_two_runs_each_findable_by_its_generated_key(
    dev: DevServer, api: AdmissionClient, tenant: str
) -> None:
    first = api.spawn(tenant, "wf/a", INPUT)
    second = api.spawn(tenant, "wf/a", INPUT)

    assert first.run_id != second.run_id
    assert first.run.dispatch_key is not None
    assert first.run.dispatch_key.startswith(GENERATED_KEY_PREFIX)
    assert api.find(tenant, first.run.dispatch_key) == first.run
    assert len(count_runs(dev.dynamodb(), dev.table_name, tenant)) == 2


def test_a_reused_key_is_refused_with_the_existing_run(api: AdmissionClient, tenant: str) -> None:
    first = api.spawn(tenant, "wf/a", INPUT, dispatch_key="k-1")

    with pytest.raises(DispatchKeyReused) as raised:
        api.spawn(tenant, "wf/a", {**INPUT, "amount": 2}, dispatch_key="k-1")

    assert (raised.value.status, raised.value.run_id) == (422, first.run_id)


def test_spawn_many_gives_a_spawn_its_batch_cannot_carry_its_own_refusal_and_admits_the_others(
    dev: DevServer, api: AdmissionClient, tenant: str
) -> None:
    # Given a spawn nested deeper than the API reads any body (a batch carrying it is refused whole), between two
    deep: dict[str, Any] = {}
    for _ in range(MAX_JSON_DEPTH - 1):
        deep = {"a": deep}
    spawns = [
        SpawnRequest("wf/a", INPUT, dispatch_key="many-ok"),
        SpawnRequest("wf/a", deep, dispatch_key="many-deep"),
        SpawnRequest("wf/a", INPUT, dispatch_key="many-after"),
    ]

    # When they are spawned in one spawn_many
    first, refused, last = api.spawn_many(tenant, spawns)

    # Then each got what spawn gives it alone, in order: two runs, and the deep one's own malformed-json
    assert isinstance(first, Spawned), first
    assert isinstance(last, Spawned), last
    assert (first.run_id, last.run_id) == (keyed_run_id(tenant, "many-ok"), keyed_run_id(tenant, "many-after"))
    assert isinstance(refused, InvalidRequest)
    assert refused.problem is not None
    assert (refused.status, refused.problem.type, refused.dispatch_key) == (
        400,
        "urn:poimen:problem:malformed-json",
        "many-deep",
    )
    # And the table holds those two runs, one a key
    stored = count_runs(dev.dynamodb(), dev.table_name, tenant, only="dispatch_key")
    assert sorted(item["dispatch_key"]["S"] for item in stored) == ["many-after", "many-ok"]


def test_unknown_runs_are_not_found(api: AdmissionClient, tenant: str) -> None:
    with pytest.raises(NotFound) as raised:
        api.get(tenant, str(uuid.uuid4()))

    assert raised.value.problem is not None
    assert raised.value.problem.type == "urn:poimen:problem:run-not-found"
    assert api.find(tenant, "never-sent") is None


def test_a_bad_signature_is_forbidden_by_the_gateway(dev: DevServer, tenant: str) -> None:
    wrong = AdmissionClient(dev.url, credentials=Credentials("POIMENDEVACCESSKEY", "not-the-secret"))

    with pytest.raises(Forbidden) as raised:
        wrong.spawn(tenant, "wf/a", INPUT)

    assert (raised.value.status, raised.value.problem) == (403, None)
    assert raised.value.body["message"].startswith("The request signature we calculated does not match")
    assert count_runs(dev.dynamodb(), dev.table_name, tenant) == []


def test_a_tenant_not_granted_is_forbidden(dev: DevServer, tmp_path: Path, tenant: str) -> None:
    # Given a principal granted only `tenant` (in the principals file of a dev server on the same table)
    principals = tmp_path / "alice.json"
    alice = {
        "AKIDALICE": {"secret": "alice-secret", "arn": "arn:aws:iam::123456789012:user/alice", "tenants": [tenant]}
    }
    principals.write_text(json.dumps(alice))
    shared_table = ("--dynamodb-endpoint", dev.aws_endpoint, "--concurrency", "1")
    server = start_dev(tmp_path, "--principals", str(principals), *shared_table, table_name=dev.table_name)
    try:
        client = AdmissionClient(server.url, credentials=Credentials("AKIDALICE", "alice-secret"))
        # When she spawns for her tenant and for another
        own = client.spawn(tenant, "wf/a", INPUT)
        with pytest.raises(Forbidden) as raised:
            client.spawn(f"{tenant}-other", "wf/a", INPUT)
    finally:
        assert server.stop() == 0

    # Then the other is refused by admission itself, with its problem
    assert own.run.tenant_id == tenant
    assert raised.value.status == 403
    assert raised.value.problem is not None
    assert raised.value.problem.type == "urn:poimen:problem:forbidden"
    assert count_runs(dev.dynamodb(), dev.table_name, f"{tenant}-other") == []


# --- an answer lost on the way back -----------------------------------------------------------------


@dataclass
class LossyProxy:
    """An HTTP proxy on loopback in front of `poimen dev`. It forwards every request as it arrived (the
    signature covers its Host, which it keeps) and reads the whole answer, so the API has committed; for
    the first `lose` requests it then loses that answer: DROP closes the client's connection, HOLD keeps
    it open without a byte until the client times out."""

    upstream: str
    mode: str
    lose: int = 1
    url: str = ""
    statuses: list[int] = field(default_factory=list)  # what the API answered, in order
    released: threading.Event = field(default_factory=threading.Event)


DROP, HOLD = "drop", "hold"


@pytest.fixture
def lossy_proxy(dev: DevServer, request: pytest.FixtureRequest) -> Iterator[LossyProxy]:
    proxy = LossyProxy(upstream=dev.url, mode=request.param)
    lock = threading.Lock()
    target = urlsplit(dev.url)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _forward(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            upstream = http.client.HTTPConnection(target.hostname or "", target.port, timeout=30)
            try:
                upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for name, value in self.headers.items():
                    upstream.putheader(name, value)
                upstream.endheaders(body or None)
                answer = upstream.getresponse()
                payload = answer.read()
            finally:
                upstream.close()
            with lock:
                proxy.statuses.append(answer.status)
                lost = proxy.lose > 0
                proxy.lose -= 1
            if lost:
                if proxy.mode == HOLD:
                    proxy.released.wait(30)
                self.close_connection = True
                return
            self.send_response(answer.status)
            for name, value in answer.getheaders():
                if name.lower() not in ("connection", "transfer-encoding", "date", "server"):
                    self.send_header(name, value)
            self.end_headers()
            self.wfile.write(payload)

        do_GET = do_POST = _forward

        def log_message(self, format: str, *args: Any) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    proxy.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield proxy
    proxy.released.set()
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


@pytest.mark.parametrize("lossy_proxy", [DROP, HOLD], indirect=True)
@pytest.mark.parametrize("dispatch_key", ["k-lost", None], ids=["keyed", "keyless"])
def test_a_retry_after_a_lost_answer_admits_one_run(
    dev: DevServer, lossy_proxy: LossyProxy, tenant: str, dispatch_key: str | None
) -> None:
    # Given a client whose first answer is lost after the API committed the run. Its timeout is what the retry's
    # answer must come within: 6 s, as a replay under the suite's parallel workers on two cores can take over 2 s
    # (a third attempt would then be counted); the held first answer costs the test that long once.
    client = AdmissionClient(lossy_proxy.url, timeout=6.0, backoff_base=0.05)

    # When it spawns (with a key of its own, or none)
    spawned = client.spawn(tenant, "wf/a", INPUT, dispatch_key=dispatch_key)

    # Then its retry was answered with the run the first attempt admitted, and the table holds one run
    assert lossy_proxy.statuses == [201, 200]
    assert spawned.attempts == 2
    assert spawned.replayed == (dispatch_key is not None)  # a generated key can only replay this call's own run
    items = count_runs(dev.dynamodb(), dev.table_name, tenant)
    assert len(items) == 1
    assert [entry["message"] for entry in dev.admissions(tenant)] == ["run admitted", "run replayed"]
    assert client.get(tenant, spawned.run_id) == spawned.run


# --- poimen runs --------------------------------------------------------------------------------------


def poimen_runs(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = runs.main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_poimen_runs_spawn_get_find(dev: DevServer, tenant: str) -> None:
    where = ("--base-url", dev.url, "--tenant", tenant)
    spawn = ("spawn", *where, "--workflow-ref", "wf/cli", "--input", '{"amount": 12345678901234567.25}')

    code, out, err = poimen_runs(*spawn, "--dispatch-key", "cli-1")
    again = poimen_runs(*spawn, "--dispatch-key", "cli-1")
    spawned = json.loads(out)
    run_id = spawned["run"]["run_id"]
    got = poimen_runs("get", *where, run_id)
    found = poimen_runs("find", *where, "cli-1")

    assert (code, err, spawned["replayed"]) == (0, "", False)
    assert '"input":{"amount":12345678901234567.25}' in out  # as sent, not through a double
    assert (again[0], json.loads(again[1])) == (0, {"replayed": True, "run": spawned["run"]})
    assert (got[0], json.loads(got[1])) == (0, spawned["run"])
    assert (found[0], json.loads(found[1])) == (0, spawned["run"])
    assert len(count_runs(dev.dynamodb(), dev.table_name, tenant)) == 1


def test_poimen_runs_errors_are_one_line_and_an_exit_code(dev: DevServer, tenant: str) -> None:
    where = ("--base-url", dev.url, "--tenant", tenant)
    spawn = ("spawn", *where, "--workflow-ref", "wf/cli", "--dispatch-key", "cli-1")
    first = json.loads(poimen_runs(*spawn, "--input", "{}")[1])["run"]
    closed = f"http://127.0.0.1:{free_port()}"

    reused = poimen_runs(*spawn, "--input", '{"other": true}')
    missing = poimen_runs("get", *where, str(uuid.uuid4()))
    not_found = poimen_runs("find", *where, "never-sent")
    unavailable = poimen_runs("find", "--base-url", closed, "--tenant", tenant, "--max-attempts", "1", "k")
    wrong_url = poimen_runs("find", "--base-url", f"{dev.url}/nope", "--tenant", tenant, "k")

    for _, out, err in (reused, missing, not_found, unavailable, wrong_url):
        assert (out, err.count("\n"), err.startswith("poimen runs ")) == ("", 1, True)
    assert reused[0] == runs.EXIT_USAGE  # a request the API refuses as such
    assert first["run_id"] in reused[2]
    assert (missing[0], not_found[0]) == (runs.EXIT_NOT_FOUND, runs.EXIT_NOT_FOUND)
    assert (unavailable[0], wrong_url[0]) == (runs.EXIT_UNAVAILABLE, runs.EXIT_UNAVAILABLE)
    assert "--base-url" in wrong_url[2]


def _command_in(line: str) -> list[str] | None:
    """The `poimen runs spawn ...` command a failure line tells to run, as runs.main's argv; None if none."""
    start = line.rfind("poimen runs spawn --")
    return shlex.split(line[start:])[2:] if start >= 0 else None


@pytest.mark.parametrize("lossy_proxy", [DROP], indirect=True)
def test_a_keyless_spawn_whose_answers_are_all_lost_says_how_to_retry_into_its_one_run(
    dev: DevServer, lossy_proxy: LossyProxy, tenant: str
) -> None:
    # Given a proxy that loses the API's answer to both attempts, though the API admitted the run on the first
    lossy_proxy.lose = 2
    spawn = ["spawn", "--base-url", lossy_proxy.url, "--tenant", tenant, "--workflow-ref", "wf/cli"]
    spawn += ["--input", '{"n": 1, "note": "it\'s"}', "--max-attempts", "2", "--timeout", "5"]

    # When `poimen runs spawn` without --dispatch-key gives up
    code, out, err = poimen_runs(*spawn)
    # And the user does what its line says: the command it names, or, naming none, the same one again
    retry = _command_in(err) or spawn
    again = poimen_runs(*retry)

    # Then following the line answered the run the first attempt admitted: one run in the table
    assert (code, out, err.count("\n")) == (runs.EXIT_UNAVAILABLE, "", 1)
    assert again[0] == 0, again[2]
    run = json.loads(again[1])["run"]
    assert [item["run_id"]["S"] for item in count_runs(dev.dynamodb(), dev.table_name, tenant)] == [run["run_id"]]
    assert lossy_proxy.statuses == [201, 200, 200]
    # And the line named its generated key, and how to look for its run instead
    assert run["dispatch_key"].startswith(GENERATED_KEY_PREFIX)
    assert run["dispatch_key"] in err
    assert f"poimen runs find --base-url {lossy_proxy.url} --tenant {tenant} {run['dispatch_key']}" in err


def test_poimen_runs_refused_caller_is_unavailable(
    dev: DevServer, tenant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")

    code, out, err = poimen_runs("find", "--base-url", dev.url, "--tenant", tenant, "k")

    assert (code, out, err.count("\n")) == (runs.EXIT_UNAVAILABLE, "", 1)
    assert "signature" in err
    assert "--dev-key" in err


def test_poimen_runs_uses_the_dev_key_on_loopback_without_credentials(dev: DevServer, tenant: str) -> None:
    env = {name: value for name, value in os.environ.items() if not name.startswith("AWS_")}
    env["AWS_CONFIG_FILE"] = env["AWS_SHARED_CREDENTIALS_FILE"] = os.devnull
    command = [sys.executable, "-m", "poimen_tools.runs", "spawn", "--base-url", dev.url, "--tenant", tenant]
    command += ["--workflow-ref", "wf/cli", "--input", "{}"]

    result = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env, check=False)

    assert (result.returncode, result.stderr) == (0, "")
    assert json.loads(result.stdout)["run"]["dispatch_key"].startswith(GENERATED_KEY_PREFIX)
    assert len(count_runs(dev.dynamodb(), dev.table_name, tenant)) == 1


def test_poimen_runs_usage_errors_exit_2(tenant: str) -> None:
    with pytest.raises(SystemExit) as bad_input:
        poimen_runs("spawn", "--tenant", tenant, "--workflow-ref", "wf/a", "--input", "[1]")
    with pytest.raises(SystemExit) as bad_url:
        poimen_runs("get", "--base-url", "127.0.0.1:8080", "--tenant", tenant, str(uuid.uuid4()))
    with pytest.raises(SystemExit) as bad_tenant:
        poimen_runs("get", "--tenant", "Not A Tenant", str(uuid.uuid4()))

    assert {bad_input.value.code, bad_url.value.code, bad_tenant.value.code} == {runs.EXIT_USAGE}
