"""Output the benchmarks keep out of their tables: what the functions under test write to stdout and stderr."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def silenced() -> Iterator[None]:
    """Send file descriptors 1 and 2 to /dev/null: a function's EMF lines and log lines (Powertools' logger
    writes to the stream it found at import, so redirecting sys.stdout is not enough), and those of worker
    processes."""
    saved = [os.dup(1), os.dup(2)]
    with open(os.devnull, "w") as devnull:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(devnull.fileno(), 1)
        os.dup2(devnull.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
