"""`poimen dlq`: inspect and redrive the dispatch records that did not become runs.

Two places hold them. The inbox relay's dead-letter queue (SQS): one relay dead letter per message, the
record as MSK delivered it and why it was dead-lettered. The failed-batch bucket (S3): one object per
batch that failed every retry, Lambda's on-failure invocation record with the whole MSK event as its
payload. `redrive` sends each record again through `POST /v1/runs`, signed as the caller, and removes a
dead letter only once the API has confirmed its run (201 or 200).

Dead-letter IDs: `sqs:<MessageId>` (one relay dead letter), `s3:<key>` (one failed batch, every record
of it), `s3:<key>#<topic>-<partition>@<offset>` (one record of a failed batch). Copies of one record (the
same topic, partition, offset, timestamp and value) are listed as one record and redriven once; two records
at one offset of a recreated topic are two.

Redriving is idempotent through admission's dispatch_key alone: a keyed record sent twice is a replay
(200) of the run it admitted. A record without one is sent with a dispatch_key derived from its topic,
partition, offset, timestamp and value digest (`poimen-redrive/<sha256>`), the same every time, so it too
becomes one run however often it is sent (and a run an earlier version admitted under its key of old,
without the digest, is found first and replayed, not admitted again). A dead letter is deleted right
after its confirmation, and a failed-batch record marked done (a progress marker beside its object,
`<key>.progress/<record identity>`): a redrive interrupted and run again sends again at most the one
record that was in flight.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from types import FrameType
from typing import Any, TextIO

import boto3
import botocore.config
import botocore.session
import urllib3
from botocore.credentials import Credentials

from poimen.cells import CELLS_DOCUMENT_VARIABLE, CELLS_FILE_VARIABLE, CellMap, InvalidCellMap
from poimen.endpoints import RegionalEndpoint
from poimen.retention import RunRetention, with_change
from poimen_tools.arguments import (
    base_url,
    bucket_name,
    changed_at,
    endpoint_url,
    region,
    run_retention_days,
    text,
)
from poimen_tools.credentials import local_credentials
from poimen_tools.dlq.api import AdmissionApi
from poimen_tools.dlq.errors import EXIT_OK, AwsUnavailable, DeadLetterNotFound, DlqError, UsageError
from poimen_tools.dlq.letters import DeadLetterQueue
from poimen_tools.dlq.model import HELD_KINDS, KINDS, DeadLetter, Parcel
from poimen_tools.dlq.parked import FailedBatches
from poimen_tools.dlq.redrive import Plan, Progress, Redrive, plan
from poimen_tools.dlq.render import inventory, letter_document, render_inventory, render_letter, table
from poimen_tools.local.sigv4 import DEV_ACCESS_KEY, DEV_SECRET_KEY
from poimen_tools.runs import cells_file

# SQS cannot peek: reading a message hides it for its visibility timeout. `list` and `show` hide what they
# read for 30 s and make it visible again as soon as they are done (if killed, it reappears by itself).
# `redrive` holds every message it read for 5 minutes, so that no message is read twice while it works.
LIST_VISIBILITY_SECONDS = 30
REDRIVE_VISIBILITY_SECONDS = 300

# A keyless spawn replicated from another Region: the relay there admitted its original, so it is sent only
# when asked for by name (every keyless spawn leaves one such letter in each peer Region's queue).
KEYLESS_REPLICA = "keyless-replica"
DEFAULT_KINDS = tuple(kind for kind in KINDS if kind != KEYLESS_REPLICA)

_RECORD_FRAGMENT = re.compile(r"(?P<topic>.+)-(?P<partition>\d+)@(?P<offset>\d+)")


@contextmanager
def holding(queue: DeadLetterQueue | None, batches: FailedBatches | None, visibility: int) -> Iterator[list[Parcel]]:
    """Every dead letter, oldest first; the queue's messages are released when the block ends."""
    try:
        parcels = (queue.read_all(visibility) if queue else []) + (batches.read_all() if batches else [])
        yield sorted(parcels, key=lambda p: (p.at.timestamp() if p.at else float("inf"), p.id))
    finally:
        if queue:
            queue.release()


