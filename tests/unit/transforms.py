"""template.yaml as CloudFormation gets it, offline: poimen_tools.sam_transform under the SAM CLI's interpreter
(as `make lint` runs it for checkov), each distinct transform run once per test run. Under pytest-xdist every
worker is a process of its own and would run it again (a transform costs seconds of CPU, the quotas' batch a
minute, on two cores shared by the workers): the first worker to ask runs it and writes its output to a folder
of the run's (tests/conftest.py, RUN_FOLDER), the others wait for that and read it."""

from __future__ import annotations

import fcntl
import hashlib
import json
import subprocess
from pathlib import Path

from tests.conftest import REPO, run_folder

SAM_PYTHON = REPO / ".venv-sam" / "bin" / "python"
SAM_TRANSFORM = REPO / "infra" / "poimen_tools" / "sam_transform.py"
TEMPLATE = REPO / "template.yaml"


def sam_transform(
    *parameters: str,
    region: str = "us-east-1",
    batch: str | None = None,
    declared: bool = False,
    template: Path = TEMPLATE,
) -> str:
    """poimen_tools.sam_transform's output for `template` with `parameters` (NAME=VALUE), or for each
    scenario of `batch` (its --batch input, JSON), in `region`, every resource declared kept (`declared`) or
    only those the stack creates: run by this process, or read from the run's folder where another worker
    wrote it."""
    assert SAM_PYTHON.exists(), "needs the SAM CLI venv: make .venv-sam/bin/sam (make test creates it)"
    # Everything the output depends on, so two tests asking for different transforms never share one.
    key = hashlib.sha256()
    every = (
        template.read_bytes(),
        SAM_TRANSFORM.read_bytes(),
        json.dumps([parameters, region, batch, declared]).encode(),
    )
    for part in every:
        key.update(hashlib.sha256(part).digest())
    output = run_folder("sam-transform") / f"{key.hexdigest()}.json"
    with output.with_suffix(".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one worker transforms; the others wait here, then read its output
        if output.exists():
            return output.read_text()
        options = (["--batch"] if batch is not None else []) + (["--declared"] if declared else [])
        result = subprocess.run(
            [str(SAM_PYTHON), str(SAM_TRANSFORM), *options, str(template), *parameters],
            input=batch,
            capture_output=True,
            text=True,
            check=False,
            env={"PATH": "/usr/bin:/bin", "AWS_DEFAULT_REGION": region, "SAM_CLI_TELEMETRY": "0"},
        )
        assert result.returncode == 0, result.stderr[-3000:]
        partial = output.with_suffix(".partial")
        partial.write_text(result.stdout)
        partial.replace(output)
        return result.stdout
