"""What `make deploy` passes for the run retention: RunRetentionDays and the record of its last change,
PreviousRunRetentionDays and RunRetentionChangedAt, worked out from the deployed stack's parameters before
deploying, and once the deploy has completed (docs/architecture.md#run-retention).

`python -m poimen_tools.retention_change --config-env ENV [--run-retention-days DAYS]` prints the parameter
overrides as `Key=Value` words on stdout (an empty value as `Key=''`, as SAM CLI takes it), and on stderr one
line when it records a change. The value to deploy is `--run-retention-days` (make's RUN_RETENTION_DAYS),
else a RunRetentionDays in the environment's parameter_overrides of samconfig.toml, else the deployed one
(unchanged). A change is passed as pending
(RunRetentionChangedAt=pending: every record is held to the shorter retention), since the stack's admission
keeps writing runs under the deployed one until the update completes, however long its change set waits.
A change to a retention shorter than the deployed stack holds records to (a lowering, turning retention on)
is refused (exit 1) until its hold is deployed: with `--hold`, run first, it prints the overrides that keep
the deployed RunRetentionDays and hold every record to the lowered one (nothing when no hold is needed);
make deploy deploys them, and then the change, so that no outcome of the change's update (a rollback
returns the stack to the hold) leaves a record held to more than the retention its run was written under.
With `--settle`, run after `sam deploy`, it prints the overrides that record when a pending change took
effect (AWS's time once the update has completed: the Date of CloudFormation's answer, or the operator's
clock if that is later), or nothing when no change is pending, or when the stack's last update rolled back
(the change stays pending); make deploy then deploys them, a parameter-only update. If the deployed stack
cannot be read, or is in any state but a complete one (an update under way, a rollback that failed), it
exits 1 with one line: deploying without knowing the retention the runs were written under could hold
records to a retention longer than theirs.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
import tomllib
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any, TextIO

import boto3
import botocore.exceptions

from poimen.retention import (
    PREVIOUS_RUN_RETENTION_ENV,
    RUN_RETENTION_CHANGED_ENV,
    RUN_RETENTION_ENV,
    InvalidRetention,
    RunRetention,
    after_change,
    hold_first,
    parse_run_retention_days,
    run_retention,
)
from poimen_tools.arguments import run_retention_days

# The template's parameters, in the order RunRetention holds them.
DAYS, PREVIOUS_DAYS, CHANGED_AT = "RunRetentionDays", "PreviousRunRetentionDays", "RunRetentionChangedAt"
# A stack in one of these has no update under way: every function runs the parameters DescribeStacks shows.
# (ROLLBACK_COMPLETE: a creation that failed; its functions are gone.) In any other (an update or rollback
# under way, UPDATE_ROLLBACK_FAILED leaving resources of both versions) nothing is worked out.
COMPLETE_STATUSES = frozenset(
    {
        "CREATE_COMPLETE",
        "UPDATE_COMPLETE",
        "UPDATE_ROLLBACK_COMPLETE",
        "IMPORT_COMPLETE",
        "IMPORT_ROLLBACK_COMPLETE",
        "ROLLBACK_COMPLETE",
    }
)
# Of those, the ones whose last update went forward: only then has a pending change taken effect. After a
# rollback (a failed or cancelled update) the stack runs the parameters it was rolled back to, and a change
# they hold pending stays pending.
FORWARD_STATUSES = frozenset({"CREATE_COMPLETE", "UPDATE_COMPLETE", "IMPORT_COMPLETE"})
# A stack created from a change set never executed: it has no resources, nothing was written.
NO_RESOURCES_STATUS = "REVIEW_IN_PROGRESS"
_UNSET: Any = object()
# make deploy's three steps: the hold of a lowering, the change, and recording when it took effect.
HOLD, CHANGE, SETTLE = "hold", "change", "settle"


class RetentionChangeError(Exception):
    """Nothing can be deployed: the retention to pass is unknown."""


@dataclass(frozen=True)
class DeployedStack:
    retention: RunRetention
    status: str  # StackStatus
    aws_time_ms: int | None  # when CloudFormation answered, by its Date header (rounded up); None: no Date


def deployed_stack(cloudformation: Any, stack_name: str) -> DeployedStack | None:
    """The deployed stack's run retention, status and AWS's time; None when no such stack exists."""
    try:
        answer = cloudformation.describe_stacks(StackName=stack_name)
        (stack,) = answer["Stacks"]
    except botocore.exceptions.ClientError as error:
        message = str(error.response.get("Error", {}).get("Message", ""))
        if error.response.get("Error", {}).get("Code") == "ValidationError" and "does not exist" in message:
            return None
        raise RetentionChangeError(f"cannot read the stack {stack_name} ({error})") from error
    except botocore.exceptions.BotoCoreError as error:
        raise RetentionChangeError(f"cannot read the stack {stack_name} ({error})") from error
    values = {entry["ParameterKey"]: entry.get("ParameterValue", "") for entry in stack.get("Parameters", [])}
    environment = {
        RUN_RETENTION_ENV: values.get(DAYS, ""),
        PREVIOUS_RUN_RETENTION_ENV: values.get(PREVIOUS_DAYS, ""),
        RUN_RETENTION_CHANGED_ENV: values.get(CHANGED_AT, ""),
    }
    try:
        retention = run_retention(environment)
    except InvalidRetention as error:
        raise RetentionChangeError(f"the stack {stack_name} has an unreadable run retention: {error}") from error
    return DeployedStack(retention, str(stack.get("StackStatus", "")), _answered_at_ms(answer))


def _answered_at_ms(answer: Any) -> int | None:
    """The Date of an AWS answer in epoch milliseconds, rounded up to the next second (HTTP-dates are whole
    seconds, and the answer was made within that second)."""
    date = answer.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    try:
        return int(parsedate_to_datetime(date).timestamp() + 1) * 1000
    except (TypeError, ValueError):
        return None


# An empty value as `sam deploy` takes it: SAM CLI refuses `Key=` alone ("is not a valid format") and reads
# `Key=''` as the empty value. make deploy hands the words over unquoted, so the quotes reach SAM CLI.
EMPTY = "''"


def overrides(retention: RunRetention) -> list[str]:
    """The `Key=Value` parameter overrides of a run retention (EMPTY: forever, or never changed)."""
    return [
        f"{DAYS}={EMPTY if retention.days is None else retention.days}",
        f"{PREVIOUS_DAYS}={EMPTY if retention.previous_days is None else retention.previous_days}",
        f"{CHANGED_AT}={retention.changed_at or EMPTY}",
    ]


def stage_region(config_file: Path, config_env: str) -> str | None:
    """The Region `sam deploy` deploys the environment to: samconfig.toml's `region`, else AWS_REGION, else
    None (the SDK's configuration: AWS_DEFAULT_REGION, the profile)."""
    environment = tomllib.loads(config_file.read_text()).get(config_env, {})
    for command in ("deploy", "global"):
        region = environment.get(command, {}).get("parameters", {}).get("region")
        if region:
            return str(region)
    return os.environ.get("AWS_REGION") or None


def stage_settings(config_file: Path, config_env: str) -> tuple[str, Any]:
    """The stack name of a samconfig.toml environment, and the RunRetentionDays its parameter_overrides set
    (_UNSET when they set none)."""
    document = tomllib.loads(config_file.read_text())
    environment = document.get(config_env, {})
    deploy = environment.get("deploy", {}).get("parameters", {})
    stack_name = deploy.get("stack_name") or environment.get("global", {}).get("parameters", {}).get("stack_name")
    if not stack_name:
        raise RetentionChangeError(f"{config_file} names no stack_name for the environment {config_env!r}")
    for word in shlex.split(str(deploy.get("parameter_overrides", ""))):
        name, _, value = word.partition("=")
        if name == DAYS:
            try:
                return stack_name, parse_run_retention_days(value)
            except InvalidRetention as error:
                raise RetentionChangeError(f"{config_file} [{config_env}]: {error}") from error
    return stack_name, _UNSET


def retention_to_deploy(
    cloudformation: Any,
    config_file: Path,
    config_env: str,
    days: Any,
    now_ms: int,
    stack_name: str | None = None,
    *,
    step: str = CHANGE,
) -> tuple[RunRetention | None, RunRetention | None, str, int]:
    """(the retention to deploy at this `step` of make deploy, or None when it has nothing to deploy: a hold
    not needed, no change to settle; the deployed one or None; the stack's name: `stack_name`, a cell's, else
    the environment's; the time it is recorded at, the later of `now_ms` and AWS's)."""
    environment_stack, staged = stage_settings(config_file, config_env)
    stack_name = stack_name or environment_stack
    if days is not _UNSET and staged is not _UNSET and days != staged:
        raise RetentionChangeError(
            f"RUN_RETENTION_DAYS={'' if days is None else days} and {DAYS}={'' if staged is None else staged} of "
            f"{config_file} [{config_env}] disagree: set it in one place"
        )
    found = deployed_stack(cloudformation, stack_name)
    if found is not None and found.status == NO_RESOURCES_STATUS:
        found = None
    deployed = None if found is None else found.retention
    moment = max(now_ms, (found and found.aws_time_ms) or 0)
    if found is not None and found.status not in COMPLETE_STATUSES:
        raise RetentionChangeError(
            f"the stack {stack_name} is {found.status or 'in no known state'}: the retention its functions run "
            "with is known only once it is in a complete state (every record is held to the shorter retention "
            "of a pending change until then); run make deploy again when it is"
        )
    forward = found is None or found.status in FORWARD_STATUSES
    if step == SETTLE:
        if deployed is None or not deployed.pending or not forward:
            return None, deployed, stack_name, moment
        return deployed.settled(moment), deployed, stack_name, moment
    wanted = days if days is not _UNSET else staged
    if wanted is _UNSET:
        wanted = None if deployed is None else deployed.days
    hold = hold_first(deployed, wanted, moment, settled=forward)
    if step == HOLD:
        return hold, deployed, stack_name, moment
    if hold is not None:
        raise RetentionChangeError(
            f"{DAYS} of {stack_name} would become {_text(wanted)}, shorter than the {_text(hold.previous_days)} "
            f"the deployed stack holds records to: deploy its hold first (--hold, as make deploy does), so that "
            "every record is held to it before any run is written under it"
        )
    return after_change(deployed, wanted, moment, settled=forward), deployed, stack_name, moment


def main(
    argv: list[str] | None = None,
    *,
    cloudformation: Any | None = None,
    now_ms: int | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    out, err = stdout or sys.stdout, stderr or sys.stderr
    parser = argparse.ArgumentParser(prog="python -m poimen_tools.retention_change", description=__doc__)
    parser.add_argument("--config-env", required=True, help="the samconfig.toml environment (CONFIG_ENV)")
    parser.add_argument("--config-file", type=Path, default=Path("samconfig.toml"))
    parser.add_argument("--stack-name", help="the stack deployed (a cell's); default: the environment's")
    parser.add_argument(
        "--run-retention-days", type=run_retention_days, default=_UNSET, help="the new RunRetentionDays ('' forever)"
    )
    steps = parser.add_mutually_exclusive_group()
    steps.add_argument(
        "--hold",
        action="store_const",
        const=HOLD,
        dest="step",
        default=CHANGE,
        help="before the change: the overrides holding every record to a lowered retention (nothing if none is)",
    )
    steps.add_argument(
        "--settle",
        action="store_const",
        const=SETTLE,
        dest="step",
        help="after sam deploy: the overrides recording when a pending change took effect (nothing if none is)",
    )
    args = parser.parse_args(argv)
    local_ms = int(time.time() * 1000) if now_ms is None else now_ms
    try:
        client = cloudformation or boto3.client(
            "cloudformation", region_name=stage_region(args.config_file, args.config_env)
        )
        retention, deployed, stack_name, moment = retention_to_deploy(
            client,
            args.config_file,
            args.config_env,
            args.run_retention_days,
            local_ms,
            args.stack_name,
            step=args.step,
        )
    except (RetentionChangeError, botocore.exceptions.BotoCoreError) as error:
        print(f"make deploy: {error}; nothing was deployed", file=err)
        return 1
    change = f"{DAYS} of {stack_name}"
    if retention is None:
        if args.step == SETTLE and deployed is not None and deployed.pending:
            print(
                f"make deploy: the last update of {stack_name} was rolled back: the change of {DAYS} it holds stays "
                f"pending (every record is held to the shorter of {_text(deployed.previous_days)} and "
                f"{_text(deployed.days)}) until an update of make deploy completes",
                file=err,
            )
        return 0
    if args.step == HOLD:
        print(
            f"make deploy: {change} is lowered from {_text(retention.days)} in two updates: first (this one) every "
            f"record is held to {_text(retention.previous_days)} while admission still writes runs under "
            f"{_text(retention.days)}, then the change, so that whatever becomes of its update no record is held "
            "to more than its run's retention (docs/architecture.md#run-retention)",
            file=err,
        )
    elif deployed is not None and retention.pending and retention.days != deployed.days:
        print(
            f"make deploy: {change} changes from {_text(deployed.days)} to {_text(retention.days)}: until the "
            f"update has completed and make deploy records when ({CHANGED_AT}, a second, parameter-only update), "
            f"every record is held to the shorter of {_text(retention.previous_days)} and {_text(retention.days)} "
            "(docs/architecture.md#run-retention)",
            file=err,
        )
    elif deployed is not None and deployed.pending and retention.changed_at_ms == moment:
        print(
            f"make deploy: the change of {change} to {_text(retention.days)} took effect by {retention.changed_at}"
            f" (AWS's time): records from before it are held to the shorter of {_text(retention.previous_days)} "
            f"and {_text(retention.days)} ({PREVIOUS_DAYS}, {CHANGED_AT}; docs/architecture.md#run-retention)",
            file=err,
        )
    print(" ".join(overrides(retention)), file=out)
    return 0


def _text(days: int | None) -> str:
    return "forever" if days is None else f"{days} day{'s' if days != 1 else ''}"


if __name__ == "__main__":
    sys.exit(main())
