"""Argument types the `poimen` commands share: each refuses what the code behind it cannot take, and
argparse turns its ArgumentTypeError into the one-line usage error (exit 2), before anything starts.

Arguments come from argv, where bytes that are not UTF-8 arrive as lone surrogates (surrogateescape):
every type refuses those first, since no AWS call, header or JSON body can carry them.
"""

from __future__ import annotations

import argparse
import re
import socket
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from poimen.config import is_region_name, parse_tenants
from poimen.contract import parse_json
from poimen.kafka import is_tenant_id
from poimen.principals import InvalidPrincipal, grant_principal
from poimen.retention import PENDING, InvalidRetention, parse_changed_at, parse_run_retention_days
from poimen.wire import TENANT_PATTERN

# DynamoDB's and SQS's naming rules (CreateTable TableName; CreateQueue QueueName, standard queues).
_TABLE_NAME = re.compile(r"[a-zA-Z0-9_.-]{3,255}")
_QUEUE_NAME = re.compile(r"[a-zA-Z0-9_-]{1,80}")
# S3 as botocore validates a bucket parameter (legacy names included).
_BUCKET_NAME = re.compile(r"[a-zA-Z0-9.\-_]{1,255}")
# One broker of a bootstrap list: [scheme://]host[:port], the host a name or an IP literal.
_BROKER = re.compile(r"(?:[A-Za-z_]+://)?(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(?::(?P<port>[0-9]{1,5}))?")
# Characters no URL carries bare: white space and control characters.
_NOT_IN_URL = re.compile(r"[\x00-\x20\x7f-\x9f]")


def text(value: str) -> str:
    """Any text, as long as it is text: argv bytes that are not UTF-8 are refused."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise argparse.ArgumentTypeError(f"'{_shown(value)}' is not UTF-8 text") from error
    return value


def tenant(value: str) -> str:
    if not is_tenant_id(text(value)):
        raise argparse.ArgumentTypeError(f"{value!r} is not a tenant id ({TENANT_PATTERN})")
    return value


def tenant_list(value: str) -> tuple[str, ...]:
    """Tenant ids, comma-separated, as the template's Tenants takes them (poimen.config.parse_tenants)."""
    try:
        return parse_tenants(text(value))
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def tenant_or_all(value: str) -> str:
    return value if value == "*" else tenant(value)


def json_object(value: str) -> dict[str, Any]:
    try:
        parsed = parse_json(text(value))
    except (ValueError, RecursionError) as error:  # RecursionError: nested too deep to parse at all
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from error
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, like '{\"key\": 1}'")
    return parsed


def positive_seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from error
    if not 0 < seconds <= 3600:
        raise argparse.ArgumentTypeError(f"{value} is not between 0 and 3600 seconds")
    return seconds


# How an option spells "runs are kept forever" besides the empty value (which a shell makes easy to lose).
FOREVER = "forever"


def run_retention_days(value: str) -> int | None:
    """Days runs are kept, as the template's RunRetentionDays: 1 to 3650, or `forever` or '' (None)."""
    if text(value).strip() == FOREVER:
        return None
    try:
        return parse_run_retention_days(text(value))
    except InvalidRetention as error:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a number of days from 1 to 3650 (or {FOREVER} to keep runs forever)"
        ) from error


def changed_at(value: str) -> str:
    """When a run retention changed, as RunRetentionChangedAt: RFC 3339 UTC, or `pending` (not yet settled)."""
    if text(value).strip() == PENDING:
        return PENDING
    try:
        moment = parse_changed_at(text(value))
    except InvalidRetention as error:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not an RFC 3339 UTC time like 2026-11-29T12:00:00Z (or {PENDING})"
        ) from error
    if moment is None:
        raise argparse.ArgumentTypeError("must not be empty")
    return value.strip()


def whole_number(low: int, high: int) -> Callable[[str], int]:
    """A type for an integer from `low` to `high`, both included."""

    def number(value: str) -> int:
        if not re.fullmatch(r"-?[0-9]{1,20}", value) or not low <= int(value) <= high:
            raise argparse.ArgumentTypeError(f"{value!r} is not a whole number from {low} to {high}")
        return int(value)

    return number


def port(value: str) -> int:
    if not re.fullmatch(r"[0-9]{1,5}", value) or int(value) > 65535:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port (0 to 65535)")
    return int(value)


