"""infra/asyncapi.yaml as a validator of Kafka records: key, headers and value of each message it describes."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import yaml
from jsonschema import Draft7Validator  # type: ignore[import-untyped]
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7

from tests.conftest import REPO

ASYNCAPI = REPO / "infra" / "asyncapi.yaml"
_BASE = "urn:poimen:asyncapi"


@cache
def document() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(ASYNCAPI.read_text())
    return loaded


def _validator(pointer: str) -> Draft7Validator:
    """A validator for the schema at `pointer` in the document, its $refs resolved within the document."""
    registry: Registry[Any] = Registry().with_resource(
        _BASE, Resource.from_contents(document(), default_specification=DRAFT7)
    )
    return Draft7Validator({"$ref": f"{_BASE}#{pointer}"}, registry=registry)


def record_errors(message: str, key: bytes | None, headers: dict[str, bytes], value: bytes) -> list[str]:
    """Why a Kafka record is not a valid `message` (components/messages/<message>); [] when it is."""
    base = f"/components/messages/{message}"
    errors = [f"key: {e.message}" for e in _validator(f"{base}/bindings/kafka/key").iter_errors(_text(key))]
    text_headers = {name: raw.decode() for name, raw in headers.items()}
    errors += [f"headers: {e.message}" for e in _validator(f"{base}/headers").iter_errors(text_headers)]
    payload = json.loads(value)
    errors += [f"value: {e.message}" for e in _validator(f"{base}/payload").iter_errors(payload)]
    if message == "runAdmitted" and isinstance(payload, dict):
        errors += _event_errors(key, text_headers, payload)
    return errors


def _event_errors(key: bytes | None, headers: dict[str, str], run: dict[str, Any]) -> list[str]:
    """What the document says of an event in prose, which its schemas cannot: its subject, time and key are
    the run's, and its id is not the run's (it names the admission)."""
    expected = {
        "ce_subject": run.get("run_id"),
        "ce_time": run.get("created_at"),
        "key": f"{run.get('tenant_id')}/{run.get('run_id')}",
    }
    actual = {**headers, "key": _text(key)}
    errors = [
        f"{name}: {actual.get(name)!r} is not the run's {value!r}"
        for name, value in expected.items()
        if actual.get(name) != value
    ]
    if headers.get("ce_id") == run.get("run_id"):
        errors.append("ce_id: the run id, not the admission's id")
    return errors


def _text(key: bytes | None) -> str | None:
    return None if key is None else key.decode()
