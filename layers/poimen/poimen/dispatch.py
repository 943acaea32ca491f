"""Publishing spawn decisions to `poimen.<tenant>.dispatch` (the orchestrator's side of the relay).

Every record it publishes carries a dispatch_key, the caller's or one generated for the spawn
(`poimen-dispatch/<UUIDv7>`), so each admits its run exactly once however often the relay is given it: the
relay passes the record through verbatim and admission's dispatch_key deduplication absorbs redeliveries.
A keyless record, delivered at least once, is published only when asked for by name
(`publish_without_dispatch_key`), with a KeylessDispatchWarning.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Final

from confluent_kafka import KafkaError, Message, Producer
from pydantic import ValidationError

from poimen.contract import JSONTooDeep, RunRequest, json_text, parse_json
from poimen.ids import keyed_run_id, unkeyed_run_id, uuid7
from poimen.kafka import InvalidTenant, dispatch_topic, partition_key
from poimen.kafka_client import broker_error_reason, client_config, delivery_settings, quiet_client_settings
from poimen.wire import MAX_BODY_BYTES

# librdkafka's own default for `message.timeout.ms`: a record waits five minutes for a broker.
DEFAULT_DELIVERY_TIMEOUT_SECONDS = 300.0
# What flush() waits beyond the delivery timeout, so every record's delivery report (with its reason) is in.
_FLUSH_MARGIN_SECONDS = 2.0
# The prefix of the dispatch keys generated for spawns published without one; 16 + 36 characters, well inside
# the API's 1-255 and free of control characters. Callers should not choose keys with it.
GENERATED_KEY_PREFIX: Final = "poimen-dispatch/"
KEYLESS_WARNING: Final = (
    "a dispatch record without a dispatch_key is delivered at least once: given to the relay again (a relay "
    "stopped before it committed the record's offset, a batch retried), it is admitted again, as another run"
)


class KeylessDispatchWarning(UserWarning):
    """A dispatch record was published without a dispatch_key, as asked for by name (KEYLESS_WARNING)."""


@dataclass(frozen=True)
class Published:
    """A queued dispatch record: the run it admits, the same however often the relay is given it, and its
    dispatch_key, the caller's or (`generated`) the one made for a spawn without one. To publish the same
    spawn again, publish it with this key: without it, it is another spawn."""

    run_id: str
    dispatch_key: str
    generated: bool


def generated_dispatch_key() -> str:
    """A fresh key for one spawn published without one: `poimen-dispatch/` and a UUIDv7 (time-ordered)."""
    return f"{GENERATED_KEY_PREFIX}{uuid7()}"


class InvalidDispatch(ValueError):
    """A dispatch record the relay could only dead-letter: refused before anything is queued."""


class DispatchTooLarge(InvalidDispatch):
    """The record's body is over the API's MAX_BODY_BYTES (`size` bytes)."""

    def __init__(self, message: str, size: int) -> None:
        super().__init__(message)
        self.size = size


class InvalidDispatchTenant(InvalidTenant, InvalidDispatch):
    """The tenant is no tenant id: no relay consumes its topic, and the API refuses it."""


class PublishFailed(RuntimeError):
    """The broker did not acknowledge dispatch records within the producer's delivery timeout."""

    def __init__(
        self,
        bootstrap_servers: str,
        unsent: int,
        failures: list[str],
        broker_errors: list[str],
        timeout_seconds: float,
    ) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.unsent = unsent  # records neither acknowledged nor failed when flush gave up
        self.failures = failures  # each failed record's delivery error, e.g. "Local: Message timed out"
        self.broker_errors = broker_errors  # the client's errors meanwhile, latest last (why it timed out)
        self.timeout_seconds = timeout_seconds
        super().__init__(
            f"{self.records} dispatch record(s) not acknowledged by {bootstrap_servers} within "
            f"{timeout_seconds:g} s; failures: {failures}" + (f"; broker: {broker_errors[-1]}" if broker_errors else "")
        )

    @property
    def records(self) -> int:
        return self.unsent + len(self.failures)

    @property
    def reason(self) -> str:
        """Why, in a few words: the broker's last error if any (e.g. 'connection refused'), else the
        first record's delivery error."""
        if self.broker_errors:
            return broker_error_reason(self.broker_errors[-1])
        if self.failures:
            return self.failures[0]
        return "no acknowledgement"


