"""infra/asyncapi.yaml through the official AsyncAPI parser (@asyncapi/parser from npm, pinned in the Makefile,
`make asyncapi-parser`): no error; its warnings, information and hints are reported, not hidden."""

from __future__ import annotations

import json
import subprocess
import warnings
from pathlib import Path
from typing import Any

import yaml

from tests.asyncapi_contract import ASYNCAPI, document
from tests.conftest import REPO

PARSER = REPO / ".cache" / "asyncapi-parser"
SCRIPT = REPO / "tests" / "asyncapi_parse.cjs"
ERROR = 0  # the parser's DiagnosticSeverity (Spectral's): 0 error, 1 warning, 2 information, 3 hint


def _diagnostics(path: Path) -> list[dict[str, Any]]:
    assert (PARSER / "node_modules" / "@asyncapi" / "parser").is_dir(), (
        "@asyncapi/parser is not installed: run `make asyncapi-parser`"
    )
    parsed = subprocess.run(
        ["node", str(SCRIPT), str(PARSER), str(path)], capture_output=True, text=True, timeout=120, check=True
    )
    found: list[dict[str, Any]] = json.loads(parsed.stdout)
    return found


def test_the_asyncapi_parser_finds_no_error_in_the_document() -> None:
    diagnostics = _diagnostics(ASYNCAPI)

    for diagnostic in diagnostics:
        if diagnostic["severity"] != ERROR:
            where = "/".join(str(part) for part in diagnostic["path"])
            warnings.warn(f"AsyncAPI parser, {diagnostic['code']} at {where}: {diagnostic['message']}", stacklevel=1)
    assert [d for d in diagnostics if d["severity"] == ERROR] == []


def test_the_parser_is_not_vacuous_a_dangling_reference_is_an_error(tmp_path: Path) -> None:
    # Given the document with its events channel naming a message that does not exist
    broken = document() | {"channels": {**document()["channels"]}}
    broken["channels"]["events"] = {
        **broken["channels"]["events"],
        "messages": {"runAdmitted": {"$ref": "#/components/messages/noSuchMessage"}},
    }
    path = tmp_path / "asyncapi.yaml"
    path.write_text(yaml.safe_dump(broken, sort_keys=False))

    # Then the parser reports it as an error
    errors = [d for d in _diagnostics(path) if d["severity"] == ERROR]
    assert any("noSuchMessage" in json.dumps(error) for error in errors), errors
