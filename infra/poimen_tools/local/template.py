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
    """`value` with a loop's identifier replaced, as AWS::LanguageExtensions does: `${Id}` in strings, `&{Id}`
    (the value's alphanumerics) in strings and keys, and `{"Ref": Id}`."""
    if isinstance(value, str):
        alphanumeric = "".join(ch for ch in replacement if ch.isalnum())
        return value.replace(f"${{{identifier}}}", replacement).replace(f"&{{{identifier}}}", alphanumeric)
    if isinstance(value, list):
        return [_substitute(item, identifier, replacement) for item in value]
    if isinstance(value, dict):
        if value == {"Ref": identifier}:
            return replacement
        return {
            _substitute(key, identifier, replacement): _substitute(item, identifier, replacement)
            for key, item in value.items()
        }
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
        """Every resource, with each Fn::ForEach loop (AWS::LanguageExtensions) expanded, nested ones too, over
        the list given for its collection parameter (else the parameter's default): `&{Id}` in logical ids,
        `${Id}` in strings, `Ref: Id`."""
        expanded = dict(self.resources)
        for name, loop in self.document["Resources"].items():
            if name.startswith("Fn::ForEach::"):
                expanded.update(self._expand(loop, parameters))
        return expanded

    def _expand(self, loop: list[Any], parameters: Mapping[str, list[str]]) -> dict[str, Any]:
        identifier, collection, templates = loop
        name = collection["Ref"]
        values = (
            parameters[name] if name in parameters else str(self.document["Parameters"][name]["Default"]).split(",")
        )
        expanded: dict[str, Any] = {}
        for value in values:
            for key, body in _substitute(templates, identifier, value).items():
                if key.startswith("Fn::ForEach::"):
                    expanded.update(self._expand(body, parameters))
                else:
                    expanded[key] = body
        return expanded

    def properties(self, logical_id: str) -> dict[str, Any]:
        return self.resources[logical_id].get("Properties", {})  # type: ignore[no-any-return]

    def resolve(self, value: Any, refs: Mapping[str, str]) -> str | None:
        """A plain string for literals, `Ref`s named in `refs` and parameter defaults (a CommaDelimitedList's
        as its comma-separated text), the branch of an Fn::If its condition chooses (parameters from `refs`,
        else their defaults), and an Fn::Join of those or of a list parameter; else None."""
        if isinstance(value, str | int | float):
            return str(value)
        if isinstance(value, dict) and set(value) == {"Fn::Join"}:
            delimiter, items = value["Fn::Join"]
            # A list parameter's Ref stands for its items; any other list holds one value per item.
            listed = self.resolve(items, refs) if isinstance(items, dict) else None
            parts = listed.split(",") if listed is not None else [self.resolve(item, refs) for item in items]
            return None if any(part is None for part in parts) else str(delimiter).join(map(str, parts))
        if isinstance(value, dict) and set(value) == {"Fn::If"}:
            condition, when_true, when_false = value["Fn::If"]
            return self.resolve(when_true if self.condition(condition, refs) else when_false, refs)
        if isinstance(value, dict) and set(value) == {"Ref"}:
            name = value["Ref"]
            if name in refs:
                return refs[name]
            default = self.document.get("Parameters", {}).get(name, {}).get("Default")
            return None if default is None else str(default)
        return None

    def evaluate(self, value: Any, parameters: Mapping[str, str] | None = None) -> Any:
        """`value` as CloudFormation would deploy it with `parameters` (else the defaults): literals, Ref of a
        parameter, Fn::If on the template's Conditions (Fn::Equals, Fn::Not, Fn::And, Fn::Or, Condition) and
        Fn::FindInMap with AWS::LanguageExtensions' DefaultValue, nested. Raises ValueError on anything else
        (a resource's Ref or GetAtt, AWS::NoValue's removal): those need a deploy."""
        given = parameters or {}
        if isinstance(value, list):
            return [self.evaluate(item, given) for item in value]
        if not isinstance(value, dict):
            return value
        if set(value) == {"Ref"} and value["Ref"] in self.document.get("Parameters", {}):
            name = value["Ref"]
            return given[name] if name in given else self.document["Parameters"][name].get("Default")
        if set(value) == {"Fn::If"}:
            condition, when_true, when_false = value["Fn::If"]
            return self.evaluate(when_true if self.condition(condition, given) else when_false, given)
        if set(value) == {"Fn::FindInMap"}:
            name, top, second, *default = value["Fn::FindInMap"]
            found = self.document.get("Mappings", {}).get(name, {})
            found = found.get(str(self.evaluate(top, given)), {}).get(str(self.evaluate(second, given)))
            if found is None and default:
                return self.evaluate(default[0]["DefaultValue"], given)
            if found is None:
                raise ValueError(f"no {top!r}/{second!r} in mapping {name}")
            return found
        if len(value) == 1 and next(iter(value)).startswith(("Ref", "Fn::")):
            raise ValueError(f"cannot evaluate {value!r} without a deploy")
        return {key: self.evaluate(item, given) for key, item in value.items()}

    def declares(self, properties: Mapping[str, Any], key: str, parameters: Mapping[str, str] | None = None) -> bool:
        """Whether `properties` hold `key` once deployed with `parameters` (else the defaults): absent, or an
        Fn::If whose chosen branch is AWS::NoValue, it is not there."""
        value = properties.get(key)
        while isinstance(value, dict) and set(value) == {"Fn::If"}:
            condition, when_true, when_false = value["Fn::If"]
            value = when_true if self.condition(condition, parameters) else when_false
        return value is not None and value != {"Ref": "AWS::NoValue"}

    def condition(self, name: str, parameters: Mapping[str, str] | None = None) -> bool:
        """Whether the template's condition `name` holds with `parameters` (else the defaults)."""
        return self._holds(self.document["Conditions"][name], parameters or {})

    def _holds(self, expression: Any, parameters: Mapping[str, str]) -> bool:
        ((function, arguments),) = expression.items()
        if function == "Condition":
            return self.condition(arguments, parameters)
        if function == "Fn::Equals":
            left, right = (self.evaluate(argument, parameters) for argument in arguments)
            return str(left) == str(right)
        if function == "Fn::Not":
            return not self._holds(arguments[0], parameters)
        if function == "Fn::And":
            return all(self._holds(argument, parameters) for argument in arguments)
        if function == "Fn::Or":
            return any(self._holds(argument, parameters) for argument in arguments)
        raise ValueError(f"unsupported condition function {function}")

    def function_environment(self, logical_id: str, refs: Mapping[str, str]) -> dict[str, str]:
        """Globals then the function's own variables, as Lambda would set them."""
        global_vars = self.document.get("Globals", {}).get("Function", {}).get("Environment", {})
        own_vars = self.properties(logical_id).get("Environment", {})
        merged = {**global_vars.get("Variables", {}), **own_vars.get("Variables", {})}
        resolved = {name: self.resolve(value, refs) for name, value in merged.items()}
        return {name: value for name, value in resolved.items() if value is not None}

    def other_functions_variables(self, logical_id: str) -> set[str]:
        """The names of the variables the template gives other functions (their own, not Globals') and not this
        one: Lambda sets this one none of them."""
        others = {
            name
            for other, body in self.resources.items()
            if other != logical_id and body.get("Type") == "AWS::Serverless::Function"
            for name in body.get("Properties", {}).get("Environment", {}).get("Variables", {})
        }
        global_vars = self.document.get("Globals", {}).get("Function", {}).get("Environment", {})
        own = {
            **global_vars.get("Variables", {}),
            **self.properties(logical_id).get("Environment", {}).get("Variables", {}),
        }
        return others - set(own)

    def function_timeout(self, logical_id: str) -> float:
        """The function's Timeout in seconds: its own, else Globals', else Lambda's default, 3 s (AWS Lambda
        Developer Guide, "Configure Lambda function timeout":
        https://docs.aws.amazon.com/lambda/latest/dg/configuration-timeout.html)."""
        declared = self.properties(logical_id).get("Timeout")
        if declared is None:
            declared = self.document.get("Globals", {}).get("Function", {}).get("Timeout", 3)
        return float(self.evaluate(declared))

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

    def time_to_live_request(
        self, logical_id: str, table_name: str, parameters: Mapping[str, str] | None = None
    ) -> dict[str, Any] | None:
        """UpdateTimeToLive parameters for the table's TimeToLiveSpecification, if it enables one with
        `parameters`; else None (CreateTable takes no TTL: it is set once the table exists)."""
        declared = self.properties(logical_id).get("TimeToLiveSpecification")
        if declared is None:
            return None
        specification = self.evaluate(declared, parameters)
        if specification.get("Enabled") is not True:
            return None
        return {
            "TableName": table_name,
            "TimeToLiveSpecification": {"AttributeName": specification["AttributeName"], "Enabled": True},
        }

    def create_queue_request(
        self, logical_id: str, queue_name: str, parameters: Mapping[str, str] | None = None
    ) -> dict[str, Any]:
        """CreateQueue parameters for an AWS::SQS::Queue resource: its attributes that are literals, or
        derived from parameters (`parameters`, else the defaults) as `evaluate` does."""
        attributes = {}
        for name, declared in self.properties(logical_id).items():
            try:
                value = self.evaluate(declared, parameters)
            except ValueError:  # needs a deploy (a key's ARN, AWS::NoValue): not a local queue's attribute
                continue
            if isinstance(value, str | int | bool) and name != "QueueName":
                attributes[name] = str(value).lower() if isinstance(value, bool) else str(value)
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
