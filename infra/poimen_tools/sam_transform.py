"""template.yaml as the stack receives it, offline: AWS::LanguageExtensions expanded (Fn::ForEach), then SAM's
translator. Local CodeUris become placeholder S3 URIs and no managed policy is looked up.

Run by the SAM CLI's interpreter, which has samcli and samtranslator (`make lint` scans its output with
checkov; tests/unit/test_template_posture.py reads it):

    .venv-sam/bin/python infra/poimen_tools/sam_transform.py template.yaml Name=value ...
    .venv-sam/bin/python infra/poimen_tools/sam_transform.py --batch [--declared|--both] template.yaml < sets.json

`--batch` reads a JSON list of parameter sets ({"Name": "value", ...}) and prints the JSON list of their
templates, in one interpreter (tests/unit/test_template_quotas.py transforms dozens of sets), the template parsed
once (a copy of it a set); `--both` prints for each set the pair [declared, created] of one expansion.
`--serve` answers requests, one JSON line each ({"template": path, "parameters": {...}} or {"template": path,
"batch": [...], "kept": "created"|"declared"|"both"}, with an "id"), with one JSON line each ({"id": the request's,
"output": the text the command line would print} or {"id": ..., "error": its traceback}) until its input ends:
the tests' transforms (tests/unit/transforms.py) pay the interpreter's start and SAM's imports (a second of CPU)
once a worker, not once a transform.

SAM CLI's own expansion resolves every Fn::Sub it meets to a string, even when a placeholder in it names a
resource or a pseudo parameter it cannot know: `!Sub https://${AdmissionApi}.execute-api...` became that
literal text, which CloudFormation would never produce. Here an Fn::Sub whose placeholders are not all
resolved stays an Fn::Sub (what is known substituted into it), as CloudFormation's transform leaves it.
A resource whose Condition the given parameters make false is left out, as the stack would not have it;
with `--declared`, every resource is kept, its Condition with it: the template as CloudFormation receives and
validates it, before any condition is evaluated (its quota of 500 resources counts these).
"""

from __future__ import annotations

import copy
import json
import os
import re
import sys
import traceback
from typing import Any, TextIO

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


def expand(template: dict[str, Any], parameters: dict[str, str]) -> tuple[dict[str, Any], list[str]]:
    """SAM CLI's expansion of AWS::LanguageExtensions (partial resolution), with Fn::Sub kept when unresolved,
    every resource declared kept; and the names of those whose Condition is false."""
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
    # As the Fn::If above, a resource's Condition is decided by the parameters given: a resource whose
    # condition is false is not in the stack (the single-Region table in multi-Region mode, say).
    absent = [
        name
        for name, resource in expanded["Resources"].items()
        if "Condition" in resource and resolver.resolve_value({"Condition": resource["Condition"]}) is False
    ]
    return expanded, absent


def translated(expanded: dict[str, Any], parameters: dict[str, str]) -> dict[str, Any]:
    """The CloudFormation template SAM's translator makes of an expanded template (which it changes)."""
    for name, resource in expanded["Resources"].items():
        properties = resource.get("Properties", {})
        for key in ("CodeUri", "ContentUri"):
            if isinstance(properties.get(key), str):
                properties[key] = f"s3://offline-artifacts/{name}.zip"
    expanded["Transform"] = "AWS::Serverless-2016-10-31"
    result: dict[str, Any] = transform(expanded, parameters, NoManagedPolicies())
    return result


def transformed(
    template: dict[str, Any], parameters: dict[str, str], *, declared: bool, created: bool
) -> list[dict[str, Any]]:
    """The templates SAM's translator makes of a parsed `template` (left unchanged) with these parameter values,
    from one expansion: every resource declared (`declared`), then only those the stack creates (`created`)."""
    expanded, absent = expand(copy.deepcopy(template), parameters)
    found = [translated(copy.deepcopy(expanded) if created else expanded, parameters)] if declared else []
    if created:
        for name in absent:
            del expanded["Resources"][name]
        found.append(translated(expanded, parameters))
    return found


def batch_output(template: dict[str, Any], sets: list[dict[str, str]], kept: str) -> str:
    """What --batch prints for these parameter sets: their created templates, or with `kept` "declared" every
    resource declared, or "both" the pair of each."""
    found = [transformed(template, given, declared=kept != "created", created=kept != "declared") for given in sets]
    return json.dumps(found if kept == "both" else [only for (only,) in found])


def single_output(template: dict[str, Any], parameters: dict[str, str]) -> str:
    """What the command line prints for one set of parameters: the template the stack creates."""
    (created,) = transformed(template, parameters, declared=False, created=True)
    return json.dumps(created, indent=1)


def serve(requests: TextIO, answers: TextIO) -> None:
    """Answer each request line of `requests` on `answers` until `requests` ends; each template parsed once."""
    parsed: dict[str, dict[str, Any]] = {}
    for line in requests:
        request = json.loads(line)
        try:
            with open(request["template"]) as source:
                text = source.read()
            if text not in parsed:
                parsed[text] = yaml_parse(text)
            template = parsed[text]
            if "batch" in request:
                answer = {"output": batch_output(template, request["batch"], request["kept"])}
            else:
                answer = {"output": single_output(template, request["parameters"])}
        except Exception:  # the requester reports it, as it would a failed command
            answer = {"error": traceback.format_exc()}
        answers.write(json.dumps({"id": request.get("id"), **answer}) + "\n")
        answers.flush()


def main(arguments: list[str]) -> None:
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")  # SAM's translator needs a region, offline
    if arguments[0] == "--serve":
        serve(sys.stdin, sys.stdout)
        return
    if arguments[0] == "--batch":
        kept = arguments[1].removeprefix("--") if arguments[1] in ("--declared", "--both") else "created"
        with open(arguments[-1]) as source:
            print(batch_output(yaml_parse(source.read()), json.load(sys.stdin), kept))
        return
    path, *pairs = arguments
    with open(path) as source:
        print(single_output(yaml_parse(source.read()), dict(pair.split("=", 1) for pair in pairs)))


if __name__ == "__main__":
    main(sys.argv[1:])
