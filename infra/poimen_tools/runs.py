"""`poimen runs spawn|spawn-many|get|find`: the admission API from the shell, through `poimen.client`.

Answers are JSON on stdout (numbers in `input` exactly as the API keeps them); a failure is one line on
stderr and an exit code. Calls are signed (SigV4, execute-api) with your AWS credentials; against a
loopback URL (`poimen dev`) for which the SDK finds none, with poimen dev's documented dev key
(`--dev-key` forces it). A spawn without --dispatch-key gets a key generated for it, so its retries
never admit it twice. `spawn-many` sends a file of spawns, one JSON object a line, in the batch form of POST
/v1/runs (as few calls as its limits allow), and prints one line a spawn, in order.

A multi-Region stack: give --base-url once per Region, in order of preference, as REGION=URL (the
Region its calls are signed for) or a bare URL (Region as for a single one). A connection failure, a
timeout, 408, 429 or 5xx moves the call to the next one, within --max-attempts; the same dispatch_key
goes with it, so the move never admits a run twice.

Cells: --cells FILE (default: the file POIMEN_CELLS_FILE names, or the map POIMEN_CELLS holds, when no
--base-url is given) is a cell map, {"cells": {"<cell>": {"endpoints": [URL or {"url": URL, "region": REGION},
...], "tenants": [...]}}}: the call goes to the endpoints of the one cell that lists --tenant, failing over
between them only, never to another cell's. A tenant in no cell, or in several, is refused before anything
is sent (exit 2).
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, BinaryIO, TextIO

from botocore.credentials import Credentials

from poimen.cells import CellMap, InvalidCellMap
from poimen.client import (
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_TIMEOUT_SECONDS,
    RUN_NOT_FOUND,
    TENANT_NOT_SERVED,
    AdmissionClient,
    AdmissionError,
    CellRoutingError,
    DispatchKeyReused,
    Forbidden,
    InvalidRequest,
    NotFound,
    RegionalEndpoint,
    Spawned,
    SpawnRequest,
    Unavailable,
    generated_dispatch_key,
)
from poimen.contract import json_text, parse_json
from poimen.wire import MAX_BATCH_SPAWNS
from poimen_tools.arguments import base_url, json_object, positive_seconds, region, tenant, text
from poimen_tools.credentials import is_loopback, local_credentials
from poimen_tools.local.sigv4 import DEV_ACCESS_KEY, DEV_SECRET_KEY

DEFAULT_BASE_URL = "http://127.0.0.1:8080"  # `poimen dev` (make run)
# `poimen dev`'s default region: the one signed for against a loopback URL unless --region says otherwise.
LOCAL_REGION = "us-east-1"

# The codes every `poimen` command uses (poimen_tools/cli.py), as they apply to an API call.
EXIT_OK = 0
EXIT_NOT_FOUND = 1  # get, find: no such run for this tenant
EXIT_USAGE = 2  # bad arguments or cell map, a tenant it does not route, or a request refused as such (400, ...)
EXIT_UNAVAILABLE = 3  # no answer (or only 408/429/5xx) after every retry, no credentials, the caller refused (403)

EPILOG = """\
output: spawn prints {"replayed": true|false, "run": {...}}; get and find print the run; numbers in input
exactly as the API keeps them. spawn-many prints a line a spawn, in the order of its file: {"line": N,
"status": 201|200, "replayed": ..., "run": {...}}, or {"line": N, "status": S|null, "dispatch_key": K,
"outcome_unknown": true|false, "error": "..."}, printed as each call ends; its exit code is the worst of its
spawns' (3, then 2), and a file with a line that is no spawn is refused before anything is sent (2).
Interrupted (Ctrl-C), it has printed every spawn it may have admitted: those answered, and those whose call was
under way as outcome unknown, with the dispatch_key to send them again with; the lines not printed were not sent.

