"""The history checker (the Go program in this folder, Porcupine inside), run on a history file, and its
report: what was checked, and each failure named by its check and its key."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
# Built by `make history-check` (a prerequisite of `make test` and `make soak`).
CHECKER = REPO / ".cache" / "bin" / "poimen-history-check"
SOURCES = ("go.mod", "go.sum", "main.go", "history.go", "model.go", "check.go")


class CheckerMissing(RuntimeError):
    """The checker is not built, or older than its sources."""


@dataclass(frozen=True)
class Failure:
    check: str
    key: str
    detail: str
    ops: tuple[int, ...] = ()


@dataclass
class Report:
    ok: bool
    ops: int
    not_sent: int
    indeterminate: int
    reads_without_answer: int
    answers: dict[str, int]
    keys: int
    keyless_runs: int
    partitions: int
    scanned_runs: int
    fences: int
    checker_seconds: float
    failures: list[Failure] = field(default_factory=list)
    visualization: str | None = None

    @classmethod
    def parse(cls, text: str) -> Report:
        fields: dict[str, Any] = json.loads(text)
        failures = [Failure(f["check"], f["key"], f["detail"], tuple(f.get("ops") or ())) for f in fields["failures"]]
        return cls(**{**fields, "failures": failures})

    def keys_at_fault(self) -> list[str]:
        return sorted({failure.key for failure in self.failures if failure.key})

    def summary(self) -> str:
        """What a person reads: the verdict, the keys at fault and where the visualization is."""
        if self.ok:
            return (
                f"history holds: {self.ops} ops ({self.indeterminate} indeterminate), {self.keys} keys, "
                f"{self.keyless_runs} keyless runs, checked in {self.checker_seconds:.2f} s"
            )
        lines = [f"history check FAILED: {len(self.failures)} violations, keys {', '.join(self.keys_at_fault())}"]
        lines += failure_lines(self.failures)
        if self.visualization:
            lines.append(f"  Porcupine's visualization: {self.visualization}")
        return "\n".join(lines)


def failure_lines(failures: list[Failure], shown: int = 20) -> list[str]:
    """The violations as a report lists them, one a line (check, key, detail), the first `shown` of them."""
    lines = [f"  {failure.check} {failure.key}: {failure.detail}" for failure in failures[:shown]]
    if len(failures) > shown:
        lines.append(f"  ... and {len(failures) - shown} more")
    return lines


def checker() -> Path:
    """The checker's path, once it is built from the sources as they are."""
    if not CHECKER.exists():
        raise CheckerMissing(f"{CHECKER} is not built: run `make history-check`")
    built = CHECKER.stat().st_mtime
    stale = [name for name in SOURCES if (HERE / name).stat().st_mtime > built]
    if stale:
        raise CheckerMissing(f"{CHECKER} is older than tests/history/{stale[0]}: run `make history-check`")
    return CHECKER


def check(history: Path, visualization: Path | None = None, timeout_seconds: float = 60.0) -> Report:
    """Check `history`; on a violation the HTML visualization goes to `visualization` (default: beside it)."""
    visualization = visualization or history.with_suffix(".html")
    result = subprocess.run(
        [str(checker()), "-visualization", str(visualization), "-timeout", f"{timeout_seconds}s", str(history)],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode not in (0, 1):
        raise RuntimeError(f"the history checker could not read {history}: {result.stderr.strip()}")
    return Report.parse(result.stdout)
