"""librdkafka client settings: plaintext on loopback, or SASL_SSL/OAUTHBEARER with MSK IAM tokens."""

from __future__ import annotations

from typing import Any

from aws_msk_iam_sasl_signer import MSKAuthTokenProvider


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
