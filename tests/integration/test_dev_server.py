"""The specification's cases over real HTTP against `poimen dev` (same handler, embedded moto server)."""

from __future__ import annotations

import http.client
import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
from moto.server import ThreadedMotoServer

from poimen.ids import keyed_run_id
from poimen_tools.local.moto import serialise_dynamodb_writes
from poimen_tools.local.sigv4 import DEV_ACCESS_KEY, DEV_SECRET_KEY, signed_headers
from tests.conftest import count_runs
from tests.integration.conftest import POIMEN, DevServer, SigV4, free_port, next_tenant, signed_session, start_dev

SPAWN = {"workflow_ref": "wf/hello", "input": {"greeting": "hi"}, "dispatch_key": "k-1"}


def _post(session: requests.Session, dev: DevServer, tenant: str, body: object) -> requests.Response:
    return session.post(f"{dev.url}/v1/runs", json=body, headers={"X-Poimen-Tenant": tenant}, timeout=30)


def test_keyed_spawn_then_replay_is_one_run(dev: DevServer, http: requests.Session, tenant: str) -> None:
    first = _post(http, dev, tenant, SPAWN)
    again = _post(http, dev, tenant, SPAWN)

    assert (first.status_code, again.status_code) == (201, 200)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json() == first.json()
    assert first.json()["run_id"] == keyed_run_id(tenant, "k-1")
    assert len(count_runs(dev.dynamodb(), dev.table_name, tenant)) == 1


def test_twenty_concurrent_duplicates_over_http_make_one_run(dev: DevServer, tenant: str) -> None:
    def spawn(_: int) -> requests.Response:
        # One connection per thread: twenty requests really are in flight together.
        with signed_session() as session:
            return _post(session, dev, tenant, SPAWN)

    with ThreadPoolExecutor(max_workers=20) as pool:
        answers = list(pool.map(spawn, range(20)))

    assert sorted(answer.status_code for answer in answers) == [200] * 19 + [201]
    assert {answer.json()["run_id"] for answer in answers} == {keyed_run_id(tenant, "k-1")}
    assert len(count_runs(dev.dynamodb(), dev.table_name, tenant)) == 1


def test_two_unkeyed_spawns_are_two_runs(dev: DevServer, http: requests.Session, tenant: str) -> None:
    body = {"workflow_ref": "wf/hello", "input": {}}

    answers = [_post(http, dev, tenant, body), _post(http, dev, tenant, body)]

    assert [answer.status_code for answer in answers] == [201, 201]
    assert answers[0].json()["run_id"] != answers[1].json()["run_id"]
    assert len(count_runs(dev.dynamodb(), dev.table_name, tenant)) == 2


def test_errors_are_problem_json_over_http(dev: DevServer, http: requests.Session, tenant: str) -> None:
    malformed = http.post(
        f"{dev.url}/v1/runs",
        data=b"{not json",
        headers={"X-Poimen-Tenant": tenant, "Content-Type": "application/json"},
        timeout=30,
    )
    oversize = _post(http, dev, tenant, {"workflow_ref": "wf", "input": {"x": "y" * 300_000}})
    missing = http.get(f"{dev.url}/v1/runs/{keyed_run_id(tenant, 'nope')}", headers={"X-Poimen-Tenant": tenant})

    assert [(r.status_code, r.headers["Content-Type"]) for r in (malformed, oversize, missing)] == [
        (400, "application/problem+json"),
        (413, "application/problem+json"),
        (404, "application/problem+json"),
    ]
    assert count_runs(dev.dynamodb(), dev.table_name, tenant) == []


def test_a_batch_whose_event_is_over_lambdas_6_mb_is_api_gateways_500_over_http(
    dev: DevServer, http: requests.Session, tenant: str
) -> None:
    # Given a batch body of 7 MB over real HTTP: within API Gateway's 10 MB, its event over Lambda's 6 MB
    spawn = {"workflow_ref": "wf", "input": {}, "dispatch_key": "k-7mb"}
    body = json.dumps({"spawns": [spawn], "pad": "x" * (7 * 1024 * 1024)}).encode()
    answer = http.post(
        f"{dev.url}/v1/runs",
        data=body,
        headers={"X-Poimen-Tenant": tenant, "Content-Type": "application/vnd.poimen.spawns+json"},
        timeout=60,
    )

    # Then API Gateway's own 500, as on AWS (Lambda refuses the invocation), not the function's 413 problem
    assert (answer.status_code, answer.headers["Content-Type"], answer.json()) == (
        500,
        "application/json",
        {"message": "Internal Server Error"},
    )
    assert count_runs(dev.dynamodb(), dev.table_name, tenant) == []