exit codes: 0 done; 1 no such run (get, find); 2 usage: bad arguments, a cell map that is not one or a
tenant it lists in no cell or in several (nothing sent), or a request the API refused (400, 413, 415; 422
dispatch_key reused, the line names the existing run); 3 unavailable: no answer, or only
408/429/5xx, after every retry; no credentials; the caller refused (403: signature or tenant not granted,
or a stack that does not serve the tenant: call its cell's API);
a --base-url that is not the admission API.

a spawn without --dispatch-key whose outcome is unknown (every answer lost, or a failure on a retry) may
have admitted a run under the key generated for it: its line names that key, the poimen runs find that
tells whether it did, and the spawn to run instead, with --dispatch-key <that key>, which admits at most
one run. Running the same command again generates another key, and may admit a second run."""


class _Failure(Exception):
    """Ends the command with one line and `exit_code`."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`poimen runs spawn|get|find` under `commands`; each leaf parser sets `run` (its handler, `run` here)
    and `prog`, as every `poimen` command does."""
    common = argparse.ArgumentParser(add_help=False)
    addressed = common.add_mutually_exclusive_group()
    addressed.add_argument(
        "--base-url",
        type=regional_base_url,
        action="append",
        metavar="[REGION=]URL",
        help="admission API base URL, e.g. the stack output AdmissionApiUrl (default: "
        f"{DEFAULT_BASE_URL}, poimen dev); repeat it for each Region of a multi-Region stack, in order of "
        "preference, REGION= naming the Region its calls are signed for",
    )
    addressed.add_argument(
        "--cells",
        type=cells_file,
        metavar="FILE",
        help="a cell map (JSON): the call goes to the endpoints of --tenant's cell, and fails over between "
        "them only (default without --base-url: the file POIMEN_CELLS_FILE names, or the map POIMEN_CELLS "
        "holds)",
    )
    common.add_argument("--tenant", required=True, type=tenant, help="the tenant the call acts for (X-Poimen-Tenant)")
    common.add_argument(
        "--region",
        type=region,
        help="SigV4 region of each --base-url without REGION= (default: the execute-api host's, else the "
        "SDK's; us-east-1 on loopback)",
    )
    common.add_argument(
        "--dev-key",
        action="store_true",
        help="sign with poimen dev's documented dev key (default on loopback when the SDK finds no credentials)",
    )
    common.add_argument(
        "--timeout",
        type=positive_seconds,
        default=DEFAULT_TIMEOUT_SECONDS,
        metavar="SECONDS",
        help="per attempt (default: %(default)g)",
    )
    common.add_argument(
        "--max-attempts", type=_attempts, default=DEFAULT_MAX_ATTEMPTS, help="attempts in all (default: %(default)s)"
    )
    formatter = argparse.RawDescriptionHelpFormatter
    runs = commands.add_parser(
        "runs",
        help="spawn and look up runs through the admission API",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=formatter,
    )
    actions = runs.add_subparsers(dest="action", required=True)
    spawn = actions.add_parser(
        "spawn",
        parents=[common],
        help="POST /v1/runs; retried safely (a key is generated when none is given)",
        epilog=EPILOG,
        formatter_class=formatter,
    )
    spawn.add_argument("--workflow-ref", required=True, type=text)
    spawn.add_argument("--input", required=True, type=json_object, help="a JSON object (numbers kept exactly)")
    spawn.add_argument("--goal-id", type=text)
    spawn.add_argument(
        "--dispatch-key", type=text, help="repeats of a key answer the first run (default: one generated for this call)"
    )
    get = actions.add_parser(
        "get", parents=[common], help="GET /v1/runs/{run_id}", epilog=EPILOG, formatter_class=formatter
    )
    get.add_argument("run_id", type=text, metavar="RUN_ID")
    find = actions.add_parser(
        "find",
        parents=[common],
        help="GET /v1/runs?dispatch_key=: did the spawn with this key land?",
        epilog=EPILOG,
        formatter_class=formatter,
    )
    find.add_argument("dispatch_key", type=text, metavar="DISPATCH_KEY")
    many = actions.add_parser(
        "spawn-many",
        parents=[common],
        help="POST /v1/runs in the batch form: a file of spawns, one JSON object a line (- for stdin)",
        epilog=EPILOG,
        formatter_class=formatter,
    )
    many.add_argument(
        "file",
        # Bytes, decoded a line at a time: a line that is not UTF-8 is a line that is no spawn, not a crash.
        type=argparse.FileType("rb"),
        metavar="FILE",
        help='JSON lines, each {"workflow_ref", "input", "goal_id"?, "dispatch_key"?}; blank lines are skipped',
    )
    for leaf in (spawn, get, find, many):
        leaf.set_defaults(run=run, prog=leaf.prog)


def main(argv: Sequence[str] | None = None) -> int:
    """`poimen runs ...` on its own (argv without `runs`); `--debug` anywhere raises instead of the line."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in arguments
    parser = argparse.ArgumentParser(prog="poimen")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["runs", *(argument for argument in arguments if argument != "--debug")])
    args.debug = debug
    return run(args)