EPILOG = """\
IDs: sqs:<MessageId> (a relay dead letter), s3:<key> (a failed batch), s3:<key>#<topic>-<partition>@<offset>
(one record of a failed batch); `poimen dlq list --ids` shows them.

exit codes: 0 done; 1 some dead letters of the chosen kinds remain (failing again, not sendable, or
refused as older than the run retention, or held to none);
2 usage error, unknown ID, or redrive refused / not confirmed; 3 AWS or the admission API unreachable,
or refusing the caller (nothing unconfirmed is removed); 130 interrupted (Ctrl-C: stopped after the
record in flight; run redrive again for the rest)."""


def add_dlq_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`poimen dlq list|show|redrive`, with the options every action shares."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--api-url", type=base_url, metavar="URL", help="admission API base URL (stack output AdmissionApiUrl)"
    )
    common.add_argument(
        "--cells",
        type=cells_file,
        metavar="FILE",
        help="a cell map (JSON) instead of --api-url: each record goes to its tenant's cell (default without "
        "--api-url: the file POIMEN_CELLS_FILE names, or the map POIMEN_CELLS holds)",
    )
    common.add_argument(
        "--queue-url",
        type=endpoint_url,
        metavar="URL",
        help="the relay's dead-letter queue (stack output RelayDeadLetterQueueUrl)",
    )
    common.add_argument(
        "--bucket",
        type=bucket_name,
        metavar="NAME",
        help="the failed-batch bucket (stack output FailedBatchesBucketName)",
    )
    common.add_argument(
        "--region",
        type=region,
        default=os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
        help="(default: AWS_REGION, AWS_DEFAULT_REGION, else us-east-1)",
    )
    common.add_argument(
        "--aws-endpoint",
        type=endpoint_url,
        metavar="URL",
        help="one endpoint for SQS and S3, e.g. poimen dev's moto (default: the SDK's)",
    )
    common.add_argument(
        "--dev-key",
        action="store_true",
        help="local only: sign API, SQS and S3 calls with poimen dev's documented dev key, not your AWS credentials",
    )
    common.add_argument("--debug", action="store_true", help="a traceback instead of the one-line error")
    formatter = argparse.RawDescriptionHelpFormatter
    dlq = commands.add_parser(
        "dlq",
        help="inspect and redrive dispatch records that did not become runs",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=formatter,
    )
    actions = dlq.add_subparsers(dest="action", required=True)
    listing = actions.add_parser(
        "list",
        parents=[common],
        help="counts by kind, oldest and newest",
        description=f"Counts by kind. Reads each SQS message with a {LIST_VISIBILITY_SECONDS} s visibility "
        "timeout (SQS cannot peek) and releases it when done; deletes nothing.",
        epilog=EPILOG,
        formatter_class=formatter,
    )
    listing.add_argument("--json", action="store_true", help="machine-readable, with every dead letter")
    listing.add_argument("--ids", action="store_true", help="also one line per dead letter")
    show = actions.add_parser(
        "show", parents=[common], help="one dead letter, decoded", epilog=EPILOG, formatter_class=formatter
    )
    show.add_argument("id", type=text, metavar="ID")
    show.add_argument("--json", action="store_true")
    redrive = actions.add_parser(
        "redrive",
        parents=[common],
        help="send dead letters again through POST /v1/runs, signed as you",
        description=inspect.cleandoc(Redrive.__doc__ or ""),
        epilog=EPILOG,
        formatter_class=formatter,
    )
    redrive.add_argument(
        "--kind",
        action="append",
        choices=KINDS,
        metavar="KIND",
        help=f"only this kind (repeatable; default: all but {KEYLESS_REPLICA}): {', '.join(KINDS)}. A kind the relay "
        f"holds back though the record is a spawn ({', '.join(HELD_KINDS)}) is sent only when named here",
    )
    redrive.add_argument(
        "--run-retention-days",
        type=run_retention_days,
        default=argparse.SUPPRESS,
        metavar="DAYS",
        help="the stack's RunRetentionDays (forever, or '', when it is empty): refuse (and keep) records whose "
        "Kafka timestamp is older, as sending them could admit a second run (default: the retention each relay "
        "dead letter records; a record held to none, a parked one or a letter of an earlier version, is refused "
        "if older than 1 day, the shortest a stack can have)",
    )
    redrive.add_argument(
        "--previous-run-retention-days",
        type=run_retention_days,
        default=argparse.SUPPRESS,
        metavar="DAYS",
        help="the stack's PreviousRunRetentionDays, with --run-retention-changed-at: a record from before the "
        "change is held to the shorter of the two retentions ('' for forever)",
    )
    redrive.add_argument(
        "--run-retention-changed-at",
        type=changed_at,
        metavar="TIME",
        help="the stack's RunRetentionChangedAt (RFC 3339 UTC, or pending, as make deploy records it)",
    )
    redrive.add_argument("--dry-run", action="store_true", help="say what would be sent; change nothing")
    redrive.add_argument("--yes", action="store_true", help="do not ask for confirmation")