def listen_host(value: str) -> str:
    """An address this machine can listen on: an IP literal or a name that resolves."""
    if not text(value):
        raise argparse.ArgumentTypeError("give an address to listen on (0.0.0.0 for every interface)")
    try:
        socket.getaddrinfo(value, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise argparse.ArgumentTypeError(f"cannot listen on {value!r} ({reason.lower()})") from error
    return value


def region(value: str) -> str:
    if not is_region_name(text(value)):
        raise argparse.ArgumentTypeError(f"{value!r} is not an AWS region (like us-east-1)")
    return value


def endpoint_url(value: str) -> str:
    """An http(s) URL with a host, and a port if any in range."""
    reason = _url_problem(value)
    if reason is not None:
        raise argparse.ArgumentTypeError(f"{value!r} is not an http(s) URL (like http://127.0.0.1:8000){reason}")
    return value


def base_url(value: str) -> str:
    """The base URL of an API: an http(s) URL without query or fragment."""
    reason = _url_problem(value)
    if reason is None and (urlsplit(value).query or urlsplit(value).fragment):
        reason = ""
    if reason is not None:
        raise argparse.ArgumentTypeError(f"{value!r} is not an http(s) URL without query or fragment{reason}")
    return value


def bootstrap_servers(value: str) -> str:
    """A Kafka bootstrap list: HOST[:PORT] brokers, comma-separated."""
    brokers = [broker.strip() for broker in text(value).split(",")]
    for broker in brokers:
        match = _BROKER.fullmatch(broker)
        if match is None or (match["port"] is not None and not 1 <= int(match["port"]) <= 65535):
            raise argparse.ArgumentTypeError(
                f"{value!r} is not a list of HOST:PORT brokers (like 127.0.0.1:9092,b-2.example.com:9098)"
            )
    return value


def table_name(value: str) -> str:
    if not _TABLE_NAME.fullmatch(text(value)):
        raise argparse.ArgumentTypeError(f"{value!r} is not a DynamoDB table name (3 to 255 of A-Z a-z 0-9 _ . -)")
    return value


def queue_name(value: str) -> str:
    if not _QUEUE_NAME.fullmatch(text(value)):
        raise argparse.ArgumentTypeError(f"{value!r} is not an SQS queue name (1 to 80 of A-Z a-z 0-9 _ -)")
    return value


def bucket_name(value: str) -> str:
    if not _BUCKET_NAME.fullmatch(text(value)):
        raise argparse.ArgumentTypeError(f"{value!r} is not an S3 bucket name")
    return value


def principal_arn(value: str) -> str:
    """The ARN of an IAM or STS principal, as given."""
    try:
        grant_principal(text(value))
    except InvalidPrincipal as error:
        raise argparse.ArgumentTypeError(str(error)) from error
    return value


def kafka_connection_arguments(
    parser: argparse.ArgumentParser,
    timeout_help: str,
    *,
    timeout_seconds: float,
    region_default: str = "us-east-1",
    region_help: str = "MSK region with --iam ",
) -> None:
    """The broker options of the commands that reach Kafka: --bootstrap-servers, --iam, --region, --timeout."""
    parser.add_argument(
        "--bootstrap-servers",
        type=bootstrap_servers,
        default="127.0.0.1:9092",
        help="(default: %(default)s, the broker of `poimen dev`)",
    )
    parser.add_argument("--iam", action="store_true", help="authenticate to MSK with IAM (SASL_SSL/OAUTHBEARER)")
    parser.add_argument("--region", type=region, default=region_default, help=f"{region_help}(default: %(default)s)")
    parser.add_argument(
        "--timeout",
        type=positive_seconds,
        default=timeout_seconds,
        metavar="SECONDS",
        help=f"{timeout_help} (default: {timeout_seconds:g})",
    )


def _url_problem(value: str) -> str | None:
    """None for an http(s) URL with a host and a valid port; else why not, as a suffix ('' or ' (...)')."""
    if _NOT_IN_URL.search(text(value)):
        return ""
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises ValueError for a port out of range or not a number
    except ValueError as error:
        return f" ({str(error).lower()})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return ""
    return None


def _shown(value: str) -> str:
    """`value` as its bytes would read: undecodable ones as \\xNN."""
    try:
        raw = value.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate not from argv (in-process callers)
        raw = value.encode("utf-8", "backslashreplace")
    return raw.decode("utf-8", "backslashreplace")
