"""Settings (and the timeouts they must agree on with template.yaml), principals and grants."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from botocore.retries.standard import ExponentialBackoff, RetryContext, RetryEventAdapter, ThrottlingErrorDetector

from poimen.admission import Admission, normalise_principal
from poimen.aws_session import CREDENTIALS_FETCH_SECONDS
from poimen.batch import MIN_REMAINING_MS
from poimen.config import API_GATEWAY_MAX_INTEGRATION_SECONDS, ConfigurationError, RelaySettings, Settings
from poimen.contract import RunRequest
from poimen.errors import IdentityMissing, TenantNotGranted
from poimen.principals import InvalidPrincipal, grant_principal
from poimen.store import Store
from poimen_tools.cli import main
from poimen_tools.local.template import Template

# An admission makes at most two retried DynamoDB calls: the grant read (on a cache miss), then the conditional
# write; after a write of unknown outcome, one more of a single attempt (the fence or the read back).
DYNAMODB_CALLS_PER_ADMISSION = 2
# An on-demand function's init phase (at most 10 s) comes before its handler's timeout starts to run.
LAMBDA_MAX_INIT_SECONDS = 10.0
# What a first request spends building the store's clients (one botocore session: the DynamoDB service
# model read once, then three clients), CPU only, as no timeout bounds it: make bench's "first answer" less
# its INIT is about 0.3 s for admission, its first write to the local table included (docs/architecture.md
# "Benchmarks"); this is three times that.
CLIENTS_BUILD_SECONDS = 1.0


def test_settings_read_and_validated_from_a_mapping() -> None:
    settings = Settings.from_env(
        {"TABLE_NAME": "t", "AWS_REGION": "eu-west-1", "GRANTS_CACHE_SECONDS": "5", "DYNAMODB_MAX_ATTEMPTS": "4"}
    )

    assert settings == Settings(table_name="t", region="eu-west-1", grants_cache_seconds=5.0, dynamodb_max_attempts=4)


@pytest.mark.parametrize(
    "environ",
    [
        {"AWS_REGION": "us-east-1"},
        {"TABLE_NAME": "t"},
        {"TABLE_NAME": "t", "AWS_REGION": "us-east-1", "DYNAMODB_MAX_ATTEMPTS": "0"},
        {"TABLE_NAME": "t", "AWS_REGION": "us-east-1", "DYNAMODB_MAX_ATTEMPTS": "three"},
        {"TABLE_NAME": "t", "AWS_REGION": "us-east-1", "GRANTS_CACHE_SECONDS": "-1"},
    ],
)
def test_bad_settings_are_refused(environ: dict[str, str]) -> None:
    with pytest.raises(ConfigurationError):
        Settings.from_env(environ)


@pytest.mark.parametrize(
    ("arn", "principal"),
    [
        (
            "arn:aws:sts::123456789012:assumed-role/relay/session-1",
            "arn:aws:iam::123456789012:role/relay",
        ),
        (
            "arn:aws-cn:sts::123456789012:assumed-role/relay/i-0abc/extra",
            "arn:aws-cn:iam::123456789012:role/relay",
        ),
        ("arn:aws:iam::123456789012:user/alice", "arn:aws:iam::123456789012:user/alice"),
        ("arn:aws:iam::123456789012:role/path/relay", "arn:aws:iam::123456789012:role/path/relay"),
    ],
)
def test_assumed_role_sessions_share_their_role(arn: str, principal: str) -> None:
    assert normalise_principal(arn) == principal


def test_wildcard_grant_covers_every_tenant(store: Store) -> None:
    store.grant("arn:aws:iam::1:role/relay", "*")
    admission = Admission(store, grants_cache_seconds=0, tenants={"any-tenant"})

    admission.authorize("arn:aws:sts::1:assumed-role/relay/s", "any-tenant")
    with pytest.raises(TenantNotGranted):
        admission.authorize("arn:aws:iam::1:role/other", "any-tenant")
    with pytest.raises(IdentityMissing):
        admission.authorize(None, "any-tenant")


@pytest.fixture
def grant_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The principals whose grants were read from the table, in order."""
    reads: list[str] = []
    original = Store.granted_tenants

    def counting(self: Store, principal: str) -> Any:
        reads.append(principal)
        return original(self, principal)

    monkeypatch.setattr(Store, "granted_tenants", counting)
    return reads