def main(argv: list[str], parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser) -> int:
    """`poimen dlq ...` (argv without `dlq`), parsed (by `parser_class`: the CLI's, one-line errors) and run."""
    parser = parser_class(prog="poimen")
    add_dlq_commands(parser.add_subparsers(dest="command", required=True))
    return run_dlq(parser.parse_args(["dlq", *argv]))


def run_dlq(
    args: argparse.Namespace,
    *,
    http: urllib3.PoolManager | None = None,
    credentials: Any | None = None,
    stdin: TextIO | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """`poimen dlq <action>`; errors end as one line on stderr and their exit code (--debug: traceback)."""
    out, err = stdout or sys.stdout, stderr or sys.stderr
    try:
        return _run(args, http, credentials, stdin or sys.stdin, out, err)
    except DlqError as error:
        if args.debug:
            raise
        print(f"poimen dlq {args.action}: {error}", file=err)
        return error.exit_code


def _run(
    args: argparse.Namespace,
    http: urllib3.PoolManager | None,
    credentials: Any | None,
    stdin: TextIO,
    out: TextIO,
    err: TextIO,
) -> int:
    if not args.queue_url and not args.bucket:
        raise UsageError("nothing to read: give --queue-url (the relay's dead-letter queue) and/or --bucket")
    queue = DeadLetterQueue(_aws_client("sqs", args), args.queue_url) if args.queue_url else None
    batches = FailedBatches(_aws_client("s3", args), args.bucket) if args.bucket else None
    now = datetime.now(UTC)
    if args.action == "list":
        with holding(queue, batches, LIST_VISIBILITY_SECONDS) as parcels:
            text = json.dumps(inventory(parcels, now), indent=2) + "\n" if args.json else None
            out.write(text or render_inventory(parcels, now, args.ids))
        return EXIT_OK
    if args.action == "show":
        found = _find(args.id, queue, batches)
        if args.json:
            letters = [letter_document(letter, now) for letter in found]
            out.write(json.dumps(letters[0] if len(letters) == 1 else letters, indent=2, ensure_ascii=False) + "\n")
        else:
            out.write("\n".join(render_letter(letter, now) for letter in found))
        return EXIT_OK
    api = None
    if not args.dry_run:
        target = _admission_target(args)
        first_url = target if isinstance(target, str) else _url(target.cells[0].endpoints[0])
        signer = credentials or _caller_credentials(args.dev_key, first_url)
        api = AdmissionApi(target, signer, args.region, http)
    retention = _operators_retention(args)
    kinds = args.kind or DEFAULT_KINDS
    waived = [kind for kind in args.kind or () if kind in HELD_KINDS]
    with holding(queue, batches, REDRIVE_VISIBILITY_SECONDS) as parcels:
        chosen = [parcel for parcel in parcels if parcel.kind in kinds]
        replicas = {
            letter.record_id or letter.id
            for parcel in parcels
            if parcel.kind == KEYLESS_REPLICA and parcel.kind not in kinds
            for letter in parcel.letters
        }
        if replicas:
            print(_not_chosen(len(replicas)), file=err)
        planned = plan(chosen, retention, waived)
        if api is not None and planned.letters and not args.yes:
            _confirm(planned, api, stdin, err)
        redrive = Redrive(
            api,
            queue,
            batches,
            Progress(planned.letters, err),
            lambda line: print(line, file=out),
            retention,
            waived,
        )
        redrive.summary.keyless_replicas_not_chosen = len(replicas)
        with _first_interrupt_stops(redrive):
            summary = redrive.run(chosen)
    rows = [("outcome", "records"), *((name, str(count)) for name, count in summary.rows(api is None))]
    out.write(table(rows, right=(1,)))
    if summary.stopped:
        print(f"poimen dlq redrive: stopped: {summary.stopped}", file=err)
    # A dry run stops only when interrupted.
    return summary.exit_code if api is not None or summary.stopped else EXIT_OK


@contextmanager
def _first_interrupt_stops(redrive: Redrive) -> Iterator[None]:
    """Ctrl-C stops the redrive after the record in flight, so that its outcome is recorded; a second
    Ctrl-C interrupts at once. (Signal handlers belong to the main thread: elsewhere, Ctrl-C is Python's.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: FrameType | None) -> None:
        redrive.interrupt()
        signal.signal(signal.SIGINT, signal.default_int_handler)

    previous = signal.signal(signal.SIGINT, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _find(dead_letter_id: str, queue: DeadLetterQueue | None, batches: FailedBatches | None) -> list[DeadLetter]:
    hint = "see poimen dlq list --ids"
    if dead_letter_id.startswith("s3:"):
        if batches is None:
            raise UsageError("an s3: ID needs --bucket")
        key, fragment = dead_letter_id[3:], None
        head, _, tail = key.rpartition("#")
        if head and _RECORD_FRAGMENT.fullmatch(tail):
            key, fragment = head, tail
        parcel = batches.read(key)
        letters = [letter for letter in parcel.letters if fragment is None or letter.id == dead_letter_id]
        if not letters:
            raise DeadLetterNotFound(f"s3://{batches.bucket}/{key} holds no record {fragment}: {hint}")
        return letters
    if dead_letter_id.startswith("sqs:"):
        if queue is None:
            raise UsageError("an sqs: ID needs --queue-url")
        with holding(queue, None, LIST_VISIBILITY_SECONDS) as parcels:
            for parcel in parcels:
                if parcel.id == dead_letter_id:
                    return parcel.letters
        raise DeadLetterNotFound(f"no message {dead_letter_id} in {queue.url}: {hint}")
    raise UsageError(f"{dead_letter_id!r} is not a dead-letter ID (sqs:<MessageId> or s3:<key>[#...]): {hint}")


def _operators_retention(args: argparse.Namespace) -> RunRetention | None:
    """The run retention the operator holds records to (--run-retention-days and its last change), if any. An
    option not given is absent from `args`; an empty --run-retention-days is given: runs kept forever."""
    given = vars(args)
    if "previous_run_retention_days" in given and args.run_retention_changed_at is None:
        raise UsageError("--previous-run-retention-days needs --run-retention-changed-at, when it changed")
    if "run_retention_days" not in given and args.run_retention_changed_at is None:
        return None
    return with_change(
        given.get("run_retention_days"), given.get("previous_run_retention_days"), args.run_retention_changed_at or ""
    )


def _not_chosen(replicas: int) -> str:
    letters = "dead letter" if replicas == 1 else "dead letters"
    spawn = "a keyless spawn" if replicas == 1 else "each a keyless spawn"
    it = "it" if replicas == 1 else "them"
    return (
        f"not chosen: {replicas} {KEYLESS_REPLICA} {letters}: {spawn} replicated from another Region, relayed "
        f"there from its original; send {it} with --kind {KEYLESS_REPLICA} only if that Region lost the original"
    )


def _confirm(planned: Plan, api: AdmissionApi, stdin: TextIO, err: TextIO) -> None:
    if not stdin.isatty():
        raise UsageError("refusing to redrive without confirmation: stdin is not a terminal; add --yes (or --dry-run)")
    keyless = f" {planned.keyless} have no dispatch_key: each becomes a new run." if planned.keyless else ""
    err.write(
        f"Send {planned.sendable} of {planned.letters} dead letters to {api.runs_url}, signed as "
        f"{api.access_key}?{keyless} [y/N] "
    )
    err.flush()
    if stdin.readline().strip().lower() not in ("y", "yes"):
        raise UsageError("redrive not confirmed: nothing was sent")


def _admission_target(args: argparse.Namespace) -> str | CellMap:
    """Where redrive sends records: --api-url, else the cell map of --cells, POIMEN_CELLS_FILE or POIMEN_CELLS."""
    if args.api_url and args.cells is not None:
        raise UsageError("give --api-url or --cells, not both")
    if args.api_url:
        return str(args.api_url)
    try:
        cells = args.cells or CellMap.from_environment()
    except InvalidCellMap as error:
        raise UsageError(f"{error}: fix it, or unset it and give --api-url") from error
    if cells is None:
        raise UsageError(
            f"redrive needs --api-url (stack output AdmissionApiUrl) or a cell map (--cells, {CELLS_FILE_VARIABLE}, "
            f"{CELLS_DOCUMENT_VARIABLE}), or --dry-run"
        )
    return cells


def _url(endpoint: str | RegionalEndpoint) -> str:
    return endpoint if isinstance(endpoint, str) else endpoint.url


def _caller_credentials(dev_key: bool, api_url: str) -> Any:
    if dev_key or _local_credentials(api_url):
        return Credentials(DEV_ACCESS_KEY, DEV_SECRET_KEY)
    found = botocore.session.get_session().get_credentials()
    if found is None:
        raise AwsUnavailable(
            "no AWS credentials to sign admission API calls with: configure them (AWS_PROFILE, aws sso login), "
            "or add --dev-key against poimen dev"
        )
    return found


def _aws_client(service: str, args: argparse.Namespace) -> Any:
    options: dict[str, Any] = {
        "region_name": args.region,
        "config": botocore.config.Config(
            connect_timeout=5,
            read_timeout=30,
            retries={"mode": "standard", "max_attempts": 3},
            s3={"addressing_style": "path"} if args.aws_endpoint else None,
        ),
    }
    if args.aws_endpoint:
        options["endpoint_url"] = args.aws_endpoint
    endpoint = (
        args.aws_endpoint or os.environ.get(f"AWS_ENDPOINT_URL_{service.upper()}") or os.environ.get("AWS_ENDPOINT_URL")
    )
    if args.dev_key or _local_credentials(endpoint):
        # Local only, like the dev key itself: moto takes any key, so poimen dev needs no AWS credentials.
        # Without --aws-endpoint the SDK's AWS_ENDPOINT_URL_SQS / _S3 still name the local endpoints.
        options |= {"aws_access_key_id": DEV_ACCESS_KEY, "aws_secret_access_key": DEV_SECRET_KEY}
    return boto3.client(service, **options)  # type: ignore[call-overload]


def _local_credentials(endpoint: str | None) -> bool:
    """Whether `endpoint` is a loopback one the SDK's chain has no credentials for (then: the dev key)."""
    return local_credentials(endpoint) is not None
