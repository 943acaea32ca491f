"""`poimen events backfill|tail`: the outbox's events topics from the shell.

`backfill` republishes the event of every run a tenant admitted in a time window, as the outbox relay
publishes it (the same code builds and sends it: identical key, headers and value), for events the outbox
gave up on (its parked batches) or never saw. Consumers already deduplicate by `ce_id` (the admission's id,
the same in every copy), so a backfill is safe to repeat. `tail` prints a tenant's events as they arrive, one
line each; a broker that does not answer within --timeout, or a tenant without an events topic, ends it with
one line and an exit code.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

import boto3
from confluent_kafka import Consumer, KafkaError, KafkaException

from poimen.kafka import events_topic
from poimen.kafka_client import broker_error_reason, client_config, quiet_client_settings
from poimen.wire import rfc3339
from poimen_tools.arguments import (
    endpoint_url,
    kafka_connection_arguments,
    table_name,
    tenant,
    text,
    whole_number,
)
from poimen_tools.credentials import local_credentials
from poimen_tools.topics import KafkaUnreachable

EXIT_OK = 0
EXIT_REFUSED = 1  # backfill: a run item that is no event, or an event the broker can never take (cli.py's codes)
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3  # the broker did not acknowledge every event in time
# Events sent per flush: each chunk is acknowledged before the next is read, and a progress line follows it.
CHUNK = 500
LOCAL_STACK = "local"  # `poimen dev`'s stack name (poimen_tools.local.stream_source.LOCAL_STACK)


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`poimen events backfill|tail` under `commands`; each leaf sets `run` and `prog` as every command does."""
    events = commands.add_parser("events", help="the outbox's poimen.<tenant>.events topics: backfill, tail")
    actions = events.add_subparsers(dest="action", required=True)

    backfill = actions.add_parser(
        "backfill", help="republish the event of every run a tenant admitted in a window (identical records)"
    )
    backfill.set_defaults(run=_backfill, prog=backfill.prog)
    backfill.add_argument("--tenant", required=True, type=tenant)
    backfill.add_argument(
        "--since", required=True, type=_bound, metavar="TIME", help="RFC 3339, inclusive (to the millisecond, up)"
    )
    backfill.add_argument(
        "--until", type=_bound, metavar="TIME", help="RFC 3339, exclusive (to the millisecond, up; default: now)"
    )
    backfill.add_argument("--dry-run", action="store_true", help="count the window's runs; publish nothing")
    backfill.add_argument(
        "--stack-name",
        type=text,
        default=os.environ.get("POIMEN_STACK_NAME", LOCAL_STACK),
        help="the stack whose events these are, in ce_source urn:poimen:<stack>:<tenant>: the deployed "
        "stack's name, for records identical to its outbox's (default: $POIMEN_STACK_NAME, else local)",
    )
    backfill.add_argument(
        "--table-name", type=table_name, default=os.environ.get("TABLE_NAME") or "poimen-admission-local"
    )
    backfill.add_argument(
        "--dynamodb-endpoint", type=endpoint_url, metavar="URL", help="a local endpoint, e.g. that of poimen dev"
    )
    _connection_arguments(backfill, "seconds to wait for the broker to acknowledge each chunk of events")

    tail = actions.add_parser(
        "tail",
        help="print a tenant's events as they arrive: time, run id, key, workflow (a record that is no event: "
        "one line on stderr)",
    )
    tail.set_defaults(run=_tail, prog=tail.prog)
    tail.add_argument("--tenant", required=True, type=tenant)
    tail.add_argument("--from-beginning", action="store_true", help="from the topic's first event, not the next")
    tail.add_argument(
        "--limit", type=whole_number(1, 10**9), metavar="N", help="stop after N events (default: until Ctrl-C)"
    )
    _connection_arguments(tail, "seconds to wait for the broker, when connecting and whenever it stops answering")


# --- backfill ----------------------------------------------------------------------------------------------


