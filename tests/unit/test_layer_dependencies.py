"""The layer pins what its package imports: every third-party distribution that `poimen` imports is in
layers/poimen/requirements.txt, so `sam build` installs the version tested here rather than whatever the
Lambda runtime happens to carry (or nothing)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys

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


def test_every_distribution_the_layer_imports_is_pinned() -> None:
    providers = importlib.metadata.packages_distributions()
    third_party = _imported_modules() - set(sys.stdlib_module_names) - {"__future__", "poimen"}
    imported = {_canonical(dist) for module in third_party for dist in providers.get(module, [module])}
    lines = (REPO / "layers/poimen/requirements.txt").read_text().splitlines()
    requirements = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    pinned = {_canonical(line.split("==")[0]) for line in requirements if "==" in line}

    assert "botocore" in imported  # the relay's SQS client and SigV4 (botocore alone: boto3 costs cold start)
    assert imported - pinned == set()
    assert len(pinned) == len(requirements), "every layer requirement is pinned with =="


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
