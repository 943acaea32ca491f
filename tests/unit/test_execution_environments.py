"""The local execution environments (poimen_tools.local.devserver.ExecutionEnvironments) as Lambda's: an
environment that dies is replaced, and its death fails only the invocation it was running; an invocation past
the function's timeout is ended; each function's environment has its own variables from the template."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from poimen_tools.local.devserver import ExecutionEnvironments, InvocationTimedOut
from poimen_tools.local.template import Template, default_template_path
from tests.conftest import wait_for

TEMPLATE = """\
Globals:
  Function:
    Timeout: 30
    Environment:
      Variables:
        POWERTOOLS_METRICS_NAMESPACE: Probes
Resources:
  Probe:
    Type: AWS::Serverless::Function
    Properties:
      CodeUri: probe/
      Handler: app.handler
      Environment:
        Variables:
          POWERTOOLS_SERVICE_NAME: poimen-probe
  BriefProbe:
    Type: AWS::Serverless::Function
    Properties:
      CodeUri: probe/
      Handler: app.handler
      Timeout: 1
"""
# A handler that answers with its process, and can wait for a file, or end its environment, when asked.
HANDLER = """\
import os
import time
from pathlib import Path


def handler(event, context):
    if event.get("variables"):
        return {name: os.environ.get(name) for name in event["variables"]}
    if event.get("sleep"):
        Path(event["sleep"]).write_text(str(os.getpid()))
        time.sleep(60)
    if event.get("started"):
        Path(event["started"]).touch()
        while not Path(event["release"]).exists():
            time.sleep(0.05)
    if event.get("exit"):
        os._exit(1)
    return {"pid": os.getpid()}
"""


@pytest.fixture
def template_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The probes' template, in a process whose environment holds another function's service name (as `poimen
    dev`'s holds admission's, which every environment it starts inherits)."""
    (tmp_path / "probe").mkdir()
    (tmp_path / "probe" / "app.py").write_text(HANDLER)
    (tmp_path / "template.yaml").write_text(TEMPLATE)
    monkeypatch.setenv("POWERTOOLS_SERVICE_NAME", "poimen-admission")
    return tmp_path / "template.yaml"


@contextlib.contextmanager
def _started(template_path: Path, logical_id: str, concurrency: int) -> Iterator[ExecutionEnvironments]:
    started = ExecutionEnvironments(str(template_path), logical_id, concurrency)
    started.start()
    try:
        started.wait_ready()
        yield started
    finally:
        started.close()


@pytest.fixture
def environments(template_path: Path) -> Iterator[ExecutionEnvironments]:
    with _started(template_path, "Probe", 2) as started:
        yield started


def _gone(pid: int) -> bool:
    """The process ended and was reaped (by the pool that watched it: it has seen the death)."""
    return not Path(f"/proc/{pid}").exists()


def test_an_environment_killed_while_idle_is_replaced_and_invocations_are_answered(
    environments: ExecutionEnvironments,
) -> None:
    # Given an environment killed (kill -9) between invocations, and its death seen
    killed = environments.invoke({})["pid"]
    os.kill(killed, signal.SIGKILL)
    wait_for(lambda: _gone(killed), timeout=30, what="the killed environment to be reaped")

    # When the function is invoked again, several times
    answers = [environments.invoke({}) for _ in range(4)]

    # Then every invocation is answered, none by the dead environment, as Lambda starts a new one
    assert len(answers) == 4
    assert killed not in {answer["pid"] for answer in answers}


