"""Reads template.yaml the way `sam local` does: resources, environments and handlers of functions."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml


class _CloudFormationLoader(yaml.SafeLoader):
    """YAML loader that turns short-form intrinsics (`!Ref X`) into their long form (`{"Ref": "X"}`)."""


def _intrinsic(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> dict[str, Any]:
    name = "Ref" if suffix == "Ref" else f"Fn::{suffix}"
    value: Any
    if isinstance(node, yaml.ScalarNode):
        value = loader.construct_scalar(node)
        if suffix == "GetAtt":
            value = str(value).split(".", 1)
    elif isinstance(node, yaml.SequenceNode):
        value = loader.construct_sequence(node, deep=True)
    else:
        value = loader.construct_mapping(node, deep=True)  # type: ignore[arg-type]
    return {name: value}


_CloudFormationLoader.add_multi_constructor("!", _intrinsic)


def _substitute(value: Any, identifier: str, replacement: str) -> Any:
    if isinstance(value, str):
        return value.replace(f"${{{identifier}}}", replacement)
    if isinstance(value, list):
        return [_substitute(item, identifier, replacement) for item in value]
    if isinstance(value, dict):
        return {key: _substitute(item, identifier, replacement) for key, item in value.items()}
    return value


def default_template_path() -> Path:
    """template.yaml of the checkout this package was installed from (editable install), else ./."""
    checkout = Path(__file__).resolve().parents[3] / "template.yaml"
    return checkout if checkout.is_file() else Path.cwd() / "template.yaml"


class Template:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.document: dict[str, Any] = yaml.load(path.read_text(), Loader=_CloudFormationLoader)  # noqa: S506 (safe loader subclass)

    @property
    def resources(self) -> dict[str, Any]:
        """The resources declared one by one (Fn::ForEach loops are in `expanded_resources`)."""
        declared: dict[str, Any] = self.document["Resources"]
        return {name: body for name, body in declared.items() if not name.startswith("Fn::ForEach::")}

    def expanded_resources(self, parameters: Mapping[str, list[str]]) -> dict[str, Any]:
        """Every resource, with each Fn::ForEach loop (AWS::LanguageExtensions) expanded over the list
        given for its collection parameter: `&{Id}` in logical ids, `${Id}` in strings."""
        expanded = dict(self.resources)
        for name, loop in self.document["Resources"].items():
            if not name.startswith("Fn::ForEach::"):
                continue
            identifier, collection, templates = loop
            for value in parameters[collection["Ref"]]:
                for logical_id, body in templates.items():
                    alphanumeric = "".join(ch for ch in value if ch.isalnum())
                    expanded[logical_id.replace(f"&{{{identifier}}}", alphanumeric)] = _substitute(
                        body, identifier, value
                    )
        return expanded

    def properties(self, logical_id: str) -> dict[str, Any]:
        return self.resources[logical_id].get("Properties", {})  # type: ignore[no-any-return]

    def resolve(self, value: Any, refs: Mapping[str, str]) -> str | None:
        """A plain string for literals, `Ref`s named in `refs` and parameter defaults; else None."""
        if isinstance(value, str | int | float):
            return str(value)
        if isinstance(value, dict) and set(value) == {"Ref"}:
            name = value["Ref"]
            if name in refs:
                return refs[name]
            default = self.document.get("Parameters", {}).get(name, {}).get("Default")
            return None if default is None else str(default)
        return None

    def function_environment(self, logical_id: str, refs: Mapping[str, str]) -> dict[str, str]:
        """Globals then the function's own variables, as Lambda would set them."""
        global_vars = self.document.get("Globals", {}).get("Function", {}).get("Environment", {})
        own_vars = self.properties(logical_id).get("Environment", {})
        merged = {**global_vars.get("Variables", {}), **own_vars.get("Variables", {})}
        resolved = {name: self.resolve(value, refs) for name, value in merged.items()}
        return {name: value for name, value in resolved.items() if value is not None}

    def create_table_request(self, logical_id: str, table_name: str) -> dict[str, Any]:
        """CreateTable parameters for an AWS::DynamoDB::Table resource, exactly as declared."""
        props = self.properties(logical_id)
        request: dict[str, Any] = {
            "TableName": table_name,
            "KeySchema": props["KeySchema"],
            "AttributeDefinitions": props["AttributeDefinitions"],
            "BillingMode": props.get("BillingMode", "PROVISIONED"),
        }
        stream = props.get("StreamSpecification")
        if stream:
            request["StreamSpecification"] = {
                "StreamEnabled": True,
                "StreamViewType": stream["StreamViewType"],
            }
        return request

    def create_queue_request(self, logical_id: str, queue_name: str) -> dict[str, Any]:
        """CreateQueue parameters for an AWS::SQS::Queue resource (its literal attributes)."""
        attributes = {
            name: str(value).lower() if isinstance(value, bool) else str(value)
            for name, value in self.properties(logical_id).items()
            if isinstance(value, str | int | bool) and name != "QueueName"
        }
        return {"QueueName": queue_name, "Attributes": attributes}

    def http_routes(self, logical_id: str) -> list[tuple[str, str]]:
        """(method, path) of each HttpApi event of the function, as API Gateway routes them."""
        events = self.properties(logical_id).get("Events", {}).values()
        return [
            (event["Properties"]["Method"].upper(), event["Properties"]["Path"])
            for event in events
            if event.get("Type") == "HttpApi"
        ]

    def load_handler(self, logical_id: str) -> Callable[[dict[str, Any], Any], Any]:
        """Import the function's handler module from its CodeUri, as the Lambda runtime would."""
        props = self.properties(logical_id)
        module_name, _, attribute = props["Handler"].rpartition(".")
        source = self.path.parent / props["CodeUri"] / f"{module_name.replace('.', '/')}.py"
        spec = importlib.util.spec_from_file_location(f"poimen_function_{logical_id}", source)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {source} for {logical_id}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        handler: Callable[[dict[str, Any], Any], Any] = getattr(module, attribute)
        return handler
