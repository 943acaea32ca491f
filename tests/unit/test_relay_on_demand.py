"""The relay under each poller mode (RelayEventPollers). Provisioned, the mapping retries a failed batch
MaximumRetryAttempts times and parks it in S3, so the relay fails it for an outage whatever its age. On-demand,
AWS retries it until it succeeds or its records leave the topic, so the relay bounds that itself: a batch that
would fail once its oldest record is RELAY_MAX_RECORD_AGE_SECONDS old dead-letters its records not yet settled
(`retries-exhausted`), once, and succeeds."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
import urllib3

from poimen.admission import Admission
from poimen.config import ON_DEMAND_POLLERS, PROVISIONED_POLLERS, ConfigurationError, RelaySettings
from poimen.observability import logger
from poimen.relay import AdmissionApiRefused, AdmissionApiUnavailable
from poimen.store import Store
from poimen_tools.cli import _dev_options, build_parser
from poimen_tools.local.devserver import LocalLambdaContext
from poimen_tools.local.event_source import LOCAL_MAX_ATTEMPTS, relay_mapping_attempts
from poimen_tools.local.template import Template
from tests.conftest import count_runs
from tests.unit import relay_harness
from tests.unit.dynamodb_faults import connect_refused, lost_before_dynamodb, script_attempts, throttled
from tests.unit.relay_harness import RelayHarness

SPAWN: dict[str, Any] = {"workflow_ref": "wf/hello", "input": {}, "goal_id": None}
HOUR_MS = 3600 * 1000


class PartlyDownApi:
    """The API reachable for the bodies naming `reachable` in them, connection refused for every other."""

    def __init__(self, up: Any, reachable: bytes) -> None:
        self._up = up
        self._reachable = reachable
        self.refused = 0

    def request(self, method: str, url: str, **kw: Any) -> Any:
        if self._reachable in kw["body"]:
            return self._up.request(method, url, **kw)
        self.refused += 1
        raise urllib3.exceptions.NewConnectionError(None, "connection refused")  # type: ignore[arg-type]


class RefusingApi:
    """The API answering 403 to the relay itself (its grant or URL wrong): every record would meet it."""

    def request(self, *_: Any, **__: Any) -> Any:
        return urllib3.HTTPResponse(body=b'{"type": "about:blank", "status": 403}', status=403, preload_content=True)


@pytest.fixture
def harness(template: Template, handler: Callable[[dict[str, Any], Any], dict[str, Any]], store: Store) -> RelayHarness:
    return RelayHarness.start(template, handler, store)


@pytest.fixture(params=[1, 100], ids=["per-record", "batch-route"])
def batch_spawns(request: pytest.FixtureRequest) -> int:
    """RELAY_BATCH_SPAWNS: the relay's per-record path and its batch path (the default) alike."""
    return int(request.param)


def _on_demand(harness: RelayHarness, batch_spawns: int = 100) -> RelayHarness:
    return harness.with_settings(
        event_pollers=ON_DEMAND_POLLERS, max_record_age_seconds=3600, batch_spawns=batch_spawns
    )


def _batch(harness: RelayHarness, age_ms: int) -> list[Any]:
    """One admitted record (key a), one malformed (key b) and one the outage keeps out (key c, on a partition of
    its own, so that the batch route's call of partition 0 does not carry it), `age_ms` old."""
    born = int(time.time() * 1000) - age_ms
    return [
        harness.record({**SPAWN, "dispatch_key": "reachable-1"}, 0, key=b"a", timestamp_ms=born),
        harness.record(b"{not json", 1, key=b"b", timestamp_ms=born),
        harness.record({**SPAWN, "dispatch_key": "kept-out-2"}, 2, key=b"c", timestamp_ms=born + 1000, partition=1),
    ]


def test_on_demand_a_batch_failing_past_the_age_limit_dead_letters_what_it_did_not_settle_once_and_succeeds(
    harness: RelayHarness, dynamodb: Any, table_name: str, batch_spawns: int
) -> None:
    # Given on-demand pollers (age limit 1 h), a batch 2 h old, and the API down for one of its records
    relay = _on_demand(harness, batch_spawns)
    down = PartlyDownApi(relay.relay._http, b"reachable-1")
    relay.relay._http = down  # type: ignore[assignment]
    records = _batch(relay, 2 * HOUR_MS)
    started = time.monotonic()
    # When the batch is invoked with 10 s left
    outcome = relay.run(records, seconds=10)
    # Then it succeeds before its deadline: the reachable record admitted, the malformed one dead-lettered for
    # itself, the one the outage kept out dead-lettered as retries-exhausted, each once
    assert time.monotonic() - started < 10
    assert down.refused >= 1
    letters = sorted((letter["record"]["offset"], letter["reason"]["kind"]) for _, letter in relay.dead_letters())
    assert letters == [(1, "invalid-json"), (2, "retries-exhausted")]
    assert (outcome.relayed, outcome.dead_lettered) == (1, 2)
    assert len(count_runs(dynamodb, table_name, relay.tenant)) == 1


