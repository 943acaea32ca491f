"""`make deploy`'s cell check (poimen_tools.deploy_check cells): a tenant another deployed cell serves on the
same MSK cluster is refused in one line naming that cell, with CloudFormation (moto's, in process) as the
list of deployed stacks; a stack keeps its cell. The tenant maximum: tests/unit/test_template_quotas.py."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from typing import Any

import boto3
import botocore.session
import pytest
from moto import mock_aws

from poimen_tools.deploy_check import TENANT_PATTERN, DeployedCell, cell_refusal, deployed_cells, main, max_tenants
from poimen_tools.local.template import Template
from tests.conftest import REPO
from tests.unit.transforms import SAM_PYTHON

CLUSTER = "arn:aws:kafka:us-east-1:111122223333:cluster/poimen/5f0c3a1e-8d2b-4c6a-9e1f-2b7d4c8a6e30-2"
OTHER_CLUSTER = "arn:aws:kafka:us-east-1:111122223333:cluster/other/00000000-0000-0000-0000-000000000000-1"
EAST2_CLUSTER = "arn:aws:kafka:us-east-2:111122223333:cluster/poimen/0c1d2e3f-8d2b-4c6a-9e1f-2b7d4c8a6e30-1"
# A stand-in for template.yaml (moto cannot run its transforms) with the parameters the check reads. Tenants
# is a String here: moto describes a CommaDelimitedList's value as a Python list's repr, where CloudFormation
# gives back the comma-separated text it was given, as it does for a String.
STAND_IN = {
    "Parameters": {
        "Tenants": {"Type": "String"},
        "MskClusterArn": {"Type": "String"},
        "Cell": {"Type": "String", "Default": ""},
        "PeerClusterAlias1": {"Type": "String", "Default": ""},
        "PeerClusterAlias2": {"Type": "String", "Default": ""},
    },
    "Resources": {"Queue": {"Type": "AWS::SQS::Queue"}},
}
BEFORE_CELLS = {  # a stack deployed before the Cell parameter existed
    "Parameters": {"Tenants": {"Type": "String"}, "MskClusterArn": {"Type": "String"}},
    "Resources": {"Queue": {"Type": "AWS::SQS::Queue"}},
}


@pytest.fixture
def cloudformation() -> Iterator[Any]:
    with mock_aws():
        yield boto3.client("cloudformation", region_name="us-east-1")


def _deploy(
    client: Any, stack: str, tenants: str, cluster: str = CLUSTER, cell: str | None = None, **more: str
) -> None:
    parameters = {"Tenants": tenants, "MskClusterArn": cluster, **({"Cell": cell} if cell is not None else {}), **more}
    client.create_stack(
        StackName=stack,
        TemplateBody=json.dumps(STAND_IN if cell is not None else BEFORE_CELLS),
        Parameters=[{"ParameterKey": key, "ParameterValue": value} for key, value in parameters.items()],
    )


def test_a_tenant_another_cell_serves_on_the_cluster_is_refused_naming_that_cell(cloudformation: Any) -> None:
    # Given cell c1 serving acme and globex
    _deploy(cloudformation, "poimen-admission-dev-c1", "acme,globex", cell="c1")

    # When cell c2 would serve globex and delta on the same cluster
    refusal = cell_refusal(
        deployed_cells(cloudformation), "poimen-admission-dev-c2", "c2", ["globex", "delta"], CLUSTER
    )

    # Then it is refused in one line that names the tenant and the cell serving it, and why
    assert refusal is not None
    assert "\n" not in refusal
    assert refusal.startswith("globex served by cell c1 (stack poimen-admission-dev-c1) already, on this MSK cluster")
    assert "acme" not in refusal
    assert "admitted twice" in refusal


def test_every_cell_serving_one_of_the_tenants_is_named(cloudformation: Any) -> None:
    _deploy(cloudformation, "poimen-admission-dev", "acme", cell=None)
    _deploy(cloudformation, "poimen-admission-dev-c1", "b1,b2,b3,b4,b5,b6,b7", cell="c1")

    tenants = ["acme", "b1", "b2", "b3", "b4", "b5", "b6", "b7"]
    refusal = cell_refusal(deployed_cells(cloudformation), "poimen-admission-dev-c2", "c2", tenants, CLUSTER)

    assert refusal is not None
    assert "acme served by the unnamed cell (stack poimen-admission-dev)" in refusal
    assert "b1, b2, b3, b4, b5 and 2 more served by cell c1 (stack poimen-admission-dev-c1)" in refusal


def test_disjoint_tenants_or_another_cluster_are_accepted(cloudformation: Any) -> None:
    _deploy(cloudformation, "poimen-admission-dev-c1", "acme,globex", cell="c1")
    deployed = deployed_cells(cloudformation)

    assert cell_refusal(deployed, "poimen-admission-dev-c2", "c2", ["delta"], CLUSTER) is None
    # Another cluster's stack of another Stage consumes other topics and groups into another deployment's table.
    assert cell_refusal(deployed, "poimen-admission-prod-c2", "c2", ["acme"], OTHER_CLUSTER, stage="prod") is None


def test_a_tenant_another_cell_of_the_stage_serves_on_another_cluster_is_refused(cloudformation: Any) -> None:
    # Given cell c1 of Stage dev serving acme on another cluster (whose dispatch topics may be replicated to this
    # one and consumed here as <alias>.poimen.acme.dispatch, or published to by the same callers)
    _deploy(cloudformation, "poimen-admission-dev-c1", "acme", cluster=OTHER_CLUSTER, cell="c1")

    # When cell c2 of Stage dev would serve acme on this cluster
    refusal = cell_refusal(deployed_cells(cloudformation), "poimen-admission-dev-c2", "c2", ["acme"], CLUSTER)

    # Then it is refused: two tables of one Stage would admit acme's keys
    assert refusal is not None
    assert refusal.startswith("acme served by cell c1 (stack poimen-admission-dev-c1) already, in Stage dev:")


def test_in_multi_region_mode_the_peer_regions_cells_count(cloudformation: Any) -> None:
    # Given cell c1 of Stage dev serving acme in us-east-2, one of this deployment's peer Regions
    east2 = boto3.client("cloudformation", region_name="us-east-2")
    _deploy(east2, "poimen-admission-dev-c1", "acme", cluster=EAST2_CLUSTER, cell="c1")
    deployed = deployed_cells(cloudformation) + deployed_cells(east2, region="us-east-2")

    # When cell c2 would serve acme here, its failover Region's callers admitting into c1's table
    refusal = cell_refusal(deployed, "poimen-admission-dev-c2", "c2", ["acme"], CLUSTER)

    # Then it is refused, naming where; and c1's own stack here may serve acme (one table in every Region)
    assert refusal is not None
    assert refusal.startswith(
        "acme served by cell c1 (stack poimen-admission-dev-c1 in us-east-2) already, in Stage dev"
    )
    assert cell_refusal(deployed, "poimen-admission-dev-c1", "c1", ["acme"], CLUSTER) is None


def test_the_command_reads_the_peer_regions(cloudformation: Any, capsys: pytest.CaptureFixture[str]) -> None:
    _deploy(boto3.client("cloudformation", region_name="us-east-2"), "poimen-admission-dev-c1", "acme", cell="c1")
    arguments = ["cells", "--stack-name", "poimen-admission-dev-c2", "--cell", "c2", "--tenants", "acme"]
    arguments += ["--msk-cluster-arn", CLUSTER, "--stage", "dev"]

    alone = main([*arguments, "--peer-regions", ","])
    with_peers = main([*arguments, "--peer-regions", "us-east-2,us-west-2"])

    assert (alone, with_peers) == (0, 2)
    assert "(stack poimen-admission-dev-c1 in us-east-2)" in capsys.readouterr().err


def test_a_cell_redeployed_with_its_own_tenants_is_accepted(cloudformation: Any) -> None:
    _deploy(cloudformation, "poimen-admission-dev-c1", "acme,globex", cell="c1")

    refusal = cell_refusal(deployed_cells(cloudformation), "poimen-admission-dev-c1", "c1", ["acme", "globex"], CLUSTER)

    assert refusal is None


@pytest.mark.parametrize(
    ("stack", "deployed_cell", "cell", "refused"),
    [
        ("poimen-admission-dev-c1", "c1", "c1", False),
        ("poimen-admission-dev-c1", "c1", "c3", True),
        ("poimen-admission-dev-c1", "c1", "", True),
        ("poimen-admission-dev", None, "", False),  # deployed before cells: the unnamed cell
        ("poimen-admission-dev", None, "c1", True),
    ],
)
def test_a_stack_keeps_its_cell(
    cloudformation: Any, stack: str, deployed_cell: str | None, cell: str, refused: bool
) -> None:
    _deploy(cloudformation, stack, "acme", cell=deployed_cell)

    refusal = cell_refusal(deployed_cells(cloudformation), stack, cell, ["acme"], CLUSTER)

    assert (refusal is not None) is refused
    if refusal is not None:
        assert "a stack's cell never changes" in refusal


def test_stacks_of_other_templates_are_not_cells(cloudformation: Any) -> None:
    cloudformation.create_stack(StackName="unrelated", TemplateBody=json.dumps({"Resources": STAND_IN["Resources"]}))
    _deploy(cloudformation, "poimen-admission-dev-c1", "acme", cell="c1")

    assert [cell.stack_name for cell in deployed_cells(cloudformation)] == ["poimen-admission-dev-c1"]


@pytest.mark.parametrize(("status", "refused"), [("ROLLBACK_COMPLETE", False), ("DELETE_FAILED", True)])
def test_only_a_stack_whose_mappings_are_gone_serves_nothing(status: str, refused: bool) -> None:
    deployed = [DeployedCell("poimen-admission-dev-c1", status, "c1", CLUSTER, ("acme",))]

    assert (cell_refusal(deployed, "poimen-admission-dev-c2", "c2", ["acme"], CLUSTER) is not None) is refused


@pytest.mark.parametrize("cell", ["C1", "-c1", "c_1", "c" * 17])
def test_a_cell_the_template_would_refuse_is_refused_first(cell: str) -> None:
    refusal = cell_refusal([], f"poimen-admission-dev-{cell}", cell, ["acme"], CLUSTER)

    assert refusal is not None
    assert "CELL" in refusal


def test_the_command_exits_2_with_one_line_on_stderr(cloudformation: Any, capsys: pytest.CaptureFixture[str]) -> None:
    _deploy(cloudformation, "poimen-admission-dev-c1", "acme", cell="c1")
    arguments = ["--prog", "make deploy", "cells", "--stack-name", "poimen-admission-dev-c2", "--cell", "c2"]
    arguments += ["--stage", "dev"]

    refused = main([*arguments, "--tenants", "acme", "--msk-cluster-arn", CLUSTER])
    refusal = capsys.readouterr().err
    accepted = main([*arguments, "--tenants", "delta", "--msk-cluster-arn", CLUSTER])

    assert refused == 2
    assert refusal.startswith("make deploy: acme served by cell c1 (stack poimen-admission-dev-c1) already")
    assert refusal.count("\n") == 1
    assert accepted == 0
    assert capsys.readouterr().err == ""


# --- what CloudFormation will serve, not only what it serves ---------------------------------------------


def _change_set(client: Any, stack: str, tenants: str, cell: str, kind: str) -> None:
    """A change set `sam deploy` leaves for its confirmation (confirm_changeset = true in the default config)."""
    parameters = {"Tenants": tenants, "MskClusterArn": CLUSTER, "Cell": cell}
    client.create_change_set(
        StackName=stack,
        ChangeSetName=f"samcli-deploy-{cell}",
        ChangeSetType=kind,
        TemplateBody=json.dumps(STAND_IN),
        Parameters=[{"ParameterKey": key, "ParameterValue": value} for key, value in parameters.items()],
    )


def test_a_new_cell_waiting_for_its_change_set_to_be_confirmed_serves_its_tenants(cloudformation: Any) -> None:
    # Given cell c1 created by a change set an operator has not confirmed yet (the stack is REVIEW_IN_PROGRESS,
    # with no parameters of its own)
    _change_set(cloudformation, "poimen-admission-dev-c1", "acme", "c1", "CREATE")

    # When cell c2 would serve acme too
    refusal = cell_refusal(deployed_cells(cloudformation), "poimen-admission-dev-c2", "c2", ["acme"], CLUSTER)

    # Then it is refused: confirmed one after the other, both cells would serve acme
    assert refusal is not None
    assert refusal.startswith("acme served by cell c1 (stack poimen-admission-dev-c1, change set samcli-deploy-c1")


def test_a_change_set_adding_a_tenant_to_a_deployed_cell_counts(cloudformation: Any) -> None:
    # Given cell c1 serving acme, and its change set adding globex waiting for confirmation
    _deploy(cloudformation, "poimen-admission-dev-c1", "acme", cell="c1")
    _change_set(cloudformation, "poimen-admission-dev-c1", "acme,globex", "c1", "UPDATE")
    deployed = deployed_cells(cloudformation)

    # Then another cell may serve neither acme nor globex, and still delta
    for tenant in ("acme", "globex"):
        assert cell_refusal(deployed, "poimen-admission-dev-c2", "c2", [tenant], CLUSTER) is not None, tenant
    assert cell_refusal(deployed, "poimen-admission-dev-c2", "c2", ["delta"], CLUSTER) is None
    # and c1 itself may be deployed again with its tenants
    assert cell_refusal(deployed, "poimen-admission-dev-c1", "c1", ["acme", "globex"], CLUSTER) is None


def test_an_executed_change_set_counts_as_the_stack_it_made(cloudformation: Any) -> None:
    _change_set(cloudformation, "poimen-admission-dev-c1", "acme", "c1", "CREATE")
    cloudformation.execute_change_set(StackName="poimen-admission-dev-c1", ChangeSetName="samcli-deploy-c1")

    deployed = deployed_cells(cloudformation)

    assert [(cell.stack_name, cell.change_set, cell.tenants) for cell in deployed] == [
        ("poimen-admission-dev-c1", "", ("acme",))
    ]


# Every status CloudFormation describes a stack with (botocore's model of the API), and those in which a stack
# holds two sets of tenants: an update or an import not yet complete.
STACK_STATUSES: list[str] = (
    botocore.session.get_session().get_service_model("cloudformation").shape_for("StackStatus").enum  # type: ignore[attr-defined]
)
UNSETTLED = [s for s in STACK_STATUSES if s.startswith(("UPDATE_", "IMPORT_")) and not s.endswith("_COMPLETE")]


@pytest.mark.parametrize("status", UNSETTLED)
def test_a_cell_whose_update_has_not_settled_holds_every_other_cell_back(status: str) -> None:
    # Given cell c1 in the middle of an update that removes acme: CloudFormation describes the new parameters,
    # while acme's mapping is still there until the cleanup, and is there again if the update rolls back
    deployed = [DeployedCell("poimen-admission-dev-c1", status, "c1", CLUSTER, ("globex",))]

    # When cell c2 would take acme over
    refusal = cell_refusal(deployed, "poimen-admission-dev-c2", "c2", ["acme"], CLUSTER)

    # Then it waits for c1 to settle, whatever the tenants c1 is described with
    assert refusal is not None
    assert refusal.startswith(f"cell c1 (stack poimen-admission-dev-c1) is {status}")
    assert "\n" not in refusal
    # A stack on another cluster of another Stage shares no topic, group nor table with this one.
    assert cell_refusal(deployed, "poimen-admission-prod-c2", "c2", ["acme"], OTHER_CLUSTER, stage="prod") is None


@pytest.mark.parametrize("status", [status for status in STACK_STATUSES if status not in UNSETTLED])
def test_a_cell_with_one_set_of_tenants_holds_back_only_those(status: str) -> None:
    deployed = [DeployedCell("poimen-admission-dev-c1", status, "c1", CLUSTER, ("globex",))]

    assert cell_refusal(deployed, "poimen-admission-dev-c2", "c2", ["acme"], CLUSTER) is None


def test_the_peer_cluster_aliases_a_stack_keeps_count_against_its_maximum(
    cloudformation: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a stack deployed with one peer cluster alias: sam deploy keeps a parameter it is not given (it passes
    # UsePreviousValue), so a deploy without PEER_CLUSTER_ALIAS_1 keeps the alias and its mappings
    _deploy(cloudformation, "poimen-admission-dev", "acme", cell="", PeerClusterAlias1="east1")
    arguments = ["--prog", "make deploy", "cells", "--stack-name", "poimen-admission-dev", "--cell", ""]
    arguments += ["--msk-cluster-arn", CLUSTER, "--stage", "dev", "--peer-cluster-aliases", ","]

    # When it is deployed with as many tenants as make build's count of the aliases given (none) accepts
    kept = main([*arguments, "--tenants", ",".join(f"t{n}" for n in range(max_tenants(0)))])
    refusal = capsys.readouterr().err
    halved = main([*arguments, "--tenants", ",".join(f"t{n}" for n in range(max_tenants(1)))])

    # Then it is refused by the aliases the stack will have, in one line that says which it keeps
    assert (kept, halved) == (2, 0)
    most = max_tenants(1)
    assert refusal.startswith(f"make deploy: {max_tenants(0)} tenants, and one stack serves at most {most} with one")
    assert "PeerClusterAlias1 (east1) kept from the deployed stack" in refusal
    assert refusal.count("\n") == 1


@pytest.mark.parametrize(
    ("given", "cleared", "expected"),
    [
        (",", "", "DispatchSources=Source,Peer1Source"),  # not given: the deployed alias stays, its mappings too
        (",", "1", "DispatchSources=Source"),  # cleared by name: its mappings go
        (",west2", "1", "DispatchSources=Source,Peer2Source"),
        ("east9,west2", "", "DispatchSources=Source,Peer1Source,Peer2Source"),
    ],
)
def test_the_deploy_is_given_the_dispatch_sources_of_the_aliases_the_stack_will_have(
    cloudformation: Any, capsys: pytest.CaptureFixture[str], given: str, cleared: str, expected: str
) -> None:
    # Given a stack deployed with one peer cluster alias
    _deploy(cloudformation, "poimen-admission-dev", "acme", cell="", PeerClusterAlias1="east1")

    # When make deploy checks it with the aliases given and those cleared
    arguments = ["--prog", "make deploy", "cells", "--stack-name", "poimen-admission-dev", "--cell", ""]
    arguments += ["--tenants", "acme", "--msk-cluster-arn", CLUSTER, "--stage", "dev"]
    code = main([*arguments, "--peer-cluster-aliases", given, "--cleared-peer-cluster-aliases", cleared])

    # Then it prints the DispatchSources that the template's Rules hold equal to those aliases
    assert (code, capsys.readouterr().out) == (0, expected + "\n")


def test_a_cleared_alias_no_longer_counts_against_the_maximum(
    cloudformation: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a stack deployed with one peer cluster alias
    _deploy(cloudformation, "poimen-admission-dev", "acme", cell="", PeerClusterAlias1="east1")
    arguments = ["--prog", "make deploy", "cells", "--stack-name", "poimen-admission-dev", "--cell", ""]
    arguments += ["--msk-cluster-arn", CLUSTER, "--stage", "dev", "--peer-cluster-aliases", ","]
    tenants = ["--tenants", ",".join(f"t{n}" for n in range(max_tenants(0)))]

    # When the most tenants a stack without alias serves are deployed with the alias cleared
    code = main([*arguments, *tenants, "--cleared-peer-cluster-aliases", "1"])

    # Then they are accepted, and the stack is deployed without the alias's mappings
    assert (code, capsys.readouterr().out) == (0, "DispatchSources=Source\n")


def _make_deploy(*assignments: str, environment: dict[str, str] | None = None) -> str:
    """The commands `make deploy` would run (make -n: nothing runs, nothing is called)."""
    given = ["TENANTS=acme", "MSK_CLUSTER_ARN=x", "KAFKA_BOOTSTRAP_SERVERS=b", "OUTBOX_SUBNET_IDS=s"]
    result = subprocess.run(
        ["make", "-n", "deploy", *given, "OUTBOX_SECURITY_GROUP_IDS=g", *assignments],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={"PATH": "/usr/bin:/bin", **(environment or {})},
    )
    commands = result.stdout.replace("\\\n", " ").splitlines()  # a command continued over lines is one
    (deploy,) = [line for line in commands if "sam deploy" in line and "RETENTION" in line]
    (check,) = [line for line in commands if "deploy_check.py" in line and " cells " in line]
    return check + "\n" + deploy


def test_make_deploy_clears_a_peer_cluster_alias_given_empty_by_name() -> None:
    kept, cleared = _make_deploy(), _make_deploy("PEER_CLUSTER_ALIAS_1=")
    from_environment = _make_deploy(environment={"PEER_CLUSTER_ALIAS_1": ""})

    # Not given (or empty in the environment, as a workflow's unset variable is): sam deploy keeps the deployed one
    for commands in (kept, from_environment):
        assert "PeerClusterAlias1=" not in commands
        assert '--cleared-peer-cluster-aliases ""' in commands
    # Given empty on the command line: passed empty, so CloudFormation clears it, and the check counts it gone
    assert "\"PeerClusterAlias1=''\"" in cleared
    assert "PeerClusterAlias2=" not in cleared
    assert '--cleared-peer-cluster-aliases "1"' in cleared
    assert "> .aws-sam/dispatch-sources.parameter" in cleared
    assert '"$(cat .aws-sam/dispatch-sources.parameter)"' in cleared


def test_sam_deploy_takes_an_empty_parameter_override_as_an_empty_value() -> None:
    # make deploy's PeerClusterAlias1='' (one argument, as the shell hands it over) must reach CloudFormation as
    # the value "": SAM CLI refuses PeerClusterAlias1= alone ("is not a valid format").
    script = (
        "from samcli.cli.types import CfnParameterOverridesType;"
        "print(CfnParameterOverridesType().convert((\"PeerClusterAlias1=''\", 'Tenants=acme'), None, None))"
    )
    result = subprocess.run([str(SAM_PYTHON), "-c", script], capture_output=True, text=True, check=True)

    assert "'PeerClusterAlias1': ''" in result.stdout


# --- what make build hands SAM ----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["a" * 64, "Acme", "-acme", "a_b", "a.b", " acme", ""])
def test_a_tenant_id_the_template_refuses_is_refused_before_sam_runs(
    bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given an id the Tenants parameter's AllowedPattern refuses (CloudFormation would, once built and uploaded),
    # or an empty one (TENANTS=acme,,globex or a trailing comma)
    code = main(["--prog", "make build", "limits", "--tenants", f"acme,{bad},globex"])

    # Then make build refuses it in one line, before SAM runs
    refusal = capsys.readouterr().err
    assert code == 2
    assert refusal.startswith(f"make build: TENANTS has {'an empty id' if not bad else repr(bad)}")
    assert refusal.count("\n") == 1


@pytest.mark.parametrize("good", ["a", "0", "a" * 63, "0-x", "beta-2"])
def test_the_ids_the_template_accepts_are_accepted(good: str) -> None:
    assert main(["limits", "--tenants", f"acme,{good}"]) == 0


def test_make_build_checks_tenant_ids_by_the_templates_pattern(template: Template) -> None:
    assert template.document["Parameters"]["Tenants"]["AllowedPattern"] == f"^{TENANT_PATTERN.pattern}$"


@pytest.mark.parametrize("aliases", ["3", "-1"])
def test_more_peer_aliases_than_the_template_has_are_a_usage_error(aliases: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["limits", "--tenants", "acme", "--peer-aliases", aliases])

    assert exit_.value.code == 2


@pytest.mark.parametrize(
    ("tenants", "named"), [("acme,a-b,ab", "'a-b' and 'ab'"), ("acme,globex,acme", "'acme' twice")]
)
def test_tenants_whose_mappings_would_share_a_logical_id_are_refused_before_sam_runs(
    tenants: str, named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given ids the template's pattern accepts, two of which name one mapping: its logical id keeps only the
    # letters and digits of a tenant id (Relay&{DispatchSource}&{TenantId}), and an id given twice is one id
    # When make build checks them
    code = main(["--prog", "make build", "limits", "--tenants", tenants])

    # Then they are refused in one line, as the template's expansion refuses them
    refusal = capsys.readouterr().err
    assert code == 2
    assert refusal.startswith(f"make build: TENANTS has {named}")
    assert refusal.count("\n") == 1
    expansion = subprocess.run(
        [str(SAM_PYTHON), str(REPO / "infra/poimen_tools/sam_transform.py"), "--batch", str(REPO / "template.yaml")],
        input=json.dumps([{"Tenants": tenants}]),
        capture_output=True,
        text=True,
        check=False,
        env={"PATH": "/usr/bin:/bin", "AWS_DEFAULT_REGION": "us-east-1", "SAM_CLI_TELEMETRY": "0"},
    )
    assert expansion.returncode != 0
    assert "conflict" in expansion.stderr