def _backfill(args: argparse.Namespace) -> int:
    # Imported here, not with the CLI: the outbox's Powertools objects must be created only once a command
    # uses them (poimen dev sets their environment first; see poimen_tools/cli.py's main).
    from poimen.config import OutboxSettings
    from poimen.observability import logger
    from poimen.outbox import BatchOutcome, OutboxBatchFailed, OutboxRelay

    if not args.debug:
        logger.setLevel(logging.WARNING)  # the relay's per-batch log lines are for Lambda, not this terminal
    bounds = _window(args)
    if bounds is None:
        return EXIT_USAGE
    since, until = bounds
    window = f"[{since.at}, {until.at})"
    items = sorted(_runs_in_window(args, since.at, until.at), key=lambda item: item["created_at"]["S"])
    events_of, malformed = _events_and_malformed(items, args.stack_name)
    if args.dry_run:
        print(f"{len(items)} run(s) of tenant {args.tenant} created in {window}; nothing published (--dry-run)")
        for reason in malformed:
            print(f"{args.prog}: {reason}: it is no event, and would not be published", file=sys.stderr)
        return EXIT_REFUSED if malformed else EXIT_OK
    settings = OutboxSettings(
        bootstrap_servers=args.bootstrap_servers,
        region=args.region,
        stack_name=args.stack_name,
        iam_auth=args.iam,
        delivery_timeout_seconds=args.timeout,
        time_margin_seconds=0.0,
    )
    relay = OutboxRelay(settings)
    published = 0
    undeliverable: list[str] = []
    for start in range(0, len(events_of), CHUNK):
        chunk = events_of[start : start + CHUNK]
        # The stream's own shape, so the outbox's one code path builds and sends each event.
        event = {"Records": [{"eventName": "INSERT", "dynamodb": {"NewImage": item}} for item in chunk]}
        outcome = BatchOutcome()
        try:
            relay.publish_batch(event, lambda: int(args.timeout * 1000), outcome)
        except OutboxBatchFailed as error:
            if args.debug:
                raise
            line = (
                f"{published} of {len(events_of)} event(s) published, then the broker at {args.bootstrap_servers} "
                f"did not acknowledge the rest within {args.timeout:g} s ({error}); rerun the backfill (it is safe "
                "to repeat), --timeout to wait longer"
            )
            print(f"{args.prog}: {' '.join(line.split())}", file=sys.stderr)
            return EXIT_UNAVAILABLE
        undeliverable += [f"{aside.event.run_id}: {aside.error.name()}" for aside in outcome.undeliverable]
        published += len(chunk) - len(outcome.undeliverable)
        print(f"backfill: {published}/{len(events_of)} event(s) published", file=sys.stderr, flush=True)
    print(f"{events_topic(args.tenant)}: {published} event(s) published for runs created in {window}")
    for reason in malformed:
        print(f"{args.prog}: {reason}: it is no event, not published", file=sys.stderr)
    if undeliverable:
        line = (
            f"{len(undeliverable)} event(s) not published: the broker can never take them as they are "
            f"({', '.join(undeliverable[:3])}{', ...' if len(undeliverable) > 3 else ''}); an unknown topic: create "
            f"it with poimen topics ensure --tenant {args.tenant}, then backfill again"
        )
        print(f"{args.prog}: {line}", file=sys.stderr)
    return EXIT_REFUSED if malformed or undeliverable else EXIT_OK


def _window(args: argparse.Namespace) -> tuple[Bound, Bound] | None:
    """(since, until) as the window uses them, each rounding said on stderr; None, said in one line, if the
    window [since, until) is empty."""
    since: Bound = args.since
    now = rfc3339(datetime.now(UTC))
    until: Bound = args.until or Bound(now, now)
    if since.at >= until.at:
        print(
            f"{args.prog}: --since {since.at} is not before --until {until.at}: the window [since, until) holds "
            "nothing; give a later --until",
            file=sys.stderr,
        )
        return None
    for option, bound in (("--since", since), ("--until", until)):
        if bound.rounded:
            print(
                f"note: {option} {bound.given} is taken as {bound.at}: created_at has millisecond precision, and "
                "the window starts and ends at the first millisecond at or after the times given",
                file=sys.stderr,
            )
    return since, until


def _events_and_malformed(items: list[dict[str, Any]], stack_name: str) -> tuple[list[dict[str, Any]], list[str]]:
    """The items that are events, and why each other one is not: a run item lacking what an event needs is
    said to be that, apart, and the others are published."""
    from poimen.outbox import MalformedRun, run_event

    events_of: list[dict[str, Any]] = []
    malformed: list[str] = []
    for item in items:
        try:
            run_event(item, stack_name)
        except MalformedRun as error:
            malformed.append(str(error))
            continue
        events_of.append(item)
    return events_of, malformed


