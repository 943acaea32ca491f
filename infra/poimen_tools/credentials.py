"""Which credentials a local command signs with: poimen dev's documented dev key for a loopback endpoint
the SDK's chain has no credentials for, and never for anything else. Shared by `poimen grants`, `dlq` and
`runs`, so each decides it the same way."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

import botocore.session

from poimen_tools.local.sigv4 import DEV_ACCESS_KEY, DEV_SECRET_KEY

_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


def is_loopback(url: str) -> bool:
    """Whether `url` (or HOST:PORT) names this machine: a stand-in's endpoint, never AWS's."""
    host = urlsplit(url if "//" in url else f"//{url}").hostname or ""
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def local_credentials(endpoint: str | None) -> tuple[str, str] | None:
    """poimen dev's documented dev key, for a loopback endpoint the SDK's chain has no credentials for.

    Local commands need no AWS account, as moto takes any key; an endpoint anywhere else gets only
    the caller's own credentials (None here), so a real AWS call is never signed with the dev key.
    """
    if not endpoint or not is_loopback(endpoint):
        return None
    session = botocore.session.Session()
    # The instance role is for AWS, not for a stand-in; probing for it costs a second off EC2.
    session.get_component("credential_provider").remove("iam-role")
    if session.get_credentials() is not None:
        return None
    return DEV_ACCESS_KEY, DEV_SECRET_KEY
