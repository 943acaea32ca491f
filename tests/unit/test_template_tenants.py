"""A tenant added to `Tenants` is served from its first record: its MSK event source starts polling only
once the admission alias serves the version whose TENANTS names it (else the relay's first batches
meet the previous version, which refuses the relay for that tenant)."""

from __future__ import annotations

import json

from tests.unit.test_template_posture import _only, _transformed


def test_a_new_tenant_publishes_a_new_admission_version() -> None:
    before = _transformed(Tenants="acme,beta-2")["Resources"]
    after = _transformed(Tenants="acme,beta-2,gamma")["Resources"]

    # TENANTS is resolved before SAM hashes the function: another version, and the alias moves to it.
    assert after["AdmissionFunction"]["Properties"]["Environment"]["Variables"]["TENANTS"] == "acme,beta-2,gamma"
    assert (
        _only(before, "AWS::Lambda::Version", "AdmissionFunction")[0]
        != (_only(after, "AWS::Lambda::Version", "AdmissionFunction")[0])
    )


def test_each_tenants_event_source_waits_for_the_admission_alias_that_trusts_the_relay_for_it() -> None:
    resources = _transformed(Tenants="acme,beta-2,gamma")["Resources"]
    version_id, _ = _only(resources, "AWS::Lambda::Version", "AdmissionFunction")
    alias = resources["AdmissionFunctionAliaslive"]

    assert alias["Type"] == "AWS::Lambda::Alias"
    assert alias["Properties"]["FunctionVersion"] == {"Fn::GetAtt": [version_id, "Version"]}
    for tenant in ("acme", "beta2", "gamma"):
        mapping = resources[f"RelaySource{tenant}"]
        assert "AdmissionFunctionAliaslive" in mapping["DependsOn"], json.dumps(mapping["DependsOn"])