def test_on_demand_the_letter_of_a_given_up_record_says_why_and_holds_the_record(harness: RelayHarness) -> None:
    # Given on-demand pollers and a batch 2 h old the API refuses to the relay itself
    relay = _on_demand(harness)
    relay.relay._http = RefusingApi()  # type: ignore[assignment]
    (record,) = _batch(relay, 2 * HOUR_MS)[2:]
    # When it is invoked
    relay.run([record], seconds=10)
    # Then its letter names the age limit and the cause, and keeps the record's value for redrive
    ((_, letter),) = relay.dead_letters()
    assert letter["reason"]["kind"] == "retries-exhausted"
    assert "RELAY_MAX_RECORD_AGE_SECONDS (1 h)" in letter["reason"]["detail"]
    assert "AdmissionApiRefused" in letter["reason"]["detail"]
    assert letter["record"]["value"] is not None


def test_on_demand_a_batch_younger_than_the_age_limit_still_fails_for_an_outage(
    harness: RelayHarness, batch_spawns: int
) -> None:
    # Given on-demand pollers and a batch a minute old, the API down for one of its records
    relay = _on_demand(harness, batch_spawns)
    relay.relay._http = PartlyDownApi(relay.relay._http, b"reachable-1")  # type: ignore[assignment]
    # When it is invoked, the batch fails (AWS retries it: nothing is lost while the topic keeps it)
    with pytest.raises(AdmissionApiUnavailable):
        relay.run(_batch(relay, 60 * 1000), seconds=5)
    # Then nothing is dead-lettered yet
    assert relay.dead_letters() == []


def test_on_demand_a_batch_without_timestamps_has_no_age_and_still_fails(harness: RelayHarness) -> None:
    relay = _on_demand(harness)
    relay.relay._http = RefusingApi()  # type: ignore[assignment]

    with pytest.raises(AdmissionApiRefused):
        relay.run([relay.record({**SPAWN, "dispatch_key": "no-time"}, 0)], seconds=5)
    assert relay.dead_letters() == []


def test_provisioned_an_old_batch_fails_for_an_outage_as_its_mapping_parks_it(
    harness: RelayHarness, batch_spawns: int
) -> None:
    # Given provisioned pollers (the default) and the same batch 2 h old, the API down for one record
    assert harness.relay._settings.event_pollers == PROVISIONED_POLLERS
    relay = harness.with_settings(max_record_age_seconds=3600, batch_spawns=batch_spawns)
    relay.relay._http = PartlyDownApi(relay.relay._http, b"reachable-1")  # type: ignore[assignment]
    # When it is invoked, the batch fails: the mapping's retries and its S3 destination bound it
    with pytest.raises(AdmissionApiUnavailable):
        relay.run(_batch(relay, 2 * HOUR_MS), seconds=5)
    assert relay.dead_letters() == []


@pytest.mark.parametrize("mode", [PROVISIONED_POLLERS, ON_DEMAND_POLLERS])
def test_the_relay_reads_its_poller_mode_from_the_template(
    harness: RelayHarness, template: Template, mode: str
) -> None:
    environment = template.function_environment("InboxRelayFunction", {"RelayEventPollers": mode})

    settings = harness.with_environment(environment).relay._settings

    assert settings.event_pollers == mode
    assert settings.bounds_failed_batches == (mode == ON_DEMAND_POLLERS)
    assert settings.max_record_age_seconds == 10800


def test_poller_settings_are_validated() -> None:
    env = {"ADMISSION_API_URL": "https://api.example", "DLQ_URL": "q", "AWS_REGION": "eu-west-1"}

    assert RelaySettings.from_env(env).event_pollers == PROVISIONED_POLLERS
    assert RelaySettings.from_env({**env, "RELAY_MAX_RECORD_AGE_SECONDS": "82800"}).max_record_age_seconds == 82800
    for broken in (
        {"RELAY_EVENT_POLLERS": "on_demand"},
        {"RELAY_MAX_RECORD_AGE_SECONDS": "59"},
        {"RELAY_MAX_RECORD_AGE_SECONDS": "82801"},
    ):
        with pytest.raises(ConfigurationError):
            RelaySettings.from_env({**env, **broken})


