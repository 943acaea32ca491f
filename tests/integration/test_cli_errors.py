"""`poimen` as a user meets it: every expected failure is one line on stderr naming the cause and the fix,
with the exit code `poimen --help` documents; `--debug` shows the traceback; local commands need no AWS
credentials. Each test runs the installed console script with no AWS settings at all (no AWS_*
variables, a HOME without ~/.aws)."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest

from poimen_tools.local.moto import EmbeddedMoto
from poimen_tools.local.template import Template
from tests.integration.conftest import POIMEN

ROLE = "arn:aws:iam::123456789012:role/poimen-orchestrator"


@dataclass
class Outcome:
    code: int
    out: str
    err: str
    seconds: float

    @property
    def line(self) -> str:
        """The one line on stderr; fails unless there is exactly one."""
        lines = self.err.splitlines()
        assert len(lines) == 1, f"expected one line on stderr, got:\n{self.err}"
        assert "Traceback" not in self.err
        return lines[0]


@pytest.fixture
def home(tmp_path: Path) -> Path:
    empty = tmp_path / "home"
    empty.mkdir()
    return empty


def without_aws(home: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without AWS settings, HOME `home` (no ~/.aws), plus `env`."""
    scrubbed = {name: value for name, value in os.environ.items() if not name.startswith(("AWS_", "POWERTOOLS_"))}
    return scrubbed | {"HOME": str(home), **(env or {})}


def poimen(home: Path, *argv: str, env: dict[str, str] | None = None, timeout: float = 120) -> Outcome:
    """The `poimen` console script in an environment with no AWS settings (plus `env`)."""
    started = time.monotonic()
    done = subprocess.run(
        [str(POIMEN), *argv], capture_output=True, text=True, env=without_aws(home, env), timeout=timeout, check=False
    )
    return Outcome(done.returncode, done.stdout, done.stderr, time.monotonic() - started)


@dataclass
class KafkaWait:
    outcome: Outcome
    started: float  # from the command's start to its Kafka client's first thread: the interpreter and imports
    waited: float  # from that thread to the command's exit: what its --timeout bounds

    @property
    def said(self) -> str:
        return f"exited {self.waited:.1f} s after its Kafka client began (its start took {self.started:.1f} s)"


