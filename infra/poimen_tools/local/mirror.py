"""Apache Kafka's MirrorMaker 2 between local brokers, as MSK Replicator runs between Regions' clusters.

Dedicated mode (`org.apache.kafka.connect.mirror.MirrorMaker`, the jars of infra/kafka/pom.xml), every
flow between the named clusters enabled (active-active), DefaultReplicationPolicy: a topic `T` of cluster
`east` is `east.T` on the others. Only the local dispatch topics are replicated (DISPATCH_TOPICS: not the
events topics, not topics replicated already, so nothing goes round in a cycle), with short refresh
intervals so that a new tenant's topic is replicated within seconds.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import TracebackType

from confluent_kafka.admin import AdminClient

from poimen.kafka import CLUSTER_ALIAS_PATTERN
from poimen_tools.local.kafka_broker import kafka_jars, launch_jvm, stop_process

MIRROR_MAKER = "org.apache.kafka.connect.mirror.MirrorMaker"
# MirrorMaker's topic filter, a Java regular expression that must match the whole name: `poimen.<tenant>.dispatch`
# only (a tenant has no dots), never `<alias>.poimen.<tenant>.dispatch` nor `poimen.<tenant>.events`.
DISPATCH_TOPICS = r"poimen\.[^.]+\.dispatch"


class MirrorError(RuntimeError):
    """MirrorMaker could not start, or did not replicate in time."""


def mirror_properties(clusters: Mapping[str, str], topics: str = DISPATCH_TOPICS) -> dict[str, str]:
    """The dedicated-mode configuration: `clusters` (alias -> bootstrap servers) each replicating `topics`
    to every other, prefixed with its alias; single-broker clusters (replication factors 1); no heartbeats,
    checkpoints, group offsets or ACLs, which the relays do not use (each Region's relay has its own group)."""
    if len(clusters) < 2:
        raise ValueError("MirrorMaker needs at least two clusters")
    for alias in clusters:
        if re.fullmatch(CLUSTER_ALIAS_PATTERN, alias) is None:
            raise ValueError(f"cluster alias {alias!r} must match {CLUSTER_ALIAS_PATTERN}")
    return {
        "clusters": ", ".join(clusters),
        **{f"{alias}.bootstrap.servers": servers for alias, servers in clusters.items()},
        **{f"{source}->{target}.enabled": "true" for source in clusters for target in clusters if source != target},
        "topics": topics,
        "groups.exclude": ".*",
        "replication.policy.class": "org.apache.kafka.connect.mirror.DefaultReplicationPolicy",
        "replication.policy.separator": ".",
        "replication.factor": "1",
        "offset-syncs.topic.replication.factor": "1",
        "checkpoints.topic.replication.factor": "1",
        "heartbeats.topic.replication.factor": "1",
        "offset.storage.replication.factor": "1",
        "config.storage.replication.factor": "1",
        "status.storage.replication.factor": "1",
        # 10 minutes by default: a new tenant's dispatch topic would wait that long for its replica.
        "refresh.topics.interval.seconds": "1",
        "sync.topic.configs.interval.seconds": "5",
        "emit.heartbeats.enabled": "false",
        "emit.checkpoints.enabled": "false",
        "sync.group.offsets.enabled": "false",
        "sync.topic.acls.enabled": "false",  # the local brokers have no authorizer
    }


def replica_topic(alias: str, topic: str) -> str:
    """The name DefaultReplicationPolicy gives `topic` of cluster `alias` on the other clusters."""
    return f"{alias}.{topic}"


class MirrorMaker:
    """`with MirrorMaker({"east": ..., "west": ...}, folder, ready_topics=[...]) as mirror:` runs MirrorMaker 2
    until the block ends; its configuration and log are in `folder` (kept)."""

    def __init__(
        self,
        clusters: Mapping[str, str],
        folder: Path,
        *,
        ready_topics: Iterable[str] = (),
        jars: Path | None = None,
    ) -> None:
        self.clusters = dict(clusters)
        self.folder = folder
        # Local topics (on every cluster) whose replicas on every other cluster mean MirrorMaker is ready.
        self.ready_topics = list(ready_topics)
        self._properties = mirror_properties(self.clusters)
        self._jars = jars
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def log_file(self) -> Path:
        return self.folder / "mirror-maker.log"

    @property
    def output_file(self) -> Path:
        """The JVM's own stdout and stderr (what happens before logging starts)."""
        return self.folder / "mirror-maker.out"

    def start(self, timeout: float = 120.0) -> None:
        """Start MirrorMaker and wait until each of `ready_topics` is replicated to every other cluster."""
        if self._process is not None:
            raise MirrorError("MirrorMaker is already running")
        if shutil.which("java") is None:
            raise MirrorError("Java 17 or later (java) is needed to run MirrorMaker 2")
        self.folder.mkdir(parents=True, exist_ok=True)
        config = self.folder / "mm2.properties"
        config.write_text("".join(f"{key} = {value}\n" for key, value in self._properties.items()))
        command = [
            "java",
            "-Xms128m",
            "-Xmx512m",
            f"-Dlog4j2.configurationFile={self._write_log_config()}",
            "-cp",
            f"{self._jars or kafka_jars()}/*",
            MIRROR_MAKER,
            str(config),
        ]
        self._process = launch_jvm(command, self.output_file)
        try:
            self.wait_replicated(self.ready_topics, timeout)
        except BaseException:
            self.stop()
            raise

    def wait_replicated(self, topics: Iterable[str], timeout: float) -> None:
        """Until every cluster has the replica of each of `topics` of every other cluster."""
        wanted = {
            target: {replica_topic(source, topic) for source in self.clusters if source != target for topic in topics}
            for target in self.clusters
        }
        admins = {
            alias: AdminClient({"bootstrap.servers": servers, "log_level": 0})
            for alias, servers in self.clusters.items()
        }
        deadline = time.monotonic() + timeout
        while True:
            if self._process is not None and self._process.poll() is not None:
                raise MirrorError(
                    f"MirrorMaker exited with {self._process.returncode}; see {self.log_file} and {self.output_file}"
                )
            missing = {alias: names - set(_topics(admins[alias])) for alias, names in wanted.items() if names}
            if not any(missing.values()):
                return
            if time.monotonic() > deadline:
                raise MirrorError(f"not replicated within {timeout} s: {missing}; see {self.log_file}")
            time.sleep(0.2)

    def _write_log_config(self) -> Path:
        path = self.folder / "log4j2.properties"
        path.write_text(
            "rootLogger.level = WARN\n"
            "rootLogger.appenderRef.file.ref = file\n"
            "logger.mirror.name = org.apache.kafka.connect.mirror\n"
            "logger.mirror.level = INFO\n"
            "appender.file.type = File\n"
            "appender.file.name = file\n"
            f"appender.file.fileName = {self.log_file}\n"
            "appender.file.layout.type = PatternLayout\n"
            "appender.file.layout.pattern = [%d] %p %m (%c)%n\n"
        )
        return path

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (MirrorMaker's clean shutdown: a few seconds), then SIGKILL if it has not ended within
        `timeout` (with a cluster gone, its flows keep it shutting down for about a minute)."""
        process, self._process = self._process, None
        stop_process(process, timeout)

    def __enter__(self) -> MirrorMaker:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()


def _topics(admin: AdminClient) -> list[str]:
    """The cluster's topic names; none while it does not answer (it may be starting, or gone)."""
    try:
        return list(admin.list_topics(timeout=1).topics)
    except Exception:
        return []