def test_lookups_and_openapi_document(dev: DevServer, http: requests.Session, tenant: str) -> None:
    created = _post(http, dev, tenant, SPAWN).json()

    by_key = http.get(f"{dev.url}/v1/runs", params={"dispatch_key": "k-1"}, headers={"X-Poimen-Tenant": tenant})
    document = http.get(f"{dev.url}/openapi.json")

    assert by_key.json() == created
    assert set(document.json()["paths"]) == {"/v1/runs", "/v1/runs/{run_id}"}


def test_dev_uses_an_already_running_dynamodb_endpoint(tmp_path: Path, tenant: str) -> None:
    # Given a moto server started outside poimen dev
    serialise_dynamodb_writes()
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    moto.start()
    try:
        host, port = moto.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        server = start_dev(tmp_path, "--dynamodb-endpoint", endpoint, table_name="external-table")
        try:
            # When a run is admitted through it
            with signed_session() as session:
                assert _post(session, server, tenant, SPAWN).status_code == 201
        finally:
            # Then it stops cleanly on Ctrl-C, and the run is in the external endpoint's table
            assert server.stop() == 0
        assert server.aws_endpoint == endpoint
        assert len(count_runs(server.dynamodb(), "external-table", tenant)) == 1
    finally:
        moto.stop()


def test_concurrent_requests_of_different_tenants_are_never_mixed(dev: DevServer) -> None:
    # Twenty different unkeyed spawns in flight at once, across two tenants and four environments
    mixed = (next_tenant(), next_tenant())
    tenants = [mixed[i % 2] for i in range(20)]

    def spawn(i: int) -> tuple[int, requests.Response]:
        with signed_session() as session:
            return i, _post(session, dev, tenants[i], {"workflow_ref": f"wf/{i}", "input": {"i": i}})

    with ThreadPoolExecutor(max_workers=20) as pool:
        answers = list(pool.map(spawn, range(20)))

    for i, answer in answers:
        assert answer.status_code == 201
        assert (answer.json()["tenant_id"], answer.json()["input"]) == (tenants[i], {"i": i})
    assert len({answer.json()["run_id"] for _, answer in answers}) == 20


def test_one_key_with_two_payloads_concurrently_is_one_run(dev: DevServer, tenant: str) -> None:
    bodies = [{**SPAWN, "input": {"variant": i % 2}} for i in range(20)]

    def spawn(body: dict[str, object]) -> requests.Response:
        with signed_session() as session:
            return _post(session, dev, tenant, body)

    with ThreadPoolExecutor(max_workers=20) as pool:
        answers = list(pool.map(spawn, bodies))

    statuses = [answer.status_code for answer in answers]
    assert statuses.count(201) == 1
    assert set(statuses) <= {200, 201, 422}
    assert statuses.count(422) == 10  # every request carrying the losing payload
    # the status line's reason phrase is RFC 9110's, as the problem's title is
    assert {(answer.reason, answer.json()["title"]) for answer in answers if answer.status_code == 422} == {
        ("Unprocessable Content", "Unprocessable Content")
    }
    assert {answer.json()["run_id"] for answer in answers} == {keyed_run_id(tenant, "k-1")}
    assert len(count_runs(dev.dynamodb(), dev.table_name, tenant)) == 1


def test_routes_outside_the_template_are_answered_by_the_gateway(dev: DevServer, http: requests.Session) -> None:
    answer = http.delete(f"{dev.url}/v1/runs", timeout=30)

    assert (answer.status_code, answer.json()) == (404, {"message": "Not Found"})


