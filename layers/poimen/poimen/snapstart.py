"""SnapStart runtime hooks: what to warm before Lambda snapshots an environment, and what to rebuild after
it restores one. Outside Lambda's managed runtimes (tests, `poimen dev`) nothing is registered.

One snapshot is restored into many environments, possibly hours later. So nothing that must differ per
environment or go stale may be carried across: network clients and their pooled connections, cached
credentials, and the state of `random` (every restored environment would draw the same jitter). Run ids
are safe: each draws from `os.urandom` and the clock when it is made, never at import.
"""

from __future__ import annotations

import importlib
import random
from collections.abc import Callable
from typing import Any

Hook = Callable[[], object]


def reseed_random() -> None:
    """Fresh `random` state for this environment, from the OS (the snapshot holds the one it was taken with)."""
    random.seed()


def register(*, before_snapshot: Hook | None = None, after_restore: Hook | None = None) -> bool:
    """Register the hooks with Lambda's runtime; return whether there is one to register them with.

    After a restore `random` is reseeded first, then `after_restore` runs, before any invocation.
    """
    return _register(_runtime_hooks(), before_snapshot, after_restore)


def _runtime_hooks() -> Any:
    """Lambda's `snapshot_restore_py`: its managed Python runtimes carry it, nothing else does (so it is
    not a layer requirement)."""
    try:
        return importlib.import_module("snapshot_restore_py")
    except ImportError:
        return None


def _register(hooks: Any, before_snapshot: Hook | None, after_restore: Hook | None) -> bool:
    if hooks is None:
        return False
    if before_snapshot is not None:
        hooks.register_before_snapshot(before_snapshot)
    hooks.register_after_restore(reseed_random)
    if after_restore is not None:
        hooks.register_after_restore(after_restore)
    return True
