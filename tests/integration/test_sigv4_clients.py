"""SigV4 conformance: real signing clients against `poimen dev` over HTTP, as they would meet API Gateway.

Each client looks up runs whose dispatch keys hold the characters SigV4 encodes (space, `# + / * ' ( ) ! ,
% ~`, non-ASCII). A client that follows the spec gets 200; what a client cannot express, or signs
differently from AWS, gets API Gateway's 403 (`_expected` says which, and why). Anything changed
after signing (body, a signed header, a presigned query) gets 403.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import quote, urlsplit

import pytest
import requests
from botocore.auth import SigV4Auth, SigV4QueryAuth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from requests_aws4auth import AWS4Auth  # type: ignore[import-untyped]  # ships no py.typed

from poimen.ids import keyed_run_id
from poimen_tools.local.devserver import MAX_PAYLOAD_BYTES
from poimen_tools.local.sigv4 import DEV_ACCESS_KEY, DEV_SECRET_KEY
from tests.conftest import count_runs
from tests.integration.conftest import DevServer, next_tenant

REGION = "us-east-1"
KEYS = [
    "plain",
    "with space",
    "hash#tag",
    "plus+sign",
    "slash/key",
    "star*key",
    "quote'key",
    "(paren)",
    "bang!",
    "comma,key",
    "100% sure",
    "tilde~key",
    "ünïcødé-键",
    "all # + / * ' ( ) ! , % ~ é",
]
SUB_DELIMITERS = ["slash/key", "star*key", "quote'key", "(paren)", "bang!", "comma,key"]


def _curl_version() -> tuple[int, ...]:
    first = subprocess.run(["curl", "--version"], capture_output=True, text=True, check=True).stdout.split()[1]
    return tuple(int(part) for part in re.findall(r"\d+", first)[:3])


CURL_VERSION = _curl_version()
# curl signed the query as typed until 8.3.0 ("http_aws_sigv4: canonicalize the query", curl/curl#11806):
# AWS refuses that signature for sub-delimiters typed raw, and so does the local server.
CURL_SIGNS_RAW_QUERY = CURL_VERSION < (8, 3)


@pytest.fixture(scope="module")
def tenant_runs(dev: DevServer) -> tuple[str, dict[str, str]]:
    """A tenant of this module and the run each key admitted (created with botocore's signer)."""
    tenant = next_tenant()
    runs = {}
    for key in KEYS:
        body = json.dumps({"workflow_ref": "wf/sigv4", "input": {}, "dispatch_key": key}).encode()
        created = _botocore(dev, "POST", "/v1/runs", body, tenant)
        assert created.status_code == 201, created.text
        runs[key] = created.json()["run_id"]
        assert runs[key] == keyed_run_id(tenant, key)
    return tenant, runs


def _botocore(dev: DevServer, method: str, path_and_query: str, body: bytes, tenant: str) -> requests.Response:
    """botocore's SigV4Auth over the exact URL (it expects the query already in SigV4's encoding)."""
    url = f"{dev.url}{path_and_query}"
    request = AWSRequest(
        method=method, url=url, data=body, headers={"X-Poimen-Tenant": tenant, "Content-Type": "application/json"}
    )
    SigV4Auth(Credentials(DEV_ACCESS_KEY, DEV_SECRET_KEY), "execute-api", REGION).add_auth(request)
    return requests.request(method, url, data=body, headers=dict(request.headers.items()), timeout=30)


def _canonical(key: str) -> str:
    return quote(key, safe="-_.~")


# --- the clients: each returns (status, body) ------------------------------------------------------------------


def _by_botocore(dev: DevServer, tenant: str, key: str) -> tuple[int, str]:
    answer = _botocore(dev, "GET", f"/v1/runs?dispatch_key={_canonical(key)}", b"", tenant)
    return answer.status_code, answer.text


def _by_requests_aws4auth(dev: DevServer, tenant: str, key: str) -> tuple[int, str]:
    auth = AWS4Auth(DEV_ACCESS_KEY, DEV_SECRET_KEY, REGION, "execute-api")
    answer = requests.get(
        f"{dev.url}/v1/runs", params={"dispatch_key": key}, headers={"X-Poimen-Tenant": tenant}, auth=auth, timeout=30
    )
    return answer.status_code, answer.text


def _curl(dev: DevServer, tenant: str, query: str) -> tuple[int, str]:
    command = ["curl", "-sg", "-w", "\n%{http_code}", "-H", f"X-Poimen-Tenant: {tenant}"]
    command += ["--aws-sigv4", f"aws:amz:{REGION}:execute-api", "--user", f"{DEV_ACCESS_KEY}:{DEV_SECRET_KEY}"]
    output = subprocess.run([*command, f"{dev.url}/v1/runs?{query}"], capture_output=True, text=True, timeout=30)
    body, _, status = output.stdout.rpartition("\n")
    return int(status), body


def _by_curl(dev: DevServer, tenant: str, key: str) -> tuple[int, str]:
    return _curl(dev, tenant, f"dispatch_key={_canonical(key)}")


# awscurl's own command-line entry (argv in, exit code out), run for every request in one subprocess: the
# CLI path exactly, without paying its start-up (boto3, awscrt) once per request.
_AWSCURL_DRIVER = """
import json, sys
from awscurl.awscurl import inner_main
print(json.dumps([inner_main(argv) for argv in json.loads(sys.stdin.read())]), file=sys.stderr)
"""


def _by_awscurl(dev: DevServer, tenant: str, keys: list[str], scratch: Path) -> list[tuple[int, str]]:
    command = ["--fail-with-body", "--service", "execute-api", "--region", REGION]
    command += ["--access_key", DEV_ACCESS_KEY, "--secret_key", DEV_SECRET_KEY, "-H", f"X-Poimen-Tenant: {tenant}"]
    # awscurl takes the query as typed and encodes it itself (unescaped here, as a user types it)
    argvs = [
        [*command, "-o", str(scratch / f"{i}.out"), f"{dev.url}/v1/runs?dispatch_key={k}"] for i, k in enumerate(keys)
    ]
    # it must read no session token from the environment: the dev key is a long-term key
    environment = {k: v for k, v in os.environ.items() if k not in ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")}
    run = subprocess.run(
        [sys.executable, "-c", _AWSCURL_DRIVER],
        input=json.dumps(argvs),
        capture_output=True,
        text=True,
        env=environment,
        timeout=120,
        check=True,
    )
    codes = json.loads(run.stderr.strip().splitlines()[-1])
    bodies = [(scratch / f"{i}.out").read_text() for i in range(len(keys))]
    # awscurl reports no status: exit 0 is a 2xx, 22 an error, whose body says which
    return [
        (200 if code == 0 else 403 if '"message"' in body else 0, body)
        for code, body in zip(codes, bodies, strict=True)
    ]


CLIENTS: dict[str, Callable[[DevServer, str, str], tuple[int, str]]] = {
    "botocore": _by_botocore,
    "requests-aws4auth": _by_requests_aws4auth,
    "curl": _by_curl,
}


def _expected(client: str, key: str) -> int:
    # awscurl signs the query it was given, encoded, but sends it through requests as typed: a "+" arrives
    # as a space (SigV4 and API Gateway read it so), a "#" starts the fragment and never leaves. AWS
    # refuses both; a literal "+" or "#" cannot be sent with awscurl.
    if client == "awscurl" and ("+" in key or "#" in key):
        return 403
    return 200


def test_every_spec_following_client_reads_runs_by_any_dispatch_key(
    dev: DevServer, tenant_runs: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    tenant, runs = tenant_runs
    cases = [(client, key) for client in CLIENTS for key in KEYS]

    with ThreadPoolExecutor(max_workers=8) as pool:
        awscurl = pool.submit(_by_awscurl, dev, tenant, KEYS, tmp_path)
        answers = list(pool.map(lambda case: CLIENTS[case[0]](dev, tenant, case[1]), cases))
        answers += awscurl.result()
    cases += [("awscurl", key) for key in KEYS]

    outcomes = {case: status for case, (status, _) in zip(cases, answers, strict=True)}
    assert outcomes == {case: _expected(*case) for case in cases}
    for (_, key), (status, body) in zip(cases, answers, strict=True):
        if status == 200:
            assert json.loads(body)["run_id"] == runs[key]
        else:
            assert json.loads(body)["message"].startswith("The request signature we calculated does not match")


def test_curl_typing_sub_delimiters_raw_is_refused_before_8_3_as_aws_refuses_it(
    dev: DevServer, tenant_runs: tuple[str, dict[str, str]]
) -> None:
    tenant, _ = tenant_runs

    with ThreadPoolExecutor(max_workers=len(SUB_DELIMITERS)) as pool:
        answers = dict(
            zip(
                SUB_DELIMITERS,
                pool.map(lambda key: _curl(dev, tenant, f"dispatch_key={key}"), SUB_DELIMITERS),
                strict=True,
            )
        )

    expected = 403 if CURL_SIGNS_RAW_QUERY else 200
    assert {key: status for key, (status, _) in answers.items()} == dict.fromkeys(SUB_DELIMITERS, expected), (
        f"curl {'.'.join(map(str, CURL_VERSION))}"
    )


def test_curl_signing_a_utf8_idempotency_key_gets_the_documented_400_and_nothing_is_written(dev: DevServer) -> None:
    # Given a spawn whose Idempotency-Key is UTF-8, signed by curl (it signs the header's bytes as it sends them)
    tenant = next_tenant()
    body = json.dumps({"workflow_ref": "wf/curl", "input": {}})
    command = ["curl", "-s", "-w", "\n%{http_code}", "-X", "POST", f"{dev.url}/v1/runs", "-d", body]
    command += ["-H", "Content-Type: application/json", "-H", f"X-Poimen-Tenant: {tenant}"]
    command += ["-H", "Idempotency-Key: ключ-é", "-v"]
    command += ["--aws-sigv4", f"aws:amz:{REGION}:execute-api", "--user", f"{DEV_ACCESS_KEY}:{DEV_SECRET_KEY}"]

    # When it is sent
    sent = subprocess.run(command, capture_output=True, text=True, timeout=30, check=True)

    # Then the signature holds (idempotency-key is a signed header) and the answer is the documented refusal
    assert "idempotency-key" in _verbose_request_headers(sent.stderr)["Authorization"]
    answer, _, status = sent.stdout.rpartition("\n")
    assert (int(status), json.loads(answer).get("type")) == (400, "urn:poimen:problem:idempotency-key-invalid")
    # And no run was written
    assert count_runs(dev.dynamodb(), dev.table_name, tenant) == []


# --- changed after signing ----------------------------------------------------------------------------------


def test_a_body_or_signed_header_changed_after_botocore_signed_is_refused(dev: DevServer) -> None:
    tenant = next_tenant()
    body = json.dumps({"workflow_ref": "wf/sigv4", "input": {}}).encode()
    request = AWSRequest(
        method="POST",
        url=f"{dev.url}/v1/runs",
        data=body,
        headers={"X-Poimen-Tenant": tenant, "Content-Type": "application/json"},
    )
    SigV4Auth(Credentials(DEV_ACCESS_KEY, DEV_SECRET_KEY), "execute-api", REGION).add_auth(request)
    signed = dict(request.headers.items())

    def post(data: bytes, headers: dict[str, str]) -> int:
        return requests.post(f"{dev.url}/v1/runs", data=data, headers=headers, timeout=30).status_code

    other_body = post(body.replace(b"wf/sigv4", b"wf/other"), signed)
    other_tenant = post(body, {**signed, "X-Poimen-Tenant": f"{tenant}-other"})
    claimed_hash = post(b"{}", {**signed, "X-Amz-Content-SHA256": hashlib.sha256(body).hexdigest()})
    unchanged = post(body, signed)

    assert (other_body, other_tenant, claimed_hash, unchanged) == (403, 403, 403, 201)


def test_a_request_changed_after_requests_aws4auth_signed_is_refused(dev: DevServer) -> None:
    tenant = next_tenant()
    # requests-aws4auth signs host, content-type and x-amz-* unless told more: the tenant header too
    auth = AWS4Auth(
        DEV_ACCESS_KEY,
        DEV_SECRET_KEY,
        REGION,
        "execute-api",
        include_hdrs=["host", "content-type", "x-amz-*", "x-poimen-tenant"],
    )
    with requests.Session() as session:

        def send(change: Callable[[requests.PreparedRequest], None]) -> int:
            prepared = session.prepare_request(
                requests.Request(
                    "POST",
                    f"{dev.url}/v1/runs",
                    json={"workflow_ref": "wf/a4", "input": {}},
                    headers={"X-Poimen-Tenant": tenant},
                    auth=auth,
                )
            )
            change(prepared)  # after signing
            return session.send(prepared, timeout=30).status_code

        def other_body(prepared: requests.PreparedRequest) -> None:
            prepared.body = b'{"workflow_ref": "wf/evil", "input": {}}'
            prepared.headers["Content-Length"] = str(len(prepared.body))

        def other_tenant(prepared: requests.PreparedRequest) -> None:
            prepared.headers["X-Poimen-Tenant"] = f"{tenant}-other"

        assert (send(other_body), send(other_tenant), send(lambda _: None)) == (403, 403, 201)


def _verbose_request_headers(stderr: str) -> dict[str, str]:
    sent = [line[2:].split(": ", 1) for line in stderr.splitlines() if line.startswith("> ") and ": " in line]
    return {name: value for name, value in sent}


def test_a_captured_curl_request_replayed_with_another_body_is_refused(dev: DevServer) -> None:
    # Given a POST signed by curl, captured from its verbose output
    tenant = next_tenant()
    body = json.dumps({"workflow_ref": "wf/curl", "input": {}, "dispatch_key": "captured"})
    command = ["curl", "-sv", "-o", "/dev/null", "-X", "POST", f"{dev.url}/v1/runs", "-d", body]
    command += ["-H", "Content-Type: application/json", "-H", f"X-Poimen-Tenant: {tenant}"]
    command += ["--aws-sigv4", f"aws:amz:{REGION}:execute-api", "--user", f"{DEV_ACCESS_KEY}:{DEV_SECRET_KEY}"]
    captured = _verbose_request_headers(subprocess.run(command, capture_output=True, text=True, check=True).stderr)
    assert "x-poimen-tenant" in captured["Authorization"]

    def replay(data: str, **changes: str) -> int:
        headers = {**captured, **changes, "Content-Length": str(len(data.encode()))}
        return requests.post(f"{dev.url}/v1/runs", data=data.encode(), headers=headers, timeout=30).status_code

    # When it is replayed with another body, claiming the first body's hash; or with another tenant
    evil = json.dumps({"workflow_ref": "wf/evil", "input": {}, "dispatch_key": "captured"})
    claimed = hashlib.sha256(body.encode()).hexdigest()
    unsigned_payload = replay(evil, **{"X-Amz-Content-SHA256": "UNSIGNED-PAYLOAD"})

    # Then only the request as signed is admitted (a replay of it within five minutes is the same run)
    assert replay(evil, **{"X-Amz-Content-SHA256": claimed}) == 403
    assert unsigned_payload == 403
    assert replay(body, **{"X-Poimen-Tenant": f"{tenant}-other"}) == 403
    assert replay(body) == 200


def test_presigned_urls_are_accepted_and_refused_once_changed(
    dev: DevServer, tenant_runs: tuple[str, dict[str, str]]
) -> None:
    tenant, runs = tenant_runs
    request = AWSRequest(
        method="GET",
        url=f"{dev.url}/v1/runs?dispatch_key={_canonical('with space')}",
        headers={"X-Poimen-Tenant": tenant},
    )
    SigV4QueryAuth(Credentials(DEV_ACCESS_KEY, DEV_SECRET_KEY), "execute-api", REGION, expires=60).add_auth(request)
    url = request.prepare().url
    assert "X-Amz-Signature=" in url

    signed = requests.get(url, headers={"X-Poimen-Tenant": tenant}, timeout=30)
    changed = requests.get(url.replace("with%20space", "plain"), headers={"X-Poimen-Tenant": tenant}, timeout=30)

    assert (signed.status_code, signed.json()["run_id"]) == (200, runs["with space"])
    assert changed.status_code == 403


# --- API Gateway's own limits -------------------------------------------------------------------------------


def test_a_payload_over_10_mb_is_refused_before_it_is_sent(dev: DevServer) -> None:
    host, port = urlsplit(dev.url).hostname or "", urlsplit(dev.url).port or 80
    with socket.create_connection((host, port), timeout=10) as connection:
        connection.sendall(
            b"POST /v1/runs HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
            % (host.encode(), port, MAX_PAYLOAD_BYTES + 1)
        )
        answer = b""
        while chunk := connection.recv(65536):  # the server closes the connection after its answer
            answer += chunk

    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 ")
    assert json.loads(body) == {"message": "Request Entity Too Large"}