def _runs_in_window(args: argparse.Namespace, since: str, until: str) -> Iterator[dict[str, Any]]:
    """Every admitted run item of the tenant created in [since, until), as DynamoDB JSON (the stream's form).

    A scan: an operator's command over a window, never on a request path. created_at is RFC 3339 UTC in
    one format (milliseconds, Z), so its text orders as its time.
    """
    dev_key = local_credentials(args.dynamodb_endpoint)
    access_key, secret_key = dev_key or (None, None)
    client = boto3.client(
        "dynamodb",
        region_name=args.region,
        endpoint_url=args.dynamodb_endpoint,
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
    )
    request: dict[str, Any] = {
        "TableName": args.table_name,
        "ConsistentRead": True,
        "FilterExpression": "begins_with(pk, :prefix) AND #status = :admitted AND created_at BETWEEN :since AND :until",
        "ExpressionAttributeNames": {"#status": "status"},
        "ExpressionAttributeValues": {
            ":prefix": {"S": f"RUN#{args.tenant}#"},
            ":admitted": {"S": "admitted"},
            ":since": {"S": since},
            ":until": {"S": until},
        },
    }
    for page in client.get_paginator("scan").paginate(**request):
        for item in page["Items"]:
            if item["created_at"]["S"] < until:  # BETWEEN includes its upper bound; the window does not
                yield item


# --- tail ----------------------------------------------------------------------------------------------


# A record's headers as confluent-kafka gives them (a list of pairs, in practice).
Headers = Mapping[str, str | bytes | None] | Sequence[tuple[str, str | bytes | None]]


class EventsTopicMissing(Exception):
    """The broker has no events topic for the tenant (MSK creates none on demand; the outbox writes only
    to topics that exist)."""

    def __init__(self, topic: str, bootstrap_servers: str) -> None:
        super().__init__(f"Kafka at {bootstrap_servers} has no topic {topic}")
        self.topic = topic
        self.bootstrap_servers = bootstrap_servers


class NotAnEvent(ValueError):
    """A record on an events topic that is not an event of the outbox; the message says why."""


def _tail(args: argparse.Namespace) -> int:
    """Every event of the tenant's topic, one line each on stdout, until --limit (or Ctrl-C).

    Before subscribing, the topic's metadata is asked for (within --timeout): KafkaUnreachable if no broker
    answers, EventsTopicMissing if it has no such topic. The consumer never asks the broker to create it
    (librdkafka's `allow.auto.create.topics`, false), so a broker that creates unknown topics and one that
    refuses them, as MSK does, answer alike. When every broker goes down while tailing, the same check runs
    again: the tail ends once the broker has not answered for --timeout.
    """
    topic = events_topic(args.tenant)
    # librdkafka's reports (error_cb), newest last: the reason a broker could not be reached.
    reports: deque[KafkaError] = deque(maxlen=20)
    consumer = Consumer(
        client_config(
            args.bootstrap_servers,
            args.region if args.iam else None,
            **{
                # A group of its own, never committed: tailing moves nobody's offsets.
                "group.id": f"poimen-events-tail-{os.getpid()}",
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest" if args.from_beginning else "latest",
                "allow.auto.create.topics": False,
                "error_cb": reports.append,
                **quiet_client_settings(args.timeout),
            },
        )
    )
    printed = 0
    try:
        consumer.poll(0)  # librdkafka serves oauth_cb (MSK IAM) only from poll()
        _check_topic(consumer, topic, args, reports)
        consumer.subscribe([topic])
        while args.limit is None or printed < args.limit:
            message = consumer.poll(0.5)
            if any(report.code() == KafkaError._ALL_BROKERS_DOWN for report in reports):
                reports.clear()
                _check_topic(consumer, topic, args, reports)
            if message is None:
                continue
            error = message.error()
            if error is not None:
                if error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:  # deleted while tailing
                    raise EventsTopicMissing(topic, args.bootstrap_servers)
                if error.fatal():
                    raise KafkaException(error)
                continue  # transient; librdkafka retries
            try:
                line = _event_line(message.headers() or [], message.value())
            except NotAnEvent as why:
                where = f"{message.topic()} partition {message.partition()} offset {message.offset()}"
                print(f"{args.prog}: {where}: not an event ({why}); skipped", file=sys.stderr, flush=True)
                continue
            print(line, flush=True)
            printed += 1
    finally:
        consumer.close()
    return EXIT_OK


