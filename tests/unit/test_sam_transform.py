"""poimen_tools.sam_transform's ways of being run agree: what `--serve` answers (the tests' transforms,
tests/unit/transforms.py) is what its command line prints (`make lint`'s), `--both` is `--batch --declared` and the
created template of one expansion, and a request that fails is answered with its error, the next still served; and a
worker's server never answers a request with another's answer, nor leaves a test waiting on it forever."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit import transforms
from tests.unit.transforms import SAM_PYTHON, SAM_TRANSFORM, TEMPLATE, sam_transform

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
        {"template": str(TEMPLATE), "parameters": GIVEN, "id": 1},
        {"template": str(TEMPLATE), "batch": [GIVEN], "kept": "both", "id": 2},
        {"template": str(TEMPLATE), "parameters": {"Tenants": "a-b,ab"}, "id": 3},  # one logical id for two tenants
        {"template": str(TEMPLATE), "parameters": GIVEN, "id": 4},
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

    # Then it answers each, by its id, as the command line prints it, the failure with its error, and goes on serving
    assert [answer.pop("id") for answer in (single, both, failed, again)] == [1, 2, 3, 4]
    assert single == again == {"output": created.removesuffix("\n")}
    assert json.loads(both["output"]) == [[declared[0], json.loads(created)]]
    assert declared[0]["Resources"].keys() != json.loads(created)["Resources"].keys()
    assert "conflict" in failed["error"]


@pytest.fixture
def servers(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """This test's own transform servers (tests/unit/transforms.py), stopped when it ends."""
    own: dict[str, Any] = {}
    monkeypatch.setattr(transforms, "_servers", own)
    yield own
    for server in own.values():
        server.kill()
        server.wait()


def _copy(tmp_path: Path, name: str) -> Path:
    """template.yaml under a name of the test's own, its bytes its own: no other test's transform is cached for it."""
    copy = tmp_path / "template.yaml"
    copy.write_text(TEMPLATE.read_text() + f"\n# {name}\n")
    return copy


def test_a_line_that_is_not_the_requests_answer_fails_it_and_the_next_is_served_fresh(
    servers: dict[str, Any], tmp_path: Path
) -> None:
    # Given a worker's server holding an answer no request of its is waiting for (a request left unread)
    template = _copy(tmp_path, "unread")
    sam_transform("Tenants=acme", template=template)
    servers["us-east-1"].stdin.write(json.dumps({"template": str(template), "parameters": {"Tenants": "zeta"}}) + "\n")
    servers["us-east-1"].stdin.flush()

    # When the worker asks for another transform, then again
    with pytest.raises(AssertionError, match="not the answer"):
        sam_transform("Tenants=globex", template=template)
    again = sam_transform("Tenants=globex", template=template)

    # Then the unread answer is never taken for it: that request fails, and the next is answered for itself
    assert "globex" in again
    assert "zeta" not in again


def test_a_server_that_died_fails_the_request_clearly_and_the_next_is_served_fresh(
    servers: dict[str, Any], tmp_path: Path
) -> None:
    # Given a worker's server killed between two requests
    template = _copy(tmp_path, "killed")
    sam_transform("Tenants=acme", template=template)
    servers["us-east-1"].kill()

    # When the worker asks for a transform, then again
    with pytest.raises(AssertionError, match="server ended"):
        sam_transform("Tenants=globex", template=template)
    again = sam_transform("Tenants=globex", template=template)

    # Then the first fails saying so, the next is answered by a fresh server, and the servers stop cleanly
    assert "globex" in again
    transforms._stop_servers()


def test_a_server_that_stops_answering_fails_the_request_within_its_time(
    servers: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a worker's server that stops answering (stopped, as a hung interpreter would be)
    template = _copy(tmp_path, "stopped")
    sam_transform("Tenants=acme", template=template)
    stopped = servers["us-east-1"]
    os.kill(stopped.pid, signal.SIGSTOP)
    monkeypatch.setattr(transforms, "ANSWER_WITHIN", 1.0)

    # When the worker asks for a transform, the test fails by itself rather than wait forever
    with pytest.raises(AssertionError, match="did not answer within"):
        sam_transform("Tenants=globex", template=template)

    # And that server is ended, no later request asking it
    assert stopped.wait(timeout=10) is not None
    assert "us-east-1" not in servers