def test_curl_aws_sigv4_is_accepted_and_unsigned_requests_are_refused(dev: DevServer, tenant: str) -> None:
    body = json.dumps({"workflow_ref": "wf/curl", "input": {}, "dispatch_key": "curl-1"})
    base = ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-X", "POST", f"{dev.url}/v1/runs"]
    base += ["-H", "Content-Type: application/json", "-H", f"X-Poimen-Tenant: {tenant}", "-d", body]
    signing = ["--aws-sigv4", "aws:amz:us-east-1:execute-api", "--user", f"{DEV_ACCESS_KEY}:{DEV_SECRET_KEY}"]

    signed = subprocess.run([*base, *signing], capture_output=True, text=True, timeout=30, check=True).stdout
    unsigned = subprocess.run(base, capture_output=True, text=True, timeout=30, check=True).stdout
    wrong = [*base, "--aws-sigv4", "aws:amz:us-east-1:execute-api", "--user", f"{DEV_ACCESS_KEY}:not-the-secret"]
    badly_signed = subprocess.run(wrong, capture_output=True, text=True, timeout=30, check=True).stdout

    assert (signed, unsigned, badly_signed) == ("201", "403", "403")
    assert len(count_runs(dev.dynamodb(), dev.table_name, tenant)) == 1


def test_a_principal_is_held_to_its_grants(dev: DevServer, tmp_path: Path, tenant: str) -> None:
    # Given a principal granted only `tenant` (in the principals file of its own dev server)
    principals = tmp_path / "alice.json"
    alice = {"AKIDALICE": {"secret": "alice-secret", "arn": "arn:aws:iam::1:user/alice", "tenants": [tenant]}}
    principals.write_text(json.dumps(alice))
    server = start_dev(
        tmp_path, "--principals", str(principals), "--dynamodb-endpoint", dev.aws_endpoint, table_name=dev.table_name
    )
    try:
        with requests.Session() as session:
            session.auth = SigV4("AKIDALICE", "alice-secret")
            own = _post(session, server, tenant, SPAWN)
            other = _post(session, server, f"{tenant}-other", SPAWN)
            # a run of the other tenant, made by the dev key, is not found by alice under her tenant
            theirs = _post(signed_session(), server, f"{tenant}-other", {**SPAWN, "dispatch_key": "theirs"}).json()
            by_id = session.get(f"{server.url}/v1/runs/{theirs['run_id']}", headers={"X-Poimen-Tenant": tenant})
    finally:
        assert server.stop() == 0
    assert (own.status_code, other.status_code, by_id.status_code) == (201, 403, 404)
    assert count_runs(dev.dynamodb(), dev.table_name, f"{tenant}-other") != []


def test_grants_are_managed_with_the_cli(dev: DevServer, tenant: str) -> None:
    def grants(*arguments: str) -> str:
        command = [str(POIMEN), "grants", *arguments, "--table-name", dev.table_name]
        command += ["--dynamodb-endpoint", dev.aws_endpoint]
        return subprocess.run(command, capture_output=True, text=True, timeout=60, check=True).stdout

    session_arn = "arn:aws:sts::123456789012:assumed-role/orchestrator/session-7"
    role_arn = "arn:aws:iam::123456789012:role/orchestrator"

    grants("add", "--principal", session_arn, "--tenant", tenant)
    grants("add", "--principal", role_arn, "--tenant", "*")
    listed = grants("list")
    grants("remove", "--principal", role_arn, "--tenant", "*")
    after = grants("list")

    assert f"{role_arn}\t*,{tenant}" in listed.splitlines()  # the session's grant belongs to its role
    assert f"{role_arn}\t{tenant}" in after.splitlines()


def test_numbers_cross_http_exactly_as_sent_and_deep_input_is_refused(
    dev: DevServer, http: requests.Session, tenant: str
) -> None:
    run_input = '{"price": 12345678901234567.25, "big": 123456789012345678901234567890, "e": 1e15, "ratio": 1.10}'
    headers = {"X-Poimen-Tenant": tenant, "Content-Type": "application/json"}

    def post(body: str) -> requests.Response:
        return http.post(f"{dev.url}/v1/runs", data=body.encode(), headers=headers, timeout=30)

    created = post(f'{{"workflow_ref": "wf/n", "dispatch_key": "n-1", "input": {run_input}}}')
    read = http.get(f"{dev.url}/v1/runs", params={"dispatch_key": "n-1"}, headers=headers, timeout=30)
    deep = post('{"workflow_ref": "wf/n", "input": ' + '{"a":' * 254 + "{}" + "}" * 254 + "}")

    assert (created.status_code, read.status_code, deep.status_code) == (201, 200, 400)
    for answer in (created, read):
        assert '"input":{"price":12345678901234567.25,"big":123456789012345678901234567890,"e":1e15,"ratio":1.10}' in (
            answer.text
        )
    assert len(count_runs(dev.dynamodb(), dev.table_name, tenant)) == 1


