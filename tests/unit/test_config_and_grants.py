from __future__ import annotations

from typing import Any

import pytest

from poimen.admission import Admission, normalise_principal
from poimen.config import ConfigurationError, Settings
from poimen.contract import RunRequest
from poimen.errors import IdentityMissing, TenantNotGranted
from poimen.store import Store


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
    admission = Admission(store, grants_cache_seconds=0)

    admission.authorize("arn:aws:sts::1:assumed-role/relay/s", "any-tenant")
    with pytest.raises(TenantNotGranted):
        admission.authorize("arn:aws:iam::1:role/other", "any-tenant")
    with pytest.raises(IdentityMissing):
        admission.authorize(None, "any-tenant")


def test_grants_are_cached_for_the_configured_time(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a cache of 60 s on a fake clock, and a principal granted one tenant
    now = [1000.0]
    reads: list[str] = []
    original = Store.granted_tenants

    def counting(self: Store, principal: str) -> Any:
        reads.append(principal)
        return original(self, principal)

    monkeypatch.setattr(Store, "granted_tenants", counting)
    store.grant("arn:aws:iam::1:user/a", "t1")
    admission = Admission(store, grants_cache_seconds=60, clock=lambda: now[0])
    request = RunRequest(workflow_ref="wf", input={})
    # When it admits twice within the minute, then once after
    admission.admit_run("arn:aws:iam::1:user/a", "t1", request)
    admission.admit_run("arn:aws:iam::1:user/a", "t1", request)
    now[0] += 61
    admission.admit_run("arn:aws:iam::1:user/a", "t1", request)
    # Then the grant was read once per cache period
    assert reads == ["arn:aws:iam::1:user/a"] * 2