@pytest.mark.parametrize(
    ("arguments", "environment", "mode"),
    [
        ([], None, None),  # the template's default
        (["--event-pollers", "on-demand"], None, ON_DEMAND_POLLERS),
        ([], "on-demand", ON_DEMAND_POLLERS),
        (["--event-pollers", "provisioned"], "on-demand", PROVISIONED_POLLERS),  # the option over the variable
    ],
)
def test_poimen_dev_takes_the_mode_from_its_option_or_environment(
    template: Template, monkeypatch: pytest.MonkeyPatch, arguments: list[str], environment: str | None, mode: str | None
) -> None:
    if environment is not None:
        monkeypatch.setenv("POIMEN_EVENT_POLLERS", environment)
    else:
        monkeypatch.delenv("POIMEN_EVENT_POLLERS", raising=False)

    options = _dev_options(build_parser().parse_args(["dev", *arguments]))

    assert options.event_pollers == mode
    relay = template.function_environment("InboxRelayFunction", options.template_parameters)
    assert relay["RELAY_EVENT_POLLERS"] == (mode or PROVISIONED_POLLERS)
    expected = LOCAL_MAX_ATTEMPTS if mode in (None, PROVISIONED_POLLERS) else None
    assert relay_mapping_attempts(template, options.template_parameters) == expected


def test_poimen_dev_refuses_an_unknown_mode_in_its_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POIMEN_EVENT_POLLERS", "lazy")

    with pytest.raises(ConfigurationError, match="POIMEN_EVENT_POLLERS"):
        _dev_options(build_parser().parse_args(["dev"]))


def test_on_demand_a_large_batch_past_the_age_limit_is_admitted_when_the_api_is_up(harness: RelayHarness) -> None:
    # Given on-demand pollers and a batch past the age limit (a backlog, not a failure: the API answers), so large
    # for the relay's concurrency that the time its letters would need, were it given up, is the whole invocation's
    # (as RelayBatchSize 1,000 is for 16 workers and 120 s: 128 s)
    relay = _on_demand(harness).with_settings(max_concurrency=1)
    born = int(time.time() * 1000) - 2 * HOUR_MS
    records = [
        relay.record({**SPAWN, "dispatch_key": f"backlog-{n}"}, n, key=f"k{n}".encode(), timestamp_ms=born)
        for n in range(5)
    ]
    # When it is invoked with 10 s left
    outcome = relay.run(records, seconds=10)
    # Then every record is admitted: the API is given time first, and nothing is dead-lettered
    assert (outcome.relayed, outcome.dead_lettered) == (5, 0)
    assert relay.dead_letters() == []


def test_on_demand_a_given_up_record_the_relay_would_dead_letter_for_itself_keeps_its_own_reason(
    harness: RelayHarness,
) -> None:
    # Given on-demand pollers and a batch 2 h old the API refuses: behind a spawn of key a, records of the same key
    # the relay never reached (malformed, a tombstone) and a keyless spawn replicated from another Region
    relay = _on_demand(harness)
    relay.relay._http = RefusingApi()  # type: ignore[assignment]
    born = int(time.time() * 1000) - 2 * HOUR_MS
    replica = f"peer.poimen.{relay.tenant}.dispatch"
    records = [
        relay.record({**SPAWN, "dispatch_key": "first"}, 0, key=b"a", timestamp_ms=born),
        relay.record(b"{not json", 1, key=b"a", timestamp_ms=born),
        relay.record(None, 2, key=b"a", timestamp_ms=born),
        relay.record(SPAWN, 3, key=b"a", timestamp_ms=born, topic=replica),
    ]
    # When it is given up
    relay.run(records, seconds=10)
    # Then only the spawn the outage kept out is retries-exhausted; each other record's letter says what the relay
    # would have said of it, so that its reason (and whether redrive sends it by default) is the relay's own
    letters = sorted((letter["record"]["offset"], letter["reason"]["kind"]) for _, letter in relay.dead_letters())
    assert letters == [(0, "retries-exhausted"), (1, "invalid-json"), (2, "empty-value"), (3, "keyless-replica")]