def run(
    args: argparse.Namespace,
    *,
    client: AdmissionClient | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """One `poimen runs <action>`. The API's answers and refusals end here, as JSON on stdout or one line
    on stderr and its exit code (`args.debug`: raised instead); anything else is left to the caller."""
    out, err = stdout or sys.stdout, stderr or sys.stderr
    try:
        if args.action == "spawn-many":
            spawns = _spawns(args.file)
            with client or _client(args) as api:
                return _spawn_many(api, args.tenant, spawns, out)
        with client or _client(args) as api:
            document = _act(api, args)
    except (AdmissionError, _Failure) as error:
        if getattr(args, "debug", False):
            raise
        line, code = _explain(error, args)
        print(f"{getattr(args, 'prog', 'poimen runs')}: {' '.join(line.split())}{_safe_retry(error, args)}", file=err)
        return code
    out.write(document + "\n")
    return EXIT_OK


def _act(api: AdmissionClient, args: argparse.Namespace) -> str:
    if args.action == "spawn":
        spawned = api.spawn(
            args.tenant, args.workflow_ref, args.input, goal_id=args.goal_id, dispatch_key=args.dispatch_key
        )
        return json_text({"replayed": spawned.replayed, "run": spawned.run.model_dump()})
    if args.action == "get":
        return json_text(api.get(args.tenant, args.run_id).model_dump())
    found = api.find(args.tenant, args.dispatch_key)
    if found is None:
        raise _Failure(f"no run for dispatch_key {args.dispatch_key!r} in tenant {args.tenant}", EXIT_NOT_FOUND)
    return json_text(found.model_dump())


def _spawns(lines: BinaryIO) -> list[tuple[int, SpawnRequest]]:
    """The file's spawns with their line numbers; _Failure (nothing sent) at the first line that is none."""
    spawns = []
    with lines:
        for number, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            try:
                fields = parse_json(raw.decode("utf-8"))
                if not isinstance(fields, dict) or set(fields) - {"workflow_ref", "input", "goal_id", "dispatch_key"}:
                    raise ValueError("not an object of workflow_ref, input, goal_id and dispatch_key")
                if not isinstance(fields.get("input"), dict):
                    # As `spawn --input`: the client's dict() would make [["a", 1]] an input, and [] an empty one.
                    raise ValueError("its input is not a JSON object")
                spawn = SpawnRequest(
                    fields["workflow_ref"], fields["input"], fields.get("goal_id"), fields.get("dispatch_key")
                )
            except (ValueError, KeyError, RecursionError) as error:
                where = getattr(lines, "name", "the file")
                raise _Failure(f"{where} line {number} is no spawn ({error}): nothing was sent", EXIT_USAGE) from error
            spawns.append((number, spawn))
    return spawns


def _spawn_many(api: AdmissionClient, tenant: str, spawns: list[tuple[int, SpawnRequest]], out: TextIO) -> int:
    """Each spawn's result on a line of its own, in order, printed as its call ends; the worst exit code of them.

    A line without a dispatch_key gets its generated key here, and the spawns go MAX_BATCH_SPAWNS at a time, so that
    an interruption (Ctrl-C) leaves every spawn it may have admitted named: those answered are printed, and those
    whose call was under way are printed with their keys as outcome unknown; those not printed were not sent."""
    code = EXIT_OK
    for start in range(0, len(spawns), MAX_BATCH_SPAWNS):
        group = spawns[start : start + MAX_BATCH_SPAWNS]
        keyed = [
            spawn if spawn.dispatch_key is not None else replace(spawn, dispatch_key=generated_dispatch_key())
            for _, spawn in group
        ]
        try:
            results = api.spawn_many(tenant, keyed)
        except KeyboardInterrupt:
            for (number, _), spawn in zip(group, keyed, strict=True):
                unknown: dict[str, Any] = {
                    "line": number,
                    "status": None,
                    "dispatch_key": spawn.dispatch_key,
                    "outcome_unknown": True,
                    "error": "interrupted while its call was under way: it may have been admitted under this "
                    "dispatch_key; send it again only with that key",
                }
                out.write(json_text(unknown) + "\n")
            out.flush()
            raise
        for (number, spawn), result in zip(group, results, strict=True):
            line: dict[str, Any]
            if isinstance(result, Spawned):
                # A key generated here is the spawn's own: a 200 is its own lost answer's run, not a replay.
                replayed = result.replayed and spawn.dispatch_key is not None
                status = 200 if replayed else 201
                line = {"line": number, "status": status, "replayed": replayed, "run": result.run.model_dump()}
            else:
                line = {
                    "line": number,
                    "status": result.status,
                    "dispatch_key": result.dispatch_key,
                    "outcome_unknown": result.outcome_unknown,
                    "error": " ".join(str(result).split()),
                }
                refused = isinstance(result, InvalidRequest | DispatchKeyReused)
                code = max(code, EXIT_USAGE if refused else EXIT_UNAVAILABLE)
            out.write(json_text(line) + "\n")
        out.flush()
    return code


def _explain(error: Exception, args: argparse.Namespace) -> tuple[str, int]:
    """(the cause and what to do about it, the exit code)."""
    if isinstance(error, _Failure):
        return str(error), error.exit_code
    if isinstance(error, CellRoutingError):
        return str(error), EXIT_USAGE
    if isinstance(error, DispatchKeyReused):
        return (
            f"{error}: dispatch_key {args.dispatch_key!r} already admitted run {error.run_id} with a different "
            "request; use another key, or poimen runs get that run",
            EXIT_USAGE,
        )
    if isinstance(error, NotFound) and error.problem is not None and error.problem.type == RUN_NOT_FOUND:
        return str(error), EXIT_NOT_FOUND
    if isinstance(error, InvalidRequest):
        return str(error), EXIT_USAGE
    if isinstance(error, Forbidden) and error.problem is not None and error.problem.type == TENANT_NOT_SERVED:
        where = error.endpoint.url if error.endpoint is not None else "--base-url"
        return (
            f"{error}: the API at {where} does not serve tenant {args.tenant} (nothing was written): call its own "
            "stack's AdmissionApiUrl, or its cell's endpoints with --cells (docs/client.md#cells)",
            EXIT_UNAVAILABLE,
        )
    if isinstance(error, Forbidden):
        fix = "check your credentials (--dev-key for poimen dev) and the tenant's grants (poimen grants list)"
        return f"{error}: {fix}", EXIT_UNAVAILABLE
    if isinstance(error, Unavailable):
        if _safe_retry(error, args):
            return str(error), EXIT_UNAVAILABLE  # what to do instead follows
        again = ""
        if args.action == "spawn":
            again = (
                " with the same --dispatch-key" if args.dispatch_key else " (no attempt reached it: nothing admitted)"
            )
        check = "the cell's endpoints in the cell map" if args.base_url is None else "--base-url"
        return f"{error}: check {check} and that the API is up, then try again{again}", EXIT_UNAVAILABLE
    # A route the API lacks (404), 401, 405, a redirect, a success that is no run.
    return f"{error}: is --base-url the admission API (the stack output AdmissionApiUrl)?", EXIT_UNAVAILABLE


def _safe_retry(error: Exception, args: argparse.Namespace) -> str:
    """For a spawn without --dispatch-key whose outcome is unknown: the generated key, how to tell whether it
    admitted a run, and the command that retries it safely (that key); '' otherwise. Its words are quoted for
    a POSIX shell and kept as they are (the rest of the line has its white space collapsed)."""
    if args.action != "spawn" or args.dispatch_key is not None or not isinstance(error, AdmissionError):
        return ""
    key = error.dispatch_key
    if key is None or not error.outcome_unknown:
        return ""
    where = _where(args)
    find = _shell("poimen", "runs", "find", *where, key)
    spawn = ["--workflow-ref", args.workflow_ref, "--input", json_text(args.input)]
    spawn += ["--goal-id", args.goal_id] if args.goal_id is not None else []
    if args.timeout != DEFAULT_TIMEOUT_SECONDS:
        spawn += ["--timeout", f"{args.timeout:g}"]
    if args.max_attempts != DEFAULT_MAX_ATTEMPTS:
        spawn += ["--max-attempts", str(args.max_attempts)]
    retry = _shell("poimen", "runs", "spawn", *where, *spawn, "--dispatch-key", key)
    return (
        f"; the spawn may have admitted a run under the dispatch_key generated for it, {key}, and running the "
        f"same command again would generate another and could admit a second run: see whether it did with "
        f"{find}, or retry with that key, which admits at most one run: {retry}"
    )


def _where(args: argparse.Namespace) -> list[str]:
    """The options that address the API as this command did: --base-url(s), --tenant, --region, --dev-key."""
    words: list[str] = ["--cells", args.cells.source] if args.cells is not None else []
    for url, named in args.base_url or []:
        words += ["--base-url", url if named is None else f"{named}={url}"]
    words += ["--tenant", args.tenant]
    words += ["--region", args.region] if args.region else []
    return [*words, "--dev-key"] if args.dev_key else words


def _shell(*words: str) -> str:
    """`words` as one line of a POSIX shell command: quoted by shlex, or as $'...' when a word holds a
    character that is not printable (a line break would end the line)."""
    return " ".join(
        shlex.quote(word)
        if word.isprintable()
        else "$'" + word.encode("unicode_escape").decode("ascii").replace("'", "\\'") + "'"
        for word in words
    )


def regional_base_url(value: str) -> tuple[str, str | None]:
    """`--base-url`: URL or REGION=URL, as (URL, REGION or None). A URL's scheme comes before any `=` it
    may hold, and a Region has no `:` or `/`, so the two forms cannot be mistaken for each other."""
    named, equals, url = text(value).partition("=")
    if not equals or ":" in named or "/" in named:
        return base_url(value), None
    try:
        return base_url(url), region(named)
    except argparse.ArgumentTypeError as error:
        raise argparse.ArgumentTypeError(f"{value!r} is not REGION=URL: {error}") from error


def cells_file(value: str) -> CellMap:
    """`--cells`: a cell map file (poimen.cells)."""
    try:
        return CellMap.load(Path(text(value)))
    except InvalidCellMap as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def _client(args: argparse.Namespace) -> AdmissionClient:
    cells: CellMap | None = args.cells
    if cells is None and not args.base_url:
        try:
            cells = CellMap.from_environment()
        except InvalidCellMap as error:
            raise _Failure(f"{error}: fix it, or unset it to call --base-url", EXIT_USAGE) from error
    given: list[str | RegionalEndpoint]
    if cells is None:
        given = [url if named is None else RegionalEndpoint(url, named) for url, named in args.base_url or []]
        given = given or [DEFAULT_BASE_URL]
    else:
        given = [endpoint for cell in cells.cells for endpoint in cell.endpoints]
    urls = [entry.url if isinstance(entry, RegionalEndpoint) else entry for entry in given]
    credentials = None
    if args.dev_key:
        credentials = Credentials(DEV_ACCESS_KEY, DEV_SECRET_KEY)
    elif all(is_loopback(url) for url in urls) and (dev_key := local_credentials(urls[0])) is not None:
        # Never with an endpoint elsewhere in the list: a real AWS call is signed only with real credentials.
        credentials = Credentials(*dev_key)
    options = {"credentials": credentials, "timeout": args.timeout, "max_attempts": args.max_attempts}
    try:
        if cells is None:
            return AdmissionClient([_signed_for(entry, args) for entry in given], **options)
        routed = [
            replace(cell, endpoints=tuple(_signed_for(each, args) for each in cell.endpoints)) for cell in cells.cells
        ]
        return AdmissionClient(cells=replace(cells, cells=tuple(routed)), **options)
    except ValueError as error:  # no credentials, or no region, found
        fix = "configure them (AWS_PROFILE, aws sso login), pass --region (or REGION=URL), or --dev-key for poimen dev"
        raise _Failure(f"{error}: {fix}", EXIT_UNAVAILABLE) from error


def _signed_for(entry: str | RegionalEndpoint, args: argparse.Namespace) -> str | RegionalEndpoint:
    """An endpoint with the Region its calls are signed for, where the command decides it: --region for a URL
    without one, and poimen dev's own (us-east-1 unless told) for a loopback URL, whatever the SDK's says."""
    if isinstance(entry, RegionalEndpoint):
        return entry
    signed_for = args.region or (LOCAL_REGION if is_loopback(entry) else None)
    return entry if signed_for is None else RegionalEndpoint(entry, signed_for)


def _attempts(value: str) -> int:
    if not re.fullmatch(r"[0-9]{1,3}", value) or not 1 <= int(value) <= 100:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of attempts from 1 to 100")
    return int(value)


if __name__ == "__main__":
    sys.exit(main())
