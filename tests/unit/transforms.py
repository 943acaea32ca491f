"""template.yaml as CloudFormation gets it, offline: poimen_tools.sam_transform under the SAM CLI's interpreter
(as `make lint` runs it for checkov), each distinct transform run once per test run. Under pytest-xdist every
worker is a process of its own and would run it again (a transform costs seconds of CPU, the quotas' batch a
minute, on two cores shared by the workers): the first worker to ask runs it and writes its output to a folder
of the run's (tests/conftest.py, RUN_FOLDER), the others wait for that and read it. A worker's transforms are
answered by one `sam_transform.py --serve` of its own a Region, started at its first: the interpreter's start
and SAM's imports (a second of CPU each) are paid once a worker and Region, not once a transform; it ends when
the worker does (its input closed). Each answer names its request, and a request that fails but by its answer (the
server ended, answered something else, or not within ANSWER_WITHIN) ends the server: no later request can read an
answer that was not its own, and no test waits on a server forever."""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import itertools
import json
import os
import queue
import subprocess
import threading
from pathlib import Path
from typing import Any, Literal

from tests.conftest import REPO, run_folder

SAM_PYTHON = REPO / ".venv-sam" / "bin" / "python"
SAM_TRANSFORM = REPO / "infra" / "poimen_tools" / "sam_transform.py"
TEMPLATE = REPO / "template.yaml"

# Seconds a server has to answer: the quotas' batch of 45 scenarios is about a minute of CPU, more on two loaded
# cores; a server that stops answering fails its test in this time rather than leave the run waiting on it forever.
ANSWER_WITHIN = 600.0

_servers: dict[str, subprocess.Popen[str]] = {}
_lines: dict[subprocess.Popen[str], queue.Queue[str]] = {}  # each server's output lines, read as they come
_asking = threading.Lock()  # one request at a time on a server's pipes
_numbers = itertools.count()  # each request's id, echoed by its answer


def _server(region: str) -> subprocess.Popen[str]:
    """This process's transform server for `region`, started at its first request."""
    if region not in _servers:
        log = run_folder("sam-transform") / f"server-{os.getpid()}-{region}.log"  # its warnings, and a crash's
        with log.open("a") as errors:  # a server that replaces one ended keeps its predecessor's log
            server = subprocess.Popen(
                [str(SAM_PYTHON), str(SAM_TRANSFORM), "--serve"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=errors,
                text=True,
                env={"PATH": "/usr/bin:/bin", "AWS_DEFAULT_REGION": region, "SAM_CLI_TELEMETRY": "0"},
            )
        _lines[server] = queue.Queue()
        threading.Thread(target=_read, args=(server, _lines[server]), daemon=True).start()
        _servers[region] = server
    return _servers[region]


def _read(server: subprocess.Popen[str], lines: queue.Queue[str]) -> None:
    """Every line `server` prints, then "" when its output ends."""
    assert server.stdout is not None
    for line in server.stdout:
        lines.put(line)
    lines.put("")


def _forget(region: str) -> None:
    """End `region`'s server: whatever it is doing or has yet to print, no later request reads it."""
    server = _servers.pop(region)
    del _lines[server]
    server.kill()
    server.wait()
    assert server.stdin is not None
    with contextlib.suppress(BrokenPipeError):  # a request it never read
        server.stdin.close()


@atexit.register
def _stop_servers() -> None:
    for region, server in list(_servers.items()):
        assert server.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # one that died since its last answer
            server.stdin.close()  # its input ends: it returns
        try:
            server.wait(timeout=ANSWER_WITHIN)
        except subprocess.TimeoutExpired:
            _forget(region)


def _ended() -> str:
    return f"the transform server ended (its stderr: {run_folder('sam-transform')})"


def _answer(region: str, number: int) -> dict[str, Any]:
    """The answer to request `number` from `region`'s server, within ANSWER_WITHIN seconds."""
    try:
        line = _lines[_servers[region]].get(timeout=ANSWER_WITHIN)
    except queue.Empty:
        raise AssertionError(f"the transform server did not answer within {ANSWER_WITHIN} s") from None
    assert line, _ended()
    answer: dict[str, Any] = json.loads(line)
    assert answer.get("id") == number, f"not the answer to request {number}: {line[:300]}"
    return answer


def _ask(region: str, request: dict[str, Any]) -> str:
    """The output of one transform, from this process's server for `region`; a request that fails any way but
    by its answer (the server ended, did not answer, answered another) ends the server, the next starts one."""
    with _asking:
        server = _server(region)
        number = next(_numbers)
        assert server.stdin is not None
        try:
            try:
                server.stdin.write(json.dumps({**request, "id": number}) + "\n")
                server.stdin.flush()
            except BrokenPipeError:  # it ended since its last answer
                raise AssertionError(_ended()) from None
            answer = _answer(region, number)
        except BaseException:
            _forget(region)
            raise
    assert "error" not in answer, answer["error"][-3000:]
    output: str = answer["output"]
    return output


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
