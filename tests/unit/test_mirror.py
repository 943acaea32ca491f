"""The local two-Region pieces without a JVM: MirrorMaker 2's configuration (prefixed active-active, only the
local dispatch topics), a jar cache filled from an older pom fetched again, and per-Region stream positions."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest

from poimen.kafka import DISPATCH_TOPIC_PATTERN, replicated_dispatch_topic
from poimen_tools.local import kafka_broker
from poimen_tools.local.kafka_broker import kafka_jars
from poimen_tools.local.mirror import DISPATCH_TOPICS, mirror_properties, replica_topic
from poimen_tools.local.stream_source import positions_file


def test_every_flow_between_the_clusters_is_enabled_and_prefixed() -> None:
    # When two clusters are configured
    properties = mirror_properties({"east": "127.0.0.1:1", "west": "127.0.0.1:2"})
    # Then both directions replicate, each to its own bootstrap servers, named by the default policy
    assert properties["clusters"] == "east, west"
    assert properties["east.bootstrap.servers"] == "127.0.0.1:1"
    assert properties["west.bootstrap.servers"] == "127.0.0.1:2"
    assert properties["east->west.enabled"] == properties["west->east.enabled"] == "true"
    assert properties["replication.policy.class"] == "org.apache.kafka.connect.mirror.DefaultReplicationPolicy"
    assert properties["replication.policy.separator"] == "."
    # And every topic MirrorMaker creates fits a one-broker cluster
    factors = {key: value for key, value in properties.items() if key.endswith("replication.factor")}
    assert len(factors) == 7
    assert set(factors.values()) == {"1"}
    # And a new tenant's topic is picked up within a second, with nothing but records replicated
    assert properties["refresh.topics.interval.seconds"] == "1"
    assert properties["emit.checkpoints.enabled"] == properties["sync.group.offsets.enabled"] == "false"


def test_only_local_dispatch_topics_are_replicated_and_their_replicas_are_what_the_relay_consumes() -> None:
    # Given MirrorMaker's topic filter (a Java regex matched against the whole name)
    topics = mirror_properties({"east": "a:1", "west": "b:2"})["topics"]
    assert topics == DISPATCH_TOPICS

    def replicated(name: str) -> bool:
        return re.fullmatch(topics, name) is not None

    # Then a tenant's local dispatch topic is replicated, its events and replicas never (no cycle)
    assert replicated("poimen.acme.dispatch")
    assert not replicated("poimen.acme.events")
    assert not replicated("east.poimen.acme.dispatch")
    assert not replicated("mm2-offsets.east.internal")
    # And the replica's name is the one poimen.kafka names, which the relay's subscription matches
    replica = replica_topic("east", "poimen.acme.dispatch")
    assert replica == replicated_dispatch_topic("east", "acme")
    assert re.fullmatch(DISPATCH_TOPIC_PATTERN, replica)


@pytest.mark.parametrize("aliases", [["east"], ["east", "we.st"], ["east", ""]])
def test_clusters_must_be_two_or_more_with_aliases_without_dots(aliases: list[str]) -> None:
    with pytest.raises(ValueError, match=r"at least two clusters|cluster alias"):
        mirror_properties({alias: "127.0.0.1:1" for alias in aliases})


def _fake_mvn(folder: Path, jars: list[str]) -> Path:
    """A Maven that copies `jars` (empty files) into the -DoutputDirectory it is given, and counts its calls."""
    calls = folder / "calls"
    mvn = folder / "mvn"
    mvn.write_text(
        "#!/bin/sh\n"
        f"echo call >> {calls}\n"
        'for a in "$@"; do case "$a" in -DoutputDirectory=*) out="${a#-DoutputDirectory=}";; esac; done\n'
        + "".join(f'touch "$out/{jar}"\n' for jar in jars)
    )
    mvn.chmod(mvn.stat().st_mode | stat.S_IEXEC)
    return calls


def test_a_cache_filled_from_an_older_pom_is_fetched_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a cache marked complete before the pom named MirrorMaker 2 (an empty marker), with a jar the pom
    # no longer names
    lib = tmp_path / "cache" / kafka_broker.KAFKA_VERSION / "lib"
    lib.mkdir(parents=True)
    (lib / ".complete").touch()
    (lib / "kafka_2.13-4.1.1.jar").write_text("old")
    (lib / "gone-1.0.jar").touch()
    calls = _fake_mvn(tmp_path, ["kafka_2.13-4.1.1.jar", "connect-mirror-4.1.1.jar"])
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    # When the jars are asked for
    assert kafka_jars(tmp_path / "cache") == lib
    # Then Maven fetched them: MirrorMaker's jar is there, the stale one gone, no staging folder left
    assert sorted(path.name for path in lib.glob("*.jar")) == ["connect-mirror-4.1.1.jar", "kafka_2.13-4.1.1.jar"]
    assert (lib / "kafka_2.13-4.1.1.jar").read_text() == ""
    assert sorted(path.name for path in lib.parent.iterdir()) == ["lib"]
    # And the cache is complete for this pom: asking again does not call Maven
    kafka_jars(tmp_path / "cache")
    assert calls.read_text().splitlines() == ["call"]


def test_a_changed_pom_fetches_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a cache complete for one pom
    pom = tmp_path / "pom.xml"
    pom.write_text("<project/>")
    monkeypatch.setattr(kafka_broker, "POM", pom)
    calls = _fake_mvn(tmp_path, ["a-1.jar"])
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    kafka_jars(tmp_path / "cache")
    # When the pom changes
    pom.write_text("<project><!-- another jar --></project>")
    kafka_jars(tmp_path / "cache")
    # Then Maven was asked again
    assert calls.read_text().splitlines() == ["call", "call"]


def test_each_region_keeps_its_own_positions_of_a_shared_table() -> None:
    # Given one table shared by the outboxes of two Regions
    east = positions_file("http://127.0.0.1:5000", "t", table_region="us-east-1", region="us-east-1")
    west = positions_file("http://127.0.0.1:5000", "t", table_region="us-east-1", region="us-west-2")
    # Then neither moves the other's checkpoints, and each is another table's (Region's) too
    assert east != west
    assert east != positions_file("http://127.0.0.1:5000", "t", table_region="us-west-2", region="us-east-1")
    # And without Regions, the file is that of `poimen dev` with its default Region (us-east-1)
    assert positions_file("http://127.0.0.1:5000", "t") == east
