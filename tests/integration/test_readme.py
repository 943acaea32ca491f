"""Every console example in README.md and docs/*.md, executed against a fresh `poimen dev` with its Kafka broker.

The extractor is ours (no executable-docs tool on PyPI runs shell sessions against a server we start):
a ```console block is a session; `$ ` starts a command (a line ending in `\\` continues it), and the lines
up to the next `$ ` are its expected output. A block whose command is `.venv/bin/poimen dev` is that
command's banner, compared with what the test's `poimen dev` printed. Every other block is run
command by command with bash, from the checkout; a shell function, `export` or assignment it defines is
kept for the commands after it.

What is normalised, and only that, because it truly varies:
- ports: the test's server listens on free ports; in commands the documented defaults
  (`http://127.0.0.1:8080`, `127.0.0.1:9092`) become its URLs, and `.venv/bin/poimen dispatch publish`
  gets `--bootstrap-servers` with its broker (the default it relies on, 127.0.0.1:9092, is checked
  below); in output its URLs become the defaults again, and moto's endpoint (any free port) becomes the
  one the docs show;
- timestamps (`created_at`, RFC 3339 with milliseconds) on both sides;
- `...` on a line of its own in the expected output stands for any lines (headers not named: Date,
  Server, Content-Length);
- a command after a `dispatch publish` is retried for up to 60 s until it matches: the relay admits the
  published run asynchronously;
- stdout is compared; stderr is shown on failure only (librdkafka may log a retry on a fresh broker).

Status lines, the headers named, bodies and every id (the derived run ids and the published one) must
match exactly.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from poimen_tools.local.dev import DevOptions
from tests.conftest import REPO
from tests.integration.conftest import POIMEN, DevServer, start_dev, wait_for

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
DEFAULT_API = "http://127.0.0.1:8080"
DEFAULT_KAFKA = "127.0.0.1:9092"
DEV_COMMAND = ".venv/bin/poimen dev"
PUBLISH = ".venv/bin/poimen dispatch publish"
EVENTS_TAIL = ".venv/bin/poimen events tail"
TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")
DEFINITION = re.compile(r"^(\w+\(\)\s*\{|export\s|\w+=)")
RELAY_WAIT_SECONDS = 60


@dataclass
class Step:
    command: str
    expected: list[str] = field(default_factory=list)


@dataclass
class Block:
    page: Path
    line: int
    steps: list[Step]

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def console_blocks(page: Path) -> list[Block]:
    blocks: list[Block] = []
    lines = page.read_text().splitlines()
    index = 0
    while index < len(lines):
        if lines[index].strip() != "```console":
            index += 1
            continue
        start, steps = index + 1, []
        index += 1
        while lines[index].strip() != "```":
            line = lines[index]
            if line.startswith("$ "):
                command = line[2:]
                while command.endswith("\\"):
                    index += 1
                    command += "\n" + lines[index]
                steps.append(Step(command))
            else:
                assert steps, f"{page}:{index + 1}: output before any command"
                steps[-1].expected.append(line)
            index += 1
        blocks.append(Block(page, start, steps))
        index += 1
    return blocks


BLOCKS = [block for page in PAGES for block in console_blocks(page)]
BANNERS = [block for block in BLOCKS if block.steps[0].command == DEV_COMMAND]
SESSIONS = [block for block in BLOCKS if block not in BANNERS]


def matches(expected: list[str], actual: str) -> bool:
    pattern = "".join(r"(?:[^\n]*\n)*?" if line == "..." else re.escape(line) + r"\n" for line in expected)
    return re.fullmatch(pattern, actual) is not None


def _normalise(text: str) -> str:
    return TIMESTAMP.sub("<timestamp>", text.replace("\r\n", "\n")).rstrip("\n") + "\n"


@dataclass
class Stack:
    dev: DevServer
    moto_shown: str  # moto's endpoint as the docs show it


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A fresh `poimen dev` with its own broker, knowing only its dev key, as `make run` starts it."""
    dev = start_dev(tmp_path_factory.mktemp("readme"), kafka=True, test_principal=False, tenants=())
    try:
        yield Stack(dev, _documented_moto_endpoint())
    finally:
        assert dev.stop() == 0


