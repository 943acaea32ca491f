"""SnapStart hooks: registered with Lambda's runtime when it is there, and after a restore the cached
clients are dropped, so a restored environment builds its own connections and credentials."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from poimen import snapstart
from tests.conftest import REPO


class FakeRuntimeHooks:
    """The two registration functions of Lambda's `snapshot_restore_py`, and a way to run what they hold."""

    def __init__(self) -> None:
        self.before: list[Callable[[], object]] = []
        self.after: list[Callable[[], object]] = []

    def register_before_snapshot(self, hook: Callable[[], object]) -> None:
        self.before.append(hook)

    def register_after_restore(self, hook: Callable[[], object]) -> None:
        self.after.append(hook)

    def snapshot(self) -> None:
        for hook in reversed(self.before):  # Lambda runs them in reverse order of registration
            hook()

    def restore(self) -> None:
        for hook in self.after:
            hook()


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> FakeRuntimeHooks:
    hooks = FakeRuntimeHooks()
    monkeypatch.setattr(snapstart, "_runtime_hooks", lambda: hooks)
    return hooks


def _load_handler(path: str) -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"handler_{path.replace('/', '_')}", REPO / path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_lambdas_runtime_nothing_is_registered() -> None:
    # Given no snapshot_restore_py (as everywhere but Lambda's managed runtimes)
    # Then registering is a no-op that says so
    assert snapstart.register(after_restore=lambda: None) is False


def test_restore_reseeds_random_so_environments_draw_different_jitter(runtime: FakeRuntimeHooks) -> None:
    # Given hooks registered and a random state as a snapshot would carry it
    assert snapstart.register() is True
    random.seed(1)
    state = random.getstate()

    # When the environment is restored
    runtime.restore()

    # Then random no longer continues from the snapshot's state
    assert random.getstate() != state


def test_admission_handler_warms_validation_and_drops_its_store_after_restore(
    runtime: FakeRuntimeHooks, monkeypatch: pytest.MonkeyPatch
) -> None:
    from poimen.api import admission_service

    monkeypatch.setenv("TABLE_NAME", "snapstart-test")
    monkeypatch.setenv("TENANTS", "acme")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    admission_service.cache_clear()

    # Given the handler imported in an environment Lambda will snapshot
    _load_handler("functions/admission/app.py")
    assert runtime.before
    assert runtime.after

    # When the snapshot is taken: validation is built without building admission (no client, no credentials)
    runtime.snapshot()
    assert admission_service.cache_info().currsize == 0

    # And an admission service (its pynamodb client and connection pool) exists when it is restored
    before = admission_service()
    runtime.restore()

    # Then the restored environment builds a new one, with a client of its own
    after = admission_service()
    assert after is not before
    assert after._store.runs is not before._store.runs
    admission_service.cache_clear()


def test_relay_handler_drops_its_clients_and_credentials_after_restore(
    runtime: FakeRuntimeHooks, monkeypatch: pytest.MonkeyPatch
) -> None:
    from poimen.relay import relay_service

    monkeypatch.setenv("ADMISSION_API_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("DLQ_URL", "http://127.0.0.1:9/000000000000/dlq")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "snapshot")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "snapshot")
    relay_service.cache_clear()

    # Given the relay built in the snapshotted environment, signing with the credentials it had then
    _load_handler("functions/inbox_relay/app.py")
    before = relay_service()

    # When the environment is restored with other credentials
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "restored")
    runtime.restore()

    # Then the next batch gets a new HTTP pool, SQS client and the credentials of now
    after = relay_service()
    assert after is not before
    assert after._http is not before._http
    assert after._sqs is not before._sqs
    assert after._credentials.get_frozen_credentials().access_key == "restored"
    relay_service.cache_clear()
