"""The benchmarks stay runnable: each runs once on a tiny workload and prints its comparison figures."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.parametrize(
    ("module", "arguments", "figures"),
    [
        (
            "benchmarks.admission_bench",
            ["--admissions", "5", "--rounds", "1", "--import-rounds", "1"],
            # The cold-import table: both handlers side by side with the botocore.session baseline.
            [
                "ours / Powertools",
                "ours / same-item floor",
                "same-item / old floor",
                "admission handler",
                "x botocore.session",
                "functions/admission/app.py",
                "functions/inbox_relay/app.py",
            ],
        ),
        (
            "benchmarks.relay_bench",
            [
                *("--records", "20", "--rounds", "1", "--batch-size", "10", "--batches", "2", "--route-spawns", "20"),
                *("--store", "moto,dynalite"),
            ],
            # Both paths on each store engine, side by side in the one run.
            [
                "moto records/s",
                "dynalite records/s",
                "moto: Ratio batch path / per-record path",
                "dynalite: Ratio batch path / per-record path",
                "dynalite: A million relayed spawns",
                "Ratio relay / floor",
                "ms a record",
                "batch / single per spawn",
                "A million relayed spawns",
                # What bounds the ratio on a CPU-bound machine: each process's CPU a 1,000 records, each path.
                "moto: CPU s a 1,000 records, batch path",
                "dynalite: CPU s a 1,000 records, per-record path",
                "admission environments",
                "ours alone (no store CPU)",
            ],
        ),
        ("benchmarks.outbox_bench", ["--batches", "2", "--rounds", "1"], ["Ratio outbox / floor", "ms a record"]),
    ],
)
def test_benchmark_runs_and_prints_its_ratios(module: str, arguments: list[str], figures: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", module, *arguments], cwd=REPO, capture_output=True, text=True, timeout=300
    )

    assert result.returncode == 0, result.stderr[-2000:]
    for figure in figures:
        assert figure in result.stdout