def test_an_unsigned_idempotency_key_on_a_signed_request_is_the_body_keys_run(
    dev: DevServer, http: requests.Session, tenant: str
) -> None:
    # Given a run admitted with k-1 in the body
    first = _post(http, dev, tenant, SPAWN)
    # When the same request comes signed, its key only in an Idempotency-Key header the signature leaves out
    unkeyed = {key: value for key, value in SPAWN.items() if key != "dispatch_key"}
    headers = {"X-Poimen-Tenant": tenant, "Idempotency-Key": '"k-1"'}
    again = http.post(f"{dev.url}/v1/runs", json=unkeyed, headers=headers, timeout=30)
    # Then the header is accepted unsigned, and it is the same run, replayed
    signed_headers = again.request.headers["Authorization"].split("SignedHeaders=", 1)[1].split(",", 1)[0]
    assert "idempotency-key" not in signed_headers.split(";")
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json() == first.json()
    assert again.json()["run_id"] == keyed_run_id(tenant, "k-1")
    assert len(count_runs(dev.dynamodb(), dev.table_name, tenant)) == 1


def test_idempotency_key_refusals_over_http(dev: DevServer, http: requests.Session, tenant: str) -> None:
    def post(header: str, body: object) -> requests.Response:
        headers = {"X-Poimen-Tenant": tenant, "Idempotency-Key": header}
        return http.post(f"{dev.url}/v1/runs", json=body, headers=headers, timeout=30)

    mismatch = post("k-2", SPAWN)
    malformed = post('"k-1', {"workflow_ref": "wf/hello", "input": {}})

    assert [(r.status_code, r.headers["Content-Type"], r.json()["type"]) for r in (mismatch, malformed)] == [
        (400, "application/problem+json", "urn:poimen:problem:idempotency-key-mismatch"),
        (400, "application/problem+json", "urn:poimen:problem:idempotency-key-invalid"),
    ]
    assert count_runs(dev.dynamodb(), dev.table_name, tenant) == []


def test_an_idempotency_key_line_sent_twice_is_refused_over_http(dev: DevServer, tenant: str) -> None:
    def post(*keys: str) -> tuple[int, dict[str, str]]:
        # Each key its own header line, as a proxy or a retrying client that appends headers may send them
        body = json.dumps({"workflow_ref": "wf/hello", "input": {}}).encode()
        url = f"{dev.url}/v1/runs"
        headers = {"Content-Type": "application/json", "X-Poimen-Tenant": tenant}
        signed = signed_headers("POST", url, headers, body, DEV_ACCESS_KEY, DEV_SECRET_KEY, "us-east-1")
        connection = http.client.HTTPConnection("127.0.0.1", int(dev.url.rsplit(":", 1)[1]), timeout=30)
        try:
            connection.putrequest("POST", "/v1/runs", skip_accept_encoding=True)
            for name, value in {**headers, **signed, "Content-Length": str(len(body))}.items():
                if name.lower() != "host":
                    connection.putheader(name, value)
            for key in keys:
                connection.putheader("Idempotency-Key", key)
            connection.endheaders(body)
            answer = connection.getresponse()
            return answer.status, json.loads(answer.read())
        finally:
            connection.close()

    # Given a run admitted under k-1 from one header line
    status, first = post("k-1")
    # When the line comes twice (poimen dev joins them with a comma, as API Gateway does), or two keys come
    twice, two = post("k-1", "k-1"), post("k-2", "k-3")
    # Then neither admits a run: one run, k-1's
    assert status == 201
    assert [(code, body["type"]) for code, body in (twice, two)] == [
        (400, "urn:poimen:problem:idempotency-key-invalid")
    ] * 2
    assert [item["run_id"]["S"] for item in count_runs(dev.dynamodb(), dev.table_name, tenant)] == [first["run_id"]]
