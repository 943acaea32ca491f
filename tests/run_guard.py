"""Every test a run selects runs: two selected tests under one node id, or a selected test that never runs, fail
the run in one line. pytest-xdist keys the work it hands out by node id, so tests sharing one collapse into one
silently (Schemathesis's three operations did, under `--dist loadgroup`), and the summary counts only what ran.
Registered by tests/conftest.py in the process that judges the run: a serial run's, or the pytest-xdist
controller's (its workers collect and run; it sees each worker's collection and every test's end). Imports
nothing of the project, so that tests/unit/test_run_guard.py runs it on a folder of its own."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest

PREFIX = "run guard"


def install(config: pytest.Config) -> None:
    """Register the guard unless this process is a pytest-xdist worker."""
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(RunGuard(config), "poimen-run-guard")


class RunGuard:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.selected: list[str] | None = None  # the node ids selected (collected, less the deselected)
        self.ran: Counter[str] = Counter()
        self.verdict: str | None = None

    def _judge_collection(self, ids: Sequence[str]) -> None:
        repeated = [nodeid for nodeid, count in Counter(ids).items() if count > 1]
        if repeated:
            # Before anything runs: under pytest-xdist only one item of each id would.
            pytest.exit(
                f"{PREFIX}: {len(repeated)} node id(s) name more than one collected test, such as {repeated[0]!r}: "
                "pytest-xdist would run one of each; give each test an id of its own",
                returncode=pytest.ExitCode.INTERRUPTED,
            )
        if self.selected is None:  # each worker's collection is the same one (pytest-xdist checks that)
            self.selected = list(ids)

    @pytest.hookimpl(trylast=True)  # after every deselection (-k, -m, --deselect, --lf)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self._judge_collection([item.nodeid for item in session.items])

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: Any, ids: Sequence[str]) -> None:
        self._judge_collection(ids)

    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        # Once a test that ran (its set-up, call and teardown reported, a skip or an error included), in the
        # controller as in a serial run; subtests' reports of one test (Schemathesis's cases) do not add to it.
        self.ran[nodeid] += 1

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # pytest-xdist's report of a test whose worker crashed (`when` "???", outside pytest's types): a failure, and
        # the test's end.
        if str(report.when) == "???":
            self.ran[report.nodeid] += 1

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        stopped = session.shouldstop or session.shouldfail  # -x, --maxfail: the rest not run, and said so
        ended = exitstatus in (pytest.ExitCode.INTERRUPTED, pytest.ExitCode.INTERNAL_ERROR, pytest.ExitCode.USAGE_ERROR)
        if self.selected is None or stopped or ended or self.config.option.collectonly:
            return
        ran = self.ran.copy()
        missing = []
        for nodeid in self.selected:  # one to one: an id selected twice must have run twice
            if ran[nodeid] > 0:
                ran[nodeid] -= 1
            else:
                missing.append(nodeid)
        if not missing:
            return
        self.verdict = (
            f"{PREFIX}: {len(self.selected) - len(missing)} of {len(self.selected)} selected tests ran; "
            f"{len(missing)} never ran, such as {missing[0]!r}"
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if self.config.pluginmanager.get_plugin("terminalreporter") is None:
            print(self.verdict, file=sys.stderr)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        # Just above the summary line, which counts only what ran.
        if self.verdict is not None:
            terminalreporter.write_line(self.verdict, red=True, bold=True)
