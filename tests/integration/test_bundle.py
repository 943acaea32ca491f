"""The deployable bundle as the deploy workflow makes it: the README's deploy commands, run here up to
the first call to AWS (and refused when another cell serves a tenant, moto's CloudFormation standing in);
what `sam build` built; `sam package` against moto's S3 on loopback."""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import subprocess
import urllib.request
import zipfile
from pathlib import Path
from typing import Any

import boto3
import pytest

from poimen_tools.local import rie
from poimen_tools.local.moto import EmbeddedMoto
from poimen_tools.local.rie import BYTECODE_TAG
from poimen_tools.local.template import Template
from tests.conftest import REPO
from tests.integration.conftest import free_port

# Both build into .cache/rie-build (rie.build_bundle) and the RIE tests run functions from it: one worker.
pytestmark = pytest.mark.xdist_group("rie-build")

BUILD = REPO / ".aws-sam" / "build"
SAM_PYTHON = REPO / ".venv-sam" / "bin" / "python"
ELF_MACHINE_AARCH64 = 183  # e_machine of an ELF file built for arm64 (AArch64)

# SAM CLI's own expansion of AWS::LanguageExtensions (the code `sam build` ran), printed as JSON.
EXPAND = """
import json, sys
from samcli.lib.cfn_language_extensions.sam_integration import expand_language_extensions
from samcli.yamlhelper import yaml_parse
template = yaml_parse(open(sys.argv[1]).read())
result = expand_language_extensions(template, json.loads(sys.argv[2]), enabled=True)
print(json.dumps(result.expanded_template))
"""


def _readme_deploy_commands() -> list[str]:
    """The shell block of the README's Deploy section, one command per (continued) line."""
    section = (REPO / "README.md").read_text().split("\n## Deploy\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```sh\n(.*?)```", section, re.DOTALL)
    assert block is not None, "README's Deploy section has no sh block"
    return [line.strip() for line in block[1].replace("\\\n", " ").splitlines() if line.strip()]


def _make_variables(command: str) -> dict[str, str]:
    words = shlex.split(command)
    return dict(word.split("=", 1) for word in words[2:] if "=" in word)


def _offline_env(**extra: str) -> dict[str, str]:
    """The test process's environment without any AWS endpoint or profile, plus `extra`.

    Without make's own variables too: under `make test` they would make the README's commands a sub-make
    (`make[1]: ***` in the last line), which is not what a user typing them sees."""
    dropped = ("AWS_ENDPOINT_URL", "AWS_PROFILE", "MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES")
    env = {k: v for k, v in os.environ.items() if not k.startswith(dropped)}
    return {**env, "SAM_CLI_TELEMETRY": "0", **extra}


