"""The endpoints a client of the admission API calls, and where its next attempt goes among them: one
rotation per set of endpoints that share a table (a multi-Region stack's Regions, or one cell's), failing over
round robin and holding back an endpoint its `Retry-After` asked to be left alone. `poimen.client` keeps one
rotation per cell; nothing moves a call from one rotation to another."""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import botocore.session
from urllib3.exceptions import LocationParseError
from urllib3.util import parse_url

_EXECUTE_API_HOST = re.compile(r"[a-z0-9]+\.execute-api\.(?P<region>[a-z0-9-]+)\.amazonaws\.com(\.cn)?")
# Spaces and control characters: urlsplit silently drops tabs and newlines anywhere and strips leading ones, so
# the URL it would judge is not the URL called.
_NOT_IN_A_URL = re.compile(r"[\x00-\x20\x7f-\x9f]")  # as poimen_tools.arguments
_DEFAULT_PORTS = {"http": 80, "https": 443}
# A percent-encoded octet; one of an unreserved character is that character (RFC 3986, 6.2.2.2).
_PERCENT_ENCODED = re.compile(r"%([0-9A-Fa-f]{2})")
_UNRESERVED = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")


def is_base_url(url: object) -> bool:
    """An http(s) URL with a host (and a valid port, if any), no query or fragment, no space or control character,
    that the client can call: urllib3 finds its host an IDNA name (it would refuse to send to it otherwise)."""
    if not isinstance(url, str) or _NOT_IN_A_URL.search(url):
        return False
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port out of range or not a number
        parse_url(url)
    except (ValueError, LocationParseError):  # also an unclosed [ of an IPv6 host
        return False
    return parts.scheme in _DEFAULT_PORTS and bool(parts.hostname) and not (parts.query or parts.fragment)


def endpoint_identity(url: str) -> tuple[str, str, int, str]:
    """What tells two base URLs (is_base_url) apart: scheme and host name case folded, the host name as the client
    calls it (an internationalised name IDNA-encoded: `bücher.example` is `xn--bcher-kva.example`), the host's
    trailing dot (the DNS root: `api.example.com.` is `api.example.com`) dropped, the port (the scheme's default if
    none is given), the path as the client calls it (dot segments removed, an unreserved character's percent-encoding
    decoded: `/a/../%761` is `/v1`) without trailing slashes. `HTTPS://API.example.com.:443/` is
    `https://api.example.com`.
    An execute-api host is one API, of one stack, whatever the path (a custom domain's base paths may be several).
    Two host names of one API (a custom domain mapped to it, and its execute-api name) are two identities: only DNS
    and API Gateway's mappings know they are one."""
    parts = urlsplit(url)
    host = _host(url)
    path = "" if _EXECUTE_API_HOST.fullmatch(host) else _path(url).rstrip("/")
    return parts.scheme, host, parts.port or _DEFAULT_PORTS[parts.scheme], path


def _host(url: str) -> str:
    """A URL's host name as urllib3 (the client) sends to it: case folded, an internationalised name IDNA-encoded,
    an IPv6 literal without its brackets; without the trailing dot a fully qualified name may carry."""
    return (parse_url(url).host or "").removeprefix("[").removesuffix("]").removesuffix(".")


def _path(url: str) -> str:
    """A URL's path as urllib3 (the client) sends it, dot segments removed, with each percent-encoded unreserved
    character decoded and every other percent-encoding in upper case (RFC 3986, 6.2.2)."""

    def octet(encoded: re.Match[str]) -> str:
        character = chr(int(encoded[1], 16))
        return character if character in _UNRESERVED else f"%{encoded[1].upper()}"

    return _PERCENT_ENCODED.sub(octet, parse_url(url).path or "")


@dataclass(frozen=True)
class RegionalEndpoint:
    """One Region's admission API: its base URL (the stack output AdmissionApiUrl of that Region's stack)
    and the Region its calls are signed for (the SigV4 credential scope API Gateway checks)."""

    url: str
    region: str

    def __str__(self) -> str:
        return f"{self.url} ({self.region})"