def test_grants_are_cached_for_the_configured_time(store: Store, grant_reads: list[str]) -> None:
    # Given a cache of 60 s on a fake clock, and a principal granted one tenant
    now = [1000.0]
    store.grant("arn:aws:iam::1:user/a", "t1")
    admission = Admission(store, grants_cache_seconds=60, clock=lambda: now[0], tenants={"t1"})
    request = RunRequest(workflow_ref="wf", input={})
    # When it admits twice within the minute, then once after
    admission.admit_run("arn:aws:iam::1:user/a", "t1", request)
    admission.admit_run("arn:aws:iam::1:user/a", "t1", request)
    now[0] += 61
    admission.admit_run("arn:aws:iam::1:user/a", "t1", request)
    # Then the grant was read once per cache period
    assert grant_reads == ["arn:aws:iam::1:user/a"] * 2


def _function_timeout(template: Template, logical_id: str) -> float:
    own = template.properties(logical_id).get("Timeout")
    return float(own if own is not None else template.document["Globals"]["Function"]["Timeout"])


def _dynamodb_call_seconds(settings: Settings) -> float:
    """The longest one DynamoDB call can take: every attempt times out connecting and then reading, and
    every wait is botocore's longest (standard mode, throttled, jitter at its maximum)."""
    backoff = ExponentialBackoff(
        random=lambda: 1.0, service_name="dynamodb", throttling_detector=ThrottlingErrorDetector(RetryEventAdapter())
    )
    throttled = {"Error": {"Code": "ThrottlingException"}}
    waits = sum(
        backoff.delay_amount(RetryContext(attempt_number=attempt, parsed_response=throttled))
        for attempt in range(1, settings.dynamodb_max_attempts)
    )
    return settings.dynamodb_max_attempts * 2 * settings.dynamodb_timeout_seconds + waits


def test_admission_answers_within_its_timeout_and_the_relay_outwaits_any_answer(template: Template) -> None:
    # Given the settings each function reads from its environment in template.yaml (defaults otherwise)
    admission = Settings.from_env(
        {"AWS_REGION": "us-east-1", **template.function_environment("AdmissionFunction", {"AdmissionTable": "t"})}
    )
    relay = RelaySettings.from_env(
        {
            "AWS_REGION": "us-east-1",
            "ADMISSION_API_URL": "https://api.example",
            "DLQ_URL": "q",
            **template.function_environment("InboxRelayFunction", {}),
        }
    )
    admission_timeout = _function_timeout(template, "AdmissionFunction")
    # Then admission's DynamoDB calls, retries and backoff included, end before its function times out:
    # it answers (503 at worst) instead of being cut off while a write may still commit
    resolution = _dynamodb_call_seconds(dataclasses.replace(admission, dynamodb_max_attempts=1))
    assert DYNAMODB_CALLS_PER_ADMISSION * _dynamodb_call_seconds(admission) + resolution < admission_timeout
    # And so do they on a first request after a SnapStart restore, or whenever the credentials are due for
    # renewal, when the store also builds its clients and fetches credentials from Lambda's container
    # endpoint (once for its three clients, within the fetch's bound), and on a cold start's, which reads
    # them from the environment
    first_request = CREDENTIALS_FETCH_SECONDS + CLIENTS_BUILD_SECONDS
    assert first_request + DYNAMODB_CALLS_PER_ADMISSION * _dynamodb_call_seconds(admission) + resolution < (
        admission_timeout
    )
    # And API Gateway does not give up (504) on a function that is still running
    assert LAMBDA_MAX_INIT_SECONDS + admission_timeout <= API_GATEWAY_MAX_INTEGRATION_SECONDS
    # And the relay waits for any answer, so it never abandons a call that admission may still commit
    worst_answer = min(API_GATEWAY_MAX_INTEGRATION_SECONDS, LAMBDA_MAX_INIT_SECONDS + admission_timeout)
    assert relay.http_timeout_seconds > worst_answer
    # And one such call, and a dead letter after it, fit in one relay invocation
    relay_timeout = _function_timeout(template, "InboxRelayFunction")
    assert relay.http_timeout_seconds + 2 * relay.dlq_timeout_seconds + relay.time_margin_seconds < relay_timeout
    # And a credentials refresh begun just before the relay's deadline (its container endpoint silent) ends
    # within the margin left after it
    assert relay.time_margin_seconds >= CREDENTIALS_FETCH_SECONDS