class DispatchPublisher:
    """An idempotent producer with acks=all: a retried send never duplicates a record in the log.

    While the broker is down, records wait in the producer's queue for `delivery_timeout_seconds`
    (librdkafka's `message.timeout.ms`, five minutes by default) and go out when it is back; past it,
    `flush` raises PublishFailed with each record's delivery error and the broker's last error.
    librdkafka's own log lines go to the Python logger `poimen.kafka.librdkafka` at warning level.
    """

    def __init__(
        self,
        bootstrap_servers: str,
        iam_region: str | None = None,
        *,
        delivery_timeout_seconds: float = DEFAULT_DELIVERY_TIMEOUT_SECONDS,
        **extra: Any,
    ) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.delivery_timeout_seconds = delivery_timeout_seconds
        quick = delivery_timeout_seconds if delivery_timeout_seconds < DEFAULT_DELIVERY_TIMEOUT_SECONDS else None
        # murmur2: the partitioner of Java producers, so every producer puts a partition key in one place.
        settings = {
            "enable.idempotence": True,
            "acks": "all",
            "partitioner": "murmur2_random",
            **delivery_settings(delivery_timeout_seconds),
            "error_cb": self._client_error,
            **quiet_client_settings(quick),
            **extra,
        }
        self._producer = Producer(client_config(bootstrap_servers, iam_region, **settings))
        self._failures: list[str] = []
        self._broker_errors: list[str] = []
        self._producer.poll(0)  # serves oauth_cb before the first request (librdkafka calls it from poll)

    def publish(self, tenant_id: str, request: RunRequest) -> Published:
        """Queue one dispatch record; the run it admits and its dispatch_key.

        The value is the body POST /v1/runs takes; the key is the partition key (tenant, run id). A request
        without a dispatch_key is given a generated one (`generated_dispatch_key`), so the run id is derived
        before admission as for any keyed spawn, and a redelivered record replays that run.

        Raises InvalidDispatch, queueing nothing, for what the relay could only dead-letter: a tenant
        that is no tenant id (InvalidDispatchTenant, an InvalidTenant too: its topic would be auto-created
        and never consumed), or a request the API refuses (fields out of bounds, a body over
        MAX_BODY_BYTES, DispatchTooLarge, which says when a generated key is what takes it over; nested too
        deep, not encodable).
        """
        generated = request.dispatch_key is None
        dispatch_key = generated_dispatch_key() if request.dispatch_key is None else request.dispatch_key
        # model_copy does not validate: _body validates the request as the API will.
        keyed = request.model_copy(update={"dispatch_key": dispatch_key}) if generated else request
        try:
            topic, value = _checked(tenant_id, keyed)
        except DispatchTooLarge as error:
            if not generated:
                raise
            # The key the caller did not choose is what may take it over: say so, and what to do.
            unkeyed = len(_body(request))  # raises DispatchTooLarge itself for a spawn too large without a key
            raise DispatchTooLarge(
                f"{error} with the dispatch_key generated for it ({unkeyed} without a key): give it a shorter "
                "dispatch_key of your own",
                error.size,
            ) from error
        run_id = keyed_run_id(tenant_id, dispatch_key)
        self._produce(topic, partition_key(tenant_id, run_id), value)
        return Published(run_id, dispatch_key, generated)

    def publish_without_dispatch_key(self, tenant_id: str, request: RunRequest) -> None:
        """Queue one dispatch record without a dispatch_key, as asked for by name, after warning that it is
        delivered at least once (KeylessDispatchWarning): a redelivery admits it again, as another run.

        No run id exists before admission, so the partition key carries a fresh UUIDv7 and none is returned.
        Raises ValueError for a request that carries a dispatch_key, and InvalidDispatch as `publish` does,
        queueing nothing.
        """
        if request.dispatch_key is not None:
            raise ValueError("the request carries a dispatch_key: publish it with publish()")
        topic, value = _checked(tenant_id, request)
        warnings.warn(KEYLESS_WARNING, KeylessDispatchWarning, stacklevel=2)
        self._produce(topic, partition_key(tenant_id, unkeyed_run_id()), value)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued record is acknowledged; raise PublishFailed if any failed or is still
        queued. By default it waits as long as a record may (the delivery timeout), so each unsent record
        comes back with its delivery error rather than as merely still queued."""
        wait = self.delivery_timeout_seconds + _FLUSH_MARGIN_SECONDS if timeout is None else timeout
        remaining = self._producer.flush(wait)
        failures, self._failures = self._failures, []
        broker_errors, self._broker_errors = self._broker_errors, []
        if failures or remaining:
            raise PublishFailed(
                self.bootstrap_servers, remaining, failures, broker_errors, self.delivery_timeout_seconds
            )

    def _produce(self, topic: str, key: bytes, value: bytes) -> None:
        self._producer.produce(topic, key=key, value=value, on_delivery=self._delivered)
        self._producer.poll(0)

    def _delivered(self, error: KafkaError | None, _message: Message) -> None:
        if error is not None:
            self._failures.append(str(error.str()))

    def _client_error(self, error: KafkaError) -> None:
        # Transport errors are not fatal (librdkafka keeps retrying): kept to say why records time out.
        # "1/1 brokers are down" follows the transport error that says why, and would hide it.
        if error.code() == KafkaError._ALL_BROKERS_DOWN and self._broker_errors:
            return
        text = str(error.str())
        if text not in self._broker_errors[-1:]:
            self._broker_errors = [*self._broker_errors[-9:], text]


def _checked(tenant_id: str, request: RunRequest) -> tuple[str, bytes]:
    """The record's topic and value; InvalidDispatch for a record the relay could only dead-letter."""
    try:
        topic = dispatch_topic(tenant_id)
    except InvalidTenant as error:
        raise InvalidDispatchTenant(tenant_id) from error
    return topic, _body(request)


def _body(request: RunRequest) -> bytes:
    """The body POST /v1/runs takes, checked as the API checks it; InvalidDispatch if it would refuse it."""
    try:
        # Validated again: a RunRequest built with model_construct (or changed since) skipped validation.
        checked = RunRequest.model_validate(request.model_dump())
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in problem['loc']) or 'request'}: {problem['msg']}"
            for problem in error.errors()
        )
        raise InvalidDispatch(f"not a valid spawn request: {problems}") from error
    try:
        # json_text: numbers parsed exactly (poimen.contract.parse_json) go out as they came in.
        text = json_text(checked.model_dump())
        body = text.encode("utf-8")
    except (TypeError, ValueError) as error:  # a non-JSON value, NaN, a lone surrogate
        raise InvalidDispatch(f"the spawn request cannot be sent as JSON: {error}") from error
    if len(body) > MAX_BODY_BYTES:
        raise DispatchTooLarge(f"the spawn request's body exceeds {MAX_BODY_BYTES} bytes ({len(body)})", len(body))
    try:
        parse_json(text)  # the API's own parse: depth, numbers it would not read back
    except JSONTooDeep as error:
        raise InvalidDispatch(f"the spawn request {error}") from error
    except (ValueError, RecursionError) as error:
        raise InvalidDispatch(f"the spawn request is not JSON the API reads: {error}") from error
    return body