def poimen_waiting_on_kafka(home: Path, *argv: str) -> KafkaWait:
    """`poimen(home, *argv)` of a command that waits on Kafka, and when it began to: the first thread of its
    librdkafka client (named `rdk:...` in /proc), created once the interpreter has started and imported, which
    on two cores shared by the suite's workers took from half a second to tens of seconds. Timed from there, the
    wait is what `--timeout` promises, whatever the machine's load did to the start."""
    started = time.monotonic()
    child = subprocess.Popen(
        [str(POIMEN), *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=without_aws(home)
    )
    client: float | None = None
    try:
        while child.poll() is None:
            assert time.monotonic() - started < 120, f"poimen {' '.join(argv)} still running after 120 s"
            if client is None and _has_librdkafka_thread(child.pid):
                client = time.monotonic()
            time.sleep(0.02)
    finally:
        if child.poll() is None:
            child.kill()
        out, err = child.communicate(timeout=30)
    ended = time.monotonic()
    assert client is not None, f"no librdkafka thread seen in poimen {' '.join(argv)}: {err}"
    return KafkaWait(Outcome(child.returncode, out, err, ended - started), client - started, ended - client)


def _has_librdkafka_thread(pid: int) -> bool:
    for comm in Path(f"/proc/{pid}/task").glob("*/comm"):
        with contextlib.suppress(OSError):  # a thread that ended, or the process, while listed
            if comm.read_text().startswith("rdk:"):
                return True
    return False


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


@dataclass
class LocalDynamoDB:
    endpoint: str
    table_name: str
    client: Any


@pytest.fixture(scope="module")
def local_dynamodb(template: Template) -> Iterator[LocalDynamoDB]:
    """A moto server on loopback holding an admission table built from template.yaml."""
    with EmbeddedMoto() as moto:
        client = boto3.client("dynamodb", endpoint_url=moto.endpoint)
        table_name = f"admission-{uuid.uuid4().hex[:8]}"
        client.create_table(**template.create_table_request("AdmissionTable", table_name))
        yield LocalDynamoDB(moto.endpoint, table_name, client)


# -- DynamoDB (poimen grants) -------------------------------------------------------------------------


def test_grants_against_a_local_endpoint_need_no_aws_credentials(local_dynamodb: LocalDynamoDB, home: Path) -> None:
    where = ["--dynamodb-endpoint", local_dynamodb.endpoint, "--table-name", local_dynamodb.table_name]
    tenant = f"t-{uuid.uuid4().hex[:8]}"

    added = poimen(home, "grants", "add", "--principal", ROLE, "--tenant", tenant, *where)
    listed = poimen(home, "grants", "list", *where)

    assert (added.code, added.err) == (0, "")
    assert (listed.code, listed.err) == (0, "")
    assert f"{ROLE}\t" in listed.out
    assert tenant in listed.out


def test_an_unreachable_dynamodb_endpoint_is_one_line_and_exit_3(home: Path) -> None:
    endpoint = f"http://127.0.0.1:{closed_port()}"

    outcome = poimen(home, "grants", "list", "--dynamodb-endpoint", endpoint)

    assert outcome.line == (
        f"poimen grants list: cannot reach DynamoDB at {endpoint} (connection refused); "
        "start it (poimen dev) or pass --dynamodb-endpoint"
    )
    assert outcome.code == 3


def test_a_missing_table_is_one_line_and_exit_1(local_dynamodb: LocalDynamoDB, home: Path) -> None:
    outcome = poimen(home, "grants", "list", "--table-name", "nope", "--dynamodb-endpoint", local_dynamodb.endpoint)

    assert outcome.line == (
        f"poimen grants list: no table nope in DynamoDB at {local_dynamodb.endpoint}: pass --table-name "
        "(poimen dev prints its table) or --dynamodb-endpoint"
    )
    assert outcome.code == 1


def test_aws_without_credentials_is_one_line_and_exit_3(home: Path) -> None:
    # No endpoint: AWS itself, for which the dev key is never used.
    outcome = poimen(home, "grants", "list")

    assert outcome.line == (
        "poimen grants list: no AWS credentials for DynamoDB in us-east-1: configure them (AWS_PROFILE, "
        "aws sso login), or pass --dynamodb-endpoint for a local table"
    )
    assert outcome.code == 3


def test_aws_unreachable_is_one_line_and_exit_3(home: Path) -> None:
    # Given credentials, and a network that reaches nothing (a proxy on a closed port stands in for it)
    env = {
        "AWS_ACCESS_KEY_ID": "AKIDEXAMPLE",
        "AWS_SECRET_ACCESS_KEY": "secret",
        "HTTPS_PROXY": f"http://127.0.0.1:{closed_port()}",
    }

    outcome = poimen(home, "grants", "list", env=env)

    assert outcome.line.startswith("poimen grants list: cannot reach DynamoDB in us-east-1 (")
    assert outcome.line.endswith("); check the network and --region")
    assert outcome.code == 3


def test_removing_a_grant_that_is_not_there_is_one_line_and_exit_1(local_dynamodb: LocalDynamoDB, home: Path) -> None:
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    where = ["--dynamodb-endpoint", local_dynamodb.endpoint, "--table-name", local_dynamodb.table_name]

    outcome = poimen(home, "grants", "remove", "--principal", ROLE, "--tenant", tenant, *where)

    assert outcome.line == (
        f"poimen grants remove: {ROLE} holds no grant of tenant {tenant}: nothing removed (see poimen grants list)"
    )
    assert outcome.code == 1


def test_debug_shows_the_traceback(home: Path) -> None:
    endpoint = f"http://127.0.0.1:{closed_port()}"

    outcome = poimen(home, "--debug", "grants", "list", "--dynamodb-endpoint", endpoint)
    after = poimen(home, "grants", "list", "--dynamodb-endpoint", endpoint, "--debug")

    for debugged in (outcome, after):
        assert "Traceback (most recent call last)" in debugged.err
        assert "StoreUnavailable" in debugged.err
        assert debugged.code != 0


# -- input -------------------------------------------------------------------------------------------


def test_input_that_is_no_json_object_is_one_line_and_exit_2(home: Path) -> None:
    outcome = poimen(home, "dispatch", "publish", "--tenant", "acme", "--workflow-ref", "wf", "--input", "[1]")

    assert outcome.line == (
        "poimen dispatch publish: argument --input: must be a JSON object, like '{\"key\": 1}'; "
        "see poimen dispatch publish --help"
    )
    assert outcome.code == 2


def test_a_spawn_request_the_api_would_refuse_is_one_line_and_exit_2(home: Path) -> None:
    outcome = poimen(home, "dispatch", "publish", "--tenant", "acme", "--workflow-ref=", "--input", "{}")

    assert outcome.line == (
        "poimen dispatch publish: not a valid spawn request: workflow_ref: String should have at least 1 character"
    )
    assert outcome.code == 2


# -- Kafka -------------------------------------------------------------------------------------------

# Beyond a command's --timeout, from its Kafka client's first thread to its exit: the rest of the client's set-up,
# the one line written, the interpreter's exit (under coverage, its data written): 0.2 s of CPU, 1 s under coverage.
# It took 0.1-0.2 s on an idle machine, 1.1 s under coverage, 2.1 s under coverage with 4 workers and 8 busy loops
# on the 2 cores (whose start, excluded, took 5 s); 10 s holds for that part slowed tenfold. A command that ignores
# its --timeout waits on librdkafka's defaults (CreateTopics 60 s, a record 300 s), far past 2 + 10 s.
KAFKA_EXIT_ALLOWANCE = 10.0


def test_publishing_to_an_absent_broker_fails_fast_in_one_line_naming_it(home: Path) -> None:
    broker = f"127.0.0.1:{closed_port()}"
    argv = ["--tenant", "acme", "--workflow-ref", "wf", "--input", "{}", "--bootstrap-servers", broker]

    kafka = poimen_waiting_on_kafka(home, "dispatch", "publish", *argv, "--timeout", "2")
    outcome = kafka.outcome

    cause = (
        f"poimen dispatch publish: cannot publish to Kafka at {broker} (connection refused): 1 record(s) not "
        "acknowledged within 2 s; start the broker (poimen dev) or pass --bootstrap-servers (--timeout to wait longer)"
    )
    # The key generated for the record, with which publishing it again admits one run
    again = r"; publish it again with --dispatch-key poimen-dispatch/[0-9a-f-]{36}, which admits at most one run"
    assert re.fullmatch(re.escape(cause) + again, outcome.line), outcome.line
    assert outcome.code == 3
    # What --timeout promises: given up within the 2 s, plus KAFKA_EXIT_ALLOWANCE (above).
    assert kafka.waited < 2 + KAFKA_EXIT_ALLOWANCE, kafka.said


def test_declaring_topics_on_an_absent_broker_fails_fast_in_one_line(home: Path) -> None:
    broker = f"127.0.0.1:{closed_port()}"

    kafka = poimen_waiting_on_kafka(
        home, "topics", "ensure", "--tenant", "acme", "--bootstrap-servers", broker, "--timeout", "2"
    )
    outcome = kafka.outcome

    assert outcome.line == (
        f"poimen topics ensure: cannot reach Kafka at {broker} (connection refused) within 2 s; "
        "start it (poimen dev) or pass --bootstrap-servers"
    )
    assert outcome.code == 3
    assert kafka.waited < 2 + KAFKA_EXIT_ALLOWANCE, kafka.said


# -- poimen dev -------------------------------------------------------------------------------------


def test_dev_on_a_port_in_use_is_one_line_naming_the_option_and_exit_4(home: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]

        outcome = poimen(home, "dev", "--port", str(port), "--no-kafka")

    assert outcome.line == (
        f"poimen dev: port {port} on 127.0.0.1 is in use; stop what listens there, or pass --port with another "
        "port (0 for any free one)"
    )
    assert outcome.code == 4


# -- the command list ----------------------------------------------------------------------------------


def test_help_lists_every_command_and_the_exit_codes(home: Path) -> None:
    outcome = poimen(home, "--help")

    assert outcome.code == 0
    for command in ("dev", "topics", "dispatch", "grants", "dlq"):
        assert f"\n    {command} " in outcome.out
    for code in ("0", "1", "2", "3", "4", "70", "130"):
        assert f"\n  {code} " in outcome.out


def test_dlq_errors_are_one_line_too(home: Path) -> None:
    unknown = poimen(home, "dlq", "peek")
    nothing = poimen(home, "dlq", "list")

    assert unknown.line.startswith("poimen dlq: argument action: invalid choice: 'peek'")
    assert unknown.code == 2
    assert nothing.line == (
        "poimen dlq list: nothing to read: give --queue-url (the relay's dead-letter queue) and/or --bucket"
    )
    assert nothing.code == 2


def test_dlq_against_a_local_endpoint_needs_no_aws_credentials(local_dynamodb: LocalDynamoDB, home: Path) -> None:
    # Given a queue in the local moto server, and no AWS credentials nor --dev-key
    queue_url = boto3.client("sqs", endpoint_url=local_dynamodb.endpoint).create_queue(
        QueueName=f"dlq-{uuid.uuid4().hex[:8]}"
    )["QueueUrl"]

    outcome = poimen(home, "dlq", "list", "--queue-url", queue_url, "--aws-endpoint", local_dynamodb.endpoint)

    assert (outcome.code, outcome.err) == (0, "")


# -- arguments: refused at the edge, one line, exit 2 ---------------------------------------------------

NOT_UTF8 = "\udcff"  # the byte 0xff in argv, as Python hands it over (surrogateescape)
NO_TEMPLATE = "Resources:\n  Only:\n    Type: AWS::SQS::Queue\n"


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["runs", "get", "--tenant", "acme", NOT_UTF8],
            "poimen runs get: argument RUN_ID: '\\xff' is not UTF-8 text; see poimen runs get --help",
        ),
        (
            ["runs", "find", "--tenant", "acme", NOT_UTF8],
            "poimen runs find: argument DISPATCH_KEY: '\\xff' is not UTF-8 text; see poimen runs find --help",
        ),
        (
            ["runs", "spawn", "--tenant", "acme", "--workflow-ref", "wf", "--input", "{}", "--region", NOT_UTF8],
            "poimen runs spawn: argument --region: '\\xff' is not UTF-8 text; see poimen runs spawn --help",
        ),
        (
            ["runs", "get", "--tenant", "acme", "r", "--base-url", "http://127.0.0.1:99999"],
            "poimen runs get: argument --base-url: 'http://127.0.0.1:99999' is not an http(s) URL without query "
            "or fragment (port out of range 0-65535); see poimen runs get --help",
        ),
        (
            ["dispatch", "publish", "--tenant", "acme", "--workflow-ref", "wf", "--input", '{"a": "' + NOT_UTF8 + '"}'],
            'poimen dispatch publish: argument --input: \'{"a": "\\xff"}\' is not UTF-8 text; '
            "see poimen dispatch publish --help",
        ),
        (
            [
                "dispatch",
                "publish",
                "--tenant",
                "acme",
                "--workflow-ref",
                "wf",
                "--input",
                "{}",
                "--bootstrap-servers",
                "127.0.0.1:99999",
            ],
            "poimen dispatch publish: argument --bootstrap-servers: '127.0.0.1:99999' is not a list of HOST:PORT "
            "brokers (like 127.0.0.1:9092,b-2.example.com:9098); see poimen dispatch publish --help",
        ),
        (
            ["topics", "ensure", "--tenant", "acme", "--partitions", "-3"],
            "poimen topics ensure: argument --partitions: '-3' is not a whole number from 1 to 100000; "
            "see poimen topics ensure --help",
        ),
        (
            ["grants", "list", "--dynamodb-endpoint", "notaurl"],
            "poimen grants list: argument --dynamodb-endpoint: 'notaurl' is not an http(s) URL "
            "(like http://127.0.0.1:8000); see poimen grants list --help",
        ),
        (
            ["dev", "--concurrency", "0"],
            "poimen dev: argument --concurrency: '0' is not a whole number from 1 to 256; see poimen dev --help",
        ),
        (
            ["dev", "--port", "99999"],
            "poimen dev: argument --port: '99999' is not a port (0 to 65535); see poimen dev --help",
        ),
        (
            ["dev", "--port", "-5"],
            "poimen dev: argument --port: '-5' is not a port (0 to 65535); see poimen dev --help",
        ),
        (
            ["dev", "--moto-port", "99999"],
            "poimen dev: argument --moto-port: '99999' is not a port (0 to 65535); see poimen dev --help",
        ),
        (
            ["dev", "--kafka-port", "99999"],
            "poimen dev: argument --kafka-port: '99999' is not a port (0 to 65535); see poimen dev --help",
        ),
        (
            ["dev", "--region="],
            "poimen dev: argument --region: '' is not an AWS region (like us-east-1); see poimen dev --help",
        ),
        (
            ["dev", "--host", "nonexistent.invalid"],
            "poimen dev: argument --host: cannot listen on 'nonexistent.invalid' (name or service not known); "
            "see poimen dev --help",
        ),
        (
            ["dev", "--dlq-name", "a.b"],
            "poimen dev: argument --dlq-name: 'a.b' is not an SQS queue name (1 to 80 of A-Z a-z 0-9 _ -); "
            "see poimen dev --help",
        ),
        (
            ["dlq", "list", "--bucket", "b", "--aws-endpoint", "notaurl"],
            "poimen dlq list: argument --aws-endpoint: 'notaurl' is not an http(s) URL (like http://127.0.0.1:8000); "
            "see poimen dlq list --help",
        ),
    ],
)
def test_an_argument_out_of_its_domain_is_one_line_and_exit_2(home: Path, argv: list[str], line: str) -> None:
    outcome = poimen(home, *argv)

    assert outcome.line == line
    assert outcome.code == 2