ROLE_WITH_PATH = "arn:aws:iam::123456789012:role/aws-reserved/sso.amazonaws.com/AWSReservedSSO_X_abc"
ROLE = "arn:aws:iam::123456789012:role/AWSReservedSSO_X_abc"
SESSION = "arn:aws:sts::123456789012:assumed-role/AWSReservedSSO_X_abc/alice@example.com"


def test_a_batch_begins_no_spawn_that_could_outlast_its_function(template: Template) -> None:
    # Given admission's settings from template.yaml
    admission = Settings.from_env(
        {"AWS_REGION": "us-east-1", **template.function_environment("AdmissionFunction", {"AdmissionTable": "t"})}
    )
    # Then a spawn begun with MIN_REMAINING_MS left ends before the function times out: its write, retries and
    # backoff included, and the resolution of an unknown outcome, on the request that builds the store's clients
    # and fetches credentials (a batch authorizes its caller once, before its first spawn: no grant read in it)
    resolution = _dynamodb_call_seconds(dataclasses.replace(admission, dynamodb_max_attempts=1))
    worst_spawn = CREDENTIALS_FETCH_SECONDS + CLIENTS_BUILD_SECONDS + _dynamodb_call_seconds(admission) + resolution
    assert worst_spawn <= MIN_REMAINING_MS / 1000
    # And spawns may still begin during the first 4 s of an invocation (a batch's 100 take well under one)
    assert _function_timeout(template, "AdmissionFunction") - MIN_REMAINING_MS / 1000 >= 4.0


@pytest.mark.parametrize(
    "arn",
    [
        "arn:aws:iam::123456789012:role/poimen-relay",
        "arn:aws:iam::123456789012:user/alice",
        "arn:aws:iam::123456789012:user/division/alice",
        "arn:aws:iam::123456789012:root",
        "arn:aws-cn:iam::123456789012:role/relay",
        "arn:aws:sts::123456789012:assumed-role/relay/session-1",
        "arn:aws:sts::123456789012:federated-user/bob",
    ],
)
def test_principal_arns_are_granted_as_given(arn: str) -> None:
    assert grant_principal(arn).arn == arn
    assert grant_principal(arn).note is None


@pytest.mark.parametrize(
    "text",
    [
        "",
        "poimen-relay",
        "*",
        "arn:aws:iam::123456789012:role/",
        "arn:aws:iam::1234:role/relay",
        "arn:aws:iam::123456789012:group/admins",
        "arn:aws:iam::123456789012:policy/p",
        "arn:aws:s3:::bucket",
        "arn:aws:sts::123456789012:assumed-role/relay",
        " arn:aws:iam::123456789012:role/relay",
        "arn:aws:iam::123456789012:role/relay\n",
        "arn:aws:iam::123456789012:role/relé",
    ],
)
def test_strings_that_are_not_principal_arns_are_refused(text: str) -> None:
    with pytest.raises(InvalidPrincipal):
        grant_principal(text)


def test_a_role_path_is_dropped_as_sessions_of_the_role_present_none() -> None:
    granted = grant_principal(ROLE_WITH_PATH)

    assert granted.arn == ROLE == normalise_principal(SESSION)
    assert granted.note is not None
    assert "/aws-reserved/sso.amazonaws.com/" in granted.note


def test_grants_add_refuses_a_string_that_is_no_principal(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["grants", "add", "--principal", "poimen-relay", "--tenant", "acme"])

    err = capsys.readouterr().err
    assert status == 2
    assert len(err.splitlines()) == 1
    assert err.startswith("poimen grants add: 'poimen-relay' is not an IAM or STS principal ARN")


