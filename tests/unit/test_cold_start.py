"""The admission function's INIT as the runtime runs it: importing its handler module, in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO

# Imports the handler as Lambda does (task root, then the layer), noting each run of the collector once the
# libraries began loading (one may run while app.py itself loads, before its first line).
_PROBE = """
import gc, json, sys
sys.path[:0] = ["functions/admission", "layers/poimen"]
collections = []
gc.callbacks.append(
    lambda phase, info: phase == "start" and "aws_lambda_powertools" in sys.modules and collections.append(info)
)
import app
print(json.dumps({
    "collections": collections,
    "enabled": gc.isenabled(),
    "frozen": gc.get_freeze_count(),
    "tracked": len(gc.get_objects()),
    "modules": len(sys.modules),
}))
"""


def test_the_admission_handlers_import_runs_no_collection_and_leaves_its_objects_frozen() -> None:
    # Given the admission handler module imported in a fresh interpreter, as the runtime's INIT imports it
    loaded = subprocess.run([sys.executable, "-c", _PROBE], cwd=REPO, capture_output=True, text=True, check=True)
    seen = json.loads(loaded.stdout)

    # Then the collector never ran while its modules loaded (41 collections under python3.13 before, a tenth of INIT),
    assert seen["collections"] == [], seen
    # and it is on again, the import's objects in the permanent generation that no later collection scans
    assert seen["enabled"] is True
    assert seen["modules"] > 500
    assert seen["frozen"] > 10 * seen["tracked"], seen


# The same import, one of the handler's modules failing to load (None in sys.modules: its import raises ImportError),
# in a process that goes on after it, as a test's or a local loader's does (Lambda's runtime exits on an INIT error).
_FAILING_PROBE = """
import gc, json, sys
sys.path[:0] = ["functions/admission", "layers/poimen"]
sys.modules["poimen.api"] = None
try:
    import app
except ImportError as error:
    print(json.dumps({"error": str(error), "enabled": gc.isenabled()}))
"""


def test_a_failed_import_of_the_admission_handler_leaves_the_collector_on() -> None:
    # Given the handler module imported in a fresh interpreter, one of its modules failing to load
    loaded = subprocess.run(
        [sys.executable, "-c", _FAILING_PROBE], cwd=REPO, capture_output=True, text=True, check=True
    )
    seen = json.loads(loaded.stdout)

    # Then the import failed, and the process goes on with its cyclic collector on, not off for the rest of its life
    assert "poimen.api" in seen["error"]
    assert seen["enabled"] is True, seen