def regional_endpoint(
    entry: str | RegionalEndpoint, region: str | None, session: Callable[[], botocore.session.Session]
) -> RegionalEndpoint:
    """`entry` checked, its URL without a trailing slash, with its Region: a RegionalEndpoint's own, else
    `region`, else the one in an execute-api host name, else the SDK's (`session`'s) configured one."""
    url, named = (entry.url, entry.region) if isinstance(entry, RegionalEndpoint) else (entry, region)
    if not is_base_url(url):
        raise ValueError(f"base_url must be an http(s) URL without query, fragment or spaces: {url!r}")
    if named is None:
        found = _EXECUTE_API_HOST.fullmatch(_host(url))
        named = found["region"] if found else session().get_config_variable("region")
    if not named:
        fix = "pass region= (or a RegionalEndpoint), or configure one (AWS_DEFAULT_REGION, a profile)"
        raise ValueError(f"no region for {url}: {fix}")
    return RegionalEndpoint(url.rstrip("/"), named)


class Rotation:
    """Endpoints of one table, in order of preference, and the one calls go to (`endpoint`): the first,
    until a failure moves it on. Safe to share between threads."""

    def __init__(self, endpoints: tuple[RegionalEndpoint, ...], max_retry_after: float, label: str = "") -> None:
        if not endpoints:
            raise ValueError("base_url must name at least one endpoint")
        # One endpoint twice: failing over from it to itself would call it again against its Retry-After.
        seen: set[tuple[str, str, int, str]] = set()
        for endpoint in endpoints:
            if endpoint_identity(endpoint.url) in seen:
                raise ValueError(f"base_url names the endpoint {endpoint.url} twice")
            seen.add(endpoint_identity(endpoint.url))
        self.endpoints = endpoints
        self.label = label  # how messages name the rotation ("in cell a"); "" for a client's only one
        self._max_retry_after = max_retry_after
        self._current = 0  # the index of the endpoint calls go to; moved by `next`
        # Per endpoint, the `clock` time before which its last Retry-After asked not to be called.
        self._not_before = [-math.inf] * len(endpoints)
        # And the time it is forgotten at: a Retry-After holds an endpoint back max_retry_after at most.
        self._forget_at = [math.inf] * len(endpoints)
        self._moving = threading.Lock()

    @property
    def endpoint(self) -> RegionalEndpoint:
        return self.endpoints[self._current]

    def next(
        self, failed: int | None, now: float, backoff: float, retry_after: float | None = None
    ) -> tuple[int, float]:
        """Where the next attempt goes, and how long from `now` its endpoint holds it back (0: not at all).

        After a failure of the endpoint at `failed` (its `retry_after`, if any, noted first), the rotation moves
        past it, unless another thread already has: to the next endpoint in round-robin order that is not held
        back beyond `backoff`, else to the one held back the shortest (`failed` itself when it is the only
        one). With `failed` None (a call's first attempt) it stays, unless its endpoint is held back and
        another is not."""
        with self._moving:
            if failed is not None and retry_after is not None:
                self._not_before[failed] = now + retry_after
                # Asked for more than it waits, the client ends the calls that would wait (this one at once),
                # but only for max_retry_after: a Retry-After of hundreds of digits (float: inf) must not hold
                # the endpoint back for the client's lifetime.
                self._forget_at[failed] = now + self._max_retry_after
            count = len(self.endpoints)
            if failed is None or self._current == failed:
                start = self._current if failed is None else failed + 1
                rotation = [(start + step) % count for step in range(count)]
                ready = [each for each in rotation if self._held_until(each, now) <= now + backoff]
                self._current = ready[0] if ready else min(rotation, key=lambda each: self._held_until(each, now))
            if self._current == failed and retry_after is not None:
                return failed, max(0.0, retry_after)  # exactly as asked, not as the clock's floats give it back
            return self._current, max(0.0, self._held_until(self._current, now) - now)

    def _held_until(self, index: int, now: float) -> float:
        """The `clock` time before which the endpoint at `index` is not to be called, as seen at `now`."""
        return self._not_before[index] if now < self._forget_at[index] else -math.inf

    def held_back(self, index: int, hold: float) -> str:
        asked = f"{hold:.0f} s, " if math.isfinite(hold) else ""
        return (
            f"the API at {self.endpoints[index]} asks to retry after {asked}more than the "
            f"{self._max_retry_after:.0f} s this client waits (max_retry_after)"
        )
