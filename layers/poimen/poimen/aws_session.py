"""Botocore sessions whose credentials fetch has a bound: one for a component's AWS clients, or one a thread.

Each botocore session resolves its credentials, and loads the service models, on its own: the store's
three pynamodb models, each with a session of its own, did both three times on the first request. On
Lambda the execution role's credentials are in the environment, read without I/O, except in a SnapStart
function: its environment has Lambda's container credentials endpoint instead
(`AWS_CONTAINER_CREDENTIALS_FULL_URI`, see
https://docs.aws.amazon.com/lambda/latest/dg/snapstart-activate.html#snapstart-credentials), which botocore
calls on the first request after a restore, and again before the credentials expire. botocore's own fetch
(`ContainerMetadataFetcher`) may wait 3 attempts x (2 s to connect + 2 s to read) + 3 x 1 s between them,
15 s, beyond the admission function's timeout. A session from `bounded_session` waits at most
CREDENTIALS_FETCH_SECONDS, then fails with botocore's CredentialRetrievalError, nothing sent.

A client is thread-safe, a session is not (https://boto3.amazonaws.com/v1/documentation/api/latest/guide/session.html):
a component whose clients may be built in any thread (the store: pynamodb builds a client in whichever thread
first needs it) takes `ThreadSessions`, a bounded session for each thread, rather than one session shared.
"""

from __future__ import annotations

import threading
from typing import Final

import botocore.session
from botocore.credentials import ContainerProvider
from botocore.utils import ContainerMetadataFetcher

# The endpoint is on the execution environment's own loopback: it answers in milliseconds or not at all.
CREDENTIALS_TIMEOUT_SECONDS: Final = 0.5  # to connect, and again to read
CREDENTIALS_ATTEMPTS: Final = 2
CREDENTIALS_FETCH_SECONDS: Final = CREDENTIALS_ATTEMPTS * 2 * CREDENTIALS_TIMEOUT_SECONDS


class _BoundedFetcher(ContainerMetadataFetcher):
    """botocore's fetcher, with the attempts and timeouts above and no sleep between attempts."""

    TIMEOUT_SECONDS = CREDENTIALS_TIMEOUT_SECONDS  # type: ignore[assignment]  # botocore takes any number
    RETRY_ATTEMPTS = CREDENTIALS_ATTEMPTS
    SLEEP_TIME = 0


def bounded_session() -> botocore.session.Session:
    """A new botocore session, its credential chain as botocore's but for the container endpoint's bound."""
    session = botocore.session.get_session()
    resolver = session.get_component("credential_provider")
    container = resolver.get_provider(ContainerProvider.METHOD)
    if container is not None:  # not in a chain an explicit profile narrowed
        # The stubs type `fetcher` as another class's; botocore's own default here is a ContainerMetadataFetcher.
        bounded = ContainerProvider(fetcher=_BoundedFetcher())  # type: ignore[arg-type]
        resolver.providers[resolver.providers.index(container)] = bounded
    return session


class ThreadSessions(threading.local):
    """A bounded session for each thread, made on the thread's first use of it: pynamodb's holder of a thread's
    session (`Connection._local`, which builds botocore's default session where it finds none). One for all the
    connections of a store, so that the clients one thread builds share its session: one fetch, one read of the
    service model."""

    def __init__(self) -> None:
        self.session = bounded_session()
