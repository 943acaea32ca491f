"""Fetching the broker's jars: Maven's console codes never reach the output, and a failure says why."""

from __future__ import annotations

import os
import stat
import uuid
from pathlib import Path

import pytest

from poimen_tools.local.kafka_broker import BrokerError, kafka_jars, new_cluster_id


def _fake_mvn(folder: Path, script: str) -> None:
    mvn = folder / "mvn"
    mvn.write_text(f"#!/bin/sh\n{script}\n")
    mvn.chmod(mvn.stat().st_mode | stat.S_IEXEC)


def test_a_failed_fetch_names_mavens_reason_without_colour_codes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    # Given a Maven that colours its output and fails, as Maven 3.8 does offline
    _fake_mvn(tmp_path, r"printf '\033[0m\033[1;31m[ERROR] Could not resolve dependencies\033[0m\n'; exit 1")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    # When the jars are fetched into an empty cache
    with pytest.raises(BrokerError) as raised:
        kafka_jars(tmp_path / "cache")
    # Then the error carries Maven's reason as plain text, and nothing was printed around it
    assert str(raised.value).splitlines() == [
        "Maven could not fetch the Kafka broker jars (exit 1):",
        "[ERROR] Could not resolve dependencies",
    ]
    assert capfd.readouterr() == ("", "")
    assert not list((tmp_path / "cache").glob("*/lib/.complete"))


def test_a_successful_fetch_prints_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    # Given a Maven that writes colour resets to stdout even in batch mode, then succeeds
    _fake_mvn(tmp_path, r"printf '\033[0m\033[0m'; exit 0")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    # When the jars are fetched
    lib = kafka_jars(tmp_path / "cache")
    # Then the cache is marked complete and no escape code reached the terminal
    assert (lib / ".complete").exists()
    assert capfd.readouterr() == ("", "")


def test_a_cluster_id_never_starts_with_a_hyphen(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given UUIDs of which the first encodes to "-…" in URL-safe base64 (its first six bits are 62)
    drawn = iter([uuid.UUID(bytes=b"\xf8" + bytes(15)), uuid.UUID(bytes=b"\x01" + bytes(15))])
    monkeypatch.setattr(uuid, "uuid4", lambda: next(drawn))
    # When a cluster id is made
    cluster_id = new_cluster_id()
    # Then it is drawn again: `StorageTool format -t -…` would take the id for an option and refuse it
    assert cluster_id == "AQAAAAAAAAAAAAAAAAAAAA"