def _documented_moto_endpoint() -> str:
    for block in BANNERS:
        for line in block.steps[0].expected:
            if line.startswith("Local AWS"):
                return line.split(": ", 1)[1].split()[0]
    return "http://127.0.0.1:<moto port>"


def _to_server(command: str, dev: DevServer) -> str:
    assert dev.kafka_bootstrap is not None
    command = command.replace(DEFAULT_API, dev.url).replace(DEFAULT_KAFKA, dev.kafka_bootstrap)
    for tool in (PUBLISH, EVENTS_TAIL):
        command = command.replace(tool, f"{tool} --bootstrap-servers {dev.kafka_bootstrap}")
    return re.sub(r"(?<![\w/.])\.venv/bin/poimen\b", str(POIMEN), command)


def _to_docs(output: str, stack: Stack) -> str:
    dev = stack.dev
    assert dev.kafka_bootstrap is not None
    output = output.replace(dev.url, DEFAULT_API).replace(dev.kafka_bootstrap, DEFAULT_KAFKA)
    return _normalise(output.replace(dev.aws_endpoint, stack.moto_shown))


def test_the_docs_have_console_examples() -> None:
    assert any(block.page.name == "README.md" for block in SESSIONS), "the README's walkthrough is gone"
    assert [block.page.name for block in BANNERS] == ["local.md"]


def test_the_defaults_the_examples_rely_on() -> None:
    # The walkthrough is run with its ports substituted: that is sound only while these are the defaults.
    assert (DevOptions().host, DevOptions().port, DevOptions().kafka_port) == ("127.0.0.1", 8080, 9092)
    publish_help = subprocess.run(
        [str(POIMEN), "dispatch", "publish", "--help"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert f"default: {DEFAULT_KAFKA}" in " ".join(publish_help.split())


@pytest.mark.parametrize("block", SESSIONS, ids=lambda block: block.name)
def test_console_session(block: Block, stack: Stack) -> None:
    definitions: list[str] = []
    published = False
    for step in block.steps:
        command = _to_server(step.command, stack.dev)
        script = "\n".join([*definitions, command])
        expected = [TIMESTAMP.sub("<timestamp>", line) for line in step.expected]
        deadline = time.monotonic() + (RELAY_WAIT_SECONDS if published else 0)
        while True:
            result = subprocess.run(
                ["bash", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
            )
            actual = _to_docs(result.stdout, stack) if result.stdout else ""
            if matches(expected, actual) or time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        assert matches(expected, actual), (
            f"{block.name}: `{step.command}`\n--- documented\n" + "\n".join(step.expected)
            + f"\n--- got (normalised)\n{actual}--- stderr\n{result.stderr}"
        )  # fmt: skip
        if DEFINITION.match(step.command):
            definitions.append(step.command)
        published = published or PUBLISH in step.command


@pytest.mark.parametrize("block", BANNERS, ids=lambda block: block.name)
def test_banner(block: Block, stack: Stack) -> None:
    # Given the banner `poimen dev` printed when it started (it ends with its `Try:` line)
    log = stack.dev.log
    wait_for(lambda: "\nTry: " in log.read_text(), timeout=30, what="the banner's last line")
    lines = log.read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("Admission API: "))
    last = next(i for i, line in enumerate(lines) if line.startswith("Try: "))
    # (its lines start with a capital; a log line of the relay's consumer or a worker may come between)
    shown = [line for line in lines[first : last + 1] if line[:1].isupper()]
    banner = _to_docs("\n".join(shown), stack)

    # Then it is the documented one, ports aside
    assert block.steps[0].expected, f"{block.name}: the banner is not shown"
    assert banner == _normalise("\n".join(block.steps[0].expected)), (
        f"{block.name}: the documented banner differs from what `poimen dev` printed:\n{banner}"
    )
