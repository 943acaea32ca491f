"""A real single-node Apache Kafka broker (KRaft: broker and controller) on 127.0.0.1, without Docker.

The jars come from Maven Central (infra/kafka/pom.xml: the broker's and MirrorMaker 2's) into a cache folder
git ignores; Java 17 runs `kafka.tools.StorageTool format` once per data folder, then `kafka.Kafka`. Data
survives restarts.
"""

from __future__ import annotations

import base64
import ctypes
import hashlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from confluent_kafka.admin import AdminClient

REPO = Path(__file__).resolve().parents[3]
POM = REPO / "infra" / "kafka" / "pom.xml"
KAFKA_VERSION = "4.1.1"
DEFAULT_CACHE = REPO / ".cache" / "kafka"


class BrokerError(RuntimeError):
    """The broker could not be fetched, formatted or started."""


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def kafka_jars(cache: Path = DEFAULT_CACHE) -> Path:
    """The folder of the jars infra/kafka/pom.xml names, fetched by Maven on first use and again whenever the
    pom changed since (needs `mvn` and Maven Central).

    The folder is complete for the pom whose digest its `.complete` marker holds (an empty marker, from before
    the pom named MirrorMaker 2, is no pom's). A fetch goes to a folder of its own, then each jar is moved
    in, and jars the pom no longer names are removed: a broker starting meanwhile finds whole jars only.
    """
    lib = cache / KAFKA_VERSION / "lib"
    done = lib / ".complete"
    wanted = hashlib.sha256(POM.read_bytes()).hexdigest()
    if done.is_file() and done.read_text().strip() == wanted:
        return lib
    if shutil.which("mvn") is None:
        raise BrokerError("Maven (mvn) is needed to fetch the Kafka broker jars")
    lib.mkdir(parents=True, exist_ok=True)
    staging = lib.with_name(f"lib.{uuid.uuid4().hex}.part")
    staging.mkdir()
    try:
        _fetch(staging)
        jars = {jar.name for jar in staging.glob("*.jar")}
        for name in jars:
            os.replace(staging / name, lib / name)
        for stale in lib.glob("*.jar"):
            if stale.name not in jars:
                stale.unlink(missing_ok=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    marked = done.with_name(f".complete.{uuid.uuid4().hex}")
    marked.write_text(wanted + "\n")
    os.replace(marked, done)
    return lib


def _fetch(lib: Path) -> None:
    """`mvn dependency:copy-dependencies` of infra/kafka/pom.xml into `lib`; BrokerError with Maven's reason."""
    fetched = subprocess.run(
        [
            "mvn",
            "--batch-mode",
            "--no-transfer-progress",
            "-Dstyle.color=never",  # plain text in logs and `make test` output (Maven 3.5+ colours otherwise)
            "-q",
            "-f",
            str(POM),
            "dependency:copy-dependencies",
            f"-DoutputDirectory={lib}",
            "-DincludeScope=runtime",
        ],
        check=False,
        # Captured: Maven 3.8's console library writes colour resets (ESC[0m) to stdout even in batch mode.
        capture_output=True,
        text=True,
    )
    if fetched.returncode != 0:
        said = _ANSI.sub("", fetched.stdout + fetched.stderr).strip().splitlines()[-20:]
        raise BrokerError(
            f"Maven could not fetch the Kafka broker jars (exit {fetched.returncode}):\n" + "\n".join(said)
        )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class KafkaBroker:
    """`with KafkaBroker(folder) as broker: broker.bootstrap_servers`; `stop()`/`start()` keep the data."""

    def __init__(self, data_dir: Path, port: int = 0, controller_port: int = 0, jars: Path | None = None) -> None:
        self.data_dir = data_dir
        self.port = port or free_port()
        self.controller_port = controller_port or free_port()
        self._jars = jars
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_file(self) -> Path:
        return self.data_dir / "broker.log"

    @property
    def output_file(self) -> Path:
        """The JVM's own stdout and stderr (what happens before logging starts)."""
        return self.data_dir / "broker.out"

    def _java(self, main_class: str, *arguments: str) -> list[str]:
        if shutil.which("java") is None:
            raise BrokerError("Java 17 or later (java) is needed to run the local Kafka broker")
        jars = self._jars or kafka_jars()
        return [
            "java",
            "-Xms128m",
            "-Xmx512m",
            f"-Dlog4j2.configurationFile={self._write_log_config()}",
            "-cp",
            f"{jars}/*",
            main_class,
            *arguments,
        ]

    def _write_config(self) -> Path:
        config = self.data_dir / "server.properties"
        settings = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.voters": f"1@127.0.0.1:{self.controller_port}",
            "listeners": f"PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(self.data_dir / "logs"),
            "num.partitions": "1",
            "offsets.topic.replication.factor": "1",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "offsets.topic.num.partitions": "1",  # 50 by default: slow to create on a 2-core machine
            "group.initial.rebalance.delay.ms": "0",
            # As MSK's default configuration (Amazon MSK Developer Guide, "Default Amazon MSK configuration"):
            # a topic exists only once created (poimen topics ensure), never because a client named it.
            "auto.create.topics.enable": "false",
        }
        config.write_text("".join(f"{key}={value}\n" for key, value in settings.items()))
        return config

    def _write_log_config(self) -> Path:
        path = self.data_dir / "log4j2.properties"
        path.write_text(
            "rootLogger.level = WARN\n"
            "rootLogger.appenderRef.file.ref = file\n"
            "appender.file.type = File\n"
            "appender.file.name = file\n"
            f"appender.file.fileName = {self.log_file}\n"
            "appender.file.layout.type = PatternLayout\n"
            "appender.file.layout.pattern = [%d] %p %m (%c)%n\n"
        )
        return path

    def start(self, timeout: float = 60.0) -> None:
        """Format the storage on first start, start the broker, and wait until it answers."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self._write_config()
        if self._process is not None:
            raise BrokerError("the broker is already running")
        meta = self.data_dir / "logs" / "meta.properties"
        if not meta.exists():
            cluster_id = new_cluster_id()
            formatted = subprocess.run(
                self._java("kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(config)),
                capture_output=True,
                text=True,
            )
            if formatted.returncode != 0:
                raise BrokerError(f"formatting {self.data_dir} failed: {formatted.stderr[-2000:]}")
        cluster_id = next(
            line.split("=", 1)[1] for line in meta.read_text().splitlines() if line.startswith("cluster.id=")
        )
        self._process = launch_jvm(self._java("kafka.Kafka", str(config)), self.output_file)
        try:
            self.wait_ready(timeout, cluster_id)
        except BaseException:
            self.stop()
            raise

    def wait_ready(self, timeout: float, cluster_id: str) -> None:
        """Until this broker (not another one on the port) answers metadata requests."""
        deadline = time.monotonic() + timeout
        # log_level 0: no "connection refused" lines while the broker is still starting.
        admin = AdminClient({"bootstrap.servers": self.bootstrap_servers, "log_level": 0})
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                raise BrokerError(
                    f"the broker exited with {self._process.returncode}; see {self.log_file} and {self.output_file}"
                )
            try:
                metadata = admin.list_topics(timeout=1)
            except Exception:
                time.sleep(0.2)
                continue
            if metadata.cluster_id != cluster_id:
                raise BrokerError(f"another Kafka cluster answers on {self.bootstrap_servers}")
            if metadata.brokers:
                return
        raise BrokerError(f"the broker did not answer within {timeout} s; see {self.log_file} and {self.output_file}")

    def stop(self, timeout: float = 30.0) -> None:
        """A clean shutdown (SIGTERM), so a later start keeps every committed record."""
        process, self._process = self._process, None
        stop_process(process, timeout)

    def kill(self) -> None:
        """SIGKILL, as a Region's outage ends it: no clean shutdown (a later start recovers its logs)."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    def __enter__(self) -> KafkaBroker:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def new_cluster_id() -> str:
    """A random KRaft cluster id: a UUID in URL-safe base64, as Kafka's own `Uuid.randomUuid()`, which also
    draws again for one starting with "-": StorageTool would read `-t -…` as an option, not its value."""
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


def launch_jvm(command: list[str], output_file: Path) -> subprocess.Popen[bytes]:
    """Start a JVM with its stdout and stderr appended to `output_file`, in its own session: a Ctrl-C meant
    for `poimen dev` must not kill it (its owner stops it cleanly). But it must not outlive its owner
    either, SIGKILL included (_terminate_with_parent)."""
    with output_file.open("ab") as out:
        return subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_terminate_with_parent(),
        )


def stop_process(process: subprocess.Popen[bytes] | None, timeout: float) -> None:
    """SIGTERM to a JVM this module started (its clean shutdown), then SIGKILL if it has not ended within
    `timeout` seconds; nothing if it is None or has ended."""
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _terminate_with_parent() -> Callable[[], None] | None:
    """A preexec_fn: the child (a broker, MirrorMaker) gets SIGTERM (a clean shutdown) when this process
    dies, SIGKILL included.

    Linux only (PR_SET_PDEATHSIG), and only from the main thread: the signal fires when the thread that
    started the child ends, and another thread may end long before this process does.
    """
    if sys.platform != "linux" or threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was asked for
            os._exit(1)

    return preexec