def test_grants_add_names_a_role_without_its_path_so_its_sessions_are_granted(
    store: Store, table_name: str, tenant: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a grant added for an SSO role ARN with its path
    status = main(["grants", "add", "--principal", ROLE_WITH_PATH, "--tenant", tenant, "--table-name", table_name])
    # Then the CLI said what it granted and why
    out, err = capsys.readouterr()
    assert status == 0
    assert out.splitlines() == [f"add: {ROLE} {tenant}"]
    assert err.startswith("note: ")
    # And a session of that role, as IAM authorization presents it, is granted the tenant
    Admission(store, grants_cache_seconds=0, tenants={tenant}).authorize(SESSION, tenant)
    # And removing with the same ARN removes that grant
    removed = main(["grants", "remove", "--principal", ROLE_WITH_PATH, "--tenant", tenant, "--table-name", table_name])
    assert removed == 0
    with pytest.raises(TenantNotGranted):
        Admission(store, grants_cache_seconds=0, tenants={tenant}).authorize(SESSION, tenant)


def test_grants_remove_takes_a_grant_of_any_name_as_listed(store: Store, table_name: str, tenant: str) -> None:
    store.grant("legacy-name", tenant)

    assert main(["grants", "remove", "--principal", "legacy-name", "--tenant", tenant, "--table-name", table_name]) == 0

    assert store.granted_tenants("legacy-name") == frozenset()


def test_the_deploy_trusts_its_relay_for_the_stacks_tenants_without_a_grant(store: Store, template: Template) -> None:
    # Given the admission function's environment as the deploy sets it (role ARN and Tenants resolved)
    variables = template.properties("AdmissionFunction")["Environment"]["Variables"]
    assert set(variables) >= {"RELAY_PRINCIPAL", "TENANTS"}
    settings = Settings.from_env(
        {
            "TABLE_NAME": store.table_name,
            "AWS_REGION": "us-east-1",
            "RELAY_PRINCIPAL": "arn:aws:iam::123456789012:role/poimen-InboxRelayFunctionRole-X1",
            "TENANTS": "acme,globex,initech",
        }
    )
    admission = Admission(
        store,
        grants_cache_seconds=60,
        tenants=settings.tenants,
        trusted={settings.relay_principal or "": frozenset({"acme", "globex"})},
    )
    relay_session = "arn:aws:sts::123456789012:assumed-role/poimen-InboxRelayFunctionRole-X1/awslambda_1"

    # Then the relay's sessions are admitted for the stack's tenants with no grant in the table
    admission.authorize(relay_session, "acme")
    admission.authorize(relay_session, "globex")
    assert store.all_grants() == {}
    # And for no other tenant, nor is another principal trusted
    with pytest.raises(TenantNotGranted):
        admission.authorize(relay_session, "initech")
    with pytest.raises(TenantNotGranted):
        admission.authorize("arn:aws:sts::123456789012:assumed-role/other/s", "acme")


def test_a_relay_role_with_a_path_is_trusted_as_its_sessions_present_it(store: Store) -> None:
    # Given the relay's role declared with a path: its sessions' ARNs carry none
    settings = Settings.from_env(
        {
            "TABLE_NAME": store.table_name,
            "AWS_REGION": "us-east-1",
            "RELAY_PRINCIPAL": "arn:aws:iam::123456789012:role/service/poimen/poimen-relay",
            "TENANTS": "acme",
        }
    )
    admission = Admission(
        store,
        grants_cache_seconds=60,
        tenants=settings.tenants,
        trusted={settings.relay_principal or "": settings.tenants},
    )

    # Then the principal is kept without its path, and the role's sessions are admitted for its tenants
    assert settings.relay_principal == "arn:aws:iam::123456789012:role/poimen-relay"
    admission.authorize("arn:aws:sts::123456789012:assumed-role/poimen-relay/awslambda_1", "acme")
    assert store.all_grants() == {}


def test_a_relay_principal_that_is_no_principal_arn_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="RELAY_PRINCIPAL"):
        Settings.from_env({"TABLE_NAME": "t", "AWS_REGION": "us-east-1", "RELAY_PRINCIPAL": "poimen-relay"})


def test_a_refusal_is_cached_briefly_and_a_grant_for_the_full_time(store: Store, grant_reads: list[str]) -> None:
    now = [1000.0]
    admission = Admission(store, grants_cache_seconds=60, clock=lambda: now[0], tenants={"t1"}, refusal_cache_seconds=5)
    caller = "arn:aws:iam::1:user/late"
    # Given a caller refused, then granted in the table
    with pytest.raises(TenantNotGranted):
        admission.authorize(caller, "t1")
    store.grant(caller, "t1")
    # When it asks again within the refusal time, it is still refused from the cache
    now[0] += 4
    with pytest.raises(TenantNotGranted):
        admission.authorize(caller, "t1")
    # Then past it the grant is read and takes effect, and then stays cached for the grant time
    now[0] += 2
    admission.authorize(caller, "t1")
    now[0] += 50
    admission.authorize(caller, "t1")
    assert grant_reads == [caller, caller]
