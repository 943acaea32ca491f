"""The deployable bundle as the deploy workflow makes it: the README's deploy commands, run here up to
the first call to AWS; what `sam build` built; `sam package` against moto's S3 on loopback."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import boto3
import pytest

from poimen_tools.local.moto import EmbeddedMoto
from tests.conftest import REPO
from tests.integration.conftest import free_port

BUILD = REPO / ".aws-sam" / "build"
SAM_PYTHON = REPO / ".venv-sam" / "bin" / "python"
ELF_MACHINE_AARCH64 = 183  # e_machine of an ELF file built for arm64 (AArch64)

# SAM CLI's own expansion of AWS::LanguageExtensions (the code `sam build` ran), printed as JSON.
EXPAND = """
import json, sys
from samcli.lib.cfn_language_extensions.sam_integration import expand_language_extensions
from samcli.yamlhelper import yaml_parse
template = yaml_parse(open(sys.argv[1]).read())
result = expand_language_extensions(template, {"Tenants": sys.argv[2]}, enabled=True)
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
    """The test process's environment without any AWS endpoint or profile, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_ENDPOINT_URL", "AWS_PROFILE"))}
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


def test_built_layer_has_only_aarch64_shared_objects(built: Path) -> None:
    shared = sorted(built.glob("PoimenLayer/python/**/*.so*"))
    names = {path.name.split(".", 1)[0] for path in shared}

    assert {"_pydantic_core", "cimpl"} <= names  # pydantic's and confluent-kafka's native code
    assert {path.name: _elf_machine(path) for path in shared if _elf_machine(path) != ELF_MACHINE_AARCH64} == {}
    assert (built / "PoimenLayer/python/poimen/api.py").is_file()
    assert (built / "AdmissionFunction/app.py").is_file()
    assert (built / "InboxRelayFunction/app.py").is_file()


def test_built_template_declares_one_mapping_per_tenant(built: Path, commands: list[str]) -> None:
    tenants = _make_variables(commands[0])["TENANTS"].split(",")
    result = subprocess.run(
        [str(SAM_PYTHON), "-c", EXPAND, str(built / "template.yaml"), ",".join(tenants)],
        capture_output=True,
        text=True,
        check=True,
    )
    resources: dict[str, Any] = json.loads(result.stdout)["Resources"]
    mappings = {
        name: res["Properties"] for name, res in resources.items() if res["Type"] == "AWS::Lambda::EventSourceMapping"
    }

    assert len(tenants) == 2
    assert sorted(mappings) == sorted(f"RelaySource{tenant.replace('-', '')}" for tenant in tenants)
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


def test_built_template_keeps_the_loop_for_cloudformation(built: Path) -> None:
    text = (built / "template.yaml").read_text()

    assert "Fn::ForEach::TenantDispatchSources" in text
    assert "RelaySourceacme" not in text  # CloudFormation expands it with the deploy's Tenants


def test_deploy_command_runs_up_to_its_first_call_to_aws(built: Path, commands: list[str]) -> None:
    # Given an AWS endpoint on a loopback port nothing listens on
    closed = f"http://127.0.0.1:{free_port()}"
    env = _offline_env(
        AWS_ENDPOINT_URL=closed, AWS_REGION="eu-west-1", AWS_DEFAULT_REGION="eu-west-1", AWS_MAX_ATTEMPTS="1"
    )
    variables = _make_variables(commands[1])

    # When the README's deploy command runs verbatim
    result = _run(commands[1], env)

    # Then it built, ran sam deploy with the stage's and the account's parameters, and stopped at AWS
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "Build Succeeded" in output
    deploy_line = next(line for line in output.splitlines() if "sam deploy --config-env" in line)
    assert f"--config-env {variables['CONFIG_ENV']}" in deploy_line
    assert "--parameter-overrides Stage=staging TableDeletionProtection=true LogRetentionDays=30" in deploy_line
    assert f'"Tenants={variables["TENANTS"]}"' in output
    assert f'"MskClusterArn={variables["MSK_CLUSTER_ARN"]}"' in output
    assert f'"AlarmEmail={variables["ALARM_EMAIL"]}"' in output
    assert f'Could not connect to the endpoint URL: "{closed}/"' in output


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
        uploaded = boto3.client("s3", endpoint_url=moto.endpoint).list_objects_v2(Bucket="poimen-artifacts")

    assert result.returncode == 0, result.stderr[-3000:]
    text = packaged.read_text()
    uris = re.findall(r"(?:CodeUri|ContentUri): (s3://\S+)", text)
    assert len(uris) == 3  # the layer and the two functions
    assert {uri.rsplit("/", 1)[1] for uri in uris} <= {item["Key"] for item in uploaded["Contents"]}
    assert "Fn::ForEach::TenantDispatchSources" in text


def test_tenant_ids_that_collide_as_logical_ids_are_refused() -> None:
    result = _run("make build TENANTS=a-b,ab", _offline_env(), timeout=300)

    assert result.returncode != 0
    assert "produced logical IDs that conflict with existing entries: RelaySourceab" in result.stdout + result.stderr
