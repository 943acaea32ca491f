"""Admission serves only the stack's tenants (TENANTS, the template's Tenants): any other tenant is refused on
every route, before anything is read or written, whatever the caller's grants; its events could never be
delivered (no topics, no outbox permission)."""

from __future__ import annotations

import concurrent.futures
import re
from typing import Any

import pytest

from poimen.config import ConfigurationError, Settings
from poimen.ids import keyed_run_id
from poimen.kafka import dispatch_topics_pattern
from poimen.store import Store
from poimen_tools.cli import build_parser, main
from poimen_tools.local.dev import DevOptions
from poimen_tools.local.template import Template
from tests.conftest import count_runs
from tests.unit.conftest import PRINCIPAL, Invoke

SPAWN = {"workflow_ref": "wf/hello", "input": {}, "dispatch_key": "k-1"}
NOT_SERVED = "urn:poimen:problem:tenant-not-served"


@pytest.fixture
def unserved(store: Store, granted: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A tenant the stack does not serve, granted to the caller by a `*` grant (and by name); only the test's
    own tenant is served."""
    from poimen.api import admission_service

    monkeypatch.setenv("TENANTS", granted)
    admission_service.cache_clear()
    store.grant(PRINCIPAL, "*")
    store.grant(PRINCIPAL, "initech")
    return "initech"


@pytest.mark.parametrize(
    ("method", "path", "query", "body"),
    [
        ("POST", "/v1/runs", "", SPAWN),
        ("POST", "/v1/runs", "", {"workflow_ref": "wf/hello", "input": {}}),
        ("GET", f"/v1/runs/{keyed_run_id('initech', 'k-1')}", "", None),
        ("GET", "/v1/runs", "dispatch_key=k-1", None),
    ],
    ids=["keyed-spawn", "keyless-spawn", "get", "find"],
)
def test_a_tenant_the_stack_does_not_serve_is_refused_on_every_route_whatever_the_grants(
    invoke: Invoke,
    dynamodb: Any,
    table_name: str,
    unserved: str,
    method: str,
    path: str,
    query: str,
    body: dict[str, Any] | None,
) -> None:
    # When a caller granted every tenant acts for a tenant the stack does not serve
    answer = invoke(method, path, body=body, query=query, tenant=unserved)
    # Then it is refused with a problem saying so, and nothing was written
    assert answer.status == 403
    assert answer.body["type"] == NOT_SERVED
    assert unserved in answer.body["detail"]
    assert count_runs(dynamodb, table_name, unserved) == []


def test_a_served_tenant_is_admitted_beside_the_refused_one(
    invoke: Invoke, dynamodb: Any, table_name: str, granted: str, unserved: str
) -> None:
    assert invoke(body=SPAWN).status == 201
    assert invoke(body=SPAWN, tenant=unserved).status == 403

    assert len(count_runs(dynamodb, table_name, granted)) == 1


def test_the_stacks_relay_is_trusted_for_the_served_tenants_and_refused_the_rest(
    invoke: Invoke, dynamodb: Any, table_name: str, granted: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given the relay's role trusted by the deploy, and two served tenants
    from poimen.api import admission_service

    relay = "arn:aws:iam::123456789012:role/poimen-InboxRelayFunctionRole-X1"
    monkeypatch.setenv("TENANTS", f"{granted},globex")
    monkeypatch.setenv("RELAY_PRINCIPAL", relay)
    admission_service.cache_clear()
    session = "arn:aws:sts::123456789012:assumed-role/poimen-InboxRelayFunctionRole-X1/awslambda_1"
    # Then its sessions are admitted for both with no grant, and refused for any other tenant
    assert invoke(body=SPAWN, principal=session, tenant="globex").status == 201
    assert invoke(body=SPAWN, principal=session, tenant=granted).status == 201
    refused = invoke(body=SPAWN, principal=session, tenant="initech")
    assert (refused.status, refused.body["type"]) == (403, NOT_SERVED)
    assert count_runs(dynamodb, table_name, "initech") == []


def test_the_served_tenants_are_the_templates_tenants(template: Template) -> None:
    variables = template.properties("AdmissionFunction")["Environment"]["Variables"]

    assert variables["TENANTS"] == {"Fn::Join": [",", {"Ref": "Tenants"}]}
    assert "RELAY_TENANTS" not in variables  # one list: the relay is trusted for exactly the served tenants
    resolved = template.function_environment("AdmissionFunction", {"Tenants": "acme,globex"})
    environ = {**resolved, "TABLE_NAME": "t", "AWS_REGION": "us-east-1"}
    assert Settings.from_env(environ).tenants == frozenset({"acme", "globex"})


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("acme,Globex", "'Globex' is not a tenant id"),
        ("acme,,globex", "empty"),
        ("acme,acme", "twice"),
        ("a-b,ab", "equal but for hyphens"),
    ],
)
def test_the_served_tenants_are_validated(value: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        Settings.from_env({"TABLE_NAME": "t", "AWS_REGION": "us-east-1", "TENANTS": value})


def test_admission_without_served_tenants_admits_nothing(
    invoke: Invoke, dynamodb: Any, table_name: str, granted: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given the function's environment without TENANTS (a template that does not set it)
    from poimen.api import admission_service

    monkeypatch.delenv("TENANTS")
    admission_service.cache_clear()
    # Then it answers as misconfigured (the log names TENANTS), and writes nothing
    answer = invoke(body=SPAWN)
    assert (answer.status, answer.body["type"]) == (500, "urn:poimen:problem:internal-error")
    assert count_runs(dynamodb, table_name, granted) == []


# --- poimen dev serves its --tenants ---------------------------------------------------------------------


def test_poimen_dev_serves_acme_by_default_and_the_tenants_it_is_given(template: Template) -> None:
    default = build_parser().parse_args(["dev"])
    given = build_parser().parse_args(["dev", "--tenants", "acme,globex-2"])

    assert default.tenants == ("acme",)  # the README's session and `make run`
    assert given.tenants == ("acme", "globex-2")
    # As the template's Tenants: admission's TENANTS is their list, as a deploy sets it
    options = DevOptions(tenants=given.tenants)
    environment = template.function_environment("AdmissionFunction", options.template_parameters)
    assert environment["TENANTS"] == "acme,globex-2"


@pytest.mark.parametrize(
    ("value", "said"),
    [("Acme", "is not a tenant id"), ("acme,acme", "twice"), ("a-b,ab", "equal but for hyphens"), ("", "empty")],
)
def test_poimen_dev_refuses_tenants_a_deploy_would(value: str, said: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["dev", "--tenants", value])
    assert exited.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("poimen dev: argument --tenants: ")
    assert said in line


def test_the_relay_of_poimen_dev_consumes_the_served_tenants_dispatch_topics_only() -> None:
    subscription = re.compile(dispatch_topics_pattern(["acme", "globex-2"]))

    assert {topic for topic in TOPICS if subscription.search(topic)} == {
        "poimen.acme.dispatch",
        "poimen.globex-2.dispatch",
        "west.poimen.acme.dispatch",
    }


TOPICS = (
    "poimen.acme.dispatch",
    "poimen.globex-2.dispatch",
    "west.poimen.acme.dispatch",
    "poimen.initech.dispatch",
    "poimen.acme-2.dispatch",
    "poimen.acme.events",
    "a.b.poimen.acme.dispatch",
)


class RecordingAdmin:
    """An AdminClient that records each CreateTopics request (in `requests`) and creates every topic."""

    def __init__(self, requests: list[list[Any]]) -> None:
        self._requests = requests

    def poll(self, _timeout: float) -> int:
        return 0

    def create_topics(self, topics: list[Any], request_timeout: float) -> dict[str, Any]:
        self._requests.append(topics)
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        done.set_result(None)
        return {topic.topic: done for topic in topics}


def test_poimen_dev_creates_its_tenants_topics_in_one_request(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given poimen dev's 100 tenants (an admin client and a request a tenant took 24 s of its start here, one
    # request for all of them 2 s)
    from poimen_tools import topics
    from poimen_tools.local.dev import create_tenant_topics

    requests: list[list[Any]] = []
    monkeypatch.setattr(topics, "AdminClient", lambda *_: RecordingAdmin(requests))
    tenants = [f"t{i:03d}" for i in range(100)]
    # When it creates their topics at start
    create_tenant_topics("127.0.0.1:1", tenants, 7)
    # Then one request declares both topics of every tenant, each as `poimen topics ensure` declares it
    (request,) = requests
    declared = {topic.topic: topic for topic in request}
    assert sorted(declared) == sorted(
        f"poimen.{tenant}.{kind}" for tenant in tenants for kind in ("dispatch", "events")
    )
    assert declared["poimen.t042.dispatch"].config["message.timestamp.type"] == "LogAppendTime"
    assert {topic.config["retention.ms"] for topic in request} == {str(7 * 24 * 3600 * 1000)}