def test_on_demand_a_given_up_records_log_line_names_its_tenant_and_dispatch_key(
    harness: RelayHarness, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given on-demand pollers and a batch 2 h old the API refuses to the relay itself
    monkeypatch.setattr(logger.registered_handler, "stream", sys.stdout)
    relay = _on_demand(harness)
    relay.relay._http = RefusingApi()  # type: ignore[assignment]
    (record,) = _batch(relay, 2 * HOUR_MS)[2:]
    capsys.readouterr()
    # When it is given up
    relay.run([record], seconds=10)
    # Then its dead-letter line carries the spawn's tenant and dispatch key, as every other spawn's letter line does
    # (and the admission's lines: a spawn is found by the two, docs/operations.md#finding-an-admission)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    (line,) = [line for line in lines if line.get("message") == "dispatch dead-lettered"]
    assert (line["reason"], line["tenant_id"], line["dispatch_key"]) == (
        "retries-exhausted",
        relay.tenant,
        "kept-out-2",
    )


class ThrottledApi:
    """The API answering API Gateway's throttle (429 `Retry-After: 1`) for `seconds` from its first request to the
    bodies naming `marker` (every body when None), then each as `up` does; connection refused for bodies naming
    `down`."""

    def __init__(self, up: Any, seconds: float, marker: bytes | None = None, down: bytes | None = None) -> None:
        self._up = up
        self._seconds = seconds
        self._marker = marker
        self._down = down
        self._until: float | None = None
        self.throttled = 0

    def lift(self) -> None:
        """Throttle no more."""
        self._until = 0.0

    def request(self, method: str, url: str, **kw: Any) -> Any:
        if self._down is not None and self._down in kw["body"]:
            raise urllib3.exceptions.NewConnectionError(None, "connection refused")  # type: ignore[arg-type]
        if self._marker is None or self._marker in kw["body"]:
            if self._until is None:
                self._until = time.monotonic() + self._seconds
            if time.monotonic() < self._until:
                self.throttled += 1
                body = b'{"message":"Too Many Requests"}'
                headers = {"Content-Type": "application/json", "Retry-After": "1"}
                return urllib3.HTTPResponse(body=body, status=429, headers=headers, preload_content=True)
        return self._up.request(method, url, **kw)


@pytest.mark.parametrize("age_hours", [1, 4], ids=["within-the-age-limit", "past-the-age-limit"])
def test_on_demand_a_backlog_the_api_only_throttles_drains_and_is_never_dead_lettered_whatever_its_age(
    harness: RelayHarness, dynamodb: Any, table_name: str, batch_spawns: int, age_hours: int
) -> None:
    # Given on-demand pollers (the template's 3 h age limit) and an API that throttles (429 Retry-After: 1) for as
    # long as the first invocation lasts
    relay = harness.with_settings(event_pollers=ON_DEMAND_POLLERS, batch_spawns=batch_spawns)
    api = ThrottledApi(relay.relay._http, seconds=3600)
    relay.relay._http = api  # type: ignore[assignment]
    born = int(time.time() * 1000) - age_hours * HOUR_MS
    records = [
        relay.record({**SPAWN, "dispatch_key": f"backlog-{n}"}, n, key=f"k{n}".encode(), timestamp_ms=born)
        for n in range(5)
    ]
    # When a batch of five records that old is invoked with 6 s left, the batch fails, to be retried: a 429 asks
    # the relay to slow down, it is no failure to give a lane up for, within the age limit or past it
    with pytest.raises(AdmissionApiUnavailable):
        relay.run(records, seconds=6)
    assert api.throttled >= 1
    assert relay.dead_letters() == []
    # And once the API admits again, its retry admits every record, and none is ever dead-lettered
    api.lift()
    outcome = relay.run(records, seconds=10)
    assert (outcome.relayed, outcome.dead_lettered) == (5, 0)
    assert relay.dead_letters() == []
    assert len(count_runs(dynamodb, table_name, relay.tenant)) == 5


def test_on_demand_a_partition_past_the_age_limit_is_given_up_alone(
    harness: RelayHarness, dynamodb: Any, table_name: str, batch_spawns: int
) -> None:
    # Given on-demand pollers (age limit 1 h), a partition 2 h old the API cannot be reached for, and a fresh
    # partition the API throttles for 5 s, longer than the stale partition is tried (half the invocation, 4 s)
    relay = _on_demand(harness, batch_spawns)
    api = ThrottledApi(relay.relay._http, seconds=5, marker=b"fresh-", down=b"stale-")
    relay.relay._http = api  # type: ignore[assignment]
    now = int(time.time() * 1000)
    stale = [
        relay.record({**SPAWN, "dispatch_key": f"stale-{n}"}, n, key=b"s", timestamp_ms=now - 2 * HOUR_MS)
        for n in range(2)
    ]
    fresh = [
        relay.record({**SPAWN, "dispatch_key": f"fresh-{n}"}, n, key=b"f", partition=1, timestamp_ms=now - 60_000)
        for n in range(2)
    ]
    # When the batch is invoked with 10 s left
    outcome = relay.run(stale + fresh, seconds=10)
    # Then only the stale partition's records are dead-lettered (retries-exhausted); the fresh partition's, though
    # in the same batch, are admitted, and the batch succeeds
    letters = sorted((letter["record"]["partition"], letter["reason"]["kind"]) for _, letter in relay.dead_letters())
    assert letters == [(0, "retries-exhausted"), (0, "retries-exhausted")]
    keys = sorted(item["dispatch_key"]["S"] for item in count_runs(dynamodb, table_name, relay.tenant))
    assert keys == ["fresh-0", "fresh-1"]
    assert (outcome.relayed, outcome.dead_lettered) == (2, 2)


def test_on_demand_a_failing_fresh_partition_still_fails_the_batch_beside_a_given_up_one(
    harness: RelayHarness, batch_spawns: int
) -> None:
    # Given on-demand pollers (age limit 1 h), a partition 2 h old and a fresh one, the API down for both
    relay = _on_demand(harness, batch_spawns)
    relay.relay._http = ThrottledApi(relay.relay._http, seconds=0, down=b"-down-")  # type: ignore[assignment]
    now = int(time.time() * 1000)
    records = [
        relay.record({**SPAWN, "dispatch_key": "stale-down-0"}, 0, key=b"s", timestamp_ms=now - 2 * HOUR_MS),
        relay.record({**SPAWN, "dispatch_key": "fresh-down-0"}, 0, key=b"f", partition=1, timestamp_ms=now - 60_000),
    ]
    # When the batch is invoked, it fails (AWS retries it: the fresh partition's record is not given up)
    with pytest.raises(AdmissionApiUnavailable):
        relay.run(records, seconds=5)
    # And nothing is dead-lettered: letters go out only with a batch that succeeds
    assert relay.dead_letters() == []


@pytest.mark.parametrize("age_hours", [4, 24], ids=["past-the-age-limit", "past-23-hours"])
def test_on_demand_a_lane_the_api_throttles_throughout_is_retried_until_23_hours_then_given_up(
    harness: RelayHarness, dynamodb: Any, table_name: str, batch_spawns: int, age_hours: int
) -> None:
    # Given on-demand pollers (the template's 3 h age limit) and an API that throttles the whole invocation
    relay = harness.with_settings(event_pollers=ON_DEMAND_POLLERS, batch_spawns=batch_spawns)
    relay.relay._http = ThrottledApi(relay.relay._http, seconds=3600)  # type: ignore[assignment]
    born = int(time.time() * 1000) - age_hours * HOUR_MS
    record = relay.record({**SPAWN, "dispatch_key": "throttled"}, 0, key=b"t", timestamp_ms=born)
    started = time.monotonic()
    if age_hours < 23:
        # When a record past the age limit but younger than 23 h is invoked, the batch fails: it is retried, not
        # given up, while the topic is sure to keep it
        with pytest.raises(AdmissionApiUnavailable):
            relay.run([record], seconds=5)
        assert relay.dead_letters() == []
    else:
        # When it is 24 h old, it is given up: its letter names the 23 h bound, and it was given up early enough to
        # send it
        outcome = relay.run([record], seconds=10)
        ((_, letter),) = relay.dead_letters()
        assert letter["reason"]["kind"] == "retries-exhausted"
        assert "23 h, the longest the API's throttling is waited out" in letter["reason"]["detail"]
        assert outcome.dead_lettered == 1
    assert time.monotonic() - started < 10
    assert count_runs(dynamodb, table_name, relay.tenant) == []


class ThrottledOnceThenDownApi:
    """The API answering API Gateway's throttle (429 `Retry-After: 0`) to its first request, then unreachable
    (connection refused) for every later one: an outage met after a brief throttle."""

    def __init__(self) -> None:
        self.requests = 0

    def request(self, *_: Any, **__: Any) -> Any:
        self.requests += 1
        if self.requests == 1:
            headers = {"Content-Type": "application/json", "Retry-After": "0"}
            return urllib3.HTTPResponse(body=b'{"message":"Too Many Requests"}', status=429, headers=headers)
        raise urllib3.exceptions.NewConnectionError(None, "connection refused")  # type: ignore[arg-type]


def test_on_demand_a_lane_throttled_once_then_failing_is_given_up_in_time_to_send_its_letters(
    harness: RelayHarness, batch_spawns: int
) -> None:
    # Given on-demand pollers (age limit 1 h), a record 2 h old, and an API that throttles the first call and is
    # unreachable after it (the backoff's cap 50 ms, so that the relay's calls end close to where it decides)
    relay = _on_demand(harness, batch_spawns).with_settings(retry_cap_seconds=0.05)
    api = ThrottledOnceThenDownApi()
    relay.relay._http = api  # type: ignore[assignment]
    (record,) = _batch(relay, 2 * HOUR_MS)[2:]
    # When it is invoked with 10 s left
    outcome = relay.run([record], seconds=10)
    # Then the lane, whose calls failed (the outage, not the throttle, is its last answer) past the age limit, is
    # given up early enough for its letter: one retries-exhausted letter, and the invocation succeeds. (It failed
    # with DeadLetterQueueUnavailable: one 429 made the lane's calls take the whole invocation, and every retry of
    # the batch met the same, so the record was never dead-lettered while the topic kept it.)
    assert api.requests > 2
    assert [letter["reason"]["kind"] for _, letter in relay.dead_letters()] == ["retries-exhausted"]
    assert outcome.dead_lettered == 1


@pytest.mark.parametrize("outage", ["dynamodb-unreachable", "writes-outcome-unknown"])
def test_on_demand_a_store_outage_past_the_age_limit_is_a_failure_that_gives_the_lane_up_not_a_throttle(
    harness: RelayHarness, monkeypatch: pytest.MonkeyPatch, batch_spawns: int, outage: str
) -> None:
    # Given on-demand pollers (age limit 1 h), a keyed record 2 h old, and DynamoDB down behind the API: every write
    # refused at connect (503 store-unavailable), or every write's answer lost and the read after it refused (503
    # outcome-unknown, keyed). Both answers carry the API's `Retry-After: 1`, as every store failure's does
    if outage == "dynamodb-unreachable":
        script_attempts(monkeypatch, put_run=[connect_refused] * 10_000)
    else:
        script_attempts(monkeypatch, put_run=[lost_before_dynamodb] * 10_000, get_run=[connect_refused] * 10_000)
    relay = _on_demand(harness, batch_spawns)
    born = int(time.time() * 1000) - 2 * HOUR_MS
    record = relay.record({**SPAWN, "dispatch_key": "store-down"}, 0, key=b"o", timestamp_ms=born)
    # When it is invoked with 10 s left
    relay.run([record], seconds=10)
    # Then the lane's calls failed past the age limit, and it is given up: DynamoDB unreachable, or writes whose
    # outcome nobody can tell, are no request to slow down. (It raised AdmissionApiUnavailable: the relay takes any
    # answer with a Retry-After for a throttle, so an on-demand lane is never given up for a store outage before
    # 23 h, whatever RELAY_MAX_RECORD_AGE_SECONDS says.)
    assert [letter["reason"]["kind"] for _, letter in relay.dead_letters()] == ["retries-exhausted"]


def test_on_demand_a_spawn_deferred_behind_a_failing_one_of_its_kafka_key_is_no_throttle(
    harness: RelayHarness, monkeypatch: pytest.MonkeyPatch, batch_spawns: int
) -> None:
    # Given on-demand pollers (age limit 1 h), two records of one Kafka key 2 h old, and an API whose admission of
    # the first fails unforeseen (500 internal-error, no Retry-After: no throttle)
    admit_run = Admission.admit_run

    def failing(self: Admission, principal: str | None, tenant_id: str, request: Any, **kwargs: Any) -> Any:
        if request.dispatch_key == "first-fails":
            raise RuntimeError("injected")
        return admit_run(self, principal, tenant_id, request, **kwargs)

    monkeypatch.setattr(Admission, "admit_run", failing)
    relay = _on_demand(harness, batch_spawns)
    born = int(time.time() * 1000) - 2 * HOUR_MS
    records = [
        relay.record({**SPAWN, "dispatch_key": "first-fails"}, 0, key=b"k", timestamp_ms=born),
        relay.record({**SPAWN, "dispatch_key": "second"}, 1, key=b"k", timestamp_ms=born),
    ]
    # When they are invoked with 10 s left
    relay.run(records, seconds=10)
    # Then, on either path, the lane's calls failed past the age limit and it is given up, both records dead-lettered
    # (the second not admitted ahead of the first). (On the batch path it raised AdmissionApiUnavailable: the second
    # spawn, deferred behind the first by its ordering key, is answered 503 with `retry_after` 1, which the relay
    # takes for a throttle; alone, the first record's lane is given up.)
    letters = sorted((letter["record"]["offset"], letter["reason"]["kind"]) for _, letter in relay.dead_letters())
    assert letters == [(0, "retries-exhausted"), (1, "retries-exhausted")]


def test_on_demand_a_lane_waiting_for_a_worker_behind_throttled_ones_is_not_given_up_untried(
    harness: RelayHarness, dynamodb: Any, table_name: str, batch_spawns: int
) -> None:
    # Given on-demand pollers (the template's 3 h age limit), more lanes than workers (two Kafka keys on two
    # partitions, one worker: RELAY_MAX_CONCURRENCY's 16 with a batch of 17 keys is the same), both 4 h old, and an
    # API that throttles for 5 s of a 10 s invocation (past the 4 s a lane that may be given up is tried), then admits
    relay = harness.with_settings(event_pollers=ON_DEMAND_POLLERS, batch_spawns=batch_spawns, max_concurrency=1)
    api = ThrottledApi(relay.relay._http, seconds=5)
    relay.relay._http = api  # type: ignore[assignment]
    born = int(time.time() * 1000) - 4 * HOUR_MS
    records = [
        relay.record({**SPAWN, "dispatch_key": f"queued-{n}"}, 0, key=f"q{n}".encode(), partition=n, timestamp_ms=born)
        for n in range(2)
    ]
    # When they are invoked with 10 s left, the batch fails, to be retried
    with pytest.raises(AdmissionApiUnavailable):
        relay.run(records, seconds=10)
    # Then neither is dead-lettered: the API only throttled, and a throttled lane younger than 23 h is not given up,
    # nor one behind it that had no time. (The second lane started after the first's 5 s, past the give-up deadline,
    # and was dead-lettered retries-exhausted, "no time left to call the admission API", without one call.)
    assert api.throttled >= 1
    assert relay.dead_letters() == []
    # And the retry, the throttle over, admits both
    api.lift()
    outcome = relay.run(records, seconds=10)
    assert (outcome.relayed, outcome.dead_lettered) == (2, 0)
    assert relay.dead_letters() == []
    assert len(count_runs(dynamodb, table_name, relay.tenant)) == 2


class ThrottledThenDownApi:
    """The API answering API Gateway's throttle (429 `Retry-After: 1`) for `seconds` from its first request, then
    unreachable (connection refused)."""

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds
        self._until: float | None = None

    def request(self, *_: Any, **__: Any) -> Any:
        if self._until is None:
            self._until = time.monotonic() + self._seconds
        if time.monotonic() < self._until:
            headers = {"Content-Type": "application/json", "Retry-After": "1"}
            return urllib3.HTTPResponse(body=b'{"message":"Too Many Requests"}', status=429, headers=headers)
        raise urllib3.exceptions.NewConnectionError(None, "connection refused")  # type: ignore[arg-type]


def test_on_demand_a_lane_throttled_past_its_give_up_deadline_then_failing_still_sends_its_letters(
    harness: RelayHarness, batch_spawns: int
) -> None:
    # Given on-demand pollers (age limit 1 h), a record 2 h old, and an API that throttles for 4.5 s (past the 4 s of
    # the invocation's 8 s, 10 s less the 2 s margin, that a lane that may be given up is tried), then is
    # unreachable
    relay = _on_demand(harness, batch_spawns).with_settings(retry_cap_seconds=0.05)
    relay.relay._http = ThrottledThenDownApi(4.5)  # type: ignore[assignment]
    (record,) = _batch(relay, 2 * HOUR_MS)[2:]
    # When it is invoked with 10 s left, its calls end at the 4 s kept for its letters, still throttled: the batch
    # fails, to be retried (a throttle gives no lane up before 23 h)
    with pytest.raises(AdmissionApiUnavailable):
        relay.run([record], seconds=10)
    assert relay.dead_letters() == []
    # And when the retry meets the rest of the throttle and then the outage
    outcome = relay.run([record], seconds=10)
    # Then its calls failed past the age limit and it is given up, its letter sent. (It raised
    # DeadLetterQueueUnavailable, "no time left for an attempt": the throttle let the lane's calls take the time
    # kept for its letters, and the outage after it gives the lane up with 1.5 s left, less than one SendMessage
    # attempt's 2 s; every retry that meets the same throttle then outage fails alike.)
    assert [letter["reason"]["kind"] for _, letter in relay.dead_letters()] == ["retries-exhausted"]
    assert outcome.dead_lettered == 1


class SlowApi:
    """The API answering each request as `up` does, `seconds` late; connection refused for bodies naming `down`."""

    def __init__(self, up: Any, seconds: float, down: bytes | None = None) -> None:
        self._up = up
        self._seconds = seconds
        self._down = down

    def request(self, method: str, url: str, **kw: Any) -> Any:
        if self._down is not None and self._down in kw["body"]:
            raise urllib3.exceptions.NewConnectionError(None, "connection refused")  # type: ignore[arg-type]
        time.sleep(self._seconds)  # the API's latency, not a wait for a condition
        return self._up.request(method, url, **kw)


def test_on_demand_a_lane_a_slow_api_leaves_no_time_is_retried_not_given_up(
    harness: RelayHarness, dynamodb: Any, table_name: str, batch_spawns: int
) -> None:
    # Given on-demand pollers (age limit 1 h), two lanes 2 h old and one worker, and an API that answers each call in
    # 4.5 s, past the 4 s the first lane may be tried: the second starts with no time left
    relay = _on_demand(harness, batch_spawns).with_settings(max_concurrency=1)
    relay.relay._http = SlowApi(relay.relay._http, 4.5)  # type: ignore[assignment]
    born = int(time.time() * 1000) - 2 * HOUR_MS
    records = [
        relay.record({**SPAWN, "dispatch_key": f"slow-{n}"}, 0, key=f"s{n}".encode(), partition=n, timestamp_ms=born)
        for n in range(2)
    ]
    # When they are invoked with 10 s left, the batch fails, to be retried
    with pytest.raises(AdmissionApiUnavailable, match="no time left"):
        relay.run(records, seconds=10)
    # Then the second lane is not dead-lettered: no call of it failed, and none of the batch's did
    assert relay.dead_letters() == []
    assert [item["dispatch_key"]["S"] for item in count_runs(dynamodb, table_name, relay.tenant)] == ["slow-0"]


def test_on_demand_a_lane_left_no_time_behind_an_outage_is_given_up_with_the_failing_ones(
    harness: RelayHarness, dynamodb: Any, table_name: str, batch_spawns: int
) -> None:
    # Given on-demand pollers (age limit 1 h), two lanes 2 h old and one worker, the API unreachable: the first lane's
    # calls fail until its 4 s are over, and the second starts with no time left
    relay = _on_demand(harness, batch_spawns).with_settings(max_concurrency=1)
    relay.relay._http = SlowApi(relay.relay._http, 0, down=b"out-")  # type: ignore[assignment]
    born = int(time.time() * 1000) - 2 * HOUR_MS
    records = [
        relay.record({**SPAWN, "dispatch_key": f"out-{n}"}, 0, key=f"o{n}".encode(), partition=n, timestamp_ms=born)
        for n in range(2)
    ]
    # When they are invoked with 10 s left
    outcome = relay.run(records, seconds=10)
    # Then both are given up, the untried one beside the failing one (an outage with more lanes than workers would
    # otherwise never end), and the batch succeeds
    letters = sorted((letter["record"]["partition"], letter["reason"]["kind"]) for _, letter in relay.dead_letters())
    assert letters == [(0, "retries-exhausted"), (1, "retries-exhausted")]
    assert outcome.dead_lettered == 2
    assert count_runs(dynamodb, table_name, relay.tenant) == []


def test_on_demand_a_backlog_dynamodb_throttles_past_the_api_invocations_time_is_not_given_up(
    harness: RelayHarness, monkeypatch: pytest.MonkeyPatch, dynamodb: Any, table_name: str
) -> None:
    # Given on-demand pollers (age limit 1 h), the batch path, and DynamoDB throttling every write (each attempt
    # answered ThrottlingException after 0.5 s: the backoff of real throttling), so that a batch of 24 records takes
    # the API's invocation past MIN_REMAINING_MS: its first 16 spawns are answered 503 `throttled: true`, the rest
    # deferred unbegun for the invocation's time (the API's invocation 10 s here, not the function's 13 s, so that it
    # reaches the 8.5 s after 1.5 s of spawns rather than 4.5 s: the same cut, sooner)
    monkeypatch.setattr(
        relay_harness, "LocalLambdaContext", lambda name, timeout_seconds: LocalLambdaContext(name, timeout_seconds=10)
    )

    def slow_throttle(send: Callable[[], Any], request: Any) -> Any:
        time.sleep(0.5)  # the throttled attempt's backoff, not a wait for a condition
        return throttled(send, request)

    script_attempts(monkeypatch, put_run=[slow_throttle] * 10_000)
    relay = _on_demand(harness, 100)
    born = int(time.time() * 1000) - 2 * HOUR_MS
    records = [
        relay.record({**SPAWN, "dispatch_key": f"throttled-{n}"}, n, key=f"k{n}".encode(), timestamp_ms=born)
        for n in range(24)
    ]
    # When it is invoked with 10 s left, the batch fails, to be retried: DynamoDB only throttled, and a spawn the API
    # had no time to begin is no failure of the API's
    with pytest.raises(AdmissionApiUnavailable):
        relay.run(records, seconds=10)
    # Then no record is dead-lettered. (All 24 were dead-lettered retries-exhausted: the deferred spawns' 503
    # store-unavailable carries no `throttled`, so the relay took the round for a failure and gave the lane up.)
    assert relay.dead_letters() == []
    assert count_runs(dynamodb, table_name, relay.tenant) == []


class MarkedThrottledApi:
    """An API (or a proxy before it) answering every call `status` with a problem of `kind` marked `throttled: true`:
    no answer the admission API gives, which marks only a 503 store-unavailable."""

    def __init__(self, status: int, kind: str) -> None:
        self._body = json.dumps({"type": f"urn:poimen:problem:{kind}", "status": status, "throttled": True}).encode()
        self._status = status

    def request(self, *_: Any, **__: Any) -> Any:
        headers = {"Content-Type": "application/problem+json", "Retry-After": "1"}
        return urllib3.HTTPResponse(body=self._body, status=self._status, headers=headers, preload_content=True)


@pytest.mark.parametrize(("status", "kind"), [(500, "internal-error"), (503, "outcome-unknown"), (502, "bad-gateway")])
def test_on_demand_a_failure_marked_throttled_is_still_a_failure_that_gives_the_lane_up(
    harness: RelayHarness, batch_spawns: int, status: int, kind: str
) -> None:
    # Given on-demand pollers (age limit 1 h), a keyed record 2 h old, and an API answering a failure (a 500, an
    # outcome unknown, a gateway's 502) that carries `throttled: true`
    relay = _on_demand(harness, batch_spawns).with_settings(retry_cap_seconds=0.05)
    relay.relay._http = MarkedThrottledApi(status, kind)  # type: ignore[assignment]
    (record,) = _batch(relay, 2 * HOUR_MS)[2:]
    # When it is invoked with 10 s left
    relay.run([record], seconds=10)
    # Then the lane failed past the age limit and is given up: a throttle is API Gateway's 429 or a 503
    # store-unavailable marked throttled, nothing else. (It raised AdmissionApiUnavailable: asks_to_slow_down reads
    # the member on any answer, so such a lane is not given up before 23 h, the unsafe default.)
    assert [letter["reason"]["kind"] for _, letter in relay.dead_letters()] == ["retries-exhausted"]
