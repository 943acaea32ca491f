"""poimen_tools.sam_transform's ways of being run agree: what `--serve` answers (the tests' transforms,
tests/unit/transforms.py) is what its command line prints (`make lint`'s), `--both` is `--batch --declared` and the
created template of one expansion, and a request that fails is answered with its error, the next still served."""

from __future__ import annotations

import json
import subprocess
from typing import Any

from tests.unit.transforms import SAM_PYTHON, SAM_TRANSFORM, TEMPLATE

ENVIRONMENT = {"PATH": "/usr/bin:/bin", "AWS_DEFAULT_REGION": "us-east-1", "SAM_CLI_TELEMETRY": "0"}
# Multi-Region home mode: the single-Region table's Condition is false, so what is declared is not what is created.
GIVEN = {"Tenants": "acme,globex", "TableMode": "global-home", "PeerRegion1": "us-east-2", "PeerRegion2": "us-west-2"}


def _command(*arguments: str, given: str | None = None) -> str:
    result = subprocess.run(
        [str(SAM_PYTHON), str(SAM_TRANSFORM), *arguments],
        input=given,
        capture_output=True,
        text=True,
        check=False,
        env=ENVIRONMENT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_the_server_answers_what_the_command_line_prints() -> None:
    # Given the template transformed by the command line, one set of parameters and as a declared batch
    created = _command(str(TEMPLATE), *(f"{name}={value}" for name, value in GIVEN.items()))
    declared = json.loads(_command("--batch", "--declared", str(TEMPLATE), given=json.dumps([GIVEN])))

    # When a server is asked for the same, both from one expansion, a set that cannot expand, and the first again
    requests: list[dict[str, Any]] = [
        {"template": str(TEMPLATE), "parameters": GIVEN},
        {"template": str(TEMPLATE), "batch": [GIVEN], "kept": "both"},
        {"template": str(TEMPLATE), "parameters": {"Tenants": "a-b,ab"}},  # one logical id for two tenants
        {"template": str(TEMPLATE), "parameters": GIVEN},
    ]
    served = subprocess.run(
        [str(SAM_PYTHON), str(SAM_TRANSFORM), "--serve"],
        input="".join(json.dumps(request) + "\n" for request in requests),
        capture_output=True,
        text=True,
        check=True,
        env=ENVIRONMENT,
    )
    single, both, failed, again = (json.loads(line) for line in served.stdout.splitlines())

    # Then it answers each as the command line prints it, the failure with its error, and goes on serving
    assert single == again == {"output": created.removesuffix("\n")}
    assert json.loads(both["output"]) == [[declared[0], json.loads(created)]]
    assert declared[0]["Resources"].keys() != json.loads(created)["Resources"].keys()
    assert "conflict" in failed["error"]
