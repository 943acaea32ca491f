"""The long API history (`make soak`): twelve clients send 20,000 operations (spawns keyed in the body or
the Idempotency-Key header, other requests for the same keys, keyless spawns, GETs by key and by id) on a
small rotating pool of keys to `poimen dev`, while a nemesis injects DynamoDB faults through a proxy
(answers held past the timeout, writes landing late, connections dropped, 500s before and after the
write, connections refused), and SIGKILLs `poimen dev`'s process group and restarts it on the same table
every cycle. Porcupine then checks the history (tests/history: every key, and every keyless run, a
first-writer-wins register; the table's final scan agreeing with every answer).

Run: `make soak`, or `.venv/bin/python -m benchmarks.history --ops 2000` for a quick one. Prints the
figures; on a violation the keys at fault and the path of Porcupine's HTML visualization. Exit codes: 0 the
history holds; 1 it does not; 2 the run could not be made (the stack did not start, a client failed, the
deadline passed: the one-line cause is printed); 130 interrupted (every process it started is stopped).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.harness import run_in_work_folder
from tests.history.check import CheckerMissing
from tests.history.nemesis import Plan
from tests.history.run import Options, RunFailed, record_and_check
from tests.history.stack import StackError


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", type=int, default=20_000, help="operations to send, at least (default: %(default)s)")
    parser.add_argument("--clients", type=int, default=12, help="concurrent clients (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=1, help="of the random choices (default: %(default)s)")
    parser.add_argument(
        "--kill-every", type=int, default=1, help="nemesis cycles between kills of poimen dev (default: %(default)s)"
    )
    parser.add_argument(
        "--deadline", type=float, default=7200.0, help="bound of the whole run, seconds (default: %(default)s)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the work folder (history, logs) when it holds")
    args = parser.parse_args()
    if min(args.ops, args.clients, args.kill_every) < 1:
        parser.error("--ops, --clients and --kill-every must be at least 1")
    options = Options(
        ops=args.ops,
        clients=args.clients,
        seed=args.seed,
        kills=1,
        plan=Plan(kill_every=args.kill_every),
        deadline_seconds=args.deadline,
    )

    def history(folder: Path) -> int:
        outcome = record_and_check(folder, options)
        print(f"\nAPI history: {args.clients} clients, seed {args.seed}, kill every {args.kill_every} cycle(s)\n")
        print(outcome.table())
        print(f"\n{'PASS' if outcome.report.ok else 'FAIL'}: {outcome.report.summary()}")
        return 0 if outcome.report.ok else 1

    return run_in_work_folder(
        "history",
        history,
        cannot_run=(StackError, RunFailed, CheckerMissing),
        cause="the run could not be made",
        kept="history and logs",
        keep=args.keep,
    )


if __name__ == "__main__":
    sys.exit(main())
