"""tests/run_guard.py refuses what it must: a collection with two tests of one node id, and a run in which a
selected test never runs, serially and under pytest-xdist, each in one line and a failing exit code; and passes a
run that deselects tests (-k), skips one, stops at its first failure (-x) or loses a worker to a crash. Each case
runs pytest on a folder of its own, with the guard and nothing else of this suite (no plugin but pytest-xdist, so
a run starts in about half a second, two workers in a few)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO

CONFTEST = """
import pytest

from tests.run_guard import install


def pytest_configure(config):
    install(config)


class Same(pytest.Item):
    def runtest(self):
        pass


class TwoOfOneId(pytest.File):
    # Two tests under one node id, as Schemathesis's operations were under pytest 9.2.
    def collect(self):
        for name in ("first", "second"):
            yield Same.from_parent(self, name=name, nodeid=f"{self.nodeid}::same")


def pytest_collect_file(file_path, parent):
    if file_path.name == "duplicates.txt":
        return TwoOfOneId.from_parent(parent, path=file_path)
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    # Handed out and never run, reporting nothing: as a scheduler that lost a test would.
    return True if item.name == "test_dropped" else None
"""

TESTS = """
import pytest


def test_fails():
    raise AssertionError("fails")


def test_runs():
    pass


def test_dropped():
    pass


@pytest.mark.skip(reason="reported as skipped, not dropped")
def test_skipped():
    pass


def test_crashes_its_worker():
    import os

    os._exit(1)
"""


@dataclass
class Run:
    code: int
    out: str

    @property
    def guard_lines(self) -> list[str]:
        return [line for line in self.out.splitlines() if "run guard:" in line]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("guarded")
    (root / "pytest.ini").write_text("[pytest]\n")
    (root / "conftest.py").write_text(CONFTEST)
    (root / "test_some.py").write_text(TESTS)
    (root / "duplicates.txt").write_text("")
    return root


def pytest_run(folder: Path, *argv: str) -> Run:
    # Only pytest-xdist of the installed plugins; the guard imported from this checkout.
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONPATH": str(REPO)}
    env.pop("PYTEST_ADDOPTS", None)
    argv = ("-p", "xdist", "-p", "no:cacheprovider", *argv)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *argv],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return Run(done.returncode, done.stdout + done.stderr)


@pytest.mark.parametrize("workers", ["0", "2"])
def test_two_tests_of_one_node_id_fail_the_run_before_it_starts(folder: Path, workers: str) -> None:
    run = pytest_run(folder, "-n", workers, "duplicates.txt", "test_some.py::test_runs")

    assert run.code == pytest.ExitCode.INTERRUPTED, run.out
    assert len(run.guard_lines) == 1, run.out
    assert "1 node id(s) name more than one collected test, such as 'duplicates.txt::same'" in run.guard_lines[0]
    assert " passed" not in run.out, run.out


@pytest.mark.parametrize("workers", ["0", "2"])
def test_a_selected_test_that_never_runs_fails_the_run(folder: Path, workers: str) -> None:
    run = pytest_run(folder, "-n", workers, "--dist", "loadgroup", "test_some.py", "-k", "not fails and not crashes")

    assert run.code == pytest.ExitCode.TESTS_FAILED, run.out
    assert run.guard_lines == [
        "run guard: 2 of 3 selected tests ran; 1 never ran, such as 'test_some.py::test_dropped'"
    ], run.out
    assert "1 passed, 1 skipped" in run.out  # all that the summary says of such a run


@pytest.mark.parametrize(
    "argv",
    [
        # Deselected tests are not selected; a skipped one reported its outcome.
        ["-n", "0", "-k", "not dropped and not fails and not crashes"],
        # A run that stops at its first failure says so itself (exit 1): the tests after it were not dropped.
        ["-n", "0", "-x", "-k", "not dropped and not crashes"],
        # A test whose pytest-xdist worker crashed is reported as failed (exit 1), and the others run on.
        ["-n", "2", "-k", "crashes or runs"],
    ],
    ids=["deselected-and-skipped", "stopped-at-first-failure", "a-worker-crashed"],
)
def test_a_run_that_selects_fewer_tests_or_stops_is_not_refused(folder: Path, argv: list[str]) -> None:
    run = pytest_run(folder, "test_some.py", *argv)

    assert run.guard_lines == [], run.out
    failed = "-x" in argv or "crashes or runs" in argv
    assert run.code == (pytest.ExitCode.TESTS_FAILED if failed else pytest.ExitCode.OK), run.out