def test_an_environment_dying_mid_invocation_fails_that_invocation_only(
    environments: ExecutionEnvironments, tmp_path: Path
) -> None:
    # Given one invocation running in one environment
    started, release = tmp_path / "started", tmp_path / "release"
    with ThreadPoolExecutor(max_workers=1) as other:
        running = other.submit(environments.invoke, {"started": str(started), "release": str(release)})
        wait_for(started.exists, timeout=30, what="the first invocation to start")

        # When the other environment's invocation ends its process (a crash, an out-of-memory kill)
        with pytest.raises(Exception) as crashed:  # noqa: PT011 - whatever the runtime's death raises
            environments.invoke({"exit": True})
        release.touch()

        # Then only that invocation failed: the one running beside it is answered
        answered: dict[str, Any] = running.result(timeout=30)
    assert crashed.value is not None
    assert answered["pid"] > 0
    # And the function is still invoked, from a new environment in place of the dead one
    assert all(environments.invoke({})["pid"] > 0 for _ in range(3))


def test_concurrent_invocations_after_a_death_are_all_answered(environments: ExecutionEnvironments) -> None:
    # Given an environment killed while idle
    killed = environments.invoke({})["pid"]
    os.kill(killed, signal.SIGKILL)
    wait_for(lambda: _gone(killed), timeout=30, what="the killed environment to be reaped")

    # When several callers invoke at once (the API's request threads, the relay's topic batches)
    barrier = threading.Barrier(4, timeout=30)

    def invoke() -> int:
        barrier.wait()
        pid: int = environments.invoke({})["pid"]
        return pid

    with ThreadPoolExecutor(max_workers=4) as callers:
        pids = list(callers.map(lambda _: invoke(), range(4)))

    # Then each is answered
    assert len(pids) == 4
    assert killed not in pids


def test_an_invocation_past_the_functions_timeout_is_ended_and_fails(template_path: Path, tmp_path: Path) -> None:
    # Given a function whose timeout is 1 s, in one execution environment
    with _started(template_path, "BriefProbe", 1) as environments:
        # When an invocation runs longer (a minute)
        pid_file = tmp_path / "slow"
        began = time.monotonic()
        with pytest.raises(InvocationTimedOut):
            environments.invoke({"sleep": str(pid_file)})
        ended = time.monotonic() - began

        # Then it fails at its timeout, and its process is ended, as Lambda ends it and resets the environment
        assert 1.0 <= ended < 10.0
        killed = int(pid_file.read_text())
        wait_for(lambda: _gone(killed), timeout=30, what="the timed-out environment to end")
        # And the next invocation is answered by a new environment
        assert environments.invoke({})["pid"] not in (0, killed)


def test_each_function_has_its_own_variables_from_the_template(environments: ExecutionEnvironments) -> None:
    # Given the probe's environments, started by a process holding another function's service name

    # When the probe reads its variables
    variables = environments.invoke({"variables": ["POWERTOOLS_SERVICE_NAME", "POWERTOOLS_METRICS_NAMESPACE"]})

    # Then they are the template's for this function (its own and the Globals'), as Lambda sets them
    assert variables == {"POWERTOOLS_SERVICE_NAME": "poimen-probe", "POWERTOOLS_METRICS_NAMESPACE": "Probes"}
    # And its timeout is the function's (Globals' here)
    assert environments.timeout_seconds == 30


def test_a_function_gets_no_variable_the_template_gives_only_another_function(template_path: Path) -> None:
    # Given a process holding another function's variable (as `poimen dev`'s holds admission's TABLE_NAME and
    # service name), and a function whose template declares no such variable
    with _started(template_path, "BriefProbe", 1) as environments:
        # When the function reads it
        variables = environments.invoke({"variables": ["POWERTOOLS_SERVICE_NAME", "POWERTOOLS_METRICS_NAMESPACE"]})

    # Then it is unset, as Lambda sets a function only its own variables (the relay cannot learn admission's
    # table from its environment, as on AWS), and the Globals' are set
    assert variables == {"POWERTOOLS_SERVICE_NAME": None, "POWERTOOLS_METRICS_NAMESPACE": "Probes"}
    # And so the relay's (in `poimen dev`, whose process holds admission's) have none of admission's own
    relay_unset = Template(default_template_path()).other_functions_variables("InboxRelayFunction")
    assert {"TABLE_NAME", "TENANTS", "RELAY_PRINCIPAL"} <= relay_unset
