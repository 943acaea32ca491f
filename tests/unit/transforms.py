"""template.yaml as CloudFormation gets it, offline: poimen_tools.sam_transform under the SAM CLI's interpreter
(as `make lint` runs it for checkov), each distinct transform run once per test run. Under pytest-xdist every
worker is a process of its own and would run it again (a transform costs seconds of CPU, the quotas' batch a
minute, on two cores shared by the workers): the first worker to ask runs it and writes its output to a folder
of the run's (tests/conftest.py, RUN_FOLDER), the others wait for that and read it. A worker's transforms are
answered by one `sam_transform.py --serve` of its own a Region, started at its first: the interpreter's start
and SAM's imports (a second of CPU each) are paid once a worker and Region, not once a transform; it ends when
the worker does (its input closed)."""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import json
import os
import subprocess
import threading
from pathlib import Path
from typing import Any, Literal

from tests.conftest import REPO, run_folder

SAM_PYTHON = REPO / ".venv-sam" / "bin" / "python"
SAM_TRANSFORM = REPO / "infra" / "poimen_tools" / "sam_transform.py"
TEMPLATE = REPO / "template.yaml"

_servers: dict[str, subprocess.Popen[str]] = {}
_asking = threading.Lock()  # one request at a time on a server's pipes


def _server(region: str) -> subprocess.Popen[str]:
    """This process's transform server for `region`, started at its first request."""
    if region not in _servers:
        log = run_folder("sam-transform") / f"server-{os.getpid()}-{region}.log"  # its warnings, and a crash's
        with log.open("w") as errors:
            _servers[region] = subprocess.Popen(
                [str(SAM_PYTHON), str(SAM_TRANSFORM), "--serve"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=errors,
                text=True,
                env={"PATH": "/usr/bin:/bin", "AWS_DEFAULT_REGION": region, "SAM_CLI_TELEMETRY": "0"},
            )
    return _servers[region]


@atexit.register
def _stop_servers() -> None:
    for server in _servers.values():
        assert server.stdin is not None
        server.stdin.close()  # its input ends: it returns
        server.wait()


def _ask(region: str, request: dict[str, Any]) -> str:
    """The output of one transform, from this process's server for `region`."""
    with _asking:
        server = _server(region)
        assert server.stdin is not None
        assert server.stdout is not None
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        line = server.stdout.readline()
    assert line, f"the transform server ended (its stderr: {run_folder('sam-transform')})"
    answer: dict[str, str] = json.loads(line)
    assert "error" not in answer, answer.get("error", "")[-3000:]
    return answer["output"]


def sam_transform(
    *parameters: str,
    region: str = "us-east-1",
    batch: str | None = None,
    kept: Literal["created", "declared", "both"] = "created",
    template: Path = TEMPLATE,
) -> str:
    """poimen_tools.sam_transform's output for `template` with `parameters` (NAME=VALUE), or for each
    scenario of `batch` (its --batch input, JSON), in `region`: only the resources the stack creates, every
    resource declared (`kept` "declared"), or both templates of each scenario from one expansion ("both", batch
    only); run by this process's server, or read from the run's folder where another worker wrote it."""
    assert SAM_PYTHON.exists(), "needs the SAM CLI venv: make .venv-sam/bin/sam (make test creates it)"
    # Everything the output depends on, so two tests asking for different transforms never share one.
    key = hashlib.sha256()
    every = (
        template.read_bytes(),
        SAM_TRANSFORM.read_bytes(),
        json.dumps([parameters, region, batch, kept]).encode(),
    )
    for part in every:
        key.update(hashlib.sha256(part).digest())
    output = run_folder("sam-transform") / f"{key.hexdigest()}.json"
    with output.with_suffix(".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one worker transforms; the others wait here, then read its output
        if output.exists():
            return output.read_text()
        request: dict[str, Any] = {"template": str(template)}
        if batch is None:
            request["parameters"] = dict(pair.split("=", 1) for pair in parameters)
        else:
            request.update(batch=json.loads(batch), kept=kept)
        text = _ask(region, request)
        partial = output.with_suffix(".partial")
        partial.write_text(text)
        partial.replace(output)
        return text
