"""librdkafka client settings: plaintext on loopback, or SASL_SSL/OAUTHBEARER with MSK IAM tokens."""

from __future__ import annotations

import logging
import re
from typing import Any

from aws_msk_iam_sasl_signer import MSKAuthTokenProvider

# librdkafka's own log lines go to this logger, never raw to stderr (see `quiet_client_settings`).
LIBRDKAFKA_LOGGER = "poimen.kafka.librdkafka"
# A library's logger has no handler but this one: with no logging configured, Python's last-resort
# handler would print every line to stderr, as librdkafka itself did.
logging.getLogger(LIBRDKAFKA_LOGGER).addHandler(logging.NullHandler())
# syslog's warning level, as librdkafka counts: notices and debug lines are not even produced.
_LOG_LEVEL_WARNING = 4
_CONNECT_FAILED = re.compile(r"failed: (?P<reason>[^(]+?)\s*(?:\(|$)")


def msk_iam_token_callback(region: str, credentials_provider: Any | None = None) -> Any:
    """An `oauth_cb` for librdkafka: (token, expiry in seconds since the epoch) from MSK IAM.

    The signer answers the expiry in milliseconds; librdkafka wants seconds.
    """

    def oauth_cb(_config: str | None) -> tuple[str, float]:
        if credentials_provider is None:
            token, expiry_ms = MSKAuthTokenProvider.generate_auth_token(region)
        else:
            token, expiry_ms = MSKAuthTokenProvider.generate_auth_token_from_credentials_provider(
                region, credentials_provider
            )
        return token, expiry_ms / 1000

    return oauth_cb


def client_config(bootstrap_servers: str, iam_region: str | None = None, **extra: Any) -> dict[str, Any]:
    """Settings for a confluent-kafka Producer, Consumer or AdminClient.

    With `iam_region` the client authenticates to MSK with IAM. librdkafka calls `oauth_cb` only from
    poll(): call `poll(0)` (producer) or `poll(0)` on the admin client before its first request.
    """
    config: dict[str, Any] = {"bootstrap.servers": bootstrap_servers, **extra}
    if iam_region:
        config |= {
            "security.protocol": "SASL_SSL",
            "sasl.mechanism": "OAUTHBEARER",
            "oauth_cb": msk_iam_token_callback(iam_region),
        }
    return config


def quiet_client_settings(timeout_seconds: float | None = None) -> dict[str, Any]:
    """librdkafka logging through the Python logger `LIBRDKAFKA_LOGGER` at warning level, and, with
    `timeout_seconds`, connection attempts bounded by it.

    Without a `logger`, librdkafka prints every failed connection attempt to stderr itself: a
    command waiting on an absent broker printed a line every few hundred milliseconds.
    """
    settings: dict[str, Any] = {"logger": logging.getLogger(LIBRDKAFKA_LOGGER), "log_level": _LOG_LEVEL_WARNING}
    if timeout_seconds is not None:
        # A broker that accepts no connection is given up on within the caller's timeout, not 30 s.
        settings["socket.connection.setup.timeout.ms"] = max(1000, int(timeout_seconds * 1000))
    return settings


def delivery_settings(delivery_timeout_seconds: float) -> dict[str, Any]:
    """A producer's record timeout (`message.timeout.ms`), and how long a topic the broker's metadata says
    does not exist may still be on its way (`topic.metadata.propagation.max.ms`, 30 s by default): at most
    10 s and half the delivery timeout, so a record of a topic that does not exist (MSK creates none on
    demand) fails as `Unknown topic` rather than as a time-out, which would read as the broker away."""
    return {
        "message.timeout.ms": int(delivery_timeout_seconds * 1000),
        "topic.metadata.propagation.max.ms": int(min(10.0, delivery_timeout_seconds / 2) * 1000),
    }


def broker_error_reason(text: str) -> str:
    """The short reason in a librdkafka transport error: 'connection refused' out of
    '127.0.0.1:1/bootstrap: Connect to ipv4#127.0.0.1:1 failed: Connection refused (after 0ms ...)'."""
    match = _CONNECT_FAILED.search(text)
    return match["reason"].strip().lower() if match else text.strip()
