"""template.yaml as the stack receives it, offline: AWS::LanguageExtensions expanded (Fn::ForEach), then SAM's
translator. Local CodeUris become placeholder S3 URIs and no managed policy is looked up.

Run by the SAM CLI's interpreter, which has samcli and samtranslator (`make lint` scans its output with
checkov; tests/unit/test_template_posture.py reads it):

    .venv-sam/bin/python infra/poimen_tools/sam_transform.py template.yaml Name=value ...
    .venv-sam/bin/python infra/poimen_tools/sam_transform.py --batch [--declared] template.yaml < parameter-sets.json

`--batch` reads a JSON list of parameter sets ({"Name": "value", ...}) and prints the JSON list of their
templates, in one interpreter (tests/unit/test_template_quotas.py transforms dozens of sets).

SAM CLI's own expansion resolves every Fn::Sub it meets to a string, even when a placeholder in it names a
resource or a pseudo parameter it cannot know: `!Sub https://${AdmissionApi}.execute-api...` became that
literal text, which CloudFormation would never produce. Here an Fn::Sub whose placeholders are not all
resolved stays an Fn::Sub (what is known substituted into it), as CloudFormation's transform leaves it.
A resource whose Condition the given parameters make false is left out, as the stack would not have it;
with `--declared`, every resource is kept, its Condition with it: the template as CloudFormation receives and
validates it, before any condition is evaluated (its quota of 500 resources counts these).
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

from samcli.lib.cfn_language_extensions.api import IntrinsicResolverProcessor, create_default_intrinsic_resolver
from samcli.lib.cfn_language_extensions.models import ResolutionMode, TemplateProcessingContext
from samcli.lib.cfn_language_extensions.pipeline import ProcessingPipeline
from samcli.lib.cfn_language_extensions.processors import (
    DeletionPolicyProcessor,
    ForEachProcessor,
    TemplateParsingProcessor,
    UpdateReplacePolicyProcessor,
)
from samcli.lib.cfn_language_extensions.resolvers.base import IntrinsicResolver
from samcli.lib.cfn_language_extensions.resolvers.fn_sub import FnSubResolver
from samcli.yamlhelper import yaml_parse
from samtranslator.translator.transform import transform

_PLACEHOLDER = re.compile(r"\$\{([^}]+)\}")
_ESCAPED = "\0escaped-placeholder\0"


class KeepUnresolvedSub(FnSubResolver):  # type: ignore[misc]
    """Fn::Sub resolved to a string only when every placeholder is; otherwise kept, partly substituted."""

    def resolve(self, value: dict[str, Any]) -> Any:
        template_string, variables = self._parse_args(self.get_function_args(value))
        resolved = self._resolve_variable_map(variables)
        # A variable whose value is still an intrinsic (a resource attribute, say) stays in the map.
        kept = {name: item for name, item in resolved.items() if isinstance(item, dict | list)}
        known = {name: item for name, item in resolved.items() if name not in kept}
        # ${!Literal} is text, not a placeholder: kept escaped while the string may remain an Fn::Sub.
        protected = template_string.replace("${!", _ESCAPED)
        substituted = _PLACEHOLDER.sub(lambda match: self._placeholder(match, known, kept), protected)
        if _PLACEHOLDER.search(substituted) is None:
            return substituted.replace(_ESCAPED, "${")
        text = substituted.replace(_ESCAPED, "${!")
        return {"Fn::Sub": [text, kept] if kept else text}

    def _placeholder(self, match: re.Match[str], known: dict[str, Any], kept: dict[str, Any]) -> str:
        name = match.group(1)
        if name in kept:
            return match.group(0)
        value = self._resolve_variable(name, known)
        return match.group(0) if value is None else str(self._value_to_string(value))


class NoManagedPolicies:
    """The translator's managed-policy loader, offline: no policy ARN is looked up."""

    def load(self) -> dict[str, str]:
        return {}


def expand(template: dict[str, Any], parameters: dict[str, str], *, declared: bool = False) -> dict[str, Any]:
    """SAM CLI's expansion of AWS::LanguageExtensions (partial resolution), with Fn::Sub kept when unresolved;
    without the resources whose Condition is false unless `declared`."""
    context = TemplateProcessingContext(
        fragment=template, parameter_values=parameters, resolution_mode=ResolutionMode.PARTIAL
    )
    resolver = IntrinsicResolver(context)
    for default in create_default_intrinsic_resolver(context).resolvers:  # SAM CLI's set and order
        resolver.register_resolver(KeepUnresolvedSub if type(default) is FnSubResolver else type(default))
    pipeline = ProcessingPipeline(
        [
            TemplateParsingProcessor(),
            ForEachProcessor(intrinsic_resolver=resolver),
            IntrinsicResolverProcessor(resolver),
            DeletionPolicyProcessor(),
            UpdateReplacePolicyProcessor(),
        ]
    )
    expanded: dict[str, Any] = pipeline.process_template(context)
    if declared:
        return expanded
    # As the Fn::If above, a resource's Condition is decided by the parameters given: a resource whose
    # condition is false is not in the stack (the single-Region table in multi-Region mode, say).
    absent = [
        name
        for name, resource in expanded["Resources"].items()
        if "Condition" in resource and resolver.resolve_value({"Condition": resource["Condition"]}) is False
    ]
    for name in absent:
        del expanded["Resources"][name]
    return expanded


def transformed(template_text: str, parameters: dict[str, str], *, declared: bool = False) -> dict[str, Any]:
    """The CloudFormation template SAM's translator makes of `template_text` with these parameter values (every
    resource declared if `declared`, else those the stack creates)."""
    template = expand(yaml_parse(template_text), parameters, declared=declared)
    for name, resource in template["Resources"].items():
        properties = resource.get("Properties", {})
        for key in ("CodeUri", "ContentUri"):
            if isinstance(properties.get(key), str):
                properties[key] = f"s3://offline-artifacts/{name}.zip"
    template["Transform"] = "AWS::Serverless-2016-10-31"
    result: dict[str, Any] = transform(template, parameters, NoManagedPolicies())
    return result


def main(arguments: list[str]) -> None:
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")  # SAM's translator needs a region, offline
    if arguments[0] == "--batch":
        declared = arguments[1] == "--declared"
        with open(arguments[2 if declared else 1]) as source:
            text = source.read()
        print(json.dumps([transformed(text, given, declared=declared) for given in json.load(sys.stdin)]))
        return
    path, *pairs = arguments
    parameters = dict(pair.split("=", 1) for pair in pairs)
    with open(path) as source:
        print(json.dumps(transformed(source.read(), parameters), indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