@pytest.mark.parametrize(
    ("name", "content", "reason"),
    [
        (
            "template.yaml",
            NO_TEMPLATE,
            "is not poimen's SAM template: it declares no AWS::Serverless::Function AdmissionFunction",
        ),
        (
            "template.yaml",
            "Resources: [\n",
            "is not YAML (expected the node content, but found '<stream end>', line 2)",
        ),
        (
            "list.json",
            "[1]",
            "is not poimen's SAM template: it declares no AWS::Serverless::Function AdmissionFunction",
        ),
    ],
)
def test_a_template_that_is_no_template_is_one_line_and_exit_2(
    home: Path, tmp_path: Path, name: str, content: str, reason: str
) -> None:
    path = tmp_path / name
    path.write_text(content)

    outcome = poimen(home, "dev", "--template", str(path))

    assert outcome.line == f"poimen dev: argument --template: {path} {reason}; see poimen dev --help"
    assert outcome.code == 2


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("nope", "is not JSON (Expecting value: line 1 column 1 (char 0))"),
        ("[1]", "must be a JSON object: access key id -> {secret, arn, tenants}"),
        ('{"AKID": {"arn": "arn:aws:iam::123456789012:user/x"}}', 'AKID: "secret" must be a string'),
        (
            '{"AKID": {"secret": "s", "arn": "arn:aws:iam::123456789012:user/x", "tenants": "acme"}}',
            'AKID: "tenants" must be a list of tenant ids or "*"',
        ),
    ],
)
def test_a_principals_file_that_is_not_one_is_one_line_and_exit_2(
    home: Path, tmp_path: Path, content: str, reason: str
) -> None:
    path = tmp_path / "principals.json"
    path.write_text(content)

    by_option = poimen(home, "dev", "--principals", str(path))
    by_variable = poimen(home, "dev", "--port", "0", "--no-kafka", env={"POIMEN_LOCAL_PRINCIPALS": str(path)})

    assert by_option.line == f"poimen dev: argument --principals: {path} {reason}; see poimen dev --help"
    assert by_option.code == 2
    assert by_variable.line == f"poimen dev: POIMEN_LOCAL_PRINCIPALS: {path} {reason}"
    assert by_variable.code == 2
