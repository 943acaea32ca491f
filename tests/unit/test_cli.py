"""The CLI's edge in-process: each failure's one line and exit code (`explain`), the dev key only for
loopback endpoints, and the publisher's fail-fast settings. The console script itself, end to end, is
tests/integration/test_cli_errors.py."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import botocore.exceptions
import pytest
from confluent_kafka import KafkaError, KafkaException
from pydantic import ValidationError

from poimen import dispatch
from poimen.contract import RunRequest
from poimen.dispatch import GENERATED_KEY_PREFIX, DispatchPublisher, InvalidDispatch, PublishFailed
from poimen.errors import StoreUnavailable
from poimen.ids import keyed_run_id
from poimen.kafka_client import LIBRDKAFKA_LOGGER, broker_error_reason
from poimen.principals import InvalidPrincipal
from poimen.store import Store
from poimen_tools import cli, dlq, topics
from poimen_tools.cli import GrantNotFound, PortInUse, build_parser, explain, main
from poimen_tools.credentials import is_loopback, local_credentials
from poimen_tools.local.dev import InvalidTemplate
from poimen_tools.local.sigv4 import DEV_ACCESS_KEY, DEV_SECRET_KEY, InvalidPrincipals
from poimen_tools.topics import KafkaUnreachable
from tests.conftest import REPO
from tests.unit.test_dispatch import FakeProducer

REFUSED = "127.0.0.1:1/bootstrap: Connect to ipv4#127.0.0.1:1 failed: Connection refused (after 0ms in state CONNECT)"


def grants_args(*argv: str) -> argparse.Namespace:
    args = build_parser().parse_args(["grants", "list", *argv])
    args.debug = False
    return args


def publish_args() -> argparse.Namespace:
    return build_parser().parse_args(
        ["dispatch", "publish", "--tenant", "acme", "--workflow-ref", "wf", "--input", "{}"]
    )


def validation_error() -> ValidationError:
    try:
        RunRequest(workflow_ref="", input={})
    except ValidationError as error:
        return error
    raise AssertionError("RunRequest accepted an empty workflow_ref")


@pytest.mark.parametrize(
    ("error", "args", "line", "code"),
    [
        (
            StoreUnavailable('DynamoDB unreachable: Could not connect to the endpoint URL: "http://127.0.0.1:1/"'),
            grants_args("--dynamodb-endpoint", "http://127.0.0.1:1"),
            "cannot reach DynamoDB at http://127.0.0.1:1 (Could not connect to the endpoint URL: "
            '"http://127.0.0.1:1/"); start it (poimen dev) or pass --dynamodb-endpoint',
            3,
        ),
        (
            botocore.exceptions.ClientError({"Error": {"Code": "ResourceNotFoundException", "Message": "no"}}, "Scan"),
            grants_args("--table-name", "nope", "--dynamodb-endpoint", "http://localhost:8000"),
            "no table nope in DynamoDB at http://localhost:8000: pass --table-name (poimen dev prints its table) "
            "or --dynamodb-endpoint",
            1,
        ),
        (
            botocore.exceptions.ClientError({"Error": {"Code": "AccessDeniedException", "Message": "denied"}}, "Scan"),
            grants_args("--region", "eu-west-1"),
            "DynamoDB in eu-west-1 refused the call (AccessDeniedException: denied); check your AWS credentials "
            "and --region",
            3,
        ),
        (
            GrantNotFound("arn:aws:iam::123456789012:role/r", "acme"),
            grants_args(),
            "arn:aws:iam::123456789012:role/r holds no grant of tenant acme: nothing removed (see poimen grants list)",
            1,
        ),
        (InvalidPrincipal("'x' is not an IAM or STS principal ARN"), grants_args(), "'x' is not", 2),
        (
            validation_error(),
            publish_args(),
            "not a valid spawn request: workflow_ref: String should have at least 1 character",
            2,
        ),
        (
            PublishFailed("b:9092", 0, ["Local: Message timed out"], [REFUSED], 10.0),
            publish_args(),
            "cannot publish to Kafka at b:9092 (connection refused): 1 record(s) not acknowledged within 10 s; "
            "start the broker (poimen dev) or pass --bootstrap-servers (--timeout to wait longer)",
            3,
        ),
        (
            PublishFailed("b:9092", 0, ["Broker: Unknown topic or partition"], [], 10.0),
            publish_args(),
            "Kafka at b:9092 has no topic poimen.acme.dispatch: create it with poimen topics ensure --tenant acme "
            "--bootstrap-servers b:9092",
            1,
        ),
        (
            KafkaUnreachable("b:9092", "connection refused", 2.0),
            publish_args(),
            "cannot reach Kafka at b:9092 (connection refused) within 2 s; start it (poimen dev) or pass "
            "--bootstrap-servers",
            3,
        ),
        (
            KafkaException(KafkaError(KafkaError.INVALID_REPLICATION_FACTOR, "Replication factor too large")),
            publish_args(),
            "Kafka at 127.0.0.1:9092 refused: Replication factor too large",
            1,
        ),
        (
            PortInUse("--kafka-port", "127.0.0.1", 9092),
            build_parser().parse_args(["dev"]),
            "port 9092 on 127.0.0.1 is in use; stop what listens there, or pass --kafka-port with another port "
            "(0 for any free one), --kafka-bootstrap HOST:PORT to use a broker already there, or --no-kafka",
            4,
        ),
        (
            FileNotFoundError(2, "No such file or directory", "principals.json"),
            build_parser().parse_args(["dev"]),
            "cannot read principals.json (no such file or directory); check the path",
            2,
        ),
        (
            InvalidDispatch("the spawn request's body exceeds 262144 bytes (300000)"),
            publish_args(),
            "the spawn request's body exceeds 262144 bytes (300000)",
            2,
        ),
        (
            InvalidPrincipals("POIMEN_LOCAL_PRINCIPALS: p.json is not JSON (Expecting value)"),
            build_parser().parse_args(["dev"]),
            "POIMEN_LOCAL_PRINCIPALS: p.json is not JSON (Expecting value)",
            2,
        ),
        (
            InvalidTemplate("t.yaml is not poimen's SAM template: it declares no AWS::DynamoDB::Table AdmissionTable"),
            build_parser().parse_args(["dev"]),
            "t.yaml is not poimen's SAM template",
            2,
        ),
        (KeyboardInterrupt(), grants_args(), "interrupted", 130),
        (
            RuntimeError("first\nsecond"),
            grants_args(),
            "unexpected RuntimeError: first second; rerun with --debug for the traceback, and report it",
            70,
        ),
    ],
)
def test_each_failure_is_one_line_and_its_exit_code(
    error: BaseException, args: argparse.Namespace, line: str, code: int
) -> None:
    explained, exit_code = explain(error, args)

    assert explained.startswith(line)
    assert "\n" not in explained
    assert exit_code == code


def test_the_cli_and_dlq_share_one_table_of_exit_codes() -> None:
    assert (dlq.EXIT_OK, dlq.EXIT_REMAINING, dlq.EXIT_USAGE, dlq.EXIT_UNREACHABLE) == (
        cli.EXIT_OK,
        cli.EXIT_NOT_FOUND,
        cli.EXIT_USAGE,
        cli.EXIT_UNAVAILABLE,
    )
    for code in (0, 1, 2, 3, 4, 70, 130):
        assert f"\n  {code} " in cli.EPILOG


def test_a_usage_error_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["dispatch", "publish", "--tenant", "acme"])

    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert err.splitlines() == [
        "poimen dispatch publish: the following arguments are required: --workflow-ref, --input; "
        "see poimen dispatch publish --help"
    ]


def test_removing_a_grant_that_is_not_there_says_so(
    store: Store, table_name: str, tenant: str, capsys: pytest.CaptureFixture[str]
) -> None:
    principal = "arn:aws:iam::123456789012:role/poimen-orchestrator"
    store.grant(principal, "other-tenant")

    code = main(["grants", "remove", "--principal", principal, "--tenant", tenant, "--table-name", table_name])

    out, err = capsys.readouterr()
    assert (code, out) == (1, "")
    assert err.splitlines() == [
        f"poimen grants remove: {principal} holds no grant of tenant {tenant}: nothing removed (see poimen grants list)"
    ]
    assert store.granted_tenants(principal) == frozenset({"other-tenant"})


@pytest.mark.parametrize(
    ("url", "loopback"),
    [
        ("http://127.0.0.1:8000", True),
        ("http://localhost:4566", True),
        ("http://127.8.9.10", True),
        ("http://[::1]:8000", True),
        ("127.0.0.1:9092", True),
        ("https://dynamodb.us-east-1.amazonaws.com", False),
        ("http://10.0.0.7:8000", False),
        ("http://localhost.example.com", False),
    ],
)
def test_loopback_endpoints_are_told_from_others(url: str, loopback: bool) -> None:
    assert is_loopback(url) is loopback


@pytest.fixture
def no_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-role probe from a unit test


@pytest.mark.usefixtures("no_credentials")
def test_the_dev_key_stands_in_only_for_a_loopback_endpoint_without_credentials() -> None:
    assert local_credentials("http://127.0.0.1:8000") == (DEV_ACCESS_KEY, DEV_SECRET_KEY)
    assert local_credentials("https://dynamodb.us-east-1.amazonaws.com") is None
    assert local_credentials(None) is None


def test_the_callers_own_credentials_win_even_for_a_loopback_endpoint() -> None:
    # tests/conftest.py sets testing/testing
    assert local_credentials("http://127.0.0.1:8000") is None


def test_the_publisher_fails_fast_with_a_timeout_and_routes_librdkafka_logs(monkeypatch: pytest.MonkeyPatch) -> None:
    configs: list[dict[str, Any]] = []

    class Recorder:
        def __init__(self, config: dict[str, Any]) -> None:
            configs.append(config)

        def poll(self, timeout: float) -> int:
            return 0

    monkeypatch.setattr(dispatch, "Producer", Recorder)

    DispatchPublisher("127.0.0.1:1", delivery_timeout_seconds=2)
    DispatchPublisher("127.0.0.1:1")

    quick, default = configs
    assert quick["message.timeout.ms"] == 2000
    assert quick["socket.connection.setup.timeout.ms"] == 2000
    assert quick["logger"].name == default["logger"].name == LIBRDKAFKA_LOGGER
    assert default["message.timeout.ms"] == 300_000  # the orchestrator's publisher waits out an outage
    assert "socket.connection.setup.timeout.ms" not in default


def test_a_failed_publish_says_why_the_broker_did_not_answer() -> None:
    # Given the client's errors as librdkafka reports them while no broker listens
    failed = PublishFailed("127.0.0.1:1", 0, ["Local: Message timed out"], [REFUSED], 2.0)

    assert failed.reason == "connection refused"
    assert failed.records == 1
    assert "failures: ['Local: Message timed out']" in str(failed)
    assert broker_error_reason("1/1 brokers are down") == "1/1 brokers are down"


NOT_UTF8 = "\udcff"  # the byte 0xff in argv (surrogateescape)
PUBLISH = ["dispatch", "publish", "--tenant", "acme", "--workflow-ref", "wf", "--input", "{}"]
SPAWN = ["runs", "spawn", "--tenant", "acme", "--workflow-ref", "wf", "--input", "{}"]
ENSURE = ["topics", "ensure", "--tenant", "acme"]
BACKFILL = ["events", "backfill", "--tenant", "acme", "--since", "2026-11-27T10:00:00Z"]


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["runs", "get", "--tenant", "acme", NOT_UTF8], "RUN_ID"),
        (["runs", "find", "--tenant", "acme", NOT_UTF8], "DISPATCH_KEY"),
        (["runs", "get", "--tenant", "Acme", "r"], "--tenant"),
        (["runs", "get", "--tenant", NOT_UTF8, "r"], "--tenant"),
        ([*SPAWN, "--region="], "--region"),
        ([*SPAWN, "--region", "not_a_region!"], "--region"),
        ([*SPAWN, "--goal-id", NOT_UTF8], "--goal-id"),
        ([*SPAWN, "--dispatch-key", NOT_UTF8], "--dispatch-key"),
        ([*SPAWN[:5], NOT_UTF8, *SPAWN[6:]], "--workflow-ref"),
        (["runs", "get", "--tenant", "acme", "r", "--base-url", "http://127.0.0.1:x/"], "--base-url"),
        (["runs", "get", "--tenant", "acme", "r", "--base-url", f"http://{NOT_UTF8}/"], "--base-url"),
        (["runs", "get", "--tenant", "acme", "r", "--base-url", "http://a b/"], "--base-url"),
        (["runs", "get", "--tenant", "acme", "r", "--max-attempts", "²"], "--max-attempts"),
        ([*PUBLISH[:-1], '{"a": "' + NOT_UTF8 + '"}'], "--input"),
        ([*PUBLISH, "--bootstrap-servers", NOT_UTF8], "--bootstrap-servers"),
        ([*PUBLISH, "--bootstrap-servers="], "--bootstrap-servers"),
        ([*PUBLISH, "--bootstrap-servers", "a:1,,b:2"], "--bootstrap-servers"),
        ([*PUBLISH, "--bootstrap-servers", "a:99999"], "--bootstrap-servers"),
        ([*PUBLISH, "--iam", "--region", NOT_UTF8], "--region"),
        ([*PUBLISH, "--iam", "--region="], "--region"),
        ([*PUBLISH, "--goal-id", NOT_UTF8], "--goal-id"),
        ([*ENSURE, "--partitions", "0"], "--partitions"),
        ([*ENSURE, "--partitions", "99999999999"], "--partitions"),
        ([*ENSURE, "--replication-factor", "0"], "--replication-factor"),
        ([*ENSURE, "--retention-ms", "-5"], "--retention-ms"),
        ([*ENSURE, "--run-retention-days", "0"], "--run-retention-days"),
        ([*ENSURE, "--bootstrap-servers", NOT_UTF8], "--bootstrap-servers"),
        (["grants", "add", "--principal", NOT_UTF8, "--tenant", "acme"], "--principal"),
        (["grants", "list", "--dynamodb-endpoint", "notaurl"], "--dynamodb-endpoint"),
        (["grants", "list", "--dynamodb-endpoint", "http://127.0.0.1:99999"], "--dynamodb-endpoint"),
        (["grants", "list", "--table-name", NOT_UTF8], "--table-name"),
        (["grants", "list", "--table-name="], "--table-name"),
        (["grants", "list", "--region", "not_a_region!"], "--region"),
        (["dev", "--host", NOT_UTF8], "--host"),
        (["dev", "--host="], "--host"),
        (["dev", "--host", "256.1.1.1"], "--host"),
        (["dev", "--table-name", "a"], "--table-name"),
        (["dev", "--dlq-name", NOT_UTF8], "--dlq-name"),
        (["dev", "--principal", NOT_UTF8], "--principal"),
        (["dev", "--principal", "arn:aws:iam::1:user/x"], "--principal"),
        (["dev", "--region", "bad!"], "--region"),
        (["dev", "--dynamodb-endpoint", "notaurl"], "--dynamodb-endpoint"),
        (["dev", "--sqs-endpoint", "http://127.0.0.1:99999"], "--sqs-endpoint"),
        (["dev", "--s3-endpoint", "ftp://127.0.0.1"], "--s3-endpoint"),
        (["dev", "--kafka-bootstrap", NOT_UTF8], "--kafka-bootstrap"),
        (["dev", "--kafka-bootstrap", "host:99999"], "--kafka-bootstrap"),
        (["dev", "--kafka-port", "-1"], "--kafka-port"),
        (["dev", "--concurrency", "99999"], "--concurrency"),
        (["dev", "--template", "/nonexistent/template.yaml"], "--template"),
        (["dev", "--principals", "/nonexistent/principals.json"], "--principals"),
        (["events", "tail", "--tenant", "acme", "--bootstrap-servers", "127.0.0.1:99999"], "--bootstrap-servers"),
        (["events", "tail", "--tenant", "acme", "--limit", "-1"], "--limit"),
        (["events", "tail", "--tenant", "acme", "--iam", "--region", NOT_UTF8], "--region"),
        ([*BACKFILL, "--dynamodb-endpoint", "notaurl"], "--dynamodb-endpoint"),
        ([*BACKFILL, "--table-name", "a"], "--table-name"),
        ([*BACKFILL, "--stack-name", NOT_UTF8], "--stack-name"),
        (["dlq", "list", "--queue-url", "notaurl"], "--queue-url"),
        (["dlq", "list", "--queue-url", "http://127.0.0.1:99999/q"], "--queue-url"),
        (["dlq", "list", "--bucket", NOT_UTF8], "--bucket"),
        (["dlq", "list", "--bucket", "b", "--region="], "--region"),
        (["dlq", "show", "s3:" + NOT_UTF8, "--bucket", "b"], "ID"),
        (["dlq", "redrive", "--bucket", "b", "--api-url", "notaurl", "--yes"], "--api-url"),
        (["dlq", "redrive", "--bucket", "b", "--run-retention-days", "x"], "--run-retention-days"),
    ],
)
def test_every_argument_out_of_its_domain_is_a_one_line_usage_error(
    argv: list[str], option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)

    lines = capsys.readouterr().err.splitlines()
    assert exited.value.code == 2
    assert len(lines) == 1
    assert f": argument {option}: " in lines[0]
    assert lines[0].endswith(" --help")


def test_an_address_not_of_this_machine_is_a_usage_error_naming_host() -> None:
    # Given an address that resolves but is no interface's (TEST-NET-1, RFC 5737)
    args = build_parser().parse_args(["dev", "--host", "192.0.2.1", "--no-kafka"])

    refusal = cli._busy_port(args)

    assert refusal is not None
    assert explain(refusal, args) == (
        "cannot listen on 192.0.2.1 port 8080 (cannot assign requested address); pass --host with an address of "
        "this machine",
        2,
    )


class NoBroker:
    """An AdminClient that must not be built: topics ensure refused before calling Kafka."""

    def __init__(self, *_: Any, **__: Any) -> None:
        raise AssertionError("topics ensure called Kafka")


@pytest.mark.parametrize(
    ("retention", "line"),
    [
        (
            ["--run-retention-days", "3"],
            "poimen topics ensure: --retention-ms 604800000 (7 days) keeps dispatch records longer than "
            "--run-retention-days 3: a record older than its run could be admitted again; nothing was created",
        ),
        (
            ["--retention-ms", "-1", "--run-retention-days", "30"],
            "poimen topics ensure: --retention-ms -1 (forever) keeps dispatch records longer than "
            "--run-retention-days 30: a record older than its run could be admitted again; nothing was created",
        ),
        (
            ["--retention-ms", "90000000", "--run-retention-days", "1"],
            "poimen topics ensure: --retention-ms 90000000 (1.04167 days) keeps dispatch records longer than "
            "--run-retention-days 1: a record older than its run could be admitted again; nothing was created",
        ),
    ],
)
def test_topics_ensure_refuses_a_dispatch_retention_longer_than_the_run_retention(
    retention: list[str], line: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(topics, "AdminClient", NoBroker)

    code = main([*ENSURE, "--bootstrap-servers", "127.0.0.1:1", *retention])

    assert code == 2
    assert capsys.readouterr().err.splitlines() == [line]


@pytest.mark.parametrize(("retention_ms", "days"), [(86_400_000, 1), (3_600_000, 1), (604_800_000, None), (-1, None)])
def test_a_dispatch_retention_within_the_run_retention_is_accepted(retention_ms: int, days: int | None) -> None:
    topics.check_dispatch_retention(retention_ms, days)


def test_dev_refuses_run_retention_on_a_table_shared_by_regions(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given poimen dev would start nothing (the refusal must come first)
    monkeypatch.setattr(cli, "run_dev", lambda _options: pytest.fail("poimen dev started"))
    # When a table of another Region (the MRSC stand-in) is asked for with a run retention
    code = main(["dev", "--region", "us-west-2", "--table-region", "us-east-1", "--run-retention-days", "7"])
    # Then it is one usage line: an MRSC global table has no TTL, as the template's Rule says
    assert code == 2
    assert capsys.readouterr().err.splitlines() == [
        "poimen dev: --run-retention-days needs the table in poimen dev's own --region: a table shared by "
        "Regions stands in for a multi-Region strongly consistent (MRSC) global table, which has no TTL "
        "(docs/operations.md#multi-region)"
    ]


@pytest.fixture
def producers(monkeypatch: pytest.MonkeyPatch) -> list[FakeProducer]:
    """The producers the CLI's publisher builds: each records what it would send."""
    made: list[FakeProducer] = []

    def build(config: dict[str, Any]) -> FakeProducer:
        made.append(FakeProducer(config))
        return made[-1]

    monkeypatch.setattr(dispatch, "Producer", build)
    return made