def _check_topic(consumer: Consumer, topic: str, args: argparse.Namespace, reports: deque[KafkaError]) -> None:
    """Returns once a broker has answered, within --timeout, that `topic` exists; else KafkaUnreachable,
    EventsTopicMissing, or the broker's refusal (KafkaException: not authorised, say)."""
    try:
        metadata = consumer.list_topics(topic, timeout=args.timeout)
    except KafkaException as error:
        consumer.poll(0)  # serves error_cb: the transport error that says why
        transport = [report.str() for report in reports if report.code() == KafkaError._TRANSPORT]
        reason = broker_error_reason(transport[-1]) if transport else error.args[0].str()
        raise KafkaUnreachable(args.bootstrap_servers, reason, args.timeout) from error
    found = metadata.topics.get(topic)
    refusal = found.error if found is not None else None
    if found is None or (refusal is not None and refusal.code() == KafkaError.UNKNOWN_TOPIC_OR_PART):
        raise EventsTopicMissing(topic, args.bootstrap_servers)
    if refusal is not None:
        raise KafkaException(refusal)


def _event_line(headers: Headers, value: bytes | None) -> str:
    """`<time> <run id> <dispatch key, - if none> <workflow_ref>`: the time is the event's `ce_time`, else the
    run's `created_at`; the run id is the run's (its `ce_id` names the admission). NotAnEvent for a record
    that is no run: a tombstone, a value that is not JSON, JSON without a run_id and a workflow_ref."""
    if value is None:
        raise NotAnEvent("a tombstone: no value")
    try:
        run = json.loads(value)
    except (ValueError, RecursionError) as error:  # not UTF-8, not JSON, nested too deep to read
        raise NotAnEvent("its value is not JSON") from error
    if (
        not isinstance(run, dict)
        or not isinstance(run.get("run_id"), str)
        or not isinstance(run.get("workflow_ref"), str)
    ):
        raise NotAnEvent("not a run: no run_id and workflow_ref")
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    text = {name: raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw for name, raw in pairs if raw}
    key = run.get("dispatch_key")
    return " ".join(
        [
            text.get("ce_time") or str(run.get("created_at") or "?"),
            run["run_id"],
            key if isinstance(key, str) and key else "-",
            run["workflow_ref"],
        ]
    )


# --- arguments -----------------------------------------------------------------------------------------


def _connection_arguments(parser: argparse.ArgumentParser, timeout_help: str) -> None:
    default_region = os.environ.get("AWS_REGION") or "us-east-1"  # also the table's, for backfill
    kafka_connection_arguments(
        parser, timeout_help, timeout_seconds=30.0, region_default=default_region, region_help=""
    )


class Bound(NamedTuple):
    """A window bound: the time given, and `at`, the first millisecond at or after it, as created_at is
    written (UTC, milliseconds, Z): created_at >= since, and < until, hold exactly when they hold of `at`."""

    given: str
    at: str

    @property
    def rounded(self) -> bool:
        return _timestamp(self.given, exact=True) != self.at


def _bound(text: str) -> Bound:
    return Bound(text, _timestamp(text))


_FRACTION = re.compile(r"\d{2}:\d{2}:\d{2}[.,](?P<digits>\d+)")


def _timestamp(text: str, *, exact: bool = False) -> str:
    """An RFC 3339 time, as created_at is written: UTC, milliseconds, Z; rounded up to the next millisecond
    if it falls between two (with `exact`, cut to the millisecond: what it was before, for comparison)."""
    try:
        moment = datetime.fromisoformat(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not an RFC 3339 time (2026-11-27T12:00:00Z)") from error
    if moment.tzinfo is None:
        raise argparse.ArgumentTypeError(f"{text!r} has no UTC offset: end it with Z or +HH:MM")
    # From the text, not the datetime: fromisoformat keeps six digits at most.
    found = _FRACTION.search(text)
    digits = found["digits"] if found else ""
    moment = moment.replace(microsecond=int(digits[:3].ljust(3, "0")) * 1000)
    if not exact and digits[3:].strip("0"):
        moment += timedelta(milliseconds=1)
    return rfc3339(moment)
