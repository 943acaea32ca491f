"""What ships must agree with what is tested: layer requirements, handler paths, the API document."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib

import yaml

from poimen.api import openapi_document
from poimen_tools.local.template import Template
from tests.conftest import REPO


def _requirements(path: str) -> list[str]:
    lines = (REPO / path).read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_layer_requirements_equal_the_project_dependencies() -> None:
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]

    assert sorted(_requirements("layers/poimen/requirements.txt")) == sorted(declared)


def test_the_kafka_layer_is_the_publisher_extra_with_the_poimen_layers_botocore() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    publisher = project["optional-dependencies"]["publisher"]
    botocore = [pin for pin in project["dependencies"] if pin.startswith("botocore==")]

    # Both layers unpack into /opt: the same botocore in each, whichever Lambda extracts last.
    assert len(botocore) == 1
    assert sorted(_requirements("layers/kafka/requirements.txt")) == sorted([*publisher, *botocore])
    # The producer side is out of the shared layer, and still in the workstation's install (the CLI).
    assert not {pin.split("==")[0] for pin in publisher} & {pin.split("==")[0] for pin in project["dependencies"]}
    assert "poimen-admission[local,publisher]" in project["optional-dependencies"]["dev"]


def test_every_function_handler_exists_and_imports(template: Template) -> None:
    functions = [name for name, res in template.resources.items() if res["Type"] == "AWS::Serverless::Function"]

    assert functions
    for name in functions:
        assert callable(template.load_handler(name))


def test_template_targets_python313_on_arm64(template: Template) -> None:
    function_globals = template.document["Globals"]["Function"]

    assert function_globals["Runtime"] == "python3.13"
    assert function_globals["Architectures"] == ["arm64"]


def test_committed_openapi_document_is_current() -> None:
    committed = json.loads((REPO / "infra/openapi.json").read_text())

    assert committed == openapi_document(), "run `make openapi`"


def test_deploy_workflow_runs_only_the_makefile_commands() -> None:
    workflow = yaml.safe_load((REPO / ".github/workflows/deploy.yml").read_text())
    runs = {name: [step["run"] for step in job["steps"] if "run" in step] for name, job in workflow["jobs"].items()}

    assert runs == {
        "test": ["make test PYTHON=python3.13"],
        "staging": ["make deploy CONFIG_ENV=staging PYTHON=python3.13"],
        "prod": ["make deploy CONFIG_ENV=prod PYTHON=python3.13"],
    }


def test_the_deploy_workflow_passes_every_variable_make_deploy_reads() -> None:
    workflow = yaml.safe_load((REPO / ".github/workflows/deploy.yml").read_text())

    for job in ("staging", "prod"):
        (step,) = [step for step in workflow["jobs"][job]["steps"] if "run" in step]
        # CELL among them: without it an environment's cell would be deployed as the unnamed cell's stack.
        assert {"TENANTS", "MSK_CLUSTER_ARN", "CELL"} <= set(step["env"]), job
        assert step["env"]["CELL"] == "${{ vars.CELL }}"
    # One group for every deploy: two cells' deploys never overlap (the cell check reads before it writes).
    assert workflow["concurrency"] == {"group": "deploy", "cancel-in-progress": False}


def test_the_cli_loads_no_powertools_object_before_poimen_dev_sets_the_functions_environment() -> None:
    # Powertools' Logger and Metrics read POWERTOOLS_* when created: created at the CLI's import, the
    # relay that `poimen dev` runs in-process had no metrics namespace and failed every batch.
    modules = "('poimen.observability', 'poimen.relay')"
    code = f"import sys, poimen_tools.cli; print(sorted(m for m in {modules} if m in sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout

    assert loaded.strip() == "[]"