def test_dispatch_publish_without_a_key_prints_the_key_generated_for_it_and_the_run_it_admits(
    producers: list[FakeProducer], capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(PUBLISH)

    out, err = capsys.readouterr()
    ((producer,),) = [producers]
    ((topic, key, value),) = producer.produced
    sent = json.loads(value)["dispatch_key"]
    assert (code, err) == (0, "")
    assert sent.startswith(GENERATED_KEY_PREFIX)
    assert out == f"published to {topic}; run_id {keyed_run_id('acme', sent)}; dispatch_key {sent} (generated)\n"
    assert key == f"acme/{keyed_run_id('acme', sent)}".encode()


def test_dispatch_publish_with_a_key_prints_its_run_as_before(
    producers: list[FakeProducer], capsys: pytest.CaptureFixture[str]
) -> None:
    code = main([*PUBLISH, "--dispatch-key", "k-2"])

    ((producer,),) = [producers]
    ((_, _, value),) = producer.produced
    assert json.loads(value)["dispatch_key"] == "k-2"
    out, err = capsys.readouterr()
    assert (code, out, err) == (0, f"published to poimen.acme.dispatch; run_id {keyed_run_id('acme', 'k-2')}\n", "")


def test_dispatch_publish_sends_a_keyless_record_only_when_asked_for_by_name_and_warns(
    producers: list[FakeProducer], capsys: pytest.CaptureFixture[str]
) -> None:
    code = main([*PUBLISH, "--no-dispatch-key"])

    out, err = capsys.readouterr()
    ((producer,),) = [producers]
    ((_, _, value),) = producer.produced
    assert json.loads(value)["dispatch_key"] is None
    assert (code, out) == (0, "published to poimen.acme.dispatch\n")
    (warning,) = err.splitlines()
    assert warning.startswith("poimen dispatch publish: warning: ")
    assert "at least once" in warning


def test_dispatch_publish_refuses_a_key_and_no_key_at_once(
    producers: list[FakeProducer], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main([*PUBLISH, "--no-dispatch-key", "--dispatch-key", "k-2"])

    assert exited.value.code == cli.EXIT_USAGE
    assert producers == []


def test_a_failed_publish_of_a_generated_key_says_how_to_publish_it_again_under_that_key(
    producers: list[FakeProducer], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a broker that acknowledges nothing (the record stays queued past the timeout)
    monkeypatch.setattr(FakeProducer, "flush", lambda self, timeout: len(self.produced))
    # When a spawn without a key is published
    code = main([*PUBLISH, "--timeout", "1"])
    # Then it fails, naming the key generated for the record, with which publishing it again admits one run
    ((producer,),) = [producers]
    ((_, _, value),) = producer.produced
    sent = json.loads(value)["dispatch_key"]
    out, err = capsys.readouterr()
    assert (code, out) == (cli.EXIT_UNAVAILABLE, "")
    (line,) = err.splitlines()
    assert line.endswith(f"publish it again with --dispatch-key {sent}, which admits at most one run")


def test_an_interrupted_publish_of_a_generated_key_says_how_to_publish_it_again_under_that_key(
    producers: list[FakeProducer], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a publish interrupted (Ctrl-C) while it waits for the broker, its record queued and perhaps written
    def interrupted(self: FakeProducer, timeout: float) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(FakeProducer, "flush", interrupted)
    # When a spawn without a key is published
    code = main(PUBLISH)
    # Then it names the key generated for the record: published again without it, it would be a second spawn
    ((producer,),) = [producers]
    ((_, _, value),) = producer.produced
    sent = json.loads(value)["dispatch_key"]
    out, err = capsys.readouterr()
    assert (code, out) == (cli.EXIT_INTERRUPTED, "")
    assert err.splitlines() == [
        f"poimen dispatch publish: interrupted; publish it again with --dispatch-key {sent}, which admits at most "
        "one run"
    ]


@pytest.mark.filterwarnings("error::poimen.dispatch.KeylessDispatchWarning")
def test_dispatch_publish_without_a_key_queues_nothing_where_its_warning_is_made_an_error(
    producers: list[FakeProducer], capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a warnings filter that makes KeylessDispatchWarning an error (PYTHONWARNINGS=error::UserWarning: a policy
    # that no keyless record be published)
    # When a keyless record is asked for by name
    code = main([*PUBLISH, "--no-dispatch-key"])
    # Then it is refused before anything is queued, in one line
    ((producer,),) = [producers]
    assert producer.produced == []
    out, err = capsys.readouterr()
    assert (code, out) == (cli.EXIT_USAGE, "")
    (line,) = err.splitlines()
    assert line.startswith("poimen dispatch publish: refused, as a warnings filter makes KeylessDispatchWarning")
    assert line.endswith("nothing was published")


def test_the_cli_loads_moto_only_for_poimen_dev() -> None:
    # Given a fresh interpreter, as each `poimen` command is one
    # When it loads the CLI (every command does), and then the local AWS `poimen dev` starts
    code = (
        "import sys; import poimen_tools.cli; before = 'moto' in sys.modules; "
        "from poimen_tools.local.moto import EmbeddedMoto; EmbeddedMoto(); print(before, 'moto' in sys.modules)"
    )
    printed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    # Then moto, about a quarter of a command's start, is loaded by the local AWS alone
    assert printed.stdout.split() == ["False", "True"]
