"""The layers pin what their code imports: every third-party distribution that `poimen` imports is pinned in
layers/poimen/requirements.txt or, for the producer side only the outbox relay runs, layers/kafka/, so `sam
build` installs the version tested here rather than whatever the Lambda runtime happens to carry (or
nothing). And no function loads a distribution of a layer it does not have (tests/integration/test_rie.py
holds the built layers to what the functions import, INIT and first invocation)."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import re
import subprocess
import sys

import pytest

from poimen_tools.local.template import Template
from tests.conftest import REPO

PACKAGE = REPO / "layers/poimen/poimen"


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _imported_modules() -> set[str]:
    """Top-level names of every absolute import in the package."""
    modules: set[str] = set()
    for path in PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
    return modules


def _pinned(layer: str) -> set[str]:
    lines = (REPO / "layers" / layer / "requirements.txt").read_text().splitlines()
    requirements = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    pinned = {_canonical(line.split("==")[0]) for line in requirements if "==" in line}
    assert len(pinned) == len(requirements), f"every requirement of layers/{layer} is pinned with =="
    return pinned


def test_every_distribution_the_layer_imports_is_pinned() -> None:
    providers = importlib.metadata.packages_distributions()
    third_party = _imported_modules() - set(sys.stdlib_module_names) - {"__future__", "poimen"}
    imported = {_canonical(dist) for module in third_party for dist in providers.get(module, [module])}

    assert "botocore" in imported  # the relay's SQS client and SigV4 (botocore alone: boto3 costs cold start)
    assert imported - _pinned("poimen") - _pinned("kafka") == set()
    assert {"confluent-kafka", "aws-msk-iam-sasl-signer-python", "boto3"} <= _pinned("kafka") - _pinned("poimen")


def _function_layers(template: Template, function: str) -> set[str]:
    """The layer directories (layers/<name>) of a function: Globals' layers, then its own."""
    function_globals = template.document["Globals"]["Function"]
    layers = [*function_globals.get("Layers", []), *template.properties(function).get("Layers", [])]
    return {template.properties(layer["Ref"])["ContentUri"].strip("/").split("/")[-1] for layer in layers}


@pytest.mark.parametrize("function", ["AdmissionFunction", "InboxRelayFunction", "OutboxRelayFunction"])
def test_no_function_loads_a_distribution_of_a_layer_it_does_not_have(template: Template, function: str) -> None:
    # Given the function's handler module imported in a fresh interpreter, as Lambda imports it
    code_uri = template.properties(function)["CodeUri"]
    probe = (
        f"import json, sys; sys.path[:0] = [{code_uri!r}, 'layers/poimen']; import app; "
        "print(json.dumps(list(sys.modules)))"
    )
    loaded = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    providers = importlib.metadata.packages_distributions()
    distributions = {_canonical(dist) for module in json.loads(loaded.stdout) for dist in providers.get(module, [])}
    layers = {"poimen", "kafka"}
    held = _function_layers(template, function)

    # Then it loaded nothing that only the layers it lacks would bring
    assert held <= layers
    foreign = set().union(*(_pinned(layer) for layer in layers - held)) - set().union(*(_pinned(h) for h in held))
    assert distributions & foreign == set()


def test_the_relay_handler_loads_without_pydantic() -> None:
    # Given the relay's handler module, imported in a fresh interpreter as Lambda imports it
    probe = (
        "import sys; sys.path[:0] = ['functions/inbox_relay', 'layers/poimen']; import app; "
        "print(sorted(m for m in ('pydantic', 'boto3', 'poimen.contract') if m in sys.modules))"
    )
    # When it is loaded
    loaded = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    # Then none of the modules that a third of its cold start went to are: it needs only poimen.wire
    assert loaded.stdout.strip() == "[]"