def _run(command: str, env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", command], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.fixture(scope="module")
def commands() -> list[str]:
    found = _readme_deploy_commands()
    assert [shlex.split(c)[:2] for c in found] == [["make", "build"], ["make", "deploy"]]
    return found


@pytest.fixture(scope="module")
def built(commands: list[str]) -> Path:
    """`make build ...` from the README, verbatim (after `make test`'s check-bundle, SAM's cache hits)."""
    result = _run(commands[0], _offline_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Build Succeeded" in result.stdout
    return BUILD


def _elf_machine(path: Path) -> int:
    header = path.read_bytes()[:20]
    assert header[:4] == b"\x7fELF", path
    return int.from_bytes(header[18:20], "little")


def _native_names(layer: Path) -> set[str]:
    return {path.name.split(".", 1)[0] for path in layer.glob("python/**/*.so*")}


def test_built_layers_have_only_aarch64_shared_objects(built: Path) -> None:
    shared = sorted(built.glob("*Layer/python/**/*.so*"))

    assert "_pydantic_core" in _native_names(built / "PoimenLayer")  # pydantic's native code
    assert "cimpl" in _native_names(built / "KafkaLayer")  # confluent-kafka's, in the outbox relay's layer only
    assert "cimpl" not in _native_names(built / "PoimenLayer")
    assert {path.name: _elf_machine(path) for path in shared if _elf_machine(path) != ELF_MACHINE_AARCH64} == {}
    assert (built / "PoimenLayer/python/poimen/api.py").is_file()
    assert (built / "AdmissionFunction/app.py").is_file()
    assert (built / "InboxRelayFunction/app.py").is_file()
    assert (built / "OutboxRelayFunction/app.py").is_file()


def _bytecode_flags(path: Path) -> int:
    """The flags word of a .pyc (PEP 552): 1 is hash-based, unchecked."""
    return int.from_bytes(path.read_bytes()[4:8], "little")


def test_every_python_file_built_has_its_unchecked_bytecode_for_python313(built: Path) -> None:
    # Lambda's /opt and task root are read-only: a .py without its .pyc is compiled again at every cold start.
    for tree in sorted(path for path in built.iterdir() if path.is_dir()):
        sources = sorted(tree.rglob("*.py"))
        compiled = {source: source.parent / "__pycache__" / f"{source.stem}.{BYTECODE_TAG}.pyc" for source in sources}

        assert sources, tree
        assert [source for source, pyc in compiled.items() if not pyc.is_file()] == [], tree
        assert {_bytecode_flags(pyc) for pyc in compiled.values()} == {1}, tree


def _normalised_files(build: Path) -> set[str]:
    """Every file of a build, relative, with what differs by architecture alone made equal: the platform in
    native file names, and the content hash auditwheel puts in a bundled library's name."""
    files = set()
    for path in build.rglob("*"):
        if path.is_file() and path.name != "template.yaml":
            relative = str(path.relative_to(build)).replace("aarch64", "x86_64")
            files.add(re.sub(r"-[0-9a-f]{8}(\.so)", r"\1", relative))
    return files


def test_the_arm64_build_holds_the_files_of_the_x86_64_build_the_rie_tests_run(built: Path) -> None:
    # Given the x86_64 variant the RIE tests run (tests/integration/test_rie.py), built and compiled the same way
    x86_64 = rie.build_bundle()

    # Then the arm64 bundle that ships has the same files, but for the architecture in native names
    arm64, tested = _normalised_files(built), _normalised_files(x86_64)
    assert sorted(arm64 - tested) == []
    assert sorted(tested - arm64) == []


def test_built_template_declares_one_mapping_per_tenant(built: Path, commands: list[str]) -> None:
    tenants = _make_variables(commands[0])["TENANTS"].split(",")
    aliases = {"PeerClusterAlias1": "east2", "PeerClusterAlias2": "west2"}
    parameters = {"Tenants": ",".join(tenants), **aliases, "DispatchSources": "Source,Peer1Source,Peer2Source"}
    result = subprocess.run(
        [str(SAM_PYTHON), "-c", EXPAND, str(built / "template.yaml"), json.dumps(parameters)],
        capture_output=True,
        text=True,
        check=True,
    )
    resources: dict[str, Any] = json.loads(result.stdout)["Resources"]
    relay_sources = {
        name: res
        for name, res in resources.items()
        if res["Type"] == "AWS::Lambda::EventSourceMapping" and name != "OutboxRelaySource"
    }
    mappings = {name: res["Properties"] for name, res in relay_sources.items() if name.startswith("RelaySource")}
    peers = {name: res for name, res in relay_sources.items() if name.startswith("RelayPeer")}

    assert len(tenants) == 2
    assert "OutboxRelaySource" in resources  # the outbox's one stream mapping, whatever the tenants
    assert sorted(mappings) == sorted(f"RelaySource{tenant.replace('-', '')}" for tenant in tenants)
    # And one more per tenant and peer cluster alias, on its replicated topic, declared only when the alias is
    # given (DispatchSources): none is conditional, CloudFormation counts every one declared
    assert not [name for name, res in relay_sources.items() if "Condition" in res]
    assert sorted(peers) == sorted(f"RelayPeer{n}Source{tenant.replace('-', '')}" for n in (1, 2) for tenant in tenants)
    for n in (1, 2):
        for tenant in tenants:
            peer = peers[f"RelayPeer{n}Source{tenant.replace('-', '')}"]
            alias = aliases[f"PeerClusterAlias{n}"]
            assert [_substituted(topic) for topic in peer["Properties"]["Topics"]] == [
                f"{alias}.poimen.{tenant}.dispatch"
            ]
            group = peer["Properties"]["AmazonManagedKafkaEventSourceConfig"]["ConsumerGroupId"]
            assert _substituted(group) == f"poimen-relay-{tenant}.{alias}"
            assert peer["Properties"]["FunctionName"] == {"Ref": "InboxRelayFunction.Alias"}
    for tenant in tenants:
        mapping = mappings[f"RelaySource{tenant.replace('-', '')}"]
        assert [_substituted(topic) for topic in mapping["Topics"]] == [f"poimen.{tenant}.dispatch"]
        group = mapping["AmazonManagedKafkaEventSourceConfig"]["ConsumerGroupId"]
        assert _substituted(group) == f"poimen-relay-{tenant}"
        assert mapping["FunctionName"] == {"Ref": "InboxRelayFunction.Alias"}
        assert mapping["DestinationConfig"]["OnFailure"]["Destination"] == {
            "Fn::GetAtt": ["FailedBatchesBucket", "Arn"]
        }


def _substituted(value: str | dict[str, str]) -> str:
    """A string the expansion left as `Fn::Sub` with no variable left in it, or resolved already."""
    text = value if isinstance(value, str) else value["Fn::Sub"]
    assert "${" not in text
    return text


def _references(value: Any, parameters: set[str], kind: str | None = None) -> set[tuple[str, str]]:
    """(intrinsic, name) for every Ref, Fn::GetAtt and Fn::Sub placeholder naming a resource or a pseudo
    parameter: what an offline transform cannot resolve and must hand CloudFormation as it is."""
    found: set[tuple[str, str]] = set()
    if isinstance(value, list):
        for item in value:
            found |= _references(item, parameters, kind)
    elif isinstance(value, dict):
        for key, item in value.items():
            if key == "Ref" and isinstance(item, str) and item not in parameters:
                found.add(("Ref", item))
            elif key == "Fn::GetAtt":
                found.add(("Fn::GetAtt", ".".join(item) if isinstance(item, list) else item))
            elif key == "Fn::Sub":
                text, variables = (item, {}) if isinstance(item, str) else (item[0], item[1])
                names = set(re.findall(r"\$\{([^}!]+)\}", text)) - set(variables) - parameters
                found |= {("Fn::Sub", name) for name in names}
                found |= _references(variables, parameters)
            else:
                found |= _references(item, parameters)
    return found


def test_the_offline_transform_keeps_the_references_sam_build_hands_cloudformation(built: Path) -> None:
    # Given sam build's template (what sam package and deploy hand CloudFormation) and the transform's
    document = Template(built / "template.yaml").document
    parameters = set(document["Parameters"]) | {"TenantId", "DispatchSource"}  # parameters, the loops' identifiers
    # Every condition true in one of two stacks (single-Region, and a multi-Region home stack: their tables
    # exclude each other), so that every resource is one CloudFormation creates (those of a false condition
    # are left out of the transform's output: CloudFormation never reads them).
    hardened = [
        "Tenants=acme",
        "KmsKeyArn=arn:aws:kms:us-east-1:111122223333:key/00000000-0000-0000-0000-000000000000",
        "AlarmEmail=ops@example.com",
        "AdmissionReservedConcurrency=10",
        "RelayReservedConcurrency=5",
        "PeerClusterAlias1=east2",
        "PeerClusterAlias2=west2",
        "DispatchSources=Source,Peer1Source,Peer2Source",
    ]
    home = [
        "TableMode=global-home",
        "PeerRegion1=us-east-2",
        "PeerRegion2=us-west-2",
        "PeerRegion1KmsKeyArn=arn:aws:kms:us-east-2:111122223333:key/00000000-0000-0000-0000-000000000000",
        "PeerRegion2KmsKeyArn=arn:aws:kms:us-west-2:111122223333:key/00000000-0000-0000-0000-000000000000",
    ]
    kept: set[tuple[str, str]] = set()
    for stack in (hardened, hardened + home):
        transformed = subprocess.run(
            [str(SAM_PYTHON), str(REPO / "infra/poimen_tools/sam_transform.py"), str(REPO / "template.yaml"), *stack],
            capture_output=True,
            text=True,
            check=True,
            env={"PATH": "/usr/bin:/bin", "AWS_DEFAULT_REGION": "us-east-1", "SAM_CLI_TELEMETRY": "0"},
        )
        kept |= _references(json.loads(transformed.stdout)["Resources"], parameters)

    # Then every reference to a resource or a pseudo parameter is still there (SAM names a function's alias
    # <Function>Aliaslive and a layer version <Layer><hash>)
    def present(reference: tuple[str, str]) -> bool:
        kind, name = reference
        head, _, attribute = name.partition(".")
        names = {name, f"{head}Aliaslive" if attribute == "Alias" else name}
        return any(k == kind and (n in names or re.fullmatch(rf"{re.escape(head)}[0-9a-f]{{10}}", n)) for k, n in kept)

    expected = _references(document["Resources"], parameters)
    assert {kind for kind, _ in expected} == {"Ref", "Fn::GetAtt", "Fn::Sub"}
    assert sorted(reference for reference in expected if not present(reference)) == []


def test_built_template_keeps_the_loop_for_cloudformation(built: Path) -> None:
    text = (built / "template.yaml").read_text()

    assert "Fn::ForEach::RelaySources" in text
    assert "RelaySourceacme" not in text  # CloudFormation expands it with the deploy's Tenants


def test_deploy_command_runs_up_to_its_first_call_to_aws(built: Path, commands: list[str]) -> None:
    # Given an AWS endpoint on a loopback port nothing listens on
    closed = f"http://127.0.0.1:{free_port()}"
    env = _offline_env(
        AWS_ENDPOINT_URL=closed, AWS_REGION="eu-west-1", AWS_DEFAULT_REGION="eu-west-1", AWS_MAX_ATTEMPTS="1"
    )

    # When the README's deploy command runs verbatim
    result = _run(commands[1], env)

    # Then it built, and stopped at its first call to AWS, the cell check's, in one line: nothing was deployed
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "Build Succeeded" in output
    (refusal,) = [line for line in result.stderr.splitlines() if line.startswith("make deploy:")]
    assert refusal.startswith("make deploy: could not read the deployed cells from CloudFormation")
    assert f'Could not connect to the endpoint URL: "{closed}/' in refusal
    # make exits 2 on every failure: the check's own code (3, AWS out of reach) is in make's last line, and the
    # operations page says so rather than promise an exit code make cannot give
    assert result.returncode == 2
    assert re.fullmatch(r"make: \*\*\* \[Makefile:\d+: deploy\] Error 3", result.stderr.splitlines()[-1])
    operations = " ".join((REPO / "docs" / "operations.md").read_text().split())
    assert "AWS out of reach: nothing deployed, `make deploy` exits 2 and its last line ends `Error 3`" in operations
    assert not [
        line for line in result.stdout.splitlines() if line.startswith("SAM_CLI_TELEMETRY=0 .venv-sam/bin/sam deploy")
    ]


@pytest.mark.parametrize("cell", ["", "c2"])
def test_deploy_command_hands_sam_the_stages_the_accounts_and_the_cells_parameters(
    commands: list[str], cell: str
) -> None:
    variables = _make_variables(commands[1])

    # When the README's deploy command is printed by make -n, with a cell or without
    result = _run(
        f"{commands[1].replace('make deploy', 'make -n deploy', 1)}{f' CELL={cell}' if cell else ''}", _offline_env()
    )

    # Then the cell check runs before sam deploy, which gets the stage's and the account's parameters
    assert result.returncode == 0, result.stderr
    lines = result.stdout.replace("\\\n", " ").splitlines()
    check = next(n for n, line in enumerate(lines) if 'deploy_check.py --prog "make deploy" cells' in line)
    deploy = next(n for n, line in enumerate(lines) if "sam deploy --config-env" in line)
    assert check < deploy
    stack = f"poimen-admission-staging{f'-{cell}' if cell else ''}"
    assert f'--stack-name "{stack}" --cell "{cell}" --tenants "{variables["TENANTS"]}"' in lines[check]
    # The Stage's other cells count on any cluster, and (multi-Region mode, none here) in the peer Regions.
    assert " ".join(lines[check].split()).endswith(
        '--stage "staging" --peer-regions "," --peer-cluster-aliases "," --cleared-peer-cluster-aliases ""'
        " > .aws-sam/dispatch-sources.parameter"
    )
    # sam deploy gets the DispatchSources the check derived from the aliases the stack will have, and the poller
    # groups the group check assigned after it (docs/operations.md#poller-groups).
    assert '"$(cat .aws-sam/dispatch-sources.parameter)"' in lines[deploy]
    groups = next(n for n, line in enumerate(lines) if 'deploy_check.py --prog "make deploy" groups' in line)
    assert check < groups < deploy
    assert f'--stack-name "{stack}" --tenants "{variables["TENANTS"]}"' in lines[groups]
    assert f'--msk-cluster-arn "{variables["MSK_CLUSTER_ARN"]}"' in lines[groups]
    assert '"$(cat .aws-sam/poller-groups.parameter)"' in lines[deploy]
    deploy_line = lines[deploy]
    assert f"--config-env {variables['CONFIG_ENV']} --stack-name {stack}" in deploy_line
    assert "--parameter-overrides Stage=staging TableDeletionProtection=true LogRetentionDays=30" in deploy_line
    assert f'"Tenants={variables["TENANTS"]}"' in deploy_line
    assert f'"MskClusterArn={variables["MSK_CLUSTER_ARN"]}"' in deploy_line
    assert f'"KafkaBootstrapServers={variables["KAFKA_BOOTSTRAP_SERVERS"]}"' in deploy_line
    assert f'"OutboxSubnetIds={variables["OUTBOX_SUBNET_IDS"]}"' in deploy_line
    assert f'"OutboxSecurityGroupIds={variables["OUTBOX_SECURITY_GROUP_IDS"]}"' in deploy_line
    assert f'"AlarmEmail={variables["ALARM_EMAIL"]}"' in deploy_line
    assert ('"Cell=c2"' in deploy_line) is bool(cell)


def test_deploy_command_refuses_a_tenant_another_cell_serves(built: Path, commands: list[str]) -> None:
    variables = _make_variables(commands[1])
    (tenant, *_) = variables["TENANTS"].split(",")
    with EmbeddedMoto() as moto:
        _reset(moto)  # moto's backends are the process's: no stack of an earlier test's stands in
        # Given cell c1 of the same stage serving the README's first tenant on the README's cluster (a stand-in
        # stack with the parameters the check reads: moto cannot run the template's transforms)
        env = _offline_env(AWS_ENDPOINT_URL=moto.endpoint, AWS_REGION="eu-west-1", AWS_DEFAULT_REGION="eu-west-1")
        boto3.client("cloudformation", endpoint_url=moto.endpoint, region_name="eu-west-1").create_stack(
            StackName="poimen-admission-staging-c1",
            TemplateBody=json.dumps(
                {
                    "Parameters": {name: {"Type": "String"} for name in ("Tenants", "MskClusterArn", "Cell")},
                    "Resources": {"Queue": {"Type": "AWS::SQS::Queue"}},
                }
            ),
            Parameters=[
                {"ParameterKey": "Tenants", "ParameterValue": f"{tenant},someone-else"},
                {"ParameterKey": "MskClusterArn", "ParameterValue": variables["MSK_CLUSTER_ARN"]},
                {"ParameterKey": "Cell", "ParameterValue": "c1"},
            ],
        )

        # When the README's deploy command runs verbatim
        result = _run(commands[1], env)

    # Then it is refused before sam deploy, in one line naming that cell
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1].endswith("] Error 2")
    (refusal,) = [line for line in result.stderr.splitlines() if line.startswith("make deploy:")]
    assert refusal.startswith(
        f"make deploy: {tenant} served by cell c1 (stack poimen-admission-staging-c1) already, on this MSK cluster"
    )
    assert not [
        line for line in result.stdout.splitlines() if line.startswith("SAM_CLI_TELEMETRY=0 .venv-sam/bin/sam deploy")
    ]


# A SAM CLI that says how it was called and deploys only the run retention's parameters (moto's CloudFormation
# cannot run the template's transforms): what the second, parameter-only deploy of a change reads back.
# It reads the overrides with SAM CLI's own parser, so that a word it refuses fails the deploy as it would; an
# update changing nothing deploys nothing (samconfig.toml's fail_on_empty_changeset = false).
FAKE_SAM = """#!{python}
import sys, boto3
from samcli.cli.types import CfnParameterOverridesType
print("sam " + " ".join(sys.argv[1:]), flush=True)
if sys.argv[1] != "deploy":
    sys.exit(0)
names = ("RunRetentionDays", "PreviousRunRetentionDays", "RunRetentionChangedAt")
start = sys.argv.index("--parameter-overrides") + 1
read = CfnParameterOverridesType().convert(tuple(w for w in sys.argv[start:] if not w.startswith("--")), None, None)
given = {{name: read[name] for name in names}}
stack = sys.argv[sys.argv.index("--stack-name") + 1]
cloudformation = boto3.client("cloudformation")
try:
    cloudformation.update_stack(StackName=stack, UsePreviousTemplate=True, Parameters=[
        {{"ParameterKey": name, "ParameterValue": given[name]}} for name in names])
except cloudformation.exceptions.ClientError as error:  # as samconfig's fail_on_empty_changeset = false
    if "No updates are to be performed" not in str(error):
        raise
"""


# A stack of the run retention's three parameters alone, as the deploy tests create it in moto's CloudFormation.
RETENTION_STACK = {
    "Parameters": {
        name: {"Type": "String", "Default": ""}
        for name in ("RunRetentionDays", "PreviousRunRetentionDays", "RunRetentionChangedAt")
    },
    "Resources": {"Queue": {"Type": "AWS::SQS::Queue"}},
}


def _fake_sam(tmp_path: Path) -> Path:
    """FAKE_SAM as an executable in `tmp_path`."""
    sam = tmp_path / "sam"
    sam.write_text(FAKE_SAM.format(python=SAM_PYTHON))
    sam.chmod(0o755)
    return sam


def test_deploy_deploys_a_raise_pending_then_records_when_it_took_effect(tmp_path: Path, commands: list[str]) -> None:
    # Given the stack deployed with runs kept 1 day (moto's CloudFormation on loopback)
    sam, stack = _fake_sam(tmp_path), RETENTION_STACK
    with EmbeddedMoto() as moto:
        _reset(moto)  # moto's backends are the process's: no stack of an earlier test's stands in
        cloudformation = boto3.client("cloudformation", endpoint_url=moto.endpoint, region_name="eu-west-1")
        cloudformation.create_stack(
            StackName="poimen-admission-staging",
            TemplateBody=json.dumps(stack),
            Parameters=[{"ParameterKey": "RunRetentionDays", "ParameterValue": "1"}],
        )
        env = _offline_env(AWS_ENDPOINT_URL=moto.endpoint, AWS_REGION="eu-west-1", AWS_DEFAULT_REGION="eu-west-1")
        # When the README's deploy command runs with RUN_RETENTION_DAYS=7
        result = _run(f"{commands[1]} RUN_RETENTION_DAYS=7 SAM={sam} COMPILE_BYTECODE=true", env)
        (deployed,) = cloudformation.describe_stacks(StackName="poimen-admission-staging")["Stacks"]
    # Then sam deploy is given the raise pending, then, once it completed, the time it took effect, and the
    # deploy says so each time
    assert result.returncode == 0, result.stderr[-2000:]
    first, second = [line for line in result.stdout.splitlines() if line.startswith("sam deploy ")]
    assert first.endswith(" RunRetentionDays=7 PreviousRunRetentionDays=1 RunRetentionChangedAt=pending")
    assert re.search(r" RunRetentionDays=7 PreviousRunRetentionDays=1 RunRetentionChangedAt=[0-9T:.-]+Z$", second)
    assert first.rsplit(" ", 3)[0] == second.rsplit(" ", 3)[0]  # the same deploy, but for the change's time
    assert "RunRetentionDays of poimen-admission-staging changes from 1 day to 7 days" in result.stderr
    assert "the change of RunRetentionDays of poimen-admission-staging to 7 days took effect by 20" in result.stderr
    recorded = {entry["ParameterKey"]: entry["ParameterValue"] for entry in deployed["Parameters"]}
    assert recorded["RunRetentionChangedAt"] == second.rsplit("=", 1)[1]


def test_deploy_with_runs_kept_forever_passes_sam_empty_values_it_takes(tmp_path: Path, commands: list[str]) -> None:
    # Given the stack deployed with the default run retention (forever: every retention parameter empty)
    sam, stack = _fake_sam(tmp_path), RETENTION_STACK
    with EmbeddedMoto() as moto:
        _reset(moto)
        cloudformation = boto3.client("cloudformation", endpoint_url=moto.endpoint, region_name="eu-west-1")
        cloudformation.create_stack(StackName="poimen-admission-staging", TemplateBody=json.dumps(stack))
        env = _offline_env(AWS_ENDPOINT_URL=moto.endpoint, AWS_REGION="eu-west-1", AWS_DEFAULT_REGION="eu-west-1")
        # When the README's deploy command runs as it is
        result = _run(f"{commands[1]} SAM={sam} COMPILE_BYTECODE=true", env)
        (deployed,) = cloudformation.describe_stacks(StackName="poimen-admission-staging")["Stacks"]
    # Then sam deploy (SAM CLI's parser) takes the empty values, and the stack keeps runs forever
    assert result.returncode == 0, result.stderr[-2000:]
    (call,) = [line for line in result.stdout.splitlines() if line.startswith("sam deploy ")]
    assert call.endswith(" RunRetentionDays='' PreviousRunRetentionDays='' RunRetentionChangedAt=''")
    recorded = {entry["ParameterKey"]: entry.get("ParameterValue", "") for entry in deployed["Parameters"]}
    assert recorded == dict.fromkeys(RETENTION_STACK["Parameters"], "")


def test_sam_package_uploads_to_s3_and_keeps_the_loop(built: Path, tmp_path: Path) -> None:
    packaged = tmp_path / "packaged.yaml"
    with EmbeddedMoto() as moto:
        boto3.client("s3", endpoint_url=moto.endpoint).create_bucket(Bucket="poimen-artifacts")
        env = _offline_env(AWS_ENDPOINT_URL=moto.endpoint)
        result = _run(
            f".venv-sam/bin/sam package --config-file {REPO / 'samconfig.toml'} --template-file"
            f" {built / 'template.yaml'} --s3-bucket poimen-artifacts --output-template-file {packaged}",
            env,
        )
        s3 = boto3.client("s3", endpoint_url=moto.endpoint)
        uploaded = s3.list_objects_v2(Bucket="poimen-artifacts")
        archives = {
            item["Key"]: zipfile.ZipFile(
                io.BytesIO(s3.get_object(Bucket="poimen-artifacts", Key=item["Key"])["Body"].read())
            ).namelist()
            for item in uploaded.get("Contents", [])
            if not item["Key"].endswith(".template")
        }

    assert result.returncode == 0, result.stderr[-3000:]
    text = packaged.read_text()
    uris = re.findall(r"(?:CodeUri|ContentUri): (s3://\S+)", text)
    assert len(uris) == len([path for path in built.iterdir() if path.is_dir()])  # each layer and function
    assert {uri.rsplit("/", 1)[1] for uri in uris} <= {item["Key"] for item in uploaded["Contents"]}
    assert "Fn::ForEach::RelaySources" in text
    # What is uploaded carries the bytecode `make build` compiled.
    for name, archive in archives.items():
        assert any(entry.endswith(f".{BYTECODE_TAG}.pyc") for entry in archive), name


def test_tenant_ids_that_collide_as_logical_ids_are_refused() -> None:
    result = _run("make build TENANTS=a-b,ab", _offline_env(), timeout=300)

    # Refused in one line before SAM runs (whose expansion would refuse it too: tests/unit/test_deploy_check.py)
    assert result.returncode != 0
    assert result.stderr.startswith("make build: TENANTS has 'a-b' and 'ab'"), result.stderr
    assert "sam build" not in result.stdout + result.stderr


def _reset(moto: EmbeddedMoto) -> None:
    """Empty moto's backends (moto server's own reset call)."""
    urllib.request.urlopen(urllib.request.Request(f"{moto.endpoint}/moto-api/reset", method="POST"), timeout=10)
