"""One history, recorded and checked: the stack up, the clients and the nemesis running until enough
operations were sent (and the nemesis killed `poimen dev` often enough), everything stopped, the table
scanned once nothing can write any more, the history written and checked."""

from __future__ import annotations

import random
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tests.history.check import Report, check
from tests.history.history import History, now
from tests.history.nemesis import Nemesis, Plan
from tests.history.stack import stack
from tests.history.workload import KeyPool, Target, Workload
from tests.integration.conftest import wait_for
from tests.integration.dynamodb_proxy import HANG_UP_WAIT_SECONDS


@dataclass(frozen=True)
class Options:
    ops: int = 2_000  # operations sent, at least
    clients: int = 12
    # poimen dev's execution environments: admissions racing on DynamoDB at once. Each restart starts
    # them all (two cores: about 10 s for 2, 20 s for 4).
    concurrency: int = 3
    seed: int = 1
    live_keys: int = 4
    uses_per_key: int = 30
    faults: bool = True  # False: no nemesis (the broken admission needs none to show)
    kills: int = 2  # at least, with faults
    plan: Plan = field(default_factory=Plan)
    strip_condition: bool = False  # the proxy removes the run write's condition: a broken admission
    deadline_seconds: float = 900.0


class RunFailed(RuntimeError):
    """The run itself went wrong (a client's bug, the deadline): no history to judge."""


@dataclass
class Outcome:
    report: Report
    history: Path
    seconds: float
    kills: int
    refusals: int
    injected: dict[str, int]

    def figures(self) -> list[tuple[str, str]]:
        report = self.report
        answers = report.answers
        return [
            ("operations sent", f"{report.ops}  (refused, not sent: {report.not_sent})"),
            ("indeterminate spawns", f"{report.indeterminate}"),
            ("reads without an answer", f"{report.reads_without_answer}"),
            ("store-unavailable answers", f"{sum(n for a, n in answers.items() if a.endswith('store-unavailable'))}"),
            ("outcome-unknown answers", f"{sum(n for a, n in answers.items() if a.endswith('outcome-unknown'))}"),
            ("keys (tenant/dispatch_key)", f"{report.keys}"),
            ("keyless runs named by answers", f"{report.keyless_runs}"),
            ("runs in the table (final scan)", f"{report.scanned_runs}, fences {report.fences}"),
            ("kill -9 of poimen dev", f"{self.kills}"),
            ("connection refusals", f"{self.refusals}"),
            ("DynamoDB faults injected", ", ".join(f"{kind} {n}" for kind, n in sorted(self.injected.items())) or "0"),
            ("wall time of the run (s)", f"{self.seconds:.0f}"),
            ("checker time (s)", f"{report.checker_seconds:.2f}"),
        ]

    def table(self) -> str:
        return "\n".join(f"{name:32} {value}" for name, value in self.figures())


def record_and_check(folder: Path, options: Options) -> Outcome:
    """Record one history under `options` in `folder` (history.jsonl, poimen dev's logs) and check it."""
    started = time.monotonic()
    tenant = f"h-{uuid.uuid4().hex[:10]}"
    history = History({"tenant": tenant, **asdict(options)})
    rng = random.Random(options.seed)
    with stack(folder, options.concurrency, tenant) as system:
        system.proxy.strip_condition = options.strip_condition
        pool = KeyPool(options.live_keys, options.uses_per_key)
        workload = Workload(Target(system.dev.url, tenant), history, options.clients, options.seed, pool)
        nemesis = Nemesis(system, history, rng, options.plan)

        def enough() -> bool:
            failure = workload.failure or (nemesis.failure and f"the nemesis failed: {nemesis.failure!r}")
            if failure:
                raise RunFailed(failure)
            return history.sent() >= options.ops and (not options.faults or nemesis.kills >= options.kills)

        workload.start()
        if options.faults:
            nemesis.start()
        try:
            wait_for(enough, timeout=options.deadline_seconds, what=f"{options.ops} operations")
        except AssertionError as error:
            raise RunFailed(f"{error} ({history.sent()} sent, {nemesis.kills} kills)") from error
        finally:
            if options.faults:
                nemesis.stop()
            workload.stop()
        system.dev.stop()
        # Whatever the proxy still holds lands (or is dropped) before the scan: after it, nothing can write.
        wait_for(system.proxy.idle, timeout=2 * HANG_UP_WAIT_SECONDS + 10, what="the proxy's held requests")
        scan_at = now()
        runs, fences = system.scan(tenant)
    path = folder / "history.jsonl"
    history.write(path, scan_at, runs, fences)
    report = check(path)
    injected = dict(system.proxy.injected)
    return Outcome(report, path, time.monotonic() - started, nemesis.kills, system.proxy.refusals, injected)
